"""Tensor parallelism for dense Llama-family targets over ``torch.distributed`` (Megatron's split).

Each rank holds a slice of every decoder layer: q/k/v and gate/up split by output rows (whole heads,
whole MLP columns), o and down by input columns, their outputs summed by one all-reduce each. The
embedding, the norms and the LM head stay whole, so every rank ends a layer with the same residual
stream, the same features for the drafter and the same logits: an all-reduce leaves the same sum on
every rank. The drafter is small and runs whole on every rank.

The engine runs on every rank in lockstep (``LLMEngine``): rank 0 takes the requests and aborts and
hands them, with its step times (the planner's only input that is not the same everywhere), to the
other ranks at the start of each step, so every rank admits, drafts and verifies the same batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar, cast

import torch
import torch.distributed as dist

# what a layer must hold to be split: (module, Linear names split by rows, the one split by columns)
_SPLITS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"), ("mlp", ("gate_proj", "up_proj"), "down_proj"))


T = TypeVar("T")
# how long a rank waits in a collective for the others: a following rank waits in one for rank 0's next
# step however long the server is idle (a new group's own default is 30 minutes)
IDLE = timedelta(days=365)


class TensorParallelError(ValueError):
    pass


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (the default process group)."""

    rank: int
    size: int
    control: Any = None  # the gloo group that carries share()'s objects and barriers (None: the default one)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def in_turn(self, fn: Callable[[], T]) -> T:
        """``fn()`` on one rank at a time, rank 0 first: a rank that loads the whole model before
        keeping its slice holds it alone, so the host holds one whole copy at a time, not ``size``."""
        out = None
        for r in range(self.size):
            if r == self.rank:
                out = fn()
            dist.barrier(group=self.control)
        return cast(T, out)

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def init_tp(tp_size: int, device: str) -> TPGroup | None:
    """The group for ``--tp-size`` (None for 1), joining the process group torchrun describes in the
    environment (gloo on the CPU, NCCL on CUDA, one GPU per local rank)."""
    if tp_size == 1:
        return None
    if tp_size < 1:
        raise TensorParallelError(f"--tp-size {tp_size}: must be at least 1")
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp_size:
            raise TensorParallelError(
                f"--tp-size {tp_size}: start one process per rank, e.g. `torchrun --nproc-per-node {tp_size} "
                f"-m dflash2.cli ...` (WORLD_SIZE is {world})"
            )
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=IDLE)
    if dist.get_world_size() != tp_size:
        raise TensorParallelError(f"--tp-size {tp_size}: the process group has {dist.get_world_size()} ranks")
    # rank 0's messages (requests, step times) over a gloo group of their own, beside NCCL too, as vLLM's
    # CPU group: a pickled object through NCCL is a host-device copy and a synchronisation each way
    control = dist.new_group(backend="gloo", timeout=IDLE)
    return TPGroup(dist.get_rank(), tp_size, control)


def shard_reason(model, size: int) -> str | None:
    """Why ``model`` cannot be split ``size`` ways, or None."""
    cfg = model.config
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(types)} (dense attention layers only)"
    for name in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, name, None)
        if not isinstance(n, int) or n % size:
            return f"{name} = {n} is not a multiple of --tp-size {size}"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return "no model.layers (the Llama family's layout)"
    for i, layer in enumerate(layers):
        for part, rows, col in _SPLITS:
            mod = getattr(layer, part, None)
            for name in (*rows, col):
                lin = getattr(mod, name, None)
                if type(lin) is not torch.nn.Linear:
                    return f"layer {i} has no {part}.{name} Linear (a mixture of experts or another layout)"
        width = getattr(layer, "mlp").gate_proj.out_features
        if width % size:
            return f"intermediate size {width} is not a multiple of --tp-size {size}"
    return None


def check_shardable(model, size: int) -> None:
    """Raise :class:`TensorParallelError` naming why ``model`` (a meta-device copy will do) cannot be
    split ``size`` ways."""
    reason = shard_reason(model, size)
    if reason:
        raise TensorParallelError(f"--tp-size {size}: {type(model).__name__}: {reason}")


def shard_target(model, tp: TPGroup):
    """Keep this rank's slice of every decoder layer of ``model`` (in place; returns it), with an
    all-reduce after each o / down projection. Raises :class:`TensorParallelError` naming what cannot
    be split."""
    check_shardable(model, tp.size)
    for layer in model.model.layers:
        for part, rows, col in _SPLITS:
            mod = getattr(layer, part)
            for name in rows:
                _keep(getattr(mod, name), tp, dim=0)
            out = getattr(mod, col)
            _keep(out, tp, dim=1)
            out.register_forward_hook(lambda _m, _x, y: tp.all_reduce(y))
    return model


def _keep(lin: torch.nn.Linear, tp: TPGroup, dim: int) -> None:
    """Slice ``dim`` of the weight (0: output rows, with the bias; 1: input columns, the bias on rank 0
    only, so the all-reduce adds it once)."""
    n = lin.weight.shape[dim] // tp.size
    part = slice(tp.rank * n, (tp.rank + 1) * n)
    w = lin.weight.detach()
    lin.weight = torch.nn.Parameter((w[part] if dim == 0 else w[:, part]).contiguous(), requires_grad=False)
    if dim == 0:
        lin.out_features = n
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter(lin.bias.detach()[part].contiguous(), requires_grad=False)
    else:
        lin.in_features = n
        if lin.bias is not None and not tp.leader:
            lin.bias = torch.nn.Parameter(torch.zeros_like(lin.bias), requires_grad=False)
