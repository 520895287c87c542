"""``dflash2 bench speed``: side-by-side speed in process (target alone vs DFlash2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .shapes import SHAPES


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    s = bsub.add_parser("speed", help="target alone vs DFlash2 on the same prompts, in one run")
    from ..entry import add_model_flags, add_tp_flag

    add_model_flags(s)
    add_tp_flag(s)
    s.add_argument(
        "--gsm8k-path", default=str(Path(__file__).resolve().parents[3].parent / "shared/data/gsm8k/test.jsonl")
    )
    s.add_argument("--limit", type=int, default=20)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument(
        "--widths",
        default=None,
        help="e.g. 5,8 (default: the loaded width, --speculative-num-draft-tokens or the drafter's)",
    )
    s.add_argument("--temperatures", default="0,1")
    s.add_argument(
        "--verifiers",
        default=None,
        help="e.g. token,block (default: block with --speculative-use-block-verification, else token)",
    )
    s.add_argument(
        "--concurrency",
        default=None,
        help="e.g. 1,8,32,64: measure through the serving engine at these concurrencies "
        "(else batch 1 through the single-request loop)",
    )
    s.add_argument("--temperature", type=float, default=0.0, help="with --concurrency")
    s.add_argument(
        "--requests-per-slot",
        type=int,
        default=None,
        help="with --concurrency: run min(limit, N x concurrency) requests per level (default: all prompts)",
    )
    s.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --concurrency: repeat every config N times in rotated order and pool them "
        "(use 3+ on a noisy or shared machine)",
    )
    s.add_argument(
        "--breakdown",
        action="store_true",
        help="the step-cost table the adaptive planner starts from: ms per step by batch bucket and verify "
        "width (1 = the target alone), replayed on the static-slot runner (CUDA graphs on CUDA)",
    )
    s.add_argument(
        "--enable-mixed-chunk",
        action="store_const",
        const=True,
        default=None,
        help="with --concurrency: every engine (the target alone's too) runs a new prompt inside a small "
        "step's forward (default: where the static runner replays CUDA graphs)",
    )
    s.add_argument("--disable-mixed-chunk", dest="enable_mixed_chunk", action="store_const", const=False)
    s.add_argument(
        "--adaptive",
        action="store_true",
        help="with --concurrency: each DFlash2 config again with the planner choosing its width per step",
    )
    s.add_argument(
        "--target-shape",
        default=None,
        choices=sorted(SHAPES),
        help="a random-weight target of this shape and a random drafter of the published architecture at "
        "its size, built in process (speed at sizes we cannot download; needs --synthetic-acceptance)",
    )
    s.add_argument(
        "--synthetic-acceptance",
        default=None,
        type=rates,
        help="e.g. 0.92, or one rate per draft position (0.9,0.8,...): the verifier accepts draft position i "
        "with that probability whatever the target says (vLLM's synthetic method): speed at a chosen "
        "acceptance profile; NOT the target's output, and every row says 'synthetic'",
    )
    s.add_argument("--output", default=None)
    s.add_argument("--plot", default=None, help="PNG of speedup against concurrency")
    s.set_defaults(fn=cmd_speed)
    from .acceptance_cli import add_acceptance_parser

    add_acceptance_parser(bsub)


def rates(value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: rates such as 0.92 or 0.9,0.8,0.7") from None
    if not all(0 <= r <= 1 for r in out):
        raise argparse.ArgumentTypeError(f"{value!r}: every rate must lie in [0, 1]")
    return out


def shape_models(args):
    """``--target-shape``: random target and drafter on the run's device and dtype; the tokenizer
    (for the prompts) from ``--model-path`` or the embedded default."""
    from transformers import AutoTokenizer

    from ..entry import resolve_device
    from ..target.loading import default_target_path, resolve_dtype
    from ..target.tensor_parallel import init_tp
    from .shapes import random_models

    if args.synthetic_acceptance is None:
        raise SystemExit("--target-shape needs --synthetic-acceptance: a random drafter's tokens are never accepted")
    device = resolve_device(args.device)
    tp = init_tp(args.tp_size, device)
    tok = AutoTokenizer.from_pretrained(args.model_path or default_target_path())
    width = args.speculative_num_draft_tokens or 5
    target, draft = random_models(args.target_shape, device, resolve_dtype(args.dtype, device), width, tok, tp=tp)
    return target, draft, width


def speed_configs(args, width: int) -> tuple[list[int], list[str]]:
    """The widths and sampled verifiers to time: ``--widths`` / ``--verifiers`` when given, else the
    loaded width and the verifier the model flags chose (no model flag is silently ignored)."""
    widths = [int(w) for w in args.widths.split(",")] if args.widths else [width]
    verifiers = (
        args.verifiers.split(",")
        if args.verifiers
        else ["block" if args.speculative_use_block_verification else "token"]
    )
    bad = [v for v in verifiers if v not in ("token", "block")]
    if bad or any(w < 2 for w in widths):
        raise SystemExit(f"--verifiers must be token or block and --widths >= 2 (got {args.verifiers}, {args.widths})")
    return widths, verifiers


def cmd_speed(args) -> int:
    from ..entry import load_models
    from .speed import format_table, gsm8k_test_prompts, save_rows, side_by_side

    if args.enable_mixed_chunk and not args.concurrency:
        raise SystemExit("--enable-mixed-chunk needs --concurrency (batch 1 runs one slot: no prompt joins a step)")
    target, draft, width = shape_models(args) if args.target_shape else load_models(args)
    engine_kw = {
        "disable_cuda_graph": args.disable_cuda_graph,
        "disable_torch_compile": args.disable_torch_compile,
        "attention_backend": args.attention_backend,
        "synthetic_acceptance": args.synthetic_acceptance,
        "sampler_backend": args.sampler_backend,
    }
    if draft is None:
        raise SystemExit(
            "bench speed compares the target alone with DFlash2: --speculative-algorithm NONE leaves nothing to compare"
        )
    widths, verifiers = speed_configs(args, width)
    if args.breakdown:
        from ..engine.config import ATTENTION_BACKENDS
        from .engine_speed import step_cost_table

        slots = max([int(c) for c in args.concurrency.split(",")] if args.concurrency else [8])
        attention = ATTENTION_BACKENDS[args.attention_backend]
        table = step_cost_table(
            target, draft, widths[0], slots, disable_cuda_graph=args.disable_cuda_graph, attention=attention
        )
        print(table, flush=True)
        return 0
    prompts = gsm8k_test_prompts(args.gsm8k_path, args.limit)
    if args.concurrency:
        from . import engine_speed

        rows = engine_speed.run(
            target,
            draft,
            prompts,
            widths,
            verifiers,
            [int(c) for c in args.concurrency.split(",")],
            args.max_new_tokens,
            args.temperature,
            args.requests_per_slot,
            args.rounds,
            on_level=lambda rows: (print(engine_speed.table(rows), flush=True), engine_speed.save(rows, args.output)),
            adaptive=args.adaptive,
            engine_kw={k: v for k, v in engine_kw.items() if k != "attention_backend"}
            | {"enable_mixed_chunk": args.enable_mixed_chunk},
            attention_backends=(args.attention_backend,),
        )
        engine_speed.save(rows, args.output, args.plot)
        return 0
    print("batch 1: the engine with one slot", flush=True)
    rows = side_by_side(
        target,
        draft,
        prompts,
        widths=widths,
        temperatures=[float(t) for t in args.temperatures.split(",")],
        max_new_tokens=args.max_new_tokens,
        verifies=tuple(verifiers),
        engine_kw=engine_kw,
    )
    print(format_table(rows))
    if args.output:
        save_rows(rows, args.output)
    return 0
