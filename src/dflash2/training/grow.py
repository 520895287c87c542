"""A trained drafter grown without changing what it proposes (issue 23: spend the shipped drafter's 48 MB
where acceptance gains): the selector's codebooks over a token map's ids (one row each, every other
token one shared row), so the bytes of 49,152 rows at rank 64 hold a higher rank or a layer more; a
higher selector rank; more layers. Why function-preserving: training then continues from the old
drafter's acceptance instead of from scratch (a stage of the shipped drafter is ~6 GPU-minutes).

- new rank columns: the successor codebook's are zero, so every pair score is the old one; the
  predecessor codebook's and the hidden projection's are random, so the gradient reaches them;
- new layers (appended after the old ones): their attention and MLP output projections are zero, so
  each is the identity on the residual stream, and the block convolutions' output is zero with them;
- with a token map: row i of the codebooks is token ``ids[i]``'s old row; the shared row (tokens
  outside the map, which a mapped draft never proposes but an anchor may be) is their old rows' mean.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model.draft import DFlash2DraftModel


def grow_draft(
    draft: DFlash2DraftModel,
    token_map: torch.Tensor | None = None,
    selector_rank: int | None = None,
    num_layers: int | None = None,
    generator: torch.Generator | None = None,
) -> DFlash2DraftModel:
    """``draft`` grown: codebooks over ``token_map`` (sorted unique ids), rank ``selector_rank``, and
    ``num_layers`` layers (None: as now). Proposes what ``draft`` proposes wherever the anchor and the
    candidates are mapped tokens (with no token map: everywhere). Weights in ``draft``'s dtype."""
    cfg, old_sel = draft.config, draft.candidate_selector
    rank = cfg.selector_rank if selector_rank is None else selector_rank
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    if rank < cfg.selector_rank:
        raise ValueError(f"selector rank {rank} is below the drafter's ({cfg.selector_rank}): growth only adds")
    if layers < cfg.num_hidden_layers:
        raise ValueError(f"{layers} layers is below the drafter's {cfg.num_hidden_layers}: growth only adds")
    rows = cfg.selector_vocab_size
    if token_map is not None:
        if old_sel.codebook_rows is not None:
            raise ValueError("the drafter's codebooks are mapped already (selector_vocab_size is set)")
        if token_map.numel() < cfg.selector_top_k:
            raise ValueError(
                f"token map has {token_map.numel()} ids; the selector needs selector_top_k = {cfg.selector_top_k}"
            )
        rows = token_map.numel() + 1 if token_map.numel() < cfg.vocab_size else None
    extra = dict(cfg.extra)
    if "layer_types" in extra:
        extra["layer_types"] = list(extra["layer_types"]) + [extra["layer_types"][-1]] * (
            layers - cfg.num_hidden_layers
        )
    new_cfg = dataclasses.replace(
        cfg, selector_rank=rank, num_hidden_layers=layers, selector_vocab_size=rows, extra=extra
    )
    dtype = draft.fc.weight.dtype
    grown = DFlash2DraftModel(new_cfg).init_weights(generator=generator)
    old = {k: v.float() if v.is_floating_point() else v for k, v in draft.state_dict().items()}
    new = grown.state_dict()
    with torch.no_grad():
        for name, value in old.items():
            if not name.startswith("candidate_selector."):
                new[name].copy_(value)
        for layer in grown.layers[cfg.num_hidden_layers :]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        sel, r = grown.candidate_selector, cfg.selector_rank
        sel.hidden_projection.weight[:r] = old["candidate_selector.hidden_projection.weight"]
        sel.successor_codebook[:, r:] = 0
        A, B = old["candidate_selector.predecessor_codebook"], old["candidate_selector.successor_codebook"]
        if token_map is None or rows is None:  # the same rows (a mapped drafter keeps its map)
            sel.predecessor_codebook[:, :r], sel.successor_codebook[:, :r] = A, B
            if old_sel.codebook_rows is not None:
                sel.codebook_rows.copy_(old_sel.codebook_rows)
        else:
            ids = token_map.long().to(A.device)
            outside = torch.ones(cfg.vocab_size, dtype=torch.bool, device=A.device)
            outside[ids] = False
            sel.predecessor_codebook[:-1, :r], sel.successor_codebook[:-1, :r] = A[ids], B[ids]
            sel.predecessor_codebook[-1, :r], sel.successor_codebook[-1, :r] = A[outside].mean(0), B[outside].mean(0)
            index = torch.full((cfg.vocab_size,), len(ids), dtype=torch.long)
            index[ids.cpu()] = torch.arange(len(ids))
            sel.codebook_rows.copy_(index)
    return grown.to(dtype).eval()
