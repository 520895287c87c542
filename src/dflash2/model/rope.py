"""Interleaved (DeepSeek) RoPE on the rope dims, with YaRN frequency scaling."""

from __future__ import annotations

import math

import torch

from ..config import DFlash2Config, yarn_get_mscale


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, max_pos: int):
    low = math.floor(_correction_dim(beta_fast, dim, base, max_pos))
    high = math.ceil(_correction_dim(beta_slow, dim, base, max_pos))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(cfg: DFlash2Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64, one per rotated pair) and the cos/sin magnitude scale."""
    dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freq_extra = 1.0 / (base**exps)
    rs = cfg.yarn()
    if rs is None:
        return freq_extra, 1.0
    factor = float(rs["factor"])
    orig = int(rs.get("original_max_position_embeddings", cfg.max_position_embeddings // max(int(factor), 1)))
    freq_inter = 1.0 / (factor * base**exps)
    low, high = yarn_correction_range(rs.get("beta_fast", 32), rs.get("beta_slow", 1), dim, base, orig)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_mask = 1.0 - ramp  # 1 keeps the original (high) frequency, 0 takes the interpolated one
    inv_freq = freq_inter * (1 - extra_mask) + freq_extra * extra_mask
    # DeepSeek: cos/sin carry mscale(mscale) / mscale(mscale_all_dim); the softmax scale carries the rest
    mscale = yarn_get_mscale(factor, rs.get("mscale", 1.0)) / yarn_get_mscale(factor, rs.get("mscale_all_dim", 0.0))
    return inv_freq, float(mscale)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        inv_freq, self.mscale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        return (angles.cos() * self.mscale).to(dtype), (angles.sin() * self.mscale).to(dtype)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` by angle ``i``. ``cos``/``sin`` broadcast over heads."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)
