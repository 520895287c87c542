"""One script for the lent H200 (see docs/benchmarks.md). Stages, each one device call, back to back:

  bash scripts/gpu_prep.sh          # here, first on a new checkout: builds stash_a/, stash_b/, .whl/, work/
  python scripts/gpu.py stash       # carry stash_a/: first half of the SmolLM2 GGUF -> ~/stash; a second
                                    #   call carrying stash_b/ (and the gguf wheel installed) joins and
                                    #   converts, so the next call can carry the drafter instead
  python scripts/gpu.py prepare --gen-batch 2048 --sampled-gsm8k 7473 --deadline-s 0
                                    # carry stash_b/ .whl/ work/: join, check sha256, convert, generate
                                    #   the training data (+ a compact copy under $OUT); trains too when
                                    #   --deadline-s leaves time. --data-npz work/data_uint16.npz loads
                                    #   an earlier session's data instead of generating it
  python scripts/gpu.py train [--init-from models/...] [--kl-weight 1] --steps N --train-seconds S [--bench]
                                    # carry work/: start or resume training, export bf16 shards to $OUT
  python scripts/gpu.py bench --acc-limit 1319 --concurrency 1,8,32,64 [--heldout-path work/recipe/heldout_prompts.jsonl]
                                    # carry work/: acceptance (engine; GSM8K test, and the held-out domains
                                    #   with --heldout-path) + speed by concurrency
  python scripts/gpu.py engine --concurrency 1,8,32 --graph-tokens 128 --rounds 1 --eager-limit 8
                                    # carry work/gsm8k_test.jsonl: the serving engine's CUDA-graph runner
                                    #   (graph_runner.py): fp32 + bf16 checks, engine speed per concurrency
  python scripts/gpu.py hardening   # no carry, no stash: the graph runner with chunked prefill (greedy fp32
                                    #   against HF) and with a NaN-weight drafter (sampled distribution)
  python scripts/gpu.py attn        # no carry, no stash: the engine's graphs at batch 1 and 8 with SDPA or
                                    #   matmul attention over 1,029 / 4,101 positions (random SmolLM2-shaped target)
  python scripts/gpu.py layers --concurrency 1,8,32,64
                                    # no carry, no stash: the fused layer kernels against their references
                                    #   (bf16, fp32), fused StaticTarget against HF, forward ms unfused / fused
  python scripts/gpu.py stash       # carry work/init (the start weights, moved out of models/) and work/recipe
                                    #   (prompt files) -> ~/stash, then the two GGUF stash calls; the data call
                                    #   then needs no weights of its own and trains after its data
  python scripts/gpu.py recipe --phase data    # carry work/recipe (prompt files): the committed recipe's
  python scripts/gpu.py recipe --phase train --train-seconds S --configs w5_greedy,w5_block_t1
                                    #   data, then training, acceptance on GSM8K + held-out domains
  python scripts/gpu.py prefill     # no carry, no stash: what each eager prefill call costs (target, DFlash2)
  python scripts/gpu.py graphs --graph-limit 20 --check-prompts 6 --eager-limit 3 [--breakdown]
                                    # carry work/gsm8k_test.jsonl: batch 1, the engine with one slot (CUDA graphs):
                                    #   fp32 + bf16 token checks, graphed side-by-side speed, eager reference
                                    #   (ninth session: 2 stash calls + 1 call of ~4 min)

The run history (which calls each stage of the shipped drafter and each benchmark took) is in
docs/gpu_runs.md.

The tracked tree plus what a call carries must stay under 64 MiB: with the 45 MB drafter in
models/, move its model.safetensors aside for the two stash calls (it is needed again for --init-from).
Everything between calls lives in ~/stash (kept only while the machine stays warm, 30 s).
Details go under $OUT; short tables are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
STASH = Path.home() / "stash"
INIT = STASH / "init"  # the recipe's start weights when a 'stash' call carried them (work/init)
OUT = Path(os.environ.get("OUT", "/tmp/out"))
T_START = time.time()
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def replay_ms(step, n: int = 100) -> float:
    """Median wall time of ``n`` synchronised calls of ``step`` (a graph replay), in ms."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    ts = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


def env_report() -> dict:
    import torch
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
    }
    log(f"env {info}")
    return info


def stage_stash(args) -> None:
    """Copy whichever GGUF halves this call carries into ~/stash; once both are there, join and
    convert (so a later call can carry the 45 MB drafter instead of a GGUF half)."""
    STASH.mkdir(exist_ok=True)
    for part in (ROOT / "stash_a" / "part0", ROOT / "stash_b" / "part1"):
        if part.is_file():
            shutil.copy(part, STASH / part.name)
            log(f"stashed {part.name} ({part.stat().st_size} bytes)")
    # the recipe's start weights (work/init/model.safetensors, the tracked copy moved aside so the GGUF
    # halves fit later calls) and its prompt files travel in a call of their own
    if (ROOT / "work" / "init" / "model.safetensors").is_file():
        (STASH / "init").mkdir(exist_ok=True)
        shipped = ROOT / "models" / "smollm2-135m-dflash2"
        for f in (ROOT / "work" / "init" / "model.safetensors", shipped / "config.json", shipped / "token_map.pt"):
            shutil.copy(f, STASH / "init" / f.name)
        log("stashed the recipe's start weights in ~/stash/init")
    if (ROOT / "work" / "recipe" / "train_prompts.jsonl.gz").is_file():
        shutil.copytree(ROOT / "work" / "recipe", STASH / "recipe", dirs_exist_ok=True)
        log("stashed the recipe's prompt files in ~/stash/recipe")
    env_report()
    if (STASH / "part1").is_file():
        log(f"target folder ready: {target_folder()}")


def target_folder() -> Path:
    folder = STASH / "smollm2"
    if (folder / "config.json").is_file():
        return folder
    part0 = STASH / "part0"
    if not part0.is_file():
        sys.exit(
            "FATAL: ~/stash/part0 is gone (the machine was given back between calls). "
            "Run the 'stash' stage again, then this one right after it."
        )
    gguf = STASH / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(gguf, "wb") as f:
        for part in (part0, STASH / "part1" if (STASH / "part1").is_file() else ROOT / "stash_b" / "part1"):
            f.write(part.read_bytes())
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        sys.exit(f"FATAL: joined GGUF sha256 {digest} != expected {GGUF_SHA256}")
    log("GGUF joined, sha256 ok; converting to bf16 safetensors")
    from dflash2.target.loading import convert_gguf

    return convert_gguf(gguf, folder)


