"""Random-weight models of real shapes, for speed at sizes we cannot download (``bench speed
--target-shape``): a target built in process from its config (Llama family, or the Kimi-Linear hybrid
of linear attention, MLA and mixture-of-experts: the card's target family), and a drafter of the
published DFlash2 architecture (``configs/kimi-k3.1-dflash2-preview.json``) at the target's hidden
size and vocabulary. Timing does not depend on the weights; acceptance does, so these runs take
``--synthetic-acceptance`` (random drafts are never accepted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PUBLISHED_DRAFT = Path(__file__).resolve().parents[3] / "configs" / "kimi-k3.1-dflash2-preview.json"

SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
    ),
    "llama-1b": dict(  # Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0,
    ),
    "llama-8b": dict(  # Llama-3.1-8B
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0,
    ),
    # Kimi-Linear-48B-A3B: transformers' KimiLinearConfig defaults are its shape (27 layers, hidden
    # 2,304, three Kimi-delta-attention layers to one MLA layer, 256 experts of which 8 run per token,
    # 49.1 B parameters). Served by the paged eager runner (the static forward is dense-Llama only).
    "kimi-linear-48b-a3b": dict(config_class="KimiLinearConfig"),
    # A stand-in that carries the published drafter at its own size: the card target's hidden size
    # (7,168), vocabulary (163,840) and depth (93 layers, so the drafter reads the card's layer ids),
    # with one 128-wide attention head and a 128-wide MLP a layer. Only the draft's times (and the
    # LM head it shares) mean anything; the target's own steps are not any real model's.
    "published-draft": dict(
        vocab_size=163840, hidden_size=7168, intermediate_size=128, num_hidden_layers=93,
        num_attention_heads=1, num_key_value_heads=1, head_dim=128, tie_word_embeddings=False, rope_theta=50000.0,
    ),
}  # fmt: skip


def target_config(name: str):
    """The transformers config of shape ``name`` (no weights)."""
    import transformers as tf

    shape = dict(SHAPES[name])
    cls = getattr(tf, shape.pop("config_class", "LlamaConfig"))
    if cls is tf.LlamaConfig:
        shape.setdefault("max_position_embeddings", 131072)
    return cls(**shape)


def draft_config(name: str, width: int):
    """The drafter of the published architecture at shape ``name``'s hidden size and vocabulary, its
    target layer ids scaled to that target's depth."""
    from ..config import DFlash2Config

    cfg = target_config(name)
    layers = cfg.num_hidden_layers
    raw = json.loads(PUBLISHED_DRAFT.read_text())
    published_ids = raw["dflash_config"]["target_layer_ids"]
    ids = sorted({min(layers - 1, round(i * layers / raw["num_target_layers"])) for i in published_ids})
    raw.update(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_target_layers=layers)
    raw["dflash_config"].update(target_layer_ids=ids, block_size=width, mask_token_id=cfg.vocab_size - 1)
    return DFlash2Config.from_dict(raw)


def random_models(name: str, device: str, dtype: torch.dtype, width: int, tokenizer, seed: int = 0, tp=None):
    """``(target, draft)`` with random weights: the target of shape ``name``, the drafter of
    :func:`draft_config`. ``tp`` (a :class:`TPGroup`): every rank builds the same whole target on the
    host, one rank at a time, and keeps its slice on ``device``."""
    import torch
    import transformers as tf

    from ..model import DFlash2DraftModel
    from ..target import TargetModel
    from ..target.tensor_parallel import shard_target

    if name not in SHAPES:
        raise SystemExit(f"--target-shape {name!r}: known shapes are {', '.join(SHAPES)}")
    cfg, dcfg = target_config(name), draft_config(name, width)

    def build(on: str):
        torch.manual_seed(seed)  # every rank the same weights
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build in the run's dtype on its device: no float32 copy of 16 GB
        try:
            with torch.device(on):
                return tf.AutoModelForCausalLM.from_config(cfg).eval(), DFlash2DraftModel(dcfg).init_weights().eval()
        finally:
            torch.set_default_dtype(previous)

    def build_slice():
        model, draft = build("cpu")
        return shard_target(model, tp).to(device), draft.to(device)

    model, draft = build(device) if tp is None else tp.in_turn(build_slice)
    target = TargetModel(model, tokenizer, dcfg.target_layer_ids)
    target.tp = tp
    return target, draft
