"""Float32 Linears on the CPU for a few rows at a time (a verify pass, a draft block).

Measured on the 2-core AVX2 VM, SmolLM2-135M's 210 Linears streamed from memory: PyTorch's
default path reads 8 GB/s at 1 row but 4.4-4.7 GB/s at 5-8 rows; oneDNN with the weight
reordered once into its blocked layout reads ~9 GB/s at 1 row and 7.5-8.7 GB/s at 5-8 rows
(docs/benchmarks.md, fifth session). Inside the model the gain is smaller: a few percent.

``pack_linears`` swaps the ``forward`` of frozen bias-free ``nn.Linear`` modules; the same
function is computed, only float rounding differs. A weight changed after packing (its
``_version`` moves) is repacked; autograd and non-fp32 inputs take ``F.linear``.
"""

from __future__ import annotations

import os
import types
import warnings

import torch
import torch.nn.functional as F

PACK_ROWS = 8  # oneDNN's layout hint: the verify / draft block sizes this project runs


def onednn_available() -> bool:
    """``DFLASH2_ONEDNN=0`` turns the packed path off (A/B timing, or a build that misbehaves)."""
    if os.environ.get("DFLASH2_ONEDNN", "1") == "0":
        return False
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def lm_head_matmul(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T``; without a packed weight. On the CPU in float32 with 2-64 rows,
    ``(weight @ hidden.T).T``: MKL's faster orientation against a large output dim (35 ms -> 13 ms
    for 5 x 49152 x 576), made contiguous because a strided result sends every later attention
    call to the slow math SDPA kernel."""
    if hidden.device.type == "cpu" and weight.dtype == torch.float32 and 1 < hidden.numel() // hidden.shape[-1] <= 64:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return (weight @ flat.T).T.contiguous().reshape(*hidden.shape[:-1], weight.shape[0])
    return F.linear(hidden, weight)


class PackedWeight:
    """One fp32 weight ``[out, in]`` kept in oneDNN's layout; called like ``F.linear(x, weight)``."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self._pack()

    def _pack(self) -> None:
        self.version = self.weight._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(x, self.weight)
        if self.weight._version != self.version:
            self._pack()
        out = self._matmul(x.reshape(-1, x.shape[-1]).contiguous())
        return out.reshape(*x.shape[:-1], self.weight.shape[0])

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, None, "none", [], "")


class Int8Weight(PackedWeight):
    """``w8a8_int8``: the weight quantised once per output channel (symmetric int8), activations
    per call (fbgemm's dynamic linear); called like ``F.linear(x, weight)``, approximately. For the
    drafter only: its Linears are memory-bound at a few rows, and int8 reads a quarter of the
    bytes. The target is never quantised (it defines the output; the drafter only proposes)."""

    def _pack(self) -> None:
        self.version = self.weight._version
        w = self.weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # PyTorch 2.13 marks quantized tensors deprecated; the ops still run
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(flat, self.packed, True)  # reduce_range: x86 fbgemm


QUANTIZATIONS = ("none", "w8a8_int8")


def check_quantization(quantization: str, what: str = "") -> None:
    """A clear error for a name outside :data:`QUANTIZATIONS` (``what``: whose, for the message)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown {what + ' ' if what else ''}quantization {quantization!r}; choose from {QUANTIZATIONS}"
        )


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


def packed_or_none(weight: torch.Tensor, quantization: str = "none") -> PackedWeight | Int8Weight | None:
    """A packed weight where oneDNN (or, for ``w8a8_int8``, fbgemm) can take it (CPU, fp32), else ``None``."""
    check_quantization(quantization)
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    try:
        if quantization == "w8a8_int8" and int8_available():
            return Int8Weight(weight)
        return PackedWeight(weight) if onednn_available() else None
    except (RuntimeError, AttributeError):  # an op this build lacks at run time: keep PyTorch's path
        return None


def pack_linears(module: torch.nn.Module, quantization: str = "none") -> int:
    """Route every bias-free fp32 CPU ``nn.Linear`` under ``module`` through a packed weight
    (``quantization="w8a8_int8"``: an int8 one). Returns how many were switched (0 off the CPU,
    in bf16, or without oneDNN)."""
    n = 0
    for mod in module.modules():
        if type(mod) is torch.nn.Linear and mod.bias is None:
            packed = packed_or_none(mod.weight, quantization)
            if packed is not None:
                mod.forward = types.MethodType(lambda m, x, _p=packed: _p(x), mod)
                n += 1
    return n
