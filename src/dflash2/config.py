"""The DFlash2 draft config: read from the published ``config.json`` layout and validated.

Keys inside ``dflash_config`` win over the same top-level keys (spec section 3). Unknown keys
are kept in ``extra`` so a save/load round trip loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config key is missing or holds an impossible value; the message names the key."""


# Keys stored under ``dflash_config`` in the public checkpoints.
DFLASH_KEYS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "selector_vocab_size",
)
# dflash_config keys written only when set (a checkpoint in the published layout has none of them)
OPTIONAL_DFLASH_KEYS = ("selector_vocab_size",)
MAX_BLOCK_SIZE = 64  # the published drafter uses 5; the verify block and its buffers grow with it
REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "vocab_size",
    "target_layer_ids",
    "block_size",
    "mask_token_id",
)


@dataclass
class DFlash2Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    sliding_window: int = 1024
    is_causal: bool = False
    num_target_layers: int | None = None
    target_hidden_size: int | None = None  # defaults to hidden_size (the draft shares the target's embedding)
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 32
    # rows of the selector's two codebooks; None: one per vocabulary token (the published layout). Fewer:
    # the checkpoint's ``candidate_selector.codebook_rows`` maps each token to its row (a token map's ids
    # their own rows, every other token one shared row), so the same bytes hold a higher rank or a layer more
    selector_vocab_size: int | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DFlash2Config":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        merged = {k: v for k, v in raw.items() if k != "dflash_config"}
        nested = raw.get("dflash_config") or {}
        if not isinstance(nested, dict):
            raise ConfigError(f"dflash_config must be an object, got {nested!r}")
        merged.update(nested)
        missing = [k for k in REQUIRED if merged.get(k) is None]
        if missing:
            raise ConfigError(f"missing required config key(s): {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: merged[k] for k in names if k in merged}
        extra = {k: v for k, v in merged.items() if k not in names}
        cfg = cls(**known, extra=extra)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "DFlash2Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The published layout: HF-style top level plus a ``dflash_config`` object."""
        out: dict[str, Any] = dict(self.extra)
        out.pop("dflash_config", None)
        for f in dataclasses.fields(self):
            if f.name == "extra" or f.name in DFLASH_KEYS:
                continue
            out[f.name] = getattr(self, f.name)
        out["architectures"] = ["DFlash2DraftModel"]
        out["model_type"] = out.get("model_type", "dflash2")
        out.setdefault("layer_types", ["sliding_attention"] * self.num_hidden_layers)
        out["dflash_config"] = {
            k: getattr(self, k) for k in DFLASH_KEYS if k not in OPTIONAL_DFLASH_KEYS or getattr(self, k) is not None
        }
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        def bad(key: str, value: Any, why: str) -> ConfigError:
            return ConfigError(f"config key {key!r} = {value!r}: {why}")

        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "intermediate_size",
            "vocab_size",
            "conv_kernel_size",
            "conv_group_size",
            "selector_rank",
            "selector_top_k",
            "max_position_embeddings",
        ):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(key, v, "must be a positive integer")
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", self.qk_rope_head_dim, "must be a positive even integer (RoPE rotates pairs)")
        if self.hidden_size % self.conv_group_size:
            raise bad("conv_group_size", self.conv_group_size, f"must divide hidden_size ({self.hidden_size})")
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise bad("sliding_window", self.sliding_window, "must be > 0")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise bad("block_size", self.block_size, "must be >= 2 (anchor plus at least one draft slot)")
        if self.selector_top_k > self.vocab_size:
            raise bad("selector_top_k", self.selector_top_k, f"must be <= vocab_size ({self.vocab_size})")
        rows = self.selector_vocab_size
        if rows is not None and (
            not isinstance(rows, int) or isinstance(rows, bool) or not 0 < rows <= self.vocab_size
        ):
            raise bad("selector_vocab_size", rows, f"must be null or an integer in [1, vocab_size = {self.vocab_size}]")
        types = self.extra.get("layer_types")
        if types is not None and (not isinstance(types, list) or len(types) != self.num_hidden_layers):
            raise bad("layer_types", types, f"must be a list of num_hidden_layers ({self.num_hidden_layers}) entries")
        ids = self.target_layer_ids
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise bad("target_layer_ids", ids, "must be a non-empty list of integers")
        if len(set(ids)) != len(ids):
            raise bad("target_layer_ids", ids, "must be unique")
        if min(ids) < 0:
            raise bad("target_layer_ids", ids, "must be non-negative")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise bad("target_layer_ids", ids, f"must be below num_target_layers ({self.num_target_layers})")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise bad("mask_token_id", self.mask_token_id, f"must be a token id in [0, {self.vocab_size})")
        if self.block_size > MAX_BLOCK_SIZE:
            raise bad("block_size", self.block_size, f"must be <= {MAX_BLOCK_SIZE} (one verify block per step)")
        if self.sliding_window > self.max_position_embeddings:
            raise bad(
                "sliding_window",
                self.sliding_window,
                f"must be <= max_position_embeddings ({self.max_position_embeddings})",
            )

        def finite(key: str, low: float, high: float = math.inf, optional: bool = False) -> None:
            v = getattr(self, key)
            if optional and v is None:
                return
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low < v < high
            if not ok:
                span = f"in ({low:g}, {high:g})" if math.isfinite(high) else f"> {low:g}"
                raise bad(key, v, f"must be a finite number {span}" + (" or null" if optional else ""))

        finite("output_multiplier", 0.0)
        finite("final_logit_softcapping", 0.0, optional=True)
        finite("rms_norm_eps", 0.0, 1.0)
        finite("rope_theta", 1.0)
        if not isinstance(self.is_causal, bool):
            raise bad("is_causal", self.is_causal, "must be true or false")
        rs = self.rope_scaling
        if rs is not None:
            if not isinstance(rs, dict):
                raise bad("rope_scaling", rs, "must be an object or null")
            kind = rs.get("type", rs.get("rope_type"))
            if kind not in ("yarn", "default", None):
                raise bad("rope_scaling.type", kind, "only 'yarn' (or none) is supported")
            for key, v in rs.items():
                if isinstance(v, float) and not math.isfinite(v):
                    raise bad(f"rope_scaling.{key}", v, "must be finite")
            if kind == "yarn" and not (isinstance(rs.get("factor"), (int, float)) and rs["factor"] >= 1):
                raise bad("rope_scaling.factor", rs.get("factor"), "must be a number >= 1")

    # ---- helpers ---------------------------------------------------------------------------
    def yarn(self) -> dict | None:
        rs = self.rope_scaling
        if not rs or rs.get("type", rs.get("rope_type")) != "yarn":
            return None
        return rs

    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5``, times ``mscale^2`` under YaRN with ``mscale_all_dim`` set."""
        scale = self.qk_head_dim**-0.5
        rs = self.yarn()
        if rs and rs.get("mscale_all_dim"):
            m = yarn_get_mscale(rs["factor"], rs["mscale_all_dim"])
            scale = scale * m * m
        return scale


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0
