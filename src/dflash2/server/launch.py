"""``dflash2 serve``: flags named and meaning as in SGLang (spec section 6)."""

from __future__ import annotations

import argparse
import gc
import logging
import re
from pathlib import Path


def add_serve_parser(sub) -> None:
    from ..entry import add_model_flags, add_tp_flag

    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--context-length", type=token_count, default=None, help="e.g. 4096, 32k (x1000), 128K (x1024)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (CPU default 65536)")
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prompt tokens prefilled per engine step, so a long prompt does not stall running "
        "requests (-1: whole prompts; default 256 on the CPU, 2048 on CUDA)",
    )
    p.add_argument(
        "--enable-mixed-chunk",
        action="store_const",
        const=True,
        default=None,
        help="a new request's whole prompt (up to 512 tokens) runs inside a small decode step's forward, "
        "sharing its read of the weights (the static-slot runner with more than one running request; "
        "default: off: with the packed prefill it no longer pays on the H200, 8B shape, 8 and 32 requests: "
        "docs/benchmarks.md, 36th session)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="commit each decode step (its tokens into the requests) before the next is launched; by default "
        "the static-slot runner commits a step while the device runs the next",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="(vLLM's flag) launch each decode step before the last one is read back, where the overlap schedule "
        "applies: the device need not wait for the host between steps (off by default until measured on a GPU)",
    )
    p.add_argument(
        "--num-continuous-decode-steps",
        type=steps_or_auto,
        default=None,
        help="while requests decode, admit (and prefill) new ones once every this many decode steps, so "
        "requests finishing a few steps apart share one prefill (1: every step); default auto: with CUDA "
        "graphs, the interval (1-4) of least expected cost from a prefill replay's price, the rate requests "
        "join and a step's cost per row; else 1",
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--speculative-draft-kv-cache-dtype", default="auto")
    add_tp_flag(p)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template (file or the template itself)")
    p.add_argument("--random-seed", type=int, default=None, help="seeds the draws of requests that give no seed")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="graphs are captured for every batch up to --max-running-requests; a smaller value is refused",
    )
    # SGLang flags whose job has no counterpart here: accepted, and start-up says so in one line each
    p.add_argument(
        "--enable-spec-usage",
        action="store_true",
        help="not an SGLang flag: OpenAI usage objects also carry spec_verify_ct and spec_accept_length "
        "(always in /generate's meta_info)",
    )
    p.add_argument("--enable-metrics", action="store_true", help="/metrics is always on")
    p.add_argument("--skip-server-warmup", action="store_true", help="serve without the short warm-up generation first")
    p.add_argument(
        "--gc-warning-threshold-secs",
        type=float,
        default=0.0,
        help="log each Python garbage collection that pauses the server at least this long (0: never; "
        "every pause counts in /metrics either way)",
    )
    p.add_argument("--disable-radix-cache", action="store_true", help="there is no prefix cache to disable")
    p.add_argument("--mamba-full-memory-ratio", type=float, default=None)
    p.add_argument("--speculative-draft-attention-backend", default=None)
    p.add_argument(
        "--model-runner",
        default="auto",
        choices=["auto", "paged", "static"],
        help="not an SGLang flag: auto = static slots + CUDA graphs where they apply, else paged; "
        "static on the CPU runs the graph runner's code eagerly (tests, debugging)",
    )
    p.set_defaults(fn=cmd_serve)


