"""``dflash2 train``, ``prepare-data``, ``token-map`` and ``grow-draft``."""

from __future__ import annotations

import json
from pathlib import Path

from ..entry import REPO


def cmd_train(args) -> int:
    from .trainer import TrainConfig, train

    overrides = {
        k: getattr(args, k)
        for k in (
            "data",
            "output_dir",
            "draft_config",
            "target_path",
            "steps",
            "batch_size",
            "lr",
            "device",
            "resume",
            "max_len",
            "kl_weight",
            "selector_kl_weight",
            "init_from",
        )
    }
    if args.config:
        tc = TrainConfig.from_file(args.config, **overrides)
    else:
        if overrides.get("init_from") and not overrides.get("draft_config"):
            overrides["draft_config"] = str(Path(overrides["init_from"]) / "config.json")
        missing = [k for k in ("data", "output_dir", "draft_config") if not overrides.get(k)]
        if missing:
            raise SystemExit(f"dflash2 train: give --config or --{', --'.join(m.replace('_', '-') for m in missing)}")
        tc = TrainConfig(**{k: v for k, v in overrides.items() if v is not None})
    res = train(tc)
    print(
        json.dumps(
            {k: res[k] for k in ("steps", "seconds", "tokens")}
            | {"final": res["history"][-1] if res["history"] else None}
        )
    )
    return 0


def _recipe(path: str):
    """A data recipe from a bare recipe file or from a ``dflash2 train --config`` file's ``prepare``."""
    from .recipe import DataRecipe

    raw = json.loads(Path(path).read_text())
    return DataRecipe.from_dict(raw["prepare"] if "prepare" in raw else raw)


def cmd_prepare_data(args) -> int:
    from ..target.loading import load_target
    from .data import TokenDataset, generate_responses, gsm8k_prompts, sharegpt_prompts, without_eval_prompts

    if args.recipe:
        from .recipe import build_prompt_files, prepare_data

        if not args.output_dir:
            raise SystemExit("dflash2 prepare-data --recipe needs --output-dir")
        recipe, out = _recipe(args.recipe), Path(args.output_dir)
        if args.prompts_only:
            ps = build_prompt_files(recipe, out)
            print(json.dumps({"train_prompts": len(ps.train), "heldout_prompts": len(ps.heldout)} | ps.report))
            return 0
        report = prepare_data(recipe, load_target(args.model_path, args.dtype, args.device), out / "data.npz",
                              out / "heldout.npz")  # fmt: skip
        print(f"wrote {report['sequences']} sequences ({report['tokens']} tokens) to {out / 'data.npz'}")
        return 0
    if not args.output:
        raise SystemExit("dflash2 prepare-data: give --recipe and --output-dir, or --output")
    target = load_target(args.model_path, args.dtype, args.device)
    prompts = gsm8k_prompts(args.gsm8k_path, args.gsm8k_limit)
    if args.sharegpt > 0:
        prompts += sharegpt_prompts(args.sharegpt)
    prompts, dropped = without_eval_prompts(prompts)
    if dropped:
        print(f"dropped {dropped} prompts that are GSM8K test questions (evaluation prompts never enter)")
    if not prompts:
        raise SystemExit("no training prompts left")
    rows = generate_responses(
        target.model,
        target.tokenizer,
        prompts,
        args.batch_size,
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
    )
    TokenDataset(rows).save(args.output)
    print(f"wrote {len(rows)} sequences to {args.output}")
    return 0


def cmd_token_map(args) -> int:
    """The most frequent response tokens of a prepared dataset (prompts excluded), plus EOS."""
    import torch
    from ..model.token_map import build_token_map, save_token_map
    from .data import TokenDataset

    ds = TokenDataset.load(args.data)
    resp = torch.cat([r["ids"][r["prompt_len"] :] for r in ds.rows])
    ids = build_token_map(resp, args.size, args.vocab_size, always=[int(t) for t in args.always.split(",") if t])
    save_token_map(ids, args.output)
    counts = torch.bincount(resp.long(), minlength=args.vocab_size)
    print(
        f"{ids.numel()} ids cover {float(counts[ids].sum() / counts.sum()):.4%} of {resp.numel()} response tokens "
        f"-> {args.output}"
    )
    return 0


