"""A function through ``torch.compile``, or eagerly where compiling fails."""

from __future__ import annotations

import warnings

import torch


RECOMPILE_LIMIT = 64


class CompiledOrEager:
    """``fn`` through ``torch.compile`` (Inductor fuses runs of small elementwise ops into one
    Triton kernel), falling back to ``fn`` itself, with a warning, if compiling fails: the eager
    function is the same math. The first call compiles (call it outside any CUDA-graph capture).
    Shapes go dynamic after the first new one (PyTorch's automatic dynamic shapes), so batch
    buckets and window prefixes share a few compilations."""

    def __init__(self, fn, name: str, backend="inductor"):
        self.fn, self.name = fn, name
        self.compiled = torch.compile(fn, backend=backend, fullgraph=True)
        # the draft's width is a Python int (a guard): engines of several widths in one process (bench
        # speed --widths 5,8) and the batch-1 specialisations took more than the default 8 compilations,
        # past which dynamo runs the function eagerly without a word
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: run the same math eagerly
                warnings.warn(f"torch.compile of {self.name} failed ({type(e).__name__}: {e}); it runs eagerly")
                self.compiled = None
        return self.fn(*args)
