"""Grouped dynamic block convolution (spec section 2).

Each block of ``width`` rows is convolved on its own: taps never cross a block boundary, so
many blocks can be packed in one tensor and any serving width works with the trained weights.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0  # identity at init
            nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Predict both sides' coefficients from the sublayer input and apply side 0."""
        dyn = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.num_groups))
        return self._conv(x, dyn, side=0, width=width), dyn

    def finish(self, h: torch.Tensor, dyn: torch.Tensor, width: int) -> torch.Tensor:
        return self._conv(h, dyn, side=1, width=width)

    def _conv(self, z: torch.Tensor, dyn: torch.Tensor, side: int, width: int) -> torch.Tensor:
        # z: [B, N*width, H] -> blocks [B, N, width, H]
        B, L, H = z.shape
        if L % width:
            raise ValueError(f"block rows ({L}) are not a multiple of the block width ({width})")
        zb = z.view(B, L // width, width, H)
        coef = dyn[..., side, :, :].repeat_interleave(self.group_size, dim=-1)  # [B, L, kernel, H]
        coef = coef.view(B, L // width, width, self.kernel_size, H) + self.base_kernel[side].to(z.dtype)
        out = coef[..., 0, :] * zb
        for o in range(1, self.kernel_size):
            if o >= width:
                break
            shifted = torch.zeros_like(zb)
            shifted[:, :, o:] = zb[:, :, :-o]  # slot t reads t-o of its own block; zeros before slot 0
            out = out + coef[..., o, :] * shifted
        return out.view(B, L, H)