def cmd_grow_draft(args) -> int:
    """A trained drafter grown without changing what it proposes (``grow.py``), written as a new folder."""
    import shutil

    import torch
    from ..model.checkpoint import load_draft, parameter_report, save_draft
    from ..model.token_map import load_token_map
    from .grow import grow_draft

    out = Path(args.output)
    if out.resolve() == Path(args.draft).resolve():  # (before loading and growing anything)
        raise ValueError(f"--output {out} is the drafter's own folder: write the grown one elsewhere")
    draft = load_draft(args.draft)
    ids = None if args.token_map is None else load_token_map(args.token_map, draft.config.vocab_size)
    gen = torch.Generator().manual_seed(args.seed)
    grown = grow_draft(draft, ids, args.selector_rank, args.num_layers, generator=gen)
    save_draft(grown, out)
    if args.token_map is not None:  # the engine loads token_map.pt from the drafter's folder by default
        shutil.copyfile(args.token_map, out / "token_map.pt")
    before, after = parameter_report(draft.config)["total"], parameter_report(grown.config)["total"]
    size = (out / "model.safetensors").stat().st_size
    print(f"{before:,} -> {after:,} parameters ({size / 1e6:.1f} MB) -> {out}")
    return 0


def add_training_parsers(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (config file and/or flags)")
    p.add_argument("--config")
    p.add_argument("--data")
    p.add_argument("--output-dir")
    p.add_argument("--draft-config")
    p.add_argument("--target-path")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--device")
    p.add_argument("--max-len", type=int)
    p.add_argument("--resume", action="store_true", default=None)
    p.add_argument("--init-from", help="start from these draft weights (a published-layout folder)")
    p.add_argument(
        "--kl-weight", type=float, help="add KL(p_target || q_draft) distillation with this weight (default 0)"
    )
    p.add_argument(
        "--selector-kl-weight",
        type=float,
        help="add the selector's KL to p_target over its candidates with this weight (default 0)",
    )
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("prepare-data", help="answer training prompts with the target itself")
    p.add_argument("--model-path")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gsm8k-path", default=str(REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))
    p.add_argument("--gsm8k-limit", type=int)
    p.add_argument("--sharegpt", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output")
    p.add_argument(
        "--recipe", help="a data recipe, or a train config with a 'prepare' section (ignores the flags above)"
    )
    p.add_argument("--output-dir", help="with --recipe: data.npz, heldout.npz, prompt files and reports go here")
    p.add_argument("--prompts-only", action="store_true", help="with --recipe: build the prompt files, answer nothing")
    p.set_defaults(fn=cmd_prepare_data)
    p = sub.add_parser("token-map", help="draft vocabulary subset from a prepared dataset (--speculative-token-map)")
    p.add_argument("--data", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--always", default="", help="comma-separated ids always kept (e.g. EOS)")
    p.set_defaults(fn=cmd_token_map)
    p = sub.add_parser(
        "grow-draft",
        help="a trained drafter with mapped codebooks, a higher selector rank or more "
        "layers, proposing what it proposed (training continues from it: --init-from)",
    )
    p.add_argument("--draft", required=True, help="the drafter's folder (config.json + model.safetensors)")
    p.add_argument("--output", required=True)
    p.add_argument("--token-map", help="codebooks over these ids plus one shared row (a --speculative-token-map file)")
    p.add_argument("--selector-rank", type=int, help="the selector's new rank (default: as now)")
    p.add_argument("--num-layers", type=int, help="layers after growth (default: as now); new ones are appended")
    p.add_argument("--seed", type=int, default=0, help="for the new parameters' random part")
    p.set_defaults(fn=cmd_grow_draft)
