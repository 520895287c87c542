"""Checkpoint I/O in the published layout: ``config.json`` + ``model.safetensors`` (or shards
with ``model.safetensors.index.json``). Every problem is reported by tensor or file name."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ConfigError, DFlash2Config
from .draft import DFlash2DraftModel
from .rope import rope_inv_freq

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class CheckpointError(RuntimeError):
    pass


def _shard_files(folder: Path) -> dict[str, list[str]]:
    """File name -> tensor names it should hold (from the index when sharded)."""
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{folder / INDEX}: unreadable index ({e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / INDEX}: weight_map must be an object")
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            # a shard is a plain file name inside the folder: nothing is read from elsewhere
            if (
                not isinstance(fname, str)
                or not fname.endswith(".safetensors")
                or fname != Path(fname).name
                or fname in (".", "..")
                or "\\" in fname
            ):
                raise CheckpointError(
                    f"{folder / INDEX}: shard {fname!r} of tensor {name!r} is not a plain "
                    f".safetensors file name inside the folder"
                )
            files.setdefault(fname, []).append(name)
        return files
    if (folder / SINGLE).is_file():
        return {SINGLE: []}
    raise CheckpointError(f"{folder}: neither {SINGLE} nor {INDEX} found")


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for fname, expected in _shard_files(folder).items():
        path = folder / fname
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in {INDEX} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for name in names:
                    state[name] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt/truncated data
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({type(e).__name__}: {e})") from None
        if expected and sorted(expected) != sorted(names):
            raise CheckpointError(
                f"{path}: tensors differ from {INDEX}: "
                f"missing {sorted(set(expected) - set(names))}, extra {sorted(set(names) - set(expected))}"
            )
    return state


def check_finite(state: dict[str, torch.Tensor], where: str | Path) -> None:
    """Refuse NaN / inf weights: a drafter with one would turn every sampled answer into garbage."""
    for name, t in state.items():
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointError(f"{where}: tensor {name} holds {bad} non-finite value(s) (NaN or inf)")


def load_draft(
    folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlash2DraftModel:
    folder = Path(folder)
    cfg = DFlash2Config.from_file(folder)
    state = read_state_dict(folder)
    check_finite(state, folder)
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or misshaped:
        lines = [f"{folder}: checkpoint does not match config.json"]
        lines += [f"  missing tensor: {k}" for k in missing]
        lines += [f"  unexpected tensor: {k}" for k in unexpected]
        lines += [f"  mis-shaped tensor: {k}" for k in misshaped]
        raise CheckpointError("\n".join(lines))
    target_dtype = dtype or next(v.dtype for v in state.values() if v.is_floating_point())
    # (integer tensors, the selector's codebook_rows, keep their type)
    model.load_state_dict(
        {k: v.to(device=device, dtype=target_dtype if v.is_floating_point() else v.dtype) for k, v in state.items()},
        assign=True,
    )
    rows = model.candidate_selector.codebook_rows
    if rows is not None and (
        rows.is_floating_point() or not bool(((rows >= 0) & (rows < cfg.selector_vocab_size)).all())
    ):
        raise CheckpointError(
            f"{folder}: tensor candidate_selector.codebook_rows must hold integer rows in [0, selector_vocab_size = "
            f"{cfg.selector_vocab_size})"
        )
    # non-persistent buffers (RoPE frequencies) are rebuilt on the real device
    model.rotary.inv_freq = rope_inv_freq(cfg)[0].float().to(device)
    return model.eval()


def save_draft(
    model: DFlash2DraftModel, folder: str | Path, max_shard_bytes: int | None = None, dtype: torch.dtype | None = None
) -> None:
    """Write ``config.json`` and the weights; shard when ``max_shard_bytes`` is given and exceeded."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save(folder / "config.json")
    state = OrderedDict(
        (k, v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype).contiguous().cpu())
        for k, v in model.state_dict().items()
    )
    total = sum(v.numel() * v.element_size() for v in state.values())
    meta = {"format": "pt"}
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, str(folder / SINGLE), metadata=meta)
        return
    shards: list[OrderedDict] = [OrderedDict()]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append(OrderedDict())
            size = 0
        shards[-1][k] = v
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def parameter_report(cfg: DFlash2Config) -> dict[str, int]:
    """Parameter count by group, computed on the meta device (no memory at any size)."""
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg)
    groups = {"layers": 0, "fc": 0, "norms": 0, "selector": 0}
    for name, p in model.named_parameters():
        key = (
            "layers"
            if name.startswith("layers.")
            else "fc"
            if name.startswith("fc.")
            else "selector"
            if name.startswith("candidate_selector.")
            else "norms"
        )
        groups[key] += p.numel()
    groups["total"] = sum(groups.values())
    return groups


__all__ = ["CheckpointError", "ConfigError", "load_draft", "save_draft", "read_state_dict", "parameter_report"]
