"""Draft vocabulary subset (SGLang's ``--speculative-token-map``, FR-Spec): the draft scores only
the most frequent output tokens, so its LM head costs a fraction of the full ``[V, H]`` product
(on a 2-core CPU the full head is ~18 of a ~50 ms draft step). Lossless: the verifier still uses
the target's full distribution, and a token outside the map simply gets q_draft = 0.

The file is a 1-D tensor of token ids saved with ``torch.save`` (``.pt``) or a JSON list.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_NAME = "token_map.pt"


class TokenMapError(ValueError):
    pass


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """Sorted unique ids (long); names the file and the problem on bad input."""
    path = Path(path)
    if not path.is_file():
        raise TokenMapError(f"{path}: token map not found")
    try:
        raw = json.loads(path.read_text()) if path.suffix == ".json" else torch.load(path, weights_only=True)
        ids = torch.as_tensor(raw).long().flatten()
    except Exception as e:  # a truncated or foreign file
        raise TokenMapError(f"{path}: not a token map ({type(e).__name__}: {e})") from None
    if ids.numel() == 0:
        raise TokenMapError(f"{path}: token map is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise TokenMapError(f"{path}: token ids must lie in [0, {vocab_size}); got {int(ids.min())}..{int(ids.max())}")
    return ids.unique(sorted=True)


def build_token_map(token_ids: torch.Tensor, size: int, vocab_size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent ids of ``token_ids`` (ties: lower id), plus ``always`` (e.g. EOS)."""
    counts = torch.bincount(token_ids.long().flatten(), minlength=vocab_size).double()
    counts[torch.as_tensor(list(always), dtype=torch.long)] = float("inf")
    order = torch.sort(-counts, stable=True).indices
    return order[: min(size, vocab_size)].sort().values


def save_token_map(ids: torch.Tensor, path: str | Path) -> None:
    torch.save(ids.to(torch.int32).contiguous(), path)