def stage_prepare(args) -> None:
    import torch
    from dflash2.target.loading import load_target
    from dflash2.training.data import TokenDataset, generate_responses

    info = env_report()
    folder = target_folder()
    if args.data_npz:  # data generated by an earlier session: skip the 7-minute generation
        rows = import_data(ROOT / args.data_npz)
        log(f"loaded {len(rows)} rows from {args.data_npz}")
        if args.add_sampled_gsm8k or args.add_sampled_sharegpt:  # fresh T=1 answers (new seed) on top
            rows += sampled_answers(args, folder)
        TokenDataset(rows).save(STASH / "data.pt")
        export_data(rows, OUT / "data_uint16.npz")
        left = args.deadline_s - (time.time() - T_START) - 40
        if left > 30:
            args.train_seconds = min(args.train_seconds, left) if args.train_seconds else left
            run_training(args, folder, resume=False)
        return
    target = load_target(folder, "bfloat16", "cuda")
    gsm, share = training_prompts()
    t0 = time.time()
    rows = []
    jobs = [
        (gsm, 0.0, 1.0, 320),
        (gsm[: args.sampled_gsm8k], 1.0, 0.95, 320),
        (share[: len(share) // 2], 0.0, 1.0, 384),
        (share[len(share) // 2 :], 1.0, 0.95, 384),
    ]
    if args.sampled_gsm8k_2:  # a second sampled answer per GSM8K prompt (another seed): T=1 acceptance data
        jobs.append((gsm[: args.sampled_gsm8k_2], 1.0, 0.95, 320))
    for seed, (texts, temp, top_p, mnt) in enumerate(jobs):  # a seed per job: two sampled passes must differ
        rows += generate_responses(target.model, target.tokenizer, texts, args.gen_batch, mnt, temp, top_p, seed=seed)
        log(f"generated {len(rows)} rows, {time.time() - t0:.0f}s")
    ds = TokenDataset(rows)
    ds.save(STASH / "data.pt")
    export_data(rows, OUT / "data_uint16.npz")
    stats = {
        "sequences": len(ds),
        "tokens": ds.num_tokens(),
        "response_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in rows),
        "gen_seconds": time.time() - t0,
        **info,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "data_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"data {stats}")
    del target
    torch.cuda.empty_cache()
    left = args.deadline_s - (time.time() - T_START) - 40  # leave time for the final eval and save
    if left > 30:
        args.train_seconds = min(args.train_seconds, left) if args.train_seconds else left
        run_training(args, folder, resume=False)


def training_prompts() -> tuple[list[str], list[str]]:
    """GSM8K train and ShareGPT first-turn texts from the carried work/prompts.jsonl."""
    prompts = [json.loads(l) for l in (ROOT / "work" / "prompts.jsonl").read_text().splitlines()]
    return (
        [p["text"] for p in prompts if p["source"] == "gsm8k"],
        [p["text"] for p in prompts if p["source"] == "sharegpt"],
    )


def sampled_answers(args, folder: Path) -> list[dict]:
    """New T=1 / top-p 0.95 answers to GSM8K train and ShareGPT prompts, with a seed no earlier
    'prepare' used, to add to loaded data (sampled acceptance wants many contexts)."""
    import torch
    from dflash2.target.loading import load_target
    from dflash2.training.data import generate_responses

    target = load_target(folder, "bfloat16", "cuda")
    gsm, share = training_prompts()
    t0, rows = time.time(), []
    off = args.add_sharegpt_offset
    jobs = [(gsm[: args.add_sampled_gsm8k], 320), (share[off : off + args.add_sampled_sharegpt], 384)]
    for seed, (texts, mnt) in enumerate(jobs, start=args.add_seed):
        if texts:
            rows += generate_responses(target.model, target.tokenizer, texts, args.gen_batch, mnt, 1.0, 0.95, seed=seed)
            log(f"generated {len(rows)} new sampled rows, {time.time() - t0:.0f}s")
    del target
    torch.cuda.empty_cache()
    return rows


def export_data(rows, path: Path) -> None:
    """The generated data, compact (TokenDataset's npz), so a later session can carry it instead of
    regenerating."""
    from dflash2.training.data import TokenDataset

    TokenDataset(rows).save(path)
    log(f"exported data to {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def import_data(path: Path) -> list[dict]:
    """The inverse of :func:`export_data` (earlier sessions' files have the same keys)."""
    from dflash2.training.data import TokenDataset

    return TokenDataset.load(path).rows


def run_training(args, folder: Path, resume: bool) -> dict:
    from dflash2.target.loading import load_target
    from dflash2.training.trainer import TrainConfig, train

    tc = TrainConfig(
        data=str(STASH / "data.pt"),
        output_dir=str(STASH / "draft"),
        draft_config=str(ROOT / "configs" / "smollm2-135m-dflash2.json"),
        steps=args.steps,
        batch_size=args.batch_size,
        max_len=768,
        anchors_per_seq=args.anchors,
        lr=args.lr,
        warmup=200,
        device="cuda",
        save_every=1000,
        eval_every=args.eval_every,
        eval_prompts=4,
        resume=resume,
        time_limit_s=args.train_seconds,
        kl_weight=args.kl_weight,
        selector_kl_weight=args.selector_kl_weight,
        init_from=str(ROOT / args.init_from) if args.init_from and not resume else None,
    )
    target = load_target(folder, "bfloat16", "cuda")
    res = train(tc, target)
    h = res["history"]
    summary = {
        "steps_done": res["steps"],
        "seconds": res["seconds"],
        "tokens": res["tokens"],
        "steps_per_s": len(h) / res["seconds"],
        "final": h[-1] if h else None,
        "config": vars(args),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"train_{'resume' if resume else 'first'}.json").write_text(json.dumps(summary, indent=2))
    log(f"training: {summary['steps_done']} steps, {summary['steps_per_s']:.2f} steps/s, final {summary['final']}")
    return summary


def merge_json_outputs() -> None:
    """At most 8 files come back from a call: the draft alone takes 6 (config, index, 4 shards
    of < 16 MiB) and the train log one, so every other JSON under $OUT goes into one summary.json."""
    parts = {f.stem: json.loads(f.read_text()) for f in sorted(OUT.glob("*.json")) if f.name != "summary.json"}
    if not parts:
        return
    summary = OUT / "summary.json"
    old = json.loads(summary.read_text()) if summary.is_file() else {}
    summary.write_text(json.dumps(old | parts, indent=1))
    for name in parts:
        (OUT / f"{name}.json").unlink()
    log(f"merged {sorted(parts)} into $OUT/summary.json")


def stage_train(args) -> None:
    import torch
    from dflash2.model.checkpoint import load_draft, save_draft

    env_report()
    folder = target_folder()
    if not (STASH / "data.pt").is_file():
        sys.exit("FATAL: ~/stash/data.pt is gone; run 'stash' and 'prepare' again")
    if args.train_seconds > 0:  # resume a run started by 'prepare', else start one (from --init-from if given)
        run_training(args, folder, resume=(STASH / "draft" / "config.json").is_file())
    draft = load_draft(STASH / "draft", device="cpu")
    save_draft(draft, OUT / "draft", max_shard_bytes=15 * 2**20, dtype=torch.bfloat16)
    shutil.copy(STASH / "draft" / "train_log.jsonl", OUT / "train_log.jsonl")
    log("exported bf16 draft to $OUT/draft")
    if args.bench:
        stage_bench(args, draft_dir=OUT / "draft")
    merge_json_outputs()


def _grown_init(args) -> Path:
    """The recipe's start weights; with --grow (e.g. "layers=5,rank=96,map"), those weights grown by
    `dflash2 grow-draft` (map: the selector's codebooks over the shipped token map), built once a machine."""
    shipped = ROOT / "models" / "smollm2-135m-dflash2"
    start = INIT if (INIT / "model.safetensors").is_file() else shipped
    if not args.grow:
        return start
    grown = STASH / f"grown_{_grow_tag(args)}"
    if not (grown / "model.safetensors").is_file():
        from dflash2.model.checkpoint import load_draft, save_draft
        from dflash2.model.token_map import load_token_map
        from dflash2.training.grow import grow_draft

        spec = dict(kv.partition("=")[::2] for kv in args.grow.split(","))
        unknown = set(spec) - {"layers", "rank", "map"}
        if unknown:
            raise SystemExit(f"--grow: unknown part(s) {sorted(unknown)}; use layers=N, rank=R, map")
        draft = load_draft(start)
        ids = load_token_map(shipped / "token_map.pt", draft.config.vocab_size) if "map" in spec else None
        g = grow_draft(draft, ids, int(spec.get("rank") or 0) or None, int(spec.get("layers") or 0) or None)
        save_draft(g, grown)
        log(f"grew {start} ({args.grow}) -> {grown}")
    return grown


def _recipe_config(args, resume: bool, time_limit_s: float | None):
    """The committed recipe (models/smollm2-135m-dflash2/recipe.json) with this machine's paths."""
    from dflash2.training.trainer import TrainConfig

    return TrainConfig.from_file(
        ROOT / args.recipe,
        data=str(STASH / "recipe" / "data.npz"),
        output_dir=str(_recipe_out(args)),
        draft_config=str(ROOT / "configs" / "smollm2-135m-dflash2.json"),
        init_from=str(_grown_init(args)),
        resume=resume or None,
        time_limit_s=time_limit_s,
        device=args.recipe_device,
        eval_every=args.eval_every,  # 0 here: the eager per-domain evaluation costs minutes on the H200;
    )  # the engine measures the held-out domains after training instead


def _recipe_out(args) -> Path:
    """Where the recipe's training writes (and resumes): one folder per --grow, so variants of one
    machine's data train side by side."""
    return STASH / "recipe" / ("draft" if not args.grow else f"draft_{_grow_tag(args)}")


def _grow_tag(args) -> str:
    """--grow as a folder name: layers=5,rank=96,map -> layers5_rank96_map."""
    return args.grow.replace(",", "_").replace("=", "")


def _save_rows_in_parts(rows, stem: str, limit: int = 15 * 2**20) -> None:
    """Rows as $OUT/<stem>_partK.npz, each under the 16 MiB a returned file may have."""
    from dflash2.training.data import TokenDataset

    parts = 1
    while True:
        size = -(-len(rows) // parts)
        paths = [OUT / f"{stem}_part{k}.npz" for k in range(parts)]
        for k, path in enumerate(paths):
            TokenDataset(rows[k * size : (k + 1) * size]).save(path)
        if all(p.stat().st_size < limit for p in paths) or parts >= 4:
            log(f"data in {parts} part(s): {[p.stat().st_size for p in paths]} bytes")
            return
        for path in paths:
            path.unlink()
        parts += 1


def stage_recipe(args) -> None:
    """The committed data recipe, on the H200, in two calls carrying work/recipe (its prompt files,
    built on the CPU by 'dflash2 prepare-data --recipe ... --prompts-only') and the shipped weights:
      --phase data   answer the prompts with the target (HF generate, bf16), data back under $OUT,
                     then train until the deadline;
      --phase train  resume until --train-seconds, export the bf16 draft (+ token map), then
                     acceptance through the engine on GSM8K test and the held-out domains."""
    import tarfile

    import torch
    from dflash2.model.checkpoint import load_draft, save_draft
    from dflash2.target.loading import load_target
    from dflash2.training.data import TokenDataset
    from dflash2.training.recipe import DataRecipe, prepare_data
    from dflash2.training.trainer import train

    info = env_report()
    folder = target_folder()
    work = STASH / "recipe"
    work.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.phase == "data":
        for f in ("train_prompts.jsonl.gz", "heldout_prompts.jsonl", "prompts_report.json"):
            if (ROOT / args.recipe_prompts / f).is_file():  # else a 'stash' call put them there
                shutil.copy(ROOT / args.recipe_prompts / f, work / f)
        tc = _recipe_config(args, False, None)
        target = load_target(folder, "bfloat16", args.recipe_device)
        budget = args.gen_seconds or None
        prep = tc.prepare | {  # to time hf against engine, or a CPU dry run with a few requests
            k: v for k, v in (("generator", args.generator), ("gen_batch", args.recipe_gen_batch)) if v
        }
        report = prepare_data(DataRecipe.from_dict(prep), target, tc.data, tc.heldout_path(), budget)
        log(f"data: {report['sequences']} sequences, {report['tokens']} tokens, {report['generation_seconds']:.0f}s")
        shutil.copy(work / "data_report.json", OUT / "data_report.json")
        _save_rows_in_parts(TokenDataset.load(tc.data).rows, "data")
        left = args.deadline_s - (time.time() - T_START) - 60
        if left > 30:
            tc = _recipe_config(args, False, left)
            res = train(tc, target)
            log(f"trained {res['steps']} steps in {res['seconds']:.0f}s ({res['tokens']} tokens)")
        return
    tc = _recipe_config(args, True, args.train_seconds)
    parts = sorted((ROOT / args.recipe_prompts).glob("data_part*.npz"))
    if not Path(tc.data).is_file() and parts:  # the data call's answers, carried back (the stash was lost)
        TokenDataset([r for p in parts for r in TokenDataset.load(p).rows]).save(tc.data)
        for f in ("heldout_prompts.jsonl", "prompts_report.json", "train_prompts.jsonl.gz"):
            shutil.copy(ROOT / args.recipe_prompts / f, work / f)
        target = load_target(folder, "bfloat16", args.recipe_device)
        from dflash2.training.recipe import heldout_rows
        from dflash2.training.sources import load_prompts

        recipe = DataRecipe.from_dict(tc.prepare)
        held = heldout_rows(target.tokenizer, load_prompts(work / "heldout_prompts.jsonl"), recipe.max_prompt_tokens)
        TokenDataset(held).save(tc.heldout_path())
        log(f"data from {len(parts)} carried part(s)")
    if args.train_seconds > 0:
        target = load_target(folder, "bfloat16", args.recipe_device)
        res = train(tc, target)
        log(f"trained to step {res['steps']} ({len(res['history'])} steps logged) in {res['seconds']:.0f}s")
        del target
        torch.cuda.empty_cache()
    draft = load_draft(_recipe_out(args), device="cpu")
    save_draft(draft, OUT / "draft", max_shard_bytes=15 * 2**20, dtype=torch.bfloat16)
    shutil.copy(ROOT / "models" / "smollm2-135m-dflash2" / "token_map.pt", OUT / "draft" / "token_map.pt")
    log("exported bf16 draft (+ token map) to $OUT/draft")
    held = ROOT / args.recipe_prompts / "heldout_prompts.jsonl"
    args.heldout_path = str(held if held.is_file() else work / "heldout_prompts.jsonl")
    stage_bench(args, draft_dir=OUT / "draft")
    (OUT / "env.json").write_text(json.dumps(info, indent=1))
    with tarfile.open(OUT / "results.tar.gz", "w:gz") as tar:  # at most 8 files come back: one for the rest
        out = _recipe_out(args)
        for f in [out / "train_log.jsonl", out / "train_curves.png", *OUT.glob("*.json")]:
            if f.is_file():
                tar.add(f, arcname=f.name)
    for f in OUT.glob("*.json"):
        f.unlink()


def stage_bench(args, draft_dir: Path | None = None) -> None:
    """Acceptance on GSM8K test through the engine (greedy and sampled, widths 5 and 8), then
    engine speed side by side at several concurrencies. Each part is guarded, so one failure
    still leaves the others' numbers."""
    import subprocess

    folder = target_folder()
    draft_dir = draft_dir or (
        STASH / "draft" if (STASH / "draft" / "config.json").is_file() else ROOT / "models" / "smollm2-135m-dflash2"
    )
    common = [
        "--model-path",
        str(folder),
        "--speculative-draft-model-path",
        str(draft_dir),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
    ]
    gsm = ["--gsm8k-path", str(ROOT / "work" / "gsm8k_test.jsonl")]
    suites = ["--dataset", "gsm8k"]
    if getattr(args, "heldout_path", None):  # the recipe's held-out domains too, one row each
        suites = ["--dataset", "gsm8k,heldout", "--heldout-path", str(ROOT / args.heldout_path)]
    runs = [
        ("w5_greedy", ["--speculative-num-draft-tokens", "5", "--temperature", "0"]),
        ("w8_greedy", ["--speculative-num-draft-tokens", "8", "--temperature", "0"]),
        ("w5_token_t1", ["--speculative-num-draft-tokens", "5", "--temperature", "1", "--top-p", "0.95"]),
        (
            "w5_block_t1",
            [
                "--speculative-num-draft-tokens",
                "5",
                "--temperature",
                "1",
                "--top-p",
                "0.95",
                "--speculative-use-block-verification",
            ],
        ),
        ("w8_token_t1", ["--speculative-num-draft-tokens", "8", "--temperature", "1", "--top-p", "0.95"]),
        (
            "w8_block_t1",
            [
                "--speculative-num-draft-tokens",
                "8",
                "--temperature",
                "1",
                "--top-p",
                "0.95",
                "--speculative-use-block-verification",
            ],
        ),
    ]
    if args.configs:  # a subset, in the order given
        by_name = dict(runs)
        runs = [(n, by_name[n]) for n in args.configs.split(",") if n]
    cli = [sys.executable, "-m", "dflash2.cli"]
    envv = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for name, extra in runs:
        if time.time() - T_START > args.deadline_s - 120:
            log(f"skip acceptance {name}: deadline")
            continue
        cmd = (
            cli
            + ["bench", "acceptance"]
            + common
            + gsm
            + extra
            + suites
            + [
                "--limit",
                str(args.acc_limit),
                "--max-tokens",
                str(args.acc_max_tokens),
                "--max-running-requests",
                str(args.acc_concurrency),
                "--num-workers",
                str(args.acc_concurrency),
                "--output",
                str(OUT / f"acc_{name}.json"),
            ]
        )
        log(f"acceptance {name}")
        try:
            r = subprocess.run(
                cmd,
                env=envv,
                capture_output=True,
                text=True,
                timeout=max(30, args.deadline_s - (time.time() - T_START) - 15),
            )
        except subprocess.TimeoutExpired:
            log(f"acceptance {name} cut by the time limit")
            continue
        print(r.stdout[-1500:], flush=True)
        if r.returncode:
            print(r.stderr[-3000:], flush=True)
    left = args.deadline_s - (time.time() - T_START) - 20
    if left > 60 and args.speed:
        cmd = (
            cli
            + ["bench", "speed"]
            + common
            + gsm
            + [
                "--limit",
                "128",
                "--max-new-tokens",
                "64",
                "--requests-per-slot",
                "2",
                "--widths",
                args.speed_widths,
                "--verifiers",
                args.speed_verifiers,
                "--concurrency",
                args.concurrency,
                "--rounds",
                str(args.rounds),
                "--temperature",
                str(args.speed_temperature),
                "--output",
                str(OUT / "speed_conc.json"),
                "--plot",
                str(OUT / "speed_conc.png"),
            ]
        )
        log("engine speed")
        try:
            r = subprocess.run(cmd, env=envv, capture_output=True, text=True, timeout=left)
            print(r.stdout[-3000:], flush=True)
            if r.returncode:
                print(r.stderr[-3000:], flush=True)
        except subprocess.TimeoutExpired as e:
            print(f"speed timed out; partial stdout: {(e.stdout or b'')[-2000:]}", flush=True)


def stage_graphs(args) -> None:
    """Batch-1 decoding (the engine with one slot: static buffers, CUDA graphs): correctness first
    (bf16: graphed plain vs HF eager, speculative vs graphed plain, token for token; fp32:
    speculative must equal the target exactly), then side-by-side speed with every config graphed,
    then an eager reference on a few prompts. Everything in $OUT/graphs.json."""
    import torch
    from dflash2.benchmark.speed import format_table, gsm8k_test_prompts, side_by_side
    from dflash2.cli import build_parser, load_models
    from dflash2.decode_cli import one_slot_engine
    from dflash2.engine import speculative_generate
    from dflash2.training.data import render
    from dflash2.verification import SamplingParams

    info = env_report()
    folder = target_folder() if args.graph_device == "cuda" else ROOT / ".cache" / "smollm2-135m-instruct"
    prompts = gsm8k_test_prompts(ROOT / "work" / "gsm8k_test.jsonl", max(args.graph_limit, args.check_prompts))
    report = {"env": info, "check": {}, "speed": {}}
    widths = [int(w) for w in args.graph_widths.split(",")]
    OUT.mkdir(parents=True, exist_ok=True)
    flags = argparse.Namespace(speculative_use_block_verification=False, disable_cuda_graph=False)

    def models(dtype):
        a = build_parser().parse_args(
            ["bench", "speed", "--model-path", str(folder), "--device", args.graph_device, "--dtype", dtype]
        )
        return load_models(a)

    def agree(a, b):  # tokens equal up to the first difference, over the shorter
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n, a == b

    for dtype in ("float32", "bfloat16")[2 - args.check_dtypes :]:
        target, draft, _ = models(dtype)
        ids = [render(target.tokenizer, p) for p in prompts[: args.check_prompts]]
        sp = SamplingParams(max_new_tokens=args.check_tokens)
        t0 = time.time()
        longest = max(len(x) for x in ids) + args.check_tokens
        plain = one_slot_engine(target, None, 1, flags, longest)
        decs = {w: one_slot_engine(target, draft, w, flags, longest) for w in (5, 8)}
        log(
            f"{dtype}: 3 one-slot engines built and captured in {time.time() - t0:.1f} s "
            f"(graphed: {[e.runner.use_graph for e in [plain, *decs.values()]]})"
        )
        rows = []
        for i, x in enumerate(ids):
            ref = plain.generate([x], sp)[0].token_ids
            eager = speculative_generate(target, None, x, sp, width=1).token_ids
            row = {"prompt": i, "static_vs_eager_plain": agree(ref, eager)}
            for w, d in decs.items():
                row[f"w{w}_vs_static_plain"] = agree(d.generate([x], sp)[0].token_ids, ref)
            rows.append(row)
        same = {k: sum(r[k][1] for r in rows) for k in rows[0] if k != "prompt"}
        log(f"{dtype}: identical outputs out of {len(rows)}: {same}")
        report["check"][dtype] = {"rows": rows, "identical": same}
        (OUT / "graphs.json").write_text(json.dumps(report, indent=1))
        if dtype == "float32":
            del target, draft, plain, decs
            torch.cuda.empty_cache()
    if args.breakdown:  # each captured graph alone: median of 200 replays, synchronised
        x = render(target.tokenizer, prompts[0])
        times = {}
        for w in [1] + widths:
            eng = one_slot_engine(target, draft if w > 1 else None, w, flags, len(x) + 8)
            for name, sp in (
                ("greedy", SamplingParams(max_new_tokens=2)),
                ("t1", SamplingParams(max_new_tokens=2, temperature=1.0, top_p=0.95, seed=0)),
            ):
                eng.generate([x], sp)  # buffers now hold a real context
            for (kind, B, greedy, kv_len, *_), (step, _) in eng.runner.graphs.items():
                times[f"w{w} {'greedy' if greedy else 't1'} {kind} kv{kv_len}"] = replay_ms(step, 200)
        print("graph replay ms (median of 200):", json.dumps({k: round(v, 3) for k, v in times.items()}), flush=True)
        report["breakdown_ms"] = times
    temps = [float(t) for t in args.graph_temperatures.split(",")]
    rows = side_by_side(
        target,
        draft,
        prompts[: args.graph_limit],
        widths=widths,
        temperatures=temps,
        max_new_tokens=args.graph_tokens,
        verifies=tuple(args.graph_verifiers.split(",")),
    )
    print("CUDA graphs, bf16, batch 1\n" + format_table(rows), flush=True)
    report["speed"]["graphs"] = [r.__dict__ for r in rows]
    (OUT / "graphs.json").write_text(json.dumps(report, indent=1))
    if args.eager_limit and time.time() - T_START < args.deadline_s - 200:
        rows = side_by_side(
            target,
            draft,
            prompts[: args.eager_limit],
            widths=(5, 8),
            temperatures=(0.0,),
            max_new_tokens=args.graph_tokens,
            verifies=("token",),
            engine_kw={"disable_cuda_graph": True},
        )
        print("eager (HF), bf16, batch 1\n" + format_table(rows), flush=True)
        report["speed"]["eager"] = [r.__dict__ for r in rows]
        (OUT / "graphs.json").write_text(json.dumps(report, indent=1))


def stage_engine(args) -> None:
    """The serving engine's CUDA-graph runner (engine/graph_runner.py): fp32 and bf16 checks
    (graphed engine at concurrency 8 against the paged, eager engine running the target alone),
    then engine speed side by side per concurrency, every row graphed (the target alone too),
    and an eager (paged) reference at one level. Everything in $OUT/engine.json."""
    import torch
    from dflash2.benchmark import engine_speed
    from dflash2.benchmark.speed import gsm8k_test_prompts
    from dflash2.cli import build_parser, load_models
    from dflash2.engine.engine import EngineConfig, LLMEngine
    from dflash2.engine.request import Request
    from dflash2.training.data import render
    from dflash2.verification import SamplingParams

    info = env_report()
    folder = target_folder() if args.graph_device == "cuda" else ROOT / ".cache" / "smollm2-135m-instruct"
    prompts = gsm8k_test_prompts(ROOT / "work" / "gsm8k_test.jsonl", 512)  # c=128 x 4 requests a slot
    report = {"env": info, "check": {}, "speed": {}}
    OUT.mkdir(parents=True, exist_ok=True)

    def models(dtype):
        a = build_parser().parse_args(
            ["bench", "speed", "--model-path", str(folder), "--device", args.graph_device, "--dtype", dtype]
        )
        return load_models(a)

    def serve(target, draft, ids, width, runner, disable=False, schedule=None):
        eng = LLMEngine(
            target,
            draft,
            EngineConfig(
                max_running_requests=8,
                speculative=draft is not None,
                num_draft_tokens=width,
                context_length=1024,
                runner=runner,
                disable_cuda_graph=disable,
                **(schedule or {}),
            ),
        )
        reqs = [Request(x, SamplingParams(max_new_tokens=args.check_tokens)) for x in ids]
        for r in reqs:
            eng.add_request(r)
        eng.run_until_done()
        return [r.output_ids for r in reqs], type(eng.runner).__name__, eng.runner.use_graph

    if not args.check_prompts:  # speed only
        target, draft, _ = models("bfloat16" if args.graph_device == "cuda" else "float32")
        if args.graph_device == "cuda":  # (the check draws on the GPU)
            report["draft_compile_check"] = draft_compile_check(target, draft)
    for dtype in ("float32", "bfloat16")[2 - args.check_dtypes :] if args.check_prompts else ():
        target, draft, _ = models(dtype)
        ids = [render(target.tokenizer, p) for p in prompts[: args.check_prompts]]
        ref, *_ = serve(target, None, ids, 2, "paged")
        row = {}
        # (each --schedules entry checked too: the overlap schedule and async scheduling must not change a token)
        for w, sched in [(w, k) for w in (1, 5, 8) for k in (args.schedules.split(",") if args.schedules else [""])]:
            t0 = time.time()
            schedule = engine_speed.schedule_fields(sched) if sched else None
            out, kind, graphed = serve(target, draft if w > 1 else None, ids, max(w, 2), "auto", schedule=schedule)
            row[f"w{w}" + (f" {sched}" if sched else "")] = {
                "runner": kind,
                "graphed": graphed,
                "seconds": round(time.time() - t0, 2),
                "identical": sum(a == b for a, b in zip(out, ref)),
                "of": len(ids),
                "first_diff": [
                    next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(out, ref)
                ],
            }
        log(f"{dtype}: graphed engine (c=8) vs paged eager target alone: {json.dumps(row)}")
        report["check"][dtype] = row
        (OUT / "engine.json").write_text(json.dumps(report, indent=1))
        if dtype == "float32":
            del target, draft
            torch.cuda.empty_cache()
    if args.breakdown:  # each graph alone at batch 1 (median of 100 synchronised replays), by buffer length
        from dflash2.engine.graph_runner import GraphModelRunner

        x = render(target.tokenizer, prompts[0])
        times = {}
        for max_len in (1029, 4101):
            for w in (5, 8):
                runner = GraphModelRunner(target, draft, w, 1, max_len)
                req = Request(x, SamplingParams())
                runner.prefill(req)
                req.output_ids.append(x[-1])
                runner._load([req], None)  # the slot's anchor and position
                for kind in ("draft", "verify"):
                    for kv_len in runner.kv_buckets:  # attending over a prefix, and over the whole buffer
                        step, _ = runner._graph(kind, 1, True, kv_len, make=True)
                        times[f"max_len {max_len} kv {kv_len} w{w} {kind}"] = round(replay_ms(step), 3)
                del runner
        log(f"graph replay ms: {json.dumps(times)}")
        report["breakdown_ms"] = times
    sets = {"gsm8k": prompts}
    if "heldout" in args.prompt_sets:  # the recipe's held-out conversations (no drafter trained on them)
        from dflash2.training.sources import load_prompts

        sets["heldout"] = [p.messages for p in load_prompts(ROOT / "work" / "recipe" / "heldout_prompts.jsonl")]
    unknown = set(args.prompt_sets.split(",")) - set(sets)
    if unknown:
        raise SystemExit(f"--prompt-sets: unknown {sorted(unknown)} (gsm8k, heldout)")
    shared = shared_engines(args)  # one engine per runner for every level, set, temperature and planner row
    for (set_name, set_prompts), temp in [
        ((name, sets[name]), float(t)) for name in args.prompt_sets.split(",")  # in the flag's order
        for t in args.graph_temperatures.split(",")
    ]:  # fmt: skip
        # (shared engines: a further set or temperature adds its rows only, no capture)
        if time.time() - T_START > args.deadline_s - (40 if args.shared_engines else 150):
            log(f"skip {set_name} T={temp}: deadline")
            continue
        key = f"graphs_t{temp}" + ("" if set_name == "gsm8k" else f"_{set_name}")

        def keep(rows, key=key):  # each finished level is saved, so a call cut by its limit keeps them
            report["speed"][key] = [r.__dict__ for r in rows]
            (OUT / "engine.json").write_text(json.dumps(report, indent=1))

        rows = speed_rows(
            args,
            target,
            draft,
            set_prompts,
            temp,
            keep,
            shared,
            attention_backends=tuple(args.attention_backends.split(",")),
            engine_kw={
                "enable_mixed_chunk": {"auto": None, "on": True, "off": False}[args.mixed_chunk],
                "disable_overlap_schedule": args.disable_overlap_schedule,
            },
        )
        print(f"engine, CUDA graphs, bf16, {set_name}, T={temp}\n" + engine_speed.table(rows), flush=True)
        keep(rows)
    if args.eager_limit and time.time() - T_START < args.deadline_s - 150:
        rows = engine_speed.run(
            target,
            draft,
            prompts,
            [5],
            ["token"],
            [args.eager_limit],
            64,
            0.0,
            requests_per_slot=1,
            rounds=1,
            engine_kw={"disable_cuda_graph": True},
        )
        print("engine, eager (paged), bf16, T=0\n" + engine_speed.table(rows), flush=True)
        report["speed"]["eager"] = [r.__dict__ for r in rows]
        (OUT / "engine.json").write_text(json.dumps(report, indent=1))


def stage_steps(args) -> None:
    """Each captured graph of the static runner alone (median of 100 synchronised replays): draft
    block + selector, and verify (target forward + latents + verifier), greedy and sampled (T=1,
    top-p 0.95, block verification), width 5 and 1, by batch, for both attention backends. A
    random SmolLM2-shaped target with the shipped drafter (or ``--steps-shape``: a random target of
    that shape and drafter, carrying work/tok), rows at ~300 positions; no stash."""
    import torch
    import transformers as tf
    from dflash2.engine import graph_runner
    from dflash2.engine.graph_runner import GraphModelRunner
    from dflash2.engine.request import Request
    from dflash2.engine.steps import BatchSampling
    from dflash2.model.checkpoint import load_draft
    from dflash2.target import TargetModel

    graph_runner.WARM_REPLAY = not args.cold_replays
    from dflash2.verification import SamplingParams

    info = env_report()
    dev = args.graph_device
    if args.steps_shape:  # a random target of that shape with a random published-architecture drafter
        from transformers import AutoTokenizer

        from dflash2.benchmark import shapes

        tok = AutoTokenizer.from_pretrained(ROOT / "work" / "tok")
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        target, draft = shapes.random_models(args.steps_shape, dev, dtype, 5, tok)
        if args.steps_shape == "published-draft":  # its 93 random layers drift past the bf16 check's 10%
            from dflash2.target.static_llama import StaticTarget  # (0.97 of 8.3): only the draft is timed

            StaticTarget.check = lambda self, *a, **k: 0.0
    else:
        draft = load_draft(ROOT / "models" / "smollm2-135m-dflash2", device=dev, dtype=torch.bfloat16).eval()
        cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # fmt: skip
        torch.manual_seed(0)
        target = TargetModel(tf.LlamaForCausalLM(cfg).to(dev, torch.bfloat16), layer_ids=draft.config.target_layer_ids)
    # rows at ~L positions (each one shorter than the last) in a context of L + 788 (1,088 at the default 300)
    L = args.steps_prompt_tokens
    ctx = L + 788
    prompt = torch.randint(100, 40000, (L,)).tolist()
    times: dict = {}
    kernels: dict = {}
    n = 100 if dev == "cuda" else 2
    samplers = args.sampler_backends.split(",")
    kinds = args.steps_kinds.split(",")
    slot_kinds = {"draft", "verify", "plain", "alone"} & set(kinds)  # (the slot-mode runners below)
    for attention, sampler in [
        (a, sb)
        for a in (args.steps_attention.split(",") if dev == "cuda" else ("sdpa",))
        for sb in samplers
        if slot_kinds
    ]:
        for B in [int(b) for b in args.concurrency.split(",")]:
            runner = GraphModelRunner(target, draft, 5, B, ctx, cuda_graph=dev == "cuda", block_verification=True,
                                      attention=attention, verify_widths=(1,), sampler=sampler,
                                      compile_draft=not args.eager_draft)  # fmt: skip
            reqs = [Request(prompt[: L - b], SamplingParams()) for b in range(B)]
            for r in reqs:
                runner.prefill(r)
                r.output_ids.append(r.prompt_ids[-1])
            top_p = [SamplingParams(temperature=1.0, top_p=0.95)] * B
            runner._load(reqs, BatchSampling.of(top_p, torch.rand(B, 2 * 4 + 1), dev))
            for greedy in (True, False):
                # plain: width 1 of requests that do not draft (no latent writes), the auto planner's
                # target-alone step, against the target-alone engine's own verify w1 below
                for kind, w in [k for k in (("draft", 5), ("verify", 5), ("verify", 1), ("plain", 1)) if k[0] in kinds]:
                    step, _ = runner._graph(kind, B, greedy, ctx, w, make=True)
                    key = f"{attention} {sampler} B{B} {'greedy' if greedy else 'T=1'} {kind} w{w}"
                    first = replay_ms(step, 1)  # the graph's first replay since its capture
                    times[key] = round(replay_ms(step, n), 3)
                    times[f"{key} first"] = round(first, 3)
                    runner.start[:B] = L  # the verify graph moves positions on
                    if args.profile and dev == "cuda":
                        kernels[key] = kernel_table(step.fn)
                        runner.start[:B] = L
            del runner
            if "alone" in kinds:  # the target alone (no drafter): its one-token step, against width 1
                plain = GraphModelRunner(target, None, 1, B, ctx, cuda_graph=dev == "cuda", attention=attention,
                                         sampler=sampler)  # fmt: skip
                reqs = [Request(prompt[: L - b], SamplingParams()) for b in range(B)]
                for r in reqs:
                    plain.prefill(r)
                    r.output_ids.append(r.prompt_ids[-1])
                plain._load(reqs, BatchSampling.of(top_p, torch.rand(B, 1), dev))
                for greedy in (True, False):
                    step, _ = plain._graph("verify", B, greedy, ctx, 1, make=True)
                    key = f"{attention} {sampler} B{B} {'greedy' if greedy else 'T=1'} target-alone verify w1"
                    first = replay_ms(step, 1)
                    times[key] = round(replay_ms(step, n), 3)
                    times[f"{key} first"] = round(first, 3)
                    plain.start[:B] = L
                    if args.profile and dev == "cuda":
                        kernels[key] = kernel_table(step.fn)
                        plain.start[:B] = L
                del plain
            if dev == "cuda":
                torch.cuda.empty_cache()
    if {"prefill", "mixed"} & set(kinds):
        times.update(packed_replay_ms(target, draft, [int(b) for b in args.concurrency.split(",")], kinds, n))
    for k, v in times.items():
        log(f"  {k:<36} {v:.3f} ms")
    for k, rows in kernels.items():  # where each graph's time goes, by kernel (eager calls of its function)
        log(f"  {k}: {sum(r[2] for r in rows):.3f} ms of kernels in {sum(r[1] for r in rows)} launches")
        for name, count, ms in rows[:12]:
            log(f"    {ms:7.3f} ms {count:4d}x {name[:90]}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"steps_{args.steps_shape or 'smollm2'}.json").write_text(
        json.dumps({"env": info, "replay_ms": times, "kernels": kernels}, indent=1)
    )


def packed_replay_ms(target, draft, concs: list[int], kinds: list[str], n: int) -> dict:
    """What admitting prompts costs, replay by replay, on the paged runner the engine serves with:
    ``prefill``: each packed prefill graph (``PREFILL_TOKENS``, with the draft's latents) against its
    real-token count, so a replay's fixed cost and per-token cost can be fitted; ``mixed``: the
    greedy width-5 verify graph of each batch with a packed prompt of each mixed length inside it
    against the same graph without (``MIXED_MAX_STEP_TOKENS`` lifted for the capture), the draft
    replay beside it. Why: DFlash2's 8B prefill at 64 requests is ~115 replays of ~470 tokens against
    the target alone's ~65 of ~860, and whether mixing or fewer replays pays hangs on those two costs
    (docs/benchmarks.md, thirty-sixth session)."""
    import torch
    from dflash2.engine import graph_runner
    from dflash2.engine.graph_runner import GraphModelRunner

    dev, out = target.device, {}
    B = max(concs)
    saved = graph_runner.MIXED_MAX_STEP_TOKENS
    graph_runner.MIXED_MAX_STEP_TOKENS = 5 * B if "mixed" in kinds else saved
    try:
        runner = GraphModelRunner(target, draft, 5, B, 1088, cuda_graph=dev.type == "cuda", page_size=64,
                                  num_pages=B * 17 + 1, mixed_chunk="mixed" in kinds)  # fmt: skip
    finally:
        graph_runner.MIXED_MAX_STEP_TOKENS = saved
    # inputs: one prompt over every packed token (positions 0 .. T-1 in slot 0's table, pages of its own)
    runner.tables[:B] = torch.arange(B * 17, dtype=torch.int32, device=dev).view(B, 17)
    runner.pf_table.copy_(runner.tables[: runner.pf_table.shape[0]])
    T_max = runner.pf.shape[1]
    runner.pf[0] = torch.randint(100, 40000, (T_max,), device=dev)
    runner.pf[1] = torch.arange(T_max, device=dev)
    runner.pf[2] = 0
    if "prefill" in kinds:
        for T in runner.prefill_tokens:
            runner.pf_last.fill_(T - 1)
            for latents in (True, False):  # (without: a request admitted not drafting, or the target alone)
                ms = replay_ms(runner.prefill_graphs[(T, latents)][0], n)
                out[f"prefill packed T{T} ({'latents' if latents else 'no latents'})"] = round(ms, 3)
    if "mixed" in kinds:
        for b in (b for b in runner.buckets if b in concs):
            runner.start[:b] = 300
            draft_ms = replay_ms(runner._graph("draft", b, True, runner.kv_buckets[0])[0], n)
            out[f"mixed B{b} draft w5"] = round(draft_ms, 3)
            for mix in (0, *runner.mixed_lengths):
                runner.pf_last.fill_(max(mix, 1) - 1)
                key = ("verify", b, True, runner._verify_kv(runner.kv_buckets[0]), 5, mix)
                if key in runner.graphs:
                    out[f"mixed B{b} verify w5 + prompt {mix}"] = round(replay_ms(runner.graphs[key][0], n), 3)
                    runner.start[:b] = 300
    del runner
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def random_block_inputs(target, draft, B: int, g) -> tuple:
    """:func:`paged_block_hidden`'s arguments for ``B`` rows of random bf16 latents (1,024 context
    positions each, in shuffled pages of 256) and random anchors, width 5."""
    import torch

    c, dev = draft.config, target.device
    page, pages, W = 256, 8 * B, 1024
    lat = torch.randn(c.num_hidden_layers, pages, page, c.kv_lora_rank + c.qk_rope_head_dim, device=dev,
                      generator=g).to(torch.bfloat16)  # fmt: skip
    tables = torch.randperm(pages, device=dev, generator=g).view(B, 8).int()
    anchors = torch.randint(100, 40000, (B,), device=dev, generator=g)
    apos = torch.randint(100, 900, (B,), device=dev, generator=g)
    return (target.embed, lat, tables, page, anchors, apos, torch.arange(W, device=dev)[None], 5)


def draft_compile_check(target, draft) -> dict:
    """The draft block with its layers compiled (as the graph runner runs them on CUDA) against the
    eager layers, on the same random latents: hidden states, the greedy drafts they give, and the
    eager / compiled time of the block (synchronised calls, not graphed: the kernels, with launches)."""
    import torch
    from dflash2.engine.graph_runner import paged_block_hidden
    from dflash2.engine.steps import greedy_walk

    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for B in (1, 8, 64):
        a = random_block_inputs(target, draft, B, g)
        anchors, apos, dev = a[4], a[5], target.device
        row = {}
        with torch.no_grad():
            hidden = {}
            for mode in ("eager", "compiled"):
                if mode == "eager":
                    draft.compile_off()
                else:
                    draft.compile_layers()
                hidden[mode] = paged_block_hidden(draft, *a)  # (the first compiled call compiles)
                row[f"{mode}_ms"] = round(replay_ms(lambda: paged_block_hidden(draft, *a), 50), 3)
            h_e, h_c = hidden["eager"].float(), hidden["compiled"].float()
            hw = target.lm_head_weight
            same = greedy_walk(draft, hidden["eager"], anchors, hw) == greedy_walk(
                draft, hidden["compiled"], anchors, hw
            )
            feats = torch.randn(B, 5, draft.fc.in_features, device=dev, generator=g).to(torch.bfloat16)
            pos = apos[:, None] + torch.arange(5, device=dev)
            rows = {}
            for mode in ("eager", "compiled"):
                draft.compile_off() if mode == "eager" else draft.compile_layers()
                rows[mode] = draft.graph_rows(feats, pos).float()
        row.update(max_abs_diff=round((h_c - h_e).abs().max().item(), 5), max_abs=round(h_e.abs().max().item(), 3),
                   greedy_drafts_equal=round(same.float().mean().item(), 4),
                   rows_max_abs_diff=round((rows["compiled"] - rows["eager"]).abs().max().item(), 5),
                   rows_max_abs=round(rows["eager"].abs().max().item(), 3))  # fmt: skip
        log(f"  draft block B={B}: {row}")
        out[f"B{B}"] = row
    draft.compile_off()  # each engine's runner compiles (reusing these compilations)
    return out


def draft_block_ab(target, draft, flag: str, names: tuple[str, str]) -> dict:
    """The draft block (layers compiled, as served) with ``model/attention.py``'s ``flag`` off
    (``names[0]``) and on (``names[1]``), alternating twice each (order effects), on the same random
    latents at batch 1, 8 and 64: time of each, hidden-state difference, and how often the greedy
    drafts agree."""
    import torch
    from dflash2.engine.graph_runner import paged_block_hidden
    from dflash2.engine.steps import greedy_walk
    from dflash2.model import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    out, before = {}, getattr(attention, flag)
    draft.compile_layers()
    for B in (1, 8, 64):
        a = random_block_inputs(target, draft, B, g)
        anchors = a[4]
        row, hidden = {}, {}
        with torch.no_grad():
            for mode in names + names:
                setattr(attention, flag, mode == names[1])
                hidden[mode] = paged_block_hidden(draft, *a)
                ms = round(replay_ms(lambda: paged_block_hidden(draft, *a), 50), 3)
                row.setdefault(f"{mode}_ms", []).append(ms)
            hw = target.lm_head_weight
            same = greedy_walk(draft, hidden[names[0]], anchors, hw) == greedy_walk(
                draft, hidden[names[1]], anchors, hw
            )
        h_r, h_t = hidden[names[0]].float(), hidden[names[1]].float()
        row.update(max_abs_diff=round((h_t - h_r).abs().max().item(), 5), max_abs=round(h_r.abs().max().item(), 3),
                   greedy_drafts_equal=round(same.float().mean().item(), 4))  # fmt: skip
        log(f"  draft block, {flag} B={B}: {row}")
        out[f"B{B}"] = row
    setattr(attention, flag, before)
    draft.compile_off()
    return out


def draft_precision_check(target, draft) -> dict:
    """The draft's attention matmuls on tensor cores (bf16 in, fp32 out) against both operands cast
    to fp32 (the plain torch reference): :func:`draft_block_ab`."""
    return draft_block_ab(target, draft, "TENSOR_CORE_SCORES", ("fp32", "tensor_cores"))


def latent_attention_inputs(B: int, g) -> tuple:
    """Random bf16 ``(q, ctx, blk, mask)`` of the draft attention at the published drafter's width: 96
    heads x 5 block rows, 1,024 context latents of 512 + 64, 70% of context keys visible, every block key."""
    import torch

    bf = torch.bfloat16
    q = torch.randn(B, 480, 576, device="cuda", generator=g).to(bf)
    ctx = torch.randn(B, 1024, 576, device="cuda", generator=g).to(bf)
    blk = torch.randn(B, 5, 576, device="cuda", generator=g).to(bf)
    mask = torch.rand(B, 5, 1029, device="cuda", generator=g) < 0.7
    mask[..., 1024:] = True
    return q, ctx, blk, mask


def draft_fused_check(target, draft) -> dict:
    """The fused latent-attention kernel (kernels/mla_attention.py) against the torch path it replaces:
    alone at batch 64 (:func:`latent_attention_inputs`, against the float32 reference), then the draft
    block both ways (:func:`draft_block_ab`), the kernel reading the paged latents in place and gathered."""
    import torch
    from dflash2.kernels.mla_attention import latent_attention, latent_attention_ref

    attn = draft.layers[0].self_attn  # (the torch path's scale is the drafter's own)
    q, ctx, blk, mask = latent_attention_inputs(64, torch.Generator(device="cuda").manual_seed(0))
    ref = latent_attention_ref(q, ctx, blk, mask, attn.scale, 512)
    got = latent_attention(q, ctx, blk, mask, attn.scale, 512)
    with torch.no_grad():
        torch_path = attn._attend(q, ctx, blk, mask)
    out: dict = {
        "kernel_alone_B64": {
            "kernel_ms": round(replay_ms(lambda: latent_attention(q, ctx, blk, mask, attn.scale, 512), 50), 4),
            "torch_ms": round(replay_ms(lambda: attn._attend(q, ctx, blk, mask), 50), 4),
            "kernel_max_abs_diff": round((got.float() - ref).abs().max().item(), 5),
            "torch_max_abs_diff": round((torch_path.float() - ref).abs().max().item(), 5),
            "max_abs": round(ref.abs().max().item(), 3),
        }
    }
    log(f"  latent attention alone: {out['kernel_alone_B64']}")
    from dflash2.model import attention

    # the kernel reading the paged latents in place, then given them gathered (as the torch path is)
    for paged in (True, False):
        attention.PAGED_READ = paged
        log(f"  PAGED_READ={paged}")
        out["paged_read" if paged else "gathered"] = draft_block_ab(
            target, draft, "FUSED_ATTENTION", ("torch", "fused")
        )
    attention.PAGED_READ = True
    return out


def packed_prefill_check(target) -> dict:
    """The packed prefill (``Rows.segment``: prompts back to back, a segment-causal mask) against each
    prompt's own forward from position 0 (last logits rows and K cache, bf16), then the forward timed
    packed against the same prompts padded to a (rows, length) shape (the prefill before the 35th
    session), eager and synchronised: at these sizes a prefill is compute-bound."""
    import torch
    from dflash2.target.static_llama import Rows, StaticTarget

    dev, V = target.device, target.config.vocab_size
    apart, joint = (StaticTarget(target, 1024, 16, "live", page_size=256, num_pages=64) for _ in "ab")
    g = torch.Generator().manual_seed(0)
    out: dict = {}

    def packed_rows(prompts, T):
        lengths = [len(x) for x in prompts]
        seg = [b for b, n in enumerate(lengths) for _ in range(n)]
        pos = [i for n in lengths for i in range(n)]
        pad = T - len(seg)
        seg, pos = seg + [seg[-1]] * pad, pos + list(range(pos[-1] + 1, pos[-1] + 1 + pad))
        tables = (torch.arange(len(prompts), dtype=torch.int32, device=dev) * 4)[:, None] + torch.arange(
            4, device=dev, dtype=torch.int32
        )
        seg_t = torch.tensor(seg, device=dev)
        ids = torch.cat([*prompts, torch.zeros(pad, dtype=torch.long, device=dev)])[:, None]
        last = torch.tensor(lengths, device=dev).cumsum(0) - 1
        return Rows(ids, torch.tensor(pos, device=dev), tables[seg_t], last=last, segment=seg_t), tables

    lengths = [110, 60, 140]
    prompts = [torch.randint(0, V, (n,), generator=g).to(dev) for n in lengths]
    rows, tables = packed_rows(prompts, 384)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    with torch.no_grad():
        want = [apart.forward(x[None], zero, kv_len=len(x), tables=tables[b : b + 1]) for b, x in enumerate(prompts)]
        (logits, _), *_ = joint.forward_rows([rows])
    diffs, kdiffs = [], []
    for b, (lg, _) in enumerate(want):
        diffs.append((logits[b, 0] - lg[0, -1]).abs().max().item() / lg[0, -1].abs().max().item())
        page = tables[b, 0].item()
        n = lengths[b]
        kdiffs.append(
            (joint.k_cache[:, page, :, :n].float() - apart.k_cache[:, page, :, :n].float()).abs().max().item()
        )
    # the rounding baseline: the same prompts padded to one (rows, length) shape against each alone
    ids = torch.stack([torch.cat([x, x.new_zeros(max(lengths) - len(x))]) for x in prompts])
    with torch.no_grad():
        padded, _ = apart.forward(
            ids, zero.expand(3), kv_len=max(lengths), tables=tables, last=rows.last.new_tensor([n - 1 for n in lengths])
        )
    base = [
        (padded[b, 0] - lg[0, -1]).abs().max().item() / lg[0, -1].abs().max().item() for b, (lg, _) in enumerate(want)
    ]
    out["check"] = {
        "lengths": lengths,
        "last_logits_rel_diff": [round(d, 4) for d in diffs],
        "padded_vs_alone_rel_diff": [round(d, 4) for d in base],
        "k_max_abs_diff": kdiffs,
    }
    log(f"  packed prefill check: {out['check']}")
    for n_prompts, L in ((1, 128), (4, 128), (8, 128), (16, 128)):
        prompts = [
            torch.randint(0, V, (int(torch.randint(90, 128, (1,), generator=g)),), generator=g).to(dev)
            for _ in range(n_prompts)
        ]
        total = sum(len(x) for x in prompts)
        T = next(t for t in (128, 192, 256, 384, 512, 768, 1024, 1536, 2048) if t >= total)
        rows, tables = packed_rows(prompts, T)
        ids = torch.stack([torch.cat([x, x.new_zeros(L - len(x))]) for x in prompts])
        last = torch.tensor([len(x) - 1 for x in prompts], device=dev)
        with torch.no_grad():
            packed_ms = replay_ms(lambda: joint.forward_rows([rows]), 10)
            padded_ms = replay_ms(
                lambda: apart.forward(ids, zero.expand(n_prompts), kv_len=L, tables=tables, last=last), 10
            )
        row = {
            "prompts": n_prompts,
            "real_tokens": total,
            "packed_T": T,
            "packed_ms": round(packed_ms, 2),
            "padded_shape": f"{n_prompts}x{L}",
            "padded_ms": round(padded_ms, 2),
        }
        log(f"  packed vs padded: {row}")
        out[f"n{n_prompts}"] = row
    return out  # (the two caches go with this frame)


def draft_split_check(target, draft) -> dict:
    """The split softmax (kernels/latent_softmax.py) alone against its float32 reference, the draft
    attention's split path against the padded one (alone, batch 64 and 1), then the draft block both
    ways (:func:`draft_block_ab`)."""
    import torch
    from dflash2.kernels.latent_softmax import latent_softmax, latent_softmax_ref
    from dflash2.kernels.mla_attention import latent_attention_ref
    from dflash2.model import attention

    attn = draft.layers[0].self_attn
    out: dict = {}
    for B in (64, 1):
        q, ctx, blk, mask = latent_attention_inputs(B, torch.Generator(device="cuda").manual_seed(0))
        s_ctx = torch.bmm(q, ctx.transpose(1, 2), out_dtype=torch.float32)
        s_blk = torch.bmm(q, blk.transpose(1, 2), out_dtype=torch.float32)
        ref = latent_softmax_ref(s_ctx, s_blk, mask, attn.scale, torch.float32)
        got = latent_softmax(s_ctx, s_blk, mask, attn.scale, torch.float32)
        got_bf = latent_softmax(s_ctx, s_blk, mask, attn.scale, torch.bfloat16)
        with torch.no_grad():
            attention.SPLIT_SOFTMAX = False
            padded = attn._attend(q, ctx, blk, mask)
            padded_ms = replay_ms(lambda: attn._attend(q, ctx, blk, mask), 50)
            attention.SPLIT_SOFTMAX = True
            split = attn._attend(q, ctx, blk, mask)
            split_ms = replay_ms(lambda: attn._attend(q, ctx, blk, mask), 50)
        exact = latent_attention_ref(q, ctx, blk, mask, attn.scale, 512)
        row = {
            "softmax_kernel_ms": round(replay_ms(lambda: latent_softmax(s_ctx, s_blk, mask, attn.scale, torch.bfloat16), 50), 4),
            "softmax_ref_ms": round(replay_ms(lambda: latent_softmax_ref(s_ctx, s_blk, mask, attn.scale, torch.bfloat16), 50), 4),
            "softmax_max_abs_diff_fp32": max((a - b).abs().max().item() for a, b in zip(got, ref)),
            "softmax_max_abs_diff_bf16": max((a.float() - b).abs().max().item() for a, b in zip(got_bf, ref)),
            "attend_padded_ms": round(padded_ms, 4),
            "attend_split_ms": round(split_ms, 4),
            "padded_max_abs_diff": round((padded.float() - exact).abs().max().item(), 5),
            "split_max_abs_diff": round((split.float() - exact).abs().max().item(), 5),
            "max_abs": round(exact.abs().max().item(), 3),
        }  # fmt: skip
        log(f"  split softmax B={B}: {row}")
        out[f"alone_B{B}"] = row
    out["block"] = draft_block_ab(target, draft, "SPLIT_SOFTMAX", ("padded", "split"))
    attention.SPLIT_SOFTMAX = True
    return out


def stage_mla(args) -> None:
    """The fused latent attention's launches (kernels/mla_attention.py ``CONFIGS``) at batch 64 and 1
    (:func:`latent_attention_inputs`), each checked against the float32 reference and timed beside the
    torch path (matmuls + softmax) of a random 8B-shape drafter's attention; then, with the fastest, that
    drafter's block both ways (:func:`draft_fused_check`)."""
    import itertools

    import torch
    from transformers import AutoTokenizer

    from dflash2.benchmark import shapes
    from dflash2.kernels import mla_attention as mla

    OUT.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ROOT / "work" / "tok")
    target, draft = shapes.random_models("llama-8b", "cuda", torch.bfloat16, 5, tok)
    attn = draft.layers[0].self_attn
    g = torch.Generator(device="cuda").manual_seed(0)
    report: dict = {"env": env_report(), "sweep": {}}
    chosen = dict(mla.CONFIGS)
    for B in (64, 1):
        q, ctx, blk, mask = latent_attention_inputs(B, g)
        ref = mla.latent_attention_ref(q, ctx, blk, mask, attn.scale, 512)
        with torch.no_grad():
            torch_ms = replay_ms(lambda: attn._attend(q, ctx, blk, mask), 50)
        rows = []
        if B == 64:
            configs = [dict(block_m=bm, block_n=bn, block_v=bv, num_warps=w, num_stages=st)
                       for bm, bn, bv, w, st in itertools.product((32, 64, 128), (32, 64), (128, 256, 512), (4, 8), (1, 2))]  # fmt: skip
        else:  # batch 1: the fastest at 64, with more column splits (more programs)
            top = [r[2] for r in report["sweep"]["B64"]["configs"][:6]]
            configs = [{**c, "block_v": bv} for c in top for bv in (128, 256)]
        for c in configs:
            mla.CONFIGS["small"] = mla.CONFIGS["large"] = c  # whichever this batch launches
            try:
                got = mla.latent_attention(q, ctx, blk, mask, attn.scale, 512)
                diff = (got.float() - ref).abs().max().item()
                ms = replay_ms(lambda: mla.latent_attention(q, ctx, blk, mask, attn.scale, 512), 30)
            except Exception as e:  # noqa: BLE001 - out of shared memory or registers: next
                log(f"  B{B} {c}: {type(e).__name__}")
                continue
            rows.append((round(ms, 4), round(diff, 5), c))
        rows.sort(key=lambda r: r[0])
        report["sweep"][f"B{B}"] = {"torch_ms": round(torch_ms, 4), "configs": rows}
        log(f"  B{B}: torch path {torch_ms:.4f} ms; fastest kernel configs:")
        for r in rows[:8]:
            log(f"    {r}")
        chosen["large" if B == 64 else "small"] = rows[0][2]
        (OUT / "mla.json").write_text(json.dumps(report, indent=1))
    mla.CONFIGS.update(chosen)
    report["draft_fused"] = draft_fused_check(target, draft)
    report["best_configs"] = mla.CONFIGS
    (OUT / "mla.json").write_text(json.dumps(report, indent=1))


def draft_matmul_check() -> dict:
    """The draft attention's pieces alone at batch 64, width 5, 96 heads (the published drafter),
    1,024 context positions: the score and value matmuls (bf16 in; fp32 or bf16 out) at 1,029 keys
    (the unpadded block) and 1,032 (padded to a multiple of 8), and the latent gather from shuffled
    pages by two index tensors against one index over the flattened pages. Each against the first
    form's result (max abs difference)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    out: dict = {}
    for lk in (1029, 1032):
        q = torch.randn(64, 480, 576, device=dev, generator=g).to(bf)
        lat = torch.randn(64, lk, 576, device=dev, generator=g).to(bf)
        probs = torch.rand(64, 480, lk, device=dev, generator=g).to(bf)
        c = lat[..., :512]
        ref_s, ref_v = torch.matmul(q.float(), lat.float().transpose(1, 2)), torch.matmul(probs.float(), c.float())
        for name, fn, ref in (
            ("scores_fp32_out", lambda: torch.bmm(q, lat.transpose(1, 2), out_dtype=torch.float32), ref_s),
            ("scores_bf16_out", lambda: torch.bmm(q, lat.transpose(1, 2)), ref_s),
            ("values_fp32_out", lambda: torch.bmm(probs, c, out_dtype=torch.float32), ref_v),
            ("values_bf16_out", lambda: torch.bmm(probs, c), ref_v),
        ):
            out[f"{name}_k{lk}"] = {
                "ms": round(replay_ms(fn, 50), 4),
                "max_abs_diff": round((fn().float() - ref).abs().max().item(), 4),
            }
    pages = torch.randn(5, 512, 256, 576, device=dev, generator=g).to(bf)
    tables = torch.randperm(512, device=dev, generator=g).view(64, 8)
    pos = torch.randint(1024, 2048, (64, 1), device=dev, generator=g) - 1024 + torch.arange(1024, device=dev)
    pg, off = tables.gather(1, pos // 256), pos % 256
    two = lambda: pages[:, pg, off]  # noqa: E731
    one = lambda: pages.flatten(1, 2).index_select(1, (pg * 256 + off).flatten()).view(5, 64, 1024, 576)  # noqa: E731
    out["gather_two_index_ms"] = round(replay_ms(two, 50), 4)
    out["gather_index_select_ms"] = round(replay_ms(one, 50), 4)
    out["gather_equal"] = bool(torch.equal(two(), one()))
    for k, v in out.items():
        log(f"  draft attention pieces {k}: {v}")
    return out


def kernel_table(fn, calls: int = 5) -> list[tuple[str, int, float]]:
    """``(kernel name, launches, ms)`` per call of ``fn``, slowest first, by torch.profiler's CUDA
    activity (the eager calls of a captured graph's function run the same kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    # without grad, as the graphs were captured: the draft runs its compiled layers only then (under
    # grad the tables of sessions 28-29 showed the eager draft's kernels, not what the graph replays)
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    rows = [
        (e.key, e.count // calls, round(e.self_device_time_total / 1e3 / calls, 4))
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[2])


def stage_prefill(args) -> None:
    """What an eager prefill call costs, target alone and with the shipped drafter (fourteenth session:
    prefill was 38% of the wall at c=8 for DFlash2 w=5, 11% for the target). A random SmolLM2-shaped
    target (bf16; cost does not depend on weights), c=8, 32 requests of 150-token prompts, T=1: per
    call its batch and ms (synchronised), then torch.profiler over the run's prefill calls, top ops
    by CPU time. No stash. $OUT/prefill.json."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from dflash2.engine.engine import EngineConfig, LLMEngine
    from dflash2.engine.request import Request
    from dflash2.model.checkpoint import load_draft
    from dflash2.target import TargetModel
    from dflash2.verification import SamplingParams

    info = env_report()
    dev = args.graph_device
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    draft = load_draft(ROOT / "models" / "smollm2-135m-dflash2", device=dev, dtype=dtype).eval()
    target = TargetModel(random_llama("smollm2", dev, dtype), layer_ids=draft.config.target_layer_ids)
    report: dict = {"env": info}
    conc = int(args.concurrency.split(",")[0])
    for name, d, planner in (
        ("target", None, "off"),
        ("dflash2 w=5", draft, "off"),
        ("dflash2 w=5 adaptive", draft, "auto"),
    ):
        eng = LLMEngine(target, d, EngineConfig(max_running_requests=conc, speculative=d is not None, num_draft_tokens=5,
                                                context_length=1024, max_total_tokens=65536, speculative_planner=planner,
                                                block_verification=True))  # fmt: skip
        calls: list = []
        ops: dict = {}  # op -> [count, CPU ms], over the profiled round's prefill calls only
        inner = eng._prefill_chunks
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

        def timed(chunks, inner=inner, calls=calls, ops=ops):
            if state["profile"]:  # round 2: each call under the profiler, its ops summed (not timed)
                with profile(activities=acts) as prof:
                    inner(chunks)
                for e in prof.key_averages():
                    c = ops.setdefault(e.key, [0, 0.0])
                    c[0], c[1] = c[0] + e.count, c[1] + e.cpu_time_total / 1e3
                return
            torch.cuda.synchronize() if cuda else None
            t0 = time.perf_counter()
            inner(chunks)
            torch.cuda.synchronize() if cuda else None
            calls.append((len(chunks), sum(n for _, n in chunks), (time.perf_counter() - t0) * 1e3))

        eng._prefill_chunks = timed
        parts: dict = {}  # "runner R<rows>" / "first R<rows>" -> [calls, synchronised ms]

        def split(fn, name, arg_rows):  # time one part of a prefill call (synchronised), by its rows
            def wrapped(x, fn=fn):
                if state["profile"]:
                    return fn(x)
                torch.cuda.synchronize() if cuda else None
                t0 = time.perf_counter()
                out = fn(x)
                torch.cuda.synchronize() if cuda else None
                c = parts.setdefault(f"{name} R{arg_rows(x)}", [0, 0.0])
                c[0], c[1] = c[0] + 1, c[1] + (time.perf_counter() - t0) * 1e3
                return out

            return wrapped

        if getattr(eng.runner, "prefill_batch", None) is not None:
            eng.runner.prefill_batch = split(eng.runner.prefill_batch, "runner", len)
        eng._first_tokens = split(eng._first_tokens, "first", len)
        g = torch.Generator().manual_seed(1)
        state = {"profile": False}
        walls = []
        for rnd in range(3):  # warm-up, timed, profiled
            reqs = [Request(torch.randint(100, 40000, (150,), generator=g).tolist(),
                            SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=64, seed=i)) for i in range(int(os.environ.get("PREFILL_REQS", "32")))]  # fmt: skip
            if rnd == 1:
                calls.clear()
                eng.stats.step_s = 0.0
            state["profile"] = rnd == 2
            t0 = time.perf_counter()
            for r in reqs:
                eng.add_request(r)
            eng.run_until_done()
            walls.append(time.perf_counter() - t0)
            if rnd == 1:
                step_s = eng.stats.step_s
        wall = walls[1]
        top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:20]
        report[name] = {
            "concurrency": conc,
            "wall_s": round(wall, 3),
            "prefill_calls": [[b, n, round(ms, 2)] for b, n, ms in calls],
            "prefill_ms_total": round(sum(ms for *_, ms in calls), 1),
            "step_s": round(step_s, 3),
            "top_ops_cpu": [[k, c, round(ms, 2)] for k, (c, ms) in top],
            # every round's calls (warm-up, timed, profiled: the profiled ones are slower), by part
            "parts_ms_per_call": {k: [c, round(ms / c, 3)] for k, (c, ms) in sorted(parts.items())},
        }
        log(f"  parts (calls, ms per call): {report[name]['parts_ms_per_call']}")
        r = report[name]
        log(
            f"{name}: wall {r['wall_s']} s, {len(calls)} prefill calls, {r['prefill_ms_total']} ms in them, steps {r['step_s']} s"
        )
        log(f"  calls (rows, tokens, ms): {r['prefill_calls'][:12]}")
        for k, c, ms in r["top_ops_cpu"][:12]:
            log(f"  {k[:48]:<48} x{c:<6} {ms:9.2f} ms CPU total")
        del eng
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "prefill.json").write_text(json.dumps(report, indent=1))


def stage_sampler(args) -> None:
    """The sort-free truncation kernel (kernels/truncate.py) against the full sort: rows of a 49,152
    vocabulary from bf16-rounded logits at T=1 (ties included), top-p 0.95 (and a top-k / min-p mix),
    rows kept identically, and ms per call of each as CUDA-graph replays. $OUT/sampler.json."""
    import torch
    from dflash2.engine.graph_runner import Replay
    from dflash2.kernels.truncate import truncate
    from dflash2.sampling import truncate_sorted as truncate_ref

    info = env_report()
    dev = args.graph_device
    cuda = dev == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    report: dict = {"env": info, "rows": {}}
    for R in (64, 320) if cuda else (4,):
        V = 49152 if cuda else 3000
        logits = (torch.randn(R, V, device=dev, generator=g) * 3).to(torch.bfloat16).float()
        probs = torch.softmax(logits, -1)
        for name, (k, tp, mp) in {
            "top_p 0.95": (-1, 0.95, 0.0),
            "top_k 40 top_p 0.9 min_p 0.05": (40, 0.9, 0.05),
        }.items():
            K = torch.full((R, 1), k, device=dev)
            TP, MP = torch.full((R, 1), tp, device=dev), torch.full((R, 1), mp, device=dev)
            ref = truncate_ref(probs, K, TP, MP)
            sort = Replay(partial(truncate_ref, probs, K, TP, MP), cuda)
            n = 50 if cuda else 1
            report["rows"][f"R{R} {name}"] = row = {"of": R, "sort_ms": round(replay_ms(sort, n), 4), "kernels": {}}
            # (thresholds per pass, entries per load, warps); 1 candidate = the bisection of session 14
            for nc, blk, nw in ((1, 1024, 4), (4, 2048, 8), (2, 4096, 16), (4, 4096, 16), (8, 2048, 8), (2, 2048, 8)):
                fn = partial(truncate, probs, K, TP, MP, candidates=nc, block=blk, num_warps=nw)
                same = int((fn() == ref).all(-1).sum())
                row["kernels"][f"nc{nc} b{blk} w{nw}"] = {
                    "identical_rows": same,
                    "ms": round(replay_ms(Replay(fn, cuda), n), 4),
                }
    for key, r in report["rows"].items():
        log(f"  {key:<36} sort {r['sort_ms']:.3f} ms")
        for kk, kr in r["kernels"].items():
            log(f"    {kk:<18} same rows {kr['identical_rows']}/{r['of']}  {kr['ms']:.3f} ms")
    report["fused"] = fused_sampler_rows(dev, cuda)
    report["verify"] = sampled_verify_rows(dev, cuda)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sampler.json").write_text(json.dumps(report, indent=1))


def fused_sampler_rows(dev: str, cuda: bool) -> dict:
    """kernels/truncate.fused_probs (temperature, softmax, truncation, renormalisation and greedy rows in
    one kernel; the graphs' sampler on CUDA since the forty-second session) against the unfused path
    (probs_from_logits capturable with the truncation kernel): R rows of bf16 logits (64 and 128 requests x
    5 positions), T=1 top-p 0.95 with every fourth row greedy; rows kept identically, the largest
    difference, ms per replay of each. ``whole-row``: the threshold search over every entry of the row at
    each pass (the kernel of sessions 42-45), against the default that passes over the entries left in
    its bracket (``shrink``)."""
    import torch
    from dflash2.engine.graph_runner import Replay
    from dflash2.kernels.truncate import fused_probs
    from dflash2.sampling import GREEDY_BELOW, probs_from_logits

    g = torch.Generator(device=dev).manual_seed(2)
    out: dict = {}
    for R in (320, 640) if cuda else (8,):
        V = 49152 if cuda else 3000
        logits = (torch.randn(R, V, device=dev, generator=g) * 3).to(torch.bfloat16)
        T = torch.where(torch.arange(R, device=dev) % 4 == 0, 0.0, 1.0)
        k, tp, mp = torch.full((R,), -1, device=dev), torch.full((R,), 0.95, device=dev), torch.zeros(R, device=dev)
        res = {}

        def unfused():
            res["unfused"] = probs_from_logits(logits, T, k, tp, mp, capturable=True, kernel="truncate")

        def fused(key, nc, blk, nw, shrink):
            res[key] = fused_probs(
                logits, T[:, None], k[:, None], tp[:, None], mp[:, None], GREEDY_BELOW, nc, blk, nw, shrink=shrink
            )

        n = 50 if cuda else 1
        row = out[f"R{R}"] = {"of": R, "ms_unfused": round(replay_ms(Replay(unfused, cuda), n), 4), "fused": {}}
        log(f"  fused sampler R{R}: unfused {row['ms_unfused']:.3f} ms")
        # (thresholds per pass, entries per load, warps, shrink): the default first
        for nc, blk, nw, shrink in (
            (2, 4096, 16, True),
            (2, 4096, 16, False),
            (4, 4096, 16, True),
            (2, 2048, 8, True),
            (4, 2048, 8, True),
            (2, 1024, 4, True),
        ):
            key = f"nc{nc} b{blk} w{nw}" + ("" if shrink else " whole-row")
            ms = replay_ms(Replay(partial(fused, key, nc, blk, nw, shrink), cuda), n)
            same = int(((res[key] > 0) == (res["unfused"] > 0)).all(-1).sum())
            diff = float((res[key] - res["unfused"]).abs().max())
            row["fused"][key] = {"ms": round(ms, 4), "same_kept_rows": same, "max_abs_diff": diff}
            log(f"    fused {key:<16} {ms:.3f} ms; same kept rows {same}/{R}, max |diff| {diff:.2e}")
    return out


def sampled_verify_rows(dev: str, cuda: bool) -> dict:
    """The graphs' sampled accept (``steps.accept``, capturable, the truncation kernel where Triton runs)
    at B rows x 4 drafts, T=1 top-p 0.95, block and token-level, with q_draft as the selector's
    candidates (CandidateQ, since the forty-first session) against the same q as dense [B, g, V] rows
    (the form before): the same draws, rows with identical tokens, ms per replay of each; and the
    greedy accept (argmax) beside them, the floor a sampled step's extra work adds to."""
    import torch
    from dflash2.engine import steps
    from dflash2.engine.graph_runner import Replay
    from dflash2.engine.steps import BatchSampling
    from dflash2.kernels.live_attention import use_triton
    from dflash2.sampling import CandidateQ, SamplingParams

    g = torch.Generator(device=dev).manual_seed(1)
    out: dict = {}
    for B in (64, 128) if cuda else (4,):
        V, gd, k = (49152 if cuda else 3000), 4, 8
        logits = (torch.randn(B, gd + 1, V, device=dev, generator=g) * 3).to(torch.bfloat16).float()
        cand = logits[:, :gd].topk(k, -1).indices  # candidates near the target's own top
        q = CandidateQ(cand, torch.softmax(torch.randn(B, gd, k, device=dev, generator=g), -1))
        dense = q.dense(V)
        rows = BatchSampling.of([SamplingParams(temperature=1.0, top_p=0.95)] * B, torch.rand(B, 2 * gd + 1), dev)
        kw = dict(capturable=True, kernel="truncate" if use_triton(torch.device(dev)) else None)
        n = 50 if cuda else 1
        greedy = replay_ms(Replay(partial(steps.accept, logits, cand[..., 0], None, None, False), cuda), n)
        for block in (True, False):
            res = {}

            def acc(qd, key):
                res[key] = steps.accept(logits, cand[..., 0], qd, rows, block, **kw).tokens

            ms = {
                key: replay_ms(Replay(partial(acc, qd, key), cuda), n)
                for key, qd in (("candidates", q), ("dense", dense))
            }
            same = int((res["candidates"] == res["dense"]).all(-1).sum())
            name = f"B{B} g{gd} {'block' if block else 'token'}"
            out[name] = {"ms_candidates": round(ms["candidates"], 4), "ms_dense": round(ms["dense"], 4),
                         "ms_greedy": round(greedy, 4), "identical_rows": same, "of": B}  # fmt: skip
            log(f"  {name:<18} accept: candidates {ms['candidates']:.3f} ms, dense q {ms['dense']:.3f} ms, greedy "
                f"{greedy:.3f} ms; identical rows {same}/{B}")  # fmt: skip
    return out


def stage_hardening(args) -> None:
    """Issue 19 on the GPU, no stash: the engine's CUDA-graph runner with chunked prefill (greedy
    fp32 output against Hugging Face's greedy, prompts longer than a chunk) and with a drafter holding
    one NaN weight (sampled: the first two tokens' joint distribution against the target's, token and
    block verification inside the graphs). Random tiny targets (tests/targets.py). $OUT/hardening.json."""
    import math

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from targets import VOCAB, build, sharp_v8_llama, tiny_config
    from dflash2.engine.engine import EngineConfig, LLMEngine
    from dflash2.engine.request import Request
    from dflash2.model import DFlash2DraftModel
    from dflash2.target import TargetModel
    from dflash2.verification import SamplingParams, probs_from_logits

    info = env_report()
    report: dict = {"env": info}
    OUT.mkdir(parents=True, exist_ok=True)
    dev = "cuda"
    t = TargetModel(build("llama", seed=3).to(dev), layer_ids=[0, 2])
    torch.manual_seed(3)
    d = (
        DFlash2DraftModel(
            tiny_config(
                hidden_size=t.config.hidden_size,
                vocab_size=VOCAB,
                mask_token_id=VOCAB - 1,
                target_layer_ids=[0, 2],
                num_target_layers=t.num_layers,
            )
        )
        .init_weights(std=0.2)
        .to(dev)
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in torch.randint(3, 90, (12,), generator=g)]
    # chunks of 16 (a long prompt's later chunks run eagerly), then whole prompts (requests admitted
    # alone as others finish replay the padded prefill graphs)
    for chunk in (16, 2048):
        eng = LLMEngine(
            t,
            d,
            EngineConfig(
                max_running_requests=8,
                num_draft_tokens=5,
                context_length=256,
                chunked_prefill_size=chunk,
                max_total_tokens=8192,
            ),
        )
        reqs = [Request(p.tolist(), SamplingParams(max_new_tokens=24)) for p in prompts]
        t0 = time.time()
        for r in reqs:
            eng.add_request(r)
        eng.run_until_done()
        same = 0
        for p, r in zip(prompts, reqs):
            ref = t.model.generate(p[None].to(dev), max_new_tokens=24, do_sample=False)[0, p.numel() :]
            same += r.output_ids == ref.tolist()
        key = "greedy_chunked" if chunk == 16 else "greedy_whole_prompts"
        report[key] = {
            "runner": type(eng.runner).__name__,
            "graphed": eng.runner.use_graph,
            "prefill_graphed": getattr(eng.runner, "prefill_graphed", False),
            "identical": same,
            "of": len(reqs),
            "seconds": round(time.time() - t0, 2),
        }
        log(f"greedy, chunked prefill {chunk}, graphs: {json.dumps(report[key])}")
    V = 8
    model = sharp_v8_llama(3).to(dev)
    tt = TargetModel(model, layer_ids=[0])
    nd = DFlash2DraftModel(
        tiny_config(
            hidden_size=16,
            vocab_size=V,
            mask_token_id=V - 1,
            target_layer_ids=[0],
            num_target_layers=2,
            selector_top_k=4,
            rope_scaling=None,
        )
    ).init_weights(std=0.2)
    with torch.no_grad():
        nd.fc.weight.view(-1)[0] = math.nan
    nd = nd.to(dev)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = probs_from_logits(model(torch.tensor([prompt], device=dev)).logits[0, -1], 1.0)
        joint = (
            torch.stack(
                [
                    p1[a] * probs_from_logits(model(torch.tensor([prompt + [a]], device=dev)).logits[0, -1], 1.0)
                    for a in range(V)
                ]
            )
            .flatten()
            .cpu()
            .double()
        )
    for method in ("token", "block"):
        e = LLMEngine(
            tt,
            nd,
            EngineConfig(
                max_running_requests=64,
                num_draft_tokens=4,
                context_length=64,
                block_verification=method == "block",
                max_total_tokens=64 * 16,
            ),
        )
        rs = [
            Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=s, ignore_eos=True))
            for s in range(3000)
        ]
        for r in rs:
            e.add_request(r)
        e.run_until_done()
        counts = torch.bincount(
            torch.tensor([r.output_ids[0] * V + r.output_ids[1] for r in rs if len(r.output_ids) == 2]), minlength=V * V
        ).double()
        keep = joint > 0
        exp = joint[keep] / joint[keep].sum() * counts[keep].sum()
        stat = float(((counts[keep] - exp) ** 2 / exp).sum())  # Pearson's chi-square (no scipy on the image)
        dof = int(keep.sum()) - 1
        row = {
            "runner": type(e.runner).__name__,
            "graphed": e.runner.use_graph,
            "finished_ok": sum(r.finish_reason == "length" for r in rs),
            "of": len(rs),
            "accepted_drafts": e.stats.accepted_by_position[0],
            "chi2": round(stat, 2),
            "dof": dof,
            "chi2_pvalue": float(
                torch.special.gammaincc(
                    torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
                )
            ),
        }
        report[f"nan_drafter_{method}"] = row
        log(f"NaN drafter, sampled, {method}: {json.dumps(row)}")
    (OUT / "hardening.json").write_text(json.dumps(report, indent=1))


SHAPES = {  # random-weight Llama targets the GPU stages time (timing does not depend on weights)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}  # fmt: skip


def random_llama(shape: str, dev: str, dtype):
    """A random-weight Llama of ``SHAPES[shape]`` on ``dev`` in ``dtype`` (seed 0), eval mode."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(dev):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(max_position_embeddings=8192, **SHAPES[shape]))
    return model.to(dtype).eval()


def copy_bandwidth(dev: str) -> float:
    """Bytes read + written per second by a 1 GiB device copy (the weight-read floor's bandwidth)."""
    import torch

    x = torch.empty(1 << (30 if dev == "cuda" else 24), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    return 2 * x.numel() / (replay_ms(partial(y.copy_, x), 20) / 1e3)


def stage_layers(args) -> None:
    """The fused layer kernels (kernels/layer_ops.py) on real shapes: each against its torch reference
    in bf16 and fp32 (largest difference, share of elements equal); StaticTarget with fused layers
    against Hugging Face's forward (check(): fp32 SmolLM2 shape, bf16 both); then the graphed static
    forward (live attention), unfused vs fused, by batch and tokens, against the weight-read floor.
    No stash. $OUT/layers.json."""
    import torch
    import transformers as tf
    from dflash2.engine.graph_runner import Replay
    from dflash2.kernels import layer_ops as ops
    from dflash2.target import TargetModel
    from dflash2.target.static_llama import StaticTarget

    info = env_report()
    dev = args.graph_device
    cuda = dev == "cuda"
    report: dict = {"env": info, "kernels": {}, "check": {}, "forward_ms": {}}
    g = torch.Generator(device=dev).manual_seed(0)

    def cmp(name, out, ref):
        report["kernels"][name] = {
            "max_abs_diff": float((out.float() - ref.float()).abs().max()),
            "equal_share": float((out == ref).float().mean()),
        }

    for dtype in (torch.bfloat16, torch.float32):
        dn = str(dtype).split(".")[-1]
        for shape, (hid, H, KV, d, inter) in {
            "smollm2": (576, 9, 3, 64, 1536),
            "llama8b": (4096, 32, 8, 128, 14336),
        }.items():
            x, r = (torch.randn(64, 5, hid, device=dev, generator=g).to(dtype) for _ in range(2))
            w = (1 + 0.1 * torch.randn(hid, device=dev, generator=g)).to(dtype)
            cmp(
                f"{dn} {shape} add_rms_norm", ops.add_rms_norm(x, w, 1e-5, r)[0], ops.add_rms_norm_ref(x, w, 1e-5, r)[0]
            )
            gu = torch.randn(64, 5, 2 * inter, device=dev, generator=g).to(dtype)
            cmp(f"{dn} {shape} silu_mul", ops.silu_mul(gu), ops.silu_mul_ref(gu))
            B, L, P = 64, 5, 64
            qkv = torch.randn(B, L, (H + 2 * KV) * d, device=dev, generator=g).to(dtype)
            rot = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(
                tf.LlamaConfig(hidden_size=hid, num_attention_heads=H, rope_theta=500000.0)
            ).to(dev)
            start = torch.randint(0, 4 * P - L, (B,), device=dev, generator=g)
            cos, sin = rot(qkv, start[:, None] + torch.arange(L, device=dev))
            table = torch.randperm(4 * B + 1, device=dev, generator=g)[: 4 * B].view(B, 4).int()
            pools = [torch.zeros(4 * B + 1, KV, P, d, device=dev, dtype=dtype) for _ in range(4)]
            q = ops.rope_kv_write(qkv, cos, sin, pools[0], pools[1], table, start, H, KV)
            q_ref = ops.rope_kv_write_ref(qkv, cos, sin, pools[2], pools[3], table, start, H, KV)
            cmp(f"{dn} {shape} rope q", q, q_ref)
            cmp(f"{dn} {shape} rope k cache", pools[0], pools[2])
            cmp(f"{dn} {shape} rope v cache", pools[1], pools[3])
    for key, r in report["kernels"].items():
        log(f"  {key:<32} max diff {r['max_abs_diff']:.3g}  equal {r['equal_share']:.4f}")
    for shape, dtype in (("smollm2", torch.float32), ("smollm2", torch.bfloat16), ("llama8b", torch.bfloat16)):
        if shape not in args.attn_shapes.split(","):
            continue
        model = random_llama(shape, dev, dtype)
        target = TargetModel(model, layer_ids=[1, 8])
        for fused in (False, True):
            st = StaticTarget(target, 256, attention="live", fused=fused)
            try:
                result: float | str = st.check(length=40)
            except RuntimeError as e:  # recorded, not fatal: the timing below still runs
                result = str(e)
            report["check"][f"{shape} {str(dtype).split('.')[-1]} fused={fused}"] = result
            del st
        del model, target
        torch.cuda.empty_cache() if cuda else None
    log(f"check() against HF (largest logit diff): {json.dumps(report['check'])}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "layers.json").write_text(json.dumps(report, indent=1))
    bandwidth = copy_bandwidth(dev)
    report["copy_bandwidth_tb_s"] = round(bandwidth / 1e12, 3)
    n = 100 if cuda else 2
    batches = [int(b) for b in args.concurrency.split(",")]
    for shape in args.attn_shapes.split(","):
        model = random_llama(shape, dev, torch.bfloat16)
        target = TargetModel(model, layer_ids=[1, 8])
        floor_ms = sum(p.numel() * p.element_size() for p in model.parameters()) / bandwidth * 1e3
        r = report["forward_ms"][shape] = {"weight_floor_ms": round(floor_ms, 3)}
        for fused in (False, True):
            for B in batches:
                st = StaticTarget(target, 1088, slots=B, attention="live", fused=fused)
                start = torch.full((B,), 300, dtype=torch.long, device=dev)
                for L in (1, 5, 8):
                    ids = torch.randint(100, 20000, (B, L), device=dev)
                    rep = Replay(partial(st.forward, ids, start), cuda)
                    r[f"fused={fused} B{B} L{L}"] = round(replay_ms(rep, n), 3)
                    del rep
                del st
                torch.cuda.empty_cache() if cuda else None
        log(f"{shape}: static forward ms (graphed, live attention, position 300); weight floor {floor_ms:.2f} ms")
        for B in batches:
            cells = "  ".join(
                f"L{L}: {r[f'fused=False B{B} L{L}']:.2f} -> {r[f'fused=True B{B} L{L}']:.2f}" for L in (1, 5, 8)
            )
            log(f"  B{B:<3} {cells}")
        del model, target
        torch.cuda.empty_cache() if cuda else None
        (OUT / "layers.json").write_text(json.dumps(report, indent=1))


def stage_attn(args) -> None:
    """The live-KV attention kernel (kernels/live_attention.py) on real shapes: checked against the
    torch reference, then timed against the masked SDPA over the whole buffer (what the static
    forward did before); then the static target forward, CUDA-graphed, sdpa vs live, for random
    targets of SmolLM2-135M's and Llama-8B's shapes, by batch and tokens per row, against the
    weight-read floor. Needs no stash (timing does not depend on weights). $OUT/attn.json."""
    import torch
    import torch.nn.functional as F
    from dflash2.engine.graph_runner import Replay
    from dflash2.kernels.live_attention import live_attention, live_attention_ref
    from dflash2.target import TargetModel
    from dflash2.target.static_llama import StaticTarget

    info = env_report()
    dev = args.graph_device  # cpu: a dry run of this code (the kernel falls back to its reference)
    cuda = dev == "cuda"
    batches, fwd_batches, lengths, n = (
        ((1, 8, 64), (1, 8, 32, 64), (1088, 4096), 100) if cuda else ((1, 2), (1, 2), (1088,), 2)
    )
    report: dict = {"env": info, "kernel": {}, "forward_ms": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    # 1. the kernel alone: max |kernel - reference| and ms, slot buffers of S positions, rows at ~S/4 .. S-L
    for shape, (H, KV, d) in {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}.items():
        for S in lengths:
            for B in batches:
                for L in (1, 5, 8):
                    k = torch.randn(B, KV, S, d, device=dev, dtype=torch.bfloat16, generator=g)
                    v = torch.randn(B, KV, S, d, device=dev, dtype=torch.bfloat16, generator=g)
                    q = torch.randn(B, H, L, d, device=dev, dtype=torch.bfloat16, generator=g)
                    start = torch.randint(S // 4, S - L, (B,), device=dev, generator=g)
                    table = torch.arange(B, device=dev, dtype=torch.int32)[:, None]
                    ref = live_attention_ref(q, k, v, table, start, d**-0.5)
                    out = live_attention(q, k, v, table, start, d**-0.5)
                    err = float((out.float() - ref.float()).abs().max())
                    pos = start[:, None] + torch.arange(L, device=dev)
                    mask = torch.where(torch.arange(S, device=dev) <= pos[..., None], 0.0, -1e30).to(q.dtype)[:, None]
                    # each timed as a CUDA graph replay, as the runner calls them (no launch overhead)
                    sdpa = Replay(partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                          scale=d**-0.5, enable_gqa=True), cuda)  # fmt: skip
                    live = Replay(partial(live_attention, q, k, v, table, start, d**-0.5), cuda)
                    report["kernel"][f"{shape} S{S} B{B} L{L}"] = {
                        "max_abs_diff": err,
                        "live_ms": round(replay_ms(live, n), 4),
                        "sdpa_masked_ms": round(replay_ms(sdpa, n), 4),
                        "mean_live_len": float(start.float().mean()) + L,
                    }
                    del sdpa, live
    bad = {k: r["max_abs_diff"] for k, r in report["kernel"].items() if not r["max_abs_diff"] < 0.05}
    log(
        f"kernel vs reference (bf16), largest diff {max(r['max_abs_diff'] for r in report['kernel'].values()):.3g}; over 0.05: {bad}"
    )
    for key, r in report["kernel"].items():
        log(f"  {key:<24} live {r['live_ms']:.3f} ms  sdpa(masked, whole buffer) {r['sdpa_masked_ms']:.3f} ms")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "attn.json").write_text(json.dumps(report, indent=1))
    # 2. the static forward, graphed: ms per call by batch and tokens, sdpa vs live, rows at position ~300
    bandwidth = copy_bandwidth(dev)
    report["copy_bandwidth_tb_s"] = round(bandwidth / 1e12, 3)
    for shape in args.attn_shapes.split(","):
        model = random_llama(shape, dev, torch.bfloat16)
        target = TargetModel(model, layer_ids=[1, 8])
        floor_ms = sum(p.numel() * p.element_size() for p in model.parameters()) / bandwidth * 1e3
        report["forward_ms"][shape] = {"weight_floor_ms": round(floor_ms, 3)}
        for attention in ("sdpa", "live"):
            for B in fwd_batches:
                st = StaticTarget(target, 1088, slots=B, attention=attention)
                start = torch.full((B,), 300, dtype=torch.long, device=dev)
                for L in (1, 5, 8):
                    ids = torch.randint(100, 20000, (B, L), device=dev)
                    rep = Replay(partial(st.forward, ids, start), cuda)
                    ms = replay_ms(rep, n)
                    report["forward_ms"][shape][f"{attention} B{B} L{L}"] = round(ms, 3)
                    del rep
                del st
                if cuda:
                    torch.cuda.empty_cache()
        r = report["forward_ms"][shape]
        log(f"{shape}: static forward ms (graphed, rows at position 300, buffer 1,088); weight floor {floor_ms:.2f} ms")
        for B in fwd_batches:
            cells = "  ".join(
                f"L{L}: sdpa {r[f'sdpa B{B} L{L}']:.2f} live {r[f'live B{B} L{L}']:.2f}" for L in (1, 5, 8)
            )
            log(f"  B{B:<3} {cells}")
        del model, target
        if cuda:
            torch.cuda.empty_cache()
        (OUT / "attn.json").write_text(json.dumps(report, indent=1))


def shared_engines(args):
    """``--shared-engines``: what ``engine_speed.run`` keeps across levels and calls; else None."""
    from dflash2.benchmark import engine_speed

    if not args.shared_engines:
        return None
    return engine_speed.SharedEngines(engine_speed.build_planner(args.adaptive, args.planner_widths))


def speed_rows(args, target, draft, prompts, temp: float, keep, shared, **kw):
    """``engine_speed.run`` with the speed flags: widths, verifiers (one at T=0: every verifier is
    the greedy one there, the same graphs), concurrencies, rounds, planner rows, the call's deadline;
    ``shared`` (:func:`shared_engines`) keeps the engines across calls under ``--shared-engines``."""
    from dflash2.benchmark import engine_speed

    concs = [int(c) for c in args.concurrency.split(",")]
    if args.repeat_prompts:  # a small set (held-out: 179) cycled, so each level holds its load for longer
        need = args.requests_per_slot * max(concs)
        prompts = (list(prompts) * -(-need // len(prompts)))[:need]
    return engine_speed.run(
        target,
        draft,
        prompts,
        [int(w) for w in args.speed_widths.split(",")],
        args.speed_verifiers.split(",")[: 1 if temp == 0 else None],
        concs,
        args.graph_tokens,
        temp,
        requests_per_slot=args.requests_per_slot,
        rounds=args.rounds,
        adaptive=args.adaptive,
        planner_widths=args.planner_widths,
        on_level=keep,
        deadline=T_START + args.deadline_s,
        slots=max(concs) if args.shared_engines else None,
        shared=shared,
        schedules=args.schedules,
        **{**kw, "engine_kw": {"sampler_backend": args.engine_sampler, **kw.get("engine_kw", {})}},
    )


def stage_shape(args) -> None:
    """Engine speed on a random-weight target of a real shape (``--target-shape``) with the published
    drafter architecture at its size, at each ``--acceptances`` rate (synthetic: the verifier accepts
    draft position i with that probability): the model is built once for every rate. Each finished
    level goes to $OUT/shape.json with the seconds it took (building and capturing dominate at 8B)."""
    import torch
    from transformers import AutoTokenizer

    from dflash2.benchmark import engine_speed, shapes
    from dflash2.benchmark.speed import gsm8k_test_prompts

    OUT.mkdir(parents=True, exist_ok=True)
    report: dict = {"env": env_report(), "shape": args.target_shape, "speed": {}, "seconds": {}}
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(ROOT / "work" / "tok")
    dtype = torch.bfloat16 if args.graph_device == "cuda" else torch.float32  # cpu: a dry run
    target, draft = shapes.random_models(args.target_shape, args.graph_device, dtype, 5, tok)
    if args.shape_draft:  # a real drafter (carried in the tree) beside the random target of its target's shape
        from dflash2.model.checkpoint import load_draft
        from dflash2.model.token_map import DEFAULT_NAME, load_token_map
        from dflash2.target import TargetModel

        draft = load_draft(ROOT / args.shape_draft, device=args.graph_device, dtype=dtype)
        target = TargetModel(target.model, tok, draft.config.target_layer_ids)
        if (ROOT / args.shape_draft / DEFAULT_NAME).is_file():
            tm = load_token_map(ROOT / args.shape_draft / DEFAULT_NAME, draft.config.vocab_size)
            draft.set_token_map(tm, target.lm_head_weight)
        report["shape_draft"] = args.shape_draft
    report["seconds"]["build"] = round(time.time() - t0, 1)
    log(f"built {args.target_shape} and its drafter in {report['seconds']['build']} s")
    if args.draft_precision:
        report["draft_pieces"] = draft_matmul_check()
        report["draft_precision"] = draft_precision_check(target, draft)
    if args.draft_fused:
        report["draft_fused"] = draft_fused_check(target, draft)
    if args.draft_split:
        report["draft_split"] = draft_split_check(target, draft)
        (OUT / "shape.json").write_text(json.dumps(report, indent=1))
    if args.prefill_packed:
        report["prefill_packed"] = packed_prefill_check(target)
        (OUT / "shape.json").write_text(json.dumps(report, indent=1))
    if not args.speed:  # --no-speed: the checks only
        (OUT / "shape.json").write_text(json.dumps(report, indent=1))
        return
    prompts = gsm8k_test_prompts(ROOT / "work" / "gsm8k_test.jsonl", 512)
    temps = [float(t) for t in (args.shape_temperatures or str(args.speed_temperature)).split(",")]
    shared = None
    for rate in [float(a) for a in args.acceptances.split(",")]:
        shared = shared_engines(args)  # this rate's engines, for every level and temperature
        for temp in temps:
            key, t1 = f"a{rate}" + (f"_t{temp}" if len(temps) > 1 else ""), time.time()

            def keep(rows, key=key, t1=t1):
                report["speed"][key] = [r.__dict__ for r in rows]
                report["seconds"][key] = round(time.time() - t1, 1)
                (OUT / "shape.json").write_text(json.dumps(report, indent=1))
                log(f"{key}: {report['seconds'][key]} s so far")

            if time.time() > T_START + args.deadline_s - 60:
                log(f"skip {key}: deadline")
                continue
            rows = speed_rows(
                args,
                target,
                draft,
                prompts,
                temp,
                keep,
                shared,
                engine_kw={
                    "synthetic_acceptance": (rate,),
                    "enable_mixed_chunk": {"auto": None, "on": True, "off": False}[args.mixed_chunk],
                },
            )
            print(
                f"{args.target_shape}, synthetic acceptance {rate}, T={temp}\n" + engine_speed.table(rows),
                flush=True,
            )
            keep(rows)
    if args.prefill_replays and shared is not None:
        report["prefill_replays"] = prefill_replay_times(shared)
        (OUT / "shape.json").write_text(json.dumps(report, indent=1))


def prefill_replay_times(shared) -> dict:
    """Each shared engine's packed prefill graphs, each replayed alone (median ms of 20, synchronised), with
    and without the drafter's latents, and a profile of the smallest one's kernels (top 12 by device time).
    After the rows: a replay rewrites the K/V pages of its last prompts (finished requests' pages). Why: at
    the 8B shape, 32 requests, drafting's 141 trickled replays took ~12 ms each over their tokens' share
    (fifty-fourth session): the graph's own cost or the engine's path around it?"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out: dict = {}
    for key, eng in shared.engines.items():
        graphs = getattr(eng.runner, "prefill_graphs", {})
        if not graphs:
            continue
        eng.runner.pf.zero_()  # (the last prompts' offsets would index past a smaller total)
        eng.runner.pf_last.zero_()
        row = {f"{T}{'+lat' if lat else ''}": round(replay_ms(g[0], 20), 3) for (T, lat), g in sorted(graphs.items())}
        row["prefill_replay_s"] = round(1e3 * eng.runner.prefill_replay_s, 3)
        row["plain_prefill_replay_s"] = round(1e3 * eng.runner.plain_prefill_replay_s, 3)
        small = min(graphs)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graphs[small][0]()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
        out[str(key)] = {"replay_ms": row, "profiled": f"{small}", "kernels": table}
        print(f"prefill replays {key}: {row}\n{table}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "stage",
        choices=[
            "stash",
            "mla",
            "prepare",
            "train",
            "bench",
            "graphs",
            "engine",
            "attn",
            "hardening",
            "steps",
            "sampler",
            "layers",
            "prefill",
            "recipe",
            "shape",
        ],
    )
    ap.add_argument("--recipe", default="models/smollm2-135m-dflash2/recipe.json", help="recipe: the train config")
    ap.add_argument("--gen-seconds", type=float, default=0, help="recipe: time budget of the answers (0: none)")
    ap.add_argument("--generator", default=None, help="recipe --phase data: hf or engine (default: the recipe's)")
    ap.add_argument("--recipe-device", default="cuda", help="recipe: cpu for a dry run")
    ap.add_argument(
        "--recipe-gen-batch", type=int, default=None, help="recipe: the answers' batch (default: the recipe's)"
    )
    ap.add_argument("--recipe-prompts", default="work/recipe", help="recipe: folder of its prompt files")
    ap.add_argument(
        "--grow",
        default="",
        help="recipe: train from the start weights grown by dflash2 grow-draft, e.g. layers=5,rank=96,map "
        "(map: codebooks over the shipped token map); its own output folder",
    )
    ap.add_argument("--phase", choices=["data", "train"], default="data", help="recipe: which call this is")
    ap.add_argument("--profile", action="store_true", help="steps: each graph's kernels by torch.profiler")
    ap.add_argument("--eager-draft", action="store_true", help="steps: the draft's layers and latents eager")
    ap.add_argument(
        "--steps-shape", default="", help="steps: a random target of this shape (default: SmolLM2 + shipped drafter)"
    )
    ap.add_argument(
        "--steps-attention", default="live", help="steps: the target's attention backends timed (e.g. sdpa,live)"
    )
    ap.add_argument(
        "--steps-prompt-tokens", type=int, default=300, help="steps: each row's context (positions), ~this many"
    )
    ap.add_argument(
        "--steps-kinds",
        default="draft,verify,plain,alone",
        help="steps: which graphs (alone: the target alone's; prefill: the packed prefill graphs by token "
        "total; mixed: verify graphs with a packed prompt inside, by length)",
    )
    ap.add_argument(
        "--cold-replays",
        action="store_true",
        help="steps: no replay right after each capture (graph_runner.WARM_REPLAY off), so the 'first' times "
        "are the graphs' first replays since capture",
    )
    ap.add_argument("--engine-sampler", default="auto", help="engine: EngineConfig.sampler_backend of every row")
    ap.add_argument(
        "--fused-whole-row", action="store_true", help="engine: the fused sampler's search over whole rows (A/B)"
    )
    ap.add_argument("--sampler-backends", default="sort", help="steps: e.g. sort,triton (the sampled truncation)")
    ap.add_argument("--attn-shapes", default="smollm2,llama8b", help="attn: random targets of these shapes timed")
    ap.add_argument(
        "--attention-backends", default="auto", help="engine: every row once per backend, e.g. torch_native,triton"
    )
    ap.add_argument("--graph-limit", type=int, default=20, help="graphs: GSM8K test prompts timed")
    ap.add_argument("--graph-temperatures", default="0,1")
    ap.add_argument("--graph-verifiers", default="token,block", help="graphs: sampled verifiers timed")
    ap.add_argument("--graph-device", default="cuda", help="graphs: cpu runs the same stage eagerly (a dry run)")
    ap.add_argument("--check-prompts", type=int, default=6)
    ap.add_argument("--check-dtypes", type=int, default=2, help="graphs: 2 = fp32 and bf16 checks, 1 = bf16 only")
    ap.add_argument("--graph-widths", default="5,8")
    ap.add_argument("--breakdown", action="store_true", help="graphs: time each captured graph alone")
    ap.add_argument("--graph-tokens", type=int, default=256)
    ap.add_argument("--check-tokens", type=int, default=128)
    ap.add_argument("--eager-limit", type=int, default=3, help="graphs: prompts of the eager reference (0: none)")
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--sampled-gsm8k", type=int, default=4000)
    ap.add_argument("--sampled-gsm8k-2", type=int, default=0)
    ap.add_argument("--add-sampled-gsm8k", type=int, default=0, help="with --data-npz: new T=1 answers to add")
    ap.add_argument("--add-sampled-sharegpt", type=int, default=0)
    ap.add_argument(
        "--add-sharegpt-offset", type=int, default=0, help="first ShareGPT prompt of --add-sampled-sharegpt"
    )
    ap.add_argument(
        "--add-seed",
        type=int,
        default=101,
        help="seed of the first added job (stage 3 used 101-102: a new stage needs new seeds)",
    )
    ap.add_argument("--data-npz", default=None, help="repo-relative data_uint16.npz from an earlier 'prepare'")
    ap.add_argument("--kl-weight", type=float, default=0.0)
    ap.add_argument("--selector-kl-weight", type=float, default=0.0)
    ap.add_argument("--init-from", default=None, help="draft folder (repo-relative) to start from")
    ap.add_argument("--acc-limit", type=int, default=1319)
    ap.add_argument("--acc-max-tokens", type=int, default=256)
    ap.add_argument(
        "--heldout-path",
        default=None,
        help="bench: the recipe's held-out prompts too (carry work/recipe/heldout_prompts.jsonl)",
    )
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--configs", default="", help="acceptance runs to do, e.g. w8_greedy,w5_token_t1 (default all)")
    ap.add_argument("--acc-concurrency", type=int, default=128)
    ap.add_argument("--no-speed", dest="speed", action="store_false", help="acceptance only")
    ap.add_argument("--speed-widths", default="5,8")
    ap.add_argument("--rounds", type=int, default=3, help="speed: rotated repeats per config (rows are noisy)")
    ap.add_argument(
        "--requests-per-slot",
        type=int,
        default=8,
        help="engine: requests per concurrency slot (8: rows of 3-8 s, first wave and drain a small share; at 2 a "
        "row was 0.3-1.6 s and moved by several percent between calls: docs/benchmarks.md, twenty-first session)",
    )
    ap.add_argument(
        "--prompt-sets",
        default="gsm8k",
        help="engine: gsm8k and/or heldout (carry work/recipe/heldout_prompts.jsonl), run in this order",
    )
    ap.add_argument(
        "--draft-precision", action="store_true", help="shape: time the draft's attention matmuls both ways"
    )
    ap.add_argument("--draft-fused", action="store_true", help="shape: the fused draft attention against torch's")
    ap.add_argument("--draft-split", action="store_true", help="shape: the split draft softmax against the padded path")
    ap.add_argument("--split-softmax", choices=("on", "off"), default="on", help="model/attention.py SPLIT_SOFTMAX")
    ap.add_argument("--target-shape", default="llama-8b", help="shape: the random target's shape")
    ap.add_argument(
        "--shape-draft",
        default=None,
        help="shape: a drafter folder (e.g. models/smollm2-135m-dflash2) instead of a random one",
    )
    ap.add_argument("--acceptances", default="0.92,0.5", help="shape: synthetic acceptance rates, one run each")
    ap.add_argument("--adaptive", action="store_true", help="engine: each DFlash2 row again with the planner on")
    ap.add_argument(
        "--planner-widths", default=None, help="engine, with --adaptive: a third row, the planner with these widths too"
    )
    ap.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="engine, shape: cycle the prompt set up to --requests-per-slot x the largest concurrency (each "
        "request its own seed), so a level is not over after one wave of a small set",
    )
    ap.add_argument(
        "--shared-engines",
        action="store_true",
        help="engine, shape: one engine per config for every concurrency (and, engine, every prompt set and "
        "temperature), built once at the largest concurrency (engine_speed.run's slots)",
    )
    ap.add_argument("--speed-verifiers", default="token,block", help="order of the rows, e.g. block,token")
    ap.add_argument(
        "--speed-temperature",
        type=float,
        default=0.0,
        help="speed rows' temperature (bench speed samples with top-p 0.95)",
    )
    ap.add_argument(
        "--shape-temperatures",
        default=None,
        help="shape: e.g. 1,0 (default: --speed-temperature); T=0 runs one verifier",
    )
    ap.add_argument("--train-seconds", type=float, default=0)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=48)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=560, help="wall budget of the prepare stage")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bench-seconds", type=float, default=150)
    ap.add_argument("--fused-attention", action="store_true", help="the draft's attention by the fused kernel")
    ap.add_argument(
        "--mixed-chunk",
        choices=("auto", "on", "off"),
        default="auto",
        help="shape, engine: --enable-mixed-chunk for every engine (target alone too); auto: the engine's default",
    )
    ap.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="engine: every engine commits each step before the next launches (A/B against the default)",
    )
    ap.add_argument(
        "--schedules",
        default="",
        help="engine, shape: every row once per schedule in the call, e.g. no-overlap,overlap,async,cds4 "
        "(engine_speed.schedule_fields)",
    )
    ap.add_argument("--prefill-packed", action="store_true", help="shape: packed prefill vs each prompt alone, timed")
    ap.add_argument(
        "--prefill-replays", action="store_true", help="shape, --shared-engines: each prefill graph replayed alone"
    )
    ap.add_argument("--prefill-tokens", default=None, help="graph_runner.PREFILL_TOKENS for this call")
    ap.add_argument("--packed-max-tokens", type=int, default=None, help="graph_runner.PACKED_MAX_TOKENS")
    ap.add_argument("--mixed-max-tokens", type=int, default=None, help="graph_runner.MIXED_MAX_STEP_TOKENS")
    args = ap.parse_args()
    if args.fused_whole_row:  # the fused sampler's threshold search, for an A/B
        from dflash2 import sampling

        sampling.FUSED_SHRINK = False
    if args.fused_attention or args.split_softmax == "off":  # model/attention.py's switches, for an A/B
        from dflash2.model import attention

        attention.FUSED_ATTENTION = attention.FUSED_ATTENTION or args.fused_attention
        attention.SPLIT_SOFTMAX = args.split_softmax == "on"
    # the packed prefill graphs' token totals and the tokens several prompts share, for an A/B
    if args.prefill_tokens or args.packed_max_tokens:
        from dflash2.engine import graph_runner

        if args.prefill_tokens:
            graph_runner.PREFILL_TOKENS = tuple(int(b) for b in args.prefill_tokens.split(","))
        if args.packed_max_tokens:
            graph_runner.PACKED_MAX_TOKENS = args.packed_max_tokens
    if args.mixed_max_tokens is not None:  # which steps take a new prompt (an A/B of the gate)
        from dflash2.engine import graph_runner

        graph_runner.MIXED_MAX_STEP_TOKENS = args.mixed_max_tokens
    {
        "stash": stage_stash,
        "prepare": stage_prepare,
        "train": stage_train,
        "bench": stage_bench,
        "graphs": stage_graphs,
        "engine": stage_engine,
        "attn": stage_attn,
        "hardening": stage_hardening,
        "steps": stage_steps,
        "sampler": stage_sampler,
        "layers": stage_layers,
        "prefill": stage_prefill,
        "recipe": stage_recipe,
        "shape": stage_shape,
        "mla": stage_mla,
    }[args.stage](args)


if __name__ == "__main__":
    main()