def token_count(value: str) -> int:
    """``4096``, ``32k`` (x1000) or ``128K`` (x1024), as vLLM reads human-readable lengths."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", value.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{value!r}: a token count such as 4096, 32k or 128K")
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[m.group(2)]
    return int(m.group(1)) * scale


def steps_or_auto(value: str) -> int | None:
    """``--num-continuous-decode-steps``: ``auto`` (None) or a step count >= 1."""
    if value.strip() == "auto":
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: auto or a number of decode steps >= 1")
    return int(value)


def flag_notes(args) -> list[str]:
    """One line per accepted SGLang flag that changes nothing here, saying why."""
    notes = []
    if args.mamba_full_memory_ratio is not None:
        notes.append(
            "--mamba-full-memory-ratio: no effect: recurrent states live per request, not in a shared "
            "pool sized against the KV cache"
        )
    if args.speculative_draft_attention_backend is not None:
        notes.append(
            f"--speculative-draft-attention-backend {args.speculative_draft_attention_backend}: no effect: "
            f"the drafter's attention is PyTorch's (SDPA / matmul)"
        )
    if args.disable_radix_cache:
        notes.append("--disable-radix-cache: no effect: there is no prefix cache")
    if args.enable_metrics:
        notes.append("--enable-metrics: no effect: /metrics is always served")
    return notes


def check_flags(args) -> None:
    """Unsupported values are a clear start-up error."""
    if args.kv_cache_dtype != "auto" or args.speculative_draft_kv_cache_dtype != "auto":
        raise SystemExit(
            "--kv-cache-dtype / --speculative-draft-kv-cache-dtype: only 'auto' is supported so far "
            "(fp8_e4m3 KV caches are not implemented)"
        )
    if args.reasoning_parser not in (None, "deepseek-r1", "qwen3", "kimi", "kimi_k2"):
        raise SystemExit(f"--reasoning-parser {args.reasoning_parser!r}: supported: deepseek-r1, qwen3, kimi, kimi_k2")
    if args.tool_call_parser not in (None, "hermes", "kimi_k2", "qwen", "qwen25"):
        raise SystemExit(f"--tool-call-parser {args.tool_call_parser!r}: supported: hermes (qwen, qwen25), kimi_k2")
    if not 0 < args.mem_fraction_static <= 1:
        raise SystemExit(f"--mem-fraction-static must be in (0, 1], got {args.mem_fraction_static}")
    if args.max_running_requests < 1:
        raise SystemExit(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.gc_warning_threshold_secs < 0:
        raise SystemExit(f"--gc-warning-threshold-secs must be >= 0, got {args.gc_warning_threshold_secs}")
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs < args.max_running_requests:
        raise SystemExit(
            f"--cuda-graph-max-bs {args.cuda_graph_max_bs} < --max-running-requests "
            f"{args.max_running_requests}: batches past the graphs are not run eagerly here; lower "
            f"--max-running-requests to {args.cuda_graph_max_bs} instead"
        )


def kv_budget_tokens(args, target) -> int:
    if args.max_total_tokens:
        return args.max_total_tokens
    if args.device != "cuda":
        return 65536
    import torch

    free, _ = torch.cuda.mem_get_info()
    return int(free * args.mem_fraction_static / target.kv_bytes_per_token)


def engine_config(args, target, draft, width: int):
    """The engine's config from ``serve``'s parsed flags (the server's, and scripts that run its engine offline)."""
    from ..engine.engine import EngineConfig

    return EngineConfig.for_models(
        target,
        draft,
        width,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        block_verification=args.speculative_use_block_verification,
        max_total_tokens=kv_budget_tokens(args, target),
        page_size=args.page_size,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_torch_compile=args.disable_torch_compile,
        attention_backend=args.attention_backend,
        sampler_backend=args.sampler_backend,
        runner=args.model_runner,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_mixed_chunk=args.enable_mixed_chunk,
        disable_overlap_schedule=args.disable_overlap_schedule,
        async_scheduling=args.async_scheduling,
        num_continuous_decode_steps=args.num_continuous_decode_steps,
        speculative_planner=args.speculative_planner,
        speculative_trim=args.enable_speculative_trim,
        speculative_planner_widths=args.speculative_planner_widths,
        speculative_width_schedule=args.speculative_width_schedule,
    )


def cmd_serve(args) -> int:
    import uvicorn

    from ..entry import load_models
    from ..engine.engine import LLMEngine
    from ..engine.gc_utils import GCPauses, freeze_gc
    from .app import create_app

    check_flags(args)
    logging.basicConfig(level=args.log_level.upper())
    for note in flag_notes(args):
        print(note, flush=True)
    if args.random_seed is not None:
        import torch

        torch.manual_seed(args.random_seed)  # unseeded requests draw their seeds from it
    target, draft, width = load_models(args)
    if args.chat_template:
        path = Path(args.chat_template)
        target.tokenizer.chat_template = path.read_text() if path.is_file() else args.chat_template
    cfg = engine_config(args, target, draft, width)
    ctx = cfg.context_length
    engine = LLMEngine(target, draft, cfg)
    if not args.skip_server_warmup:
        engine.warm_up()
    # what lives for good is built: out of the collector's walks (a full one paused 185 ms on the CPU)
    gc_pauses = GCPauses(args.gc_warning_threshold_secs)
    gc.callbacks.append(gc_pauses)
    freeze_gc("dflash2 serve")
    if engine.tp is not None and not engine.tp.leader:  # rank 0 serves; this rank steps with it
        engine.follow()
        return 0
    engine.start()
    name = args.served_model_name or (args.model_path or "SmolLM2-135M-Instruct")
    parser = {"qwen": "hermes", "qwen25": "hermes"}.get(args.tool_call_parser, args.tool_call_parser)
    app = create_app(
        engine,
        target.tokenizer,
        name,
        ctx,
        args.reasoning_parser,
        parser,
        api_key=args.api_key,
        server_args={k: v for k, v in vars(args).items() if k not in ("fn", "api_key")},
        gc_pauses=gc_pauses,
    )
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    graphs = "CUDA graphs over static slots" if engine.runner.use_graph else "eager"
    print(
        f"dflash2 serving {name} on http://{args.host}:{args.port} (width {engine.width}, "
        f"{cfg.max_total_tokens} KV tokens, max {cfg.max_running_requests} running, {graphs})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    engine.shutdown()
    return 0


def spawn_server(serve_args: list[str], cwd, tries: int = 240, ranks: int = 1):
    """``dflash2 serve`` as a child process on a free loopback port, returned once ``/health`` answers:
    ``(process, base url)`` (tests and scripts that measure a live server). ``ranks`` > 1: under
    torchrun, one process a rank (add ``--tp-size ranks``)."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dflash2.cli", "serve", *serve_args, "--port", str(port)]
    if ranks > 1:  # torchrun's module form
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *cmd[1:]]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(tries):
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read() if proc.stdout else "server exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")
