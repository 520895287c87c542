"""The ``dflash2`` command line: it assembles the subcommands' parsers and runs one. Flags are named
as in SGLang where SGLang has them."""

from __future__ import annotations

import argparse
import sys
import warnings

from .entry import DEFAULT_DRAFT, REPO, load_models  # noqa: F401  (scripts import them from here)


def build_parser() -> argparse.ArgumentParser:
    """Only the parsers: each subcommand's module adds its own (and holds its command)."""
    from .benchmark.cli import add_bench_parser
    from .decode_cli import add_decode_parsers
    from .inspect_cmd import add_inspect_parsers
    from .integrity.cli import add_integrity_parsers
    from .server.launch import add_serve_parser
    from .training.cli import add_training_parsers

    ap = argparse.ArgumentParser(prog="dflash2", description="DFlash2 block speculative decoding")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_decode_parsers(sub)
    add_inspect_parsers(sub)
    add_training_parsers(sub)
    add_bench_parser(sub)
    add_integrity_parsers(sub)
    add_serve_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    args = build_parser().parse_args(argv)
    if getattr(args, "tp_size", 1) > 1 and os.environ.get("RANK", "0") != "0":
        sys.stdout = open(os.devnull, "w")  # every rank runs the command; rank 0 prints
    from .config import ConfigError
    from .model.checkpoint import CheckpointError
    from .model.token_map import TokenMapError

    try:
        rc = args.fn(args)
    except (ConfigError, CheckpointError, TokenMapError, FileNotFoundError, ValueError) as e:
        print(f"dflash2: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank (--tp, or data-parallel train) leaves without the interpreter's teardown: there,
        # gloo's worker threads of a process group still referenced (the TP control group, DDP's reducer)
        # meet a finalizing interpreter; a `generate --tp 2` rank died of SIGABRT ("terminate called
        # without an active exception") twice in CI, once with an atexit destroy_process_group in place
        # (docs/benchmarks.md, forty-first session). Its work and output are complete here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
