"""The DFlash2 draft network (spec section 2), with the published tensor names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DFlash2Config
from .attention import MLAttention, RMSNorm
from .compiled import CompiledOrEager
from .conv import BlockConv
from .cpu_linear import check_quantization, lm_head_matmul, pack_linears, packed_or_none
from .rope import RotaryEmbedding
from .selector import CandidateSelector


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlash2Config, rotary: RotaryEmbedding):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, rotary)
        self.mlp = SwiGLU(H, cfg.intermediate_size)
        self.attention_conv = BlockConv(H, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = BlockConv(H, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, positions, ctx_latent, mask, width):
        h, k_a = self.attention_conv.prepare(self.input_layernorm(x), width)
        h = self.attention_conv.finish(self.self_attn(h, positions, ctx_latent, mask), k_a, width)
        x = x + h
        h, k_m = self.mlp_conv.prepare(self.post_attention_layernorm(x), width)
        return x + self.mlp_conv.finish(self.mlp(h), k_m, width)


# DraftLayer.forward and DFlash2DraftModel.context_rows through torch.compile, by backend (compile_layers)
_COMPILED: dict = {}


class DFlash2DraftModel(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        cfg.validate()
        self.config = cfg
        H = cfg.hidden_size
        self.rotary = RotaryEmbedding(cfg)
        self.fc = nn.Linear(cfg.fc_in_features, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, self.rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(
            H, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k, cfg.selector_vocab_size
        )
        self._token_map = None  # (ids, head rows of ids, the full head, packed rows or None); see set_token_map
        self._quantization = "none"  # of the CPU-packed Linears; see pack_cpu_linears
        self._layer_fn = None  # DraftLayer.forward through torch.compile; see compile_layers
        self._rows_fn = None  # context_rows through torch.compile, for graph_rows

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> "DFlash2DraftModel":
        """Random init for training or tests (normal linears, unit norms, identity convs, top-1 selector)."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0, std, generator=generator)
                elif isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)
                elif isinstance(m, BlockConv):
                    m.reset_parameters()
            self.candidate_selector.predecessor_codebook.normal_(0, 0.02, generator=generator)
            self.candidate_selector.successor_codebook.zero_()
        return self

    # ---- context ----------------------------------------------------------------------------
    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """``[..., K*H_target]`` concatenated target layer outputs -> ``h_ctx [..., H]``."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def context_latents(self, h_ctx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-layer latent cache rows for context tokens: ``[num_layers, B, T, kv_lora + rope]``."""
        return torch.stack([layer.self_attn.latent(h_ctx, positions) for layer in self.layers])

    def context_rows(self, target_features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Latent cache rows of context tokens straight from their target features: ``[T, K*H]`` at
        ``positions [T]`` -> ``[num_layers, T, D]`` (with a batch dim: ``[num_layers, B, T, D]``)."""
        if target_features.dim() == 2:
            return self.context_rows(target_features[None], positions[None])[:, 0]
        return self.context_latents(self.fuse(target_features), positions)

    def graph_rows(self, target_features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`context_rows` of ``[B, T, K*H]`` features (a verify step's block rows, or padded
        prefill chunks), compiled after :meth:`compile_layers` (eager, ~120 small kernels: 0.24 ms of a
        1.4 ms batch-1 verify graph on the H200, docs/benchmarks.md, twenty-second session). Only the
        graph runner's captured functions call it: their shapes are all met at start-up, so nothing
        compiles while serving (the eager prefill paths keep :meth:`context_rows`)."""
        if self._rows_fn is None or torch.is_grad_enabled():
            return self.context_rows(target_features, positions)
        return self._rows_fn(self, target_features, positions)

    # ---- block ------------------------------------------------------------------------------
    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_latents: torch.Tensor | list,
        mask: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """Block rows ``[B, N*width, H]`` (N blocks of ``[anchor, MASK...]`` embeddings) -> final-normed
        hidden states. ``ctx_latents [num_layers, B, Tc, D]`` (or a list of each layer's
        ``(pool, rows)``: :func:`~dflash2.model.attention.paged_context`); ``mask [B, N*width, Tc + N*width]``."""
        x = block_embeds.to(self.fc.weight.dtype)
        # compiled for inference only: a model that served from the graph runner still trains eagerly
        fn = self._layer_fn if self._layer_fn is not None and not torch.is_grad_enabled() else DraftLayer.__call__
        for i, layer in enumerate(self.layers):
            x = fn(layer, x, positions, ctx_latents[i], mask, width)
        return self.norm(x)

    def compile_layers(self, backend="inductor") -> None:
        """Run each layer's forward through ``torch.compile`` (one compiled graph shared by the
        layers: their parameters are its inputs). Why: eager, the 4-layer draft block was ~590
        kernel launches, most of them tiny elementwise ops (fp32 norms, block convolutions, RoPE),
        1.4 ms of a 2.9 ms batch-1 step on the H200 (docs/benchmarks.md, twenty-second session).
        Compiling the layer, not the whole block, keeps the compile short: one layer's graph, a few
        shapes. :meth:`graph_rows` (the captured graphs' latents) compiles too. The graph runner calls it on
        CUDA; eager elsewhere."""
        if backend not in _COMPILED:  # one per process: engines built later reuse its compilations
            _COMPILED[backend] = (
                CompiledOrEager(DraftLayer.forward, "the draft layer", backend),
                CompiledOrEager(DFlash2DraftModel.context_rows, "the draft's context rows", backend),
            )
        self._layer_fn, self._rows_fn = _COMPILED[backend]

    def compile_off(self) -> None:
        """Back to the eager layers and rows (a reference for :meth:`compile_layers`)."""
        self._layer_fn = self._rows_fn = None

    def set_token_map(self, ids: torch.Tensor | None, lm_head_weight: torch.Tensor | None = None) -> None:
        """Score only ``ids`` (see ``token_map.py``); the rest of the vocabulary gets -inf. ``None``: all."""
        if ids is None:
            self._token_map = None
            return
        if ids.numel() < self.config.selector_top_k:
            from .token_map import TokenMapError

            raise TokenMapError(
                f"token map has {ids.numel()} ids; the selector needs at least "
                f"selector_top_k = {self.config.selector_top_k}"
            )
        ids = ids.to(lm_head_weight.device)
        # the head rows are copied once, contiguous, so each step reads only |ids| x H
        sub_weight = lm_head_weight.index_select(0, ids).contiguous()
        self._token_map = (ids, sub_weight, lm_head_weight, packed_or_none(sub_weight, self._quantization))

    def pack_cpu_linears(self, quantization: str = "none") -> int:
        """Inference on the CPU in fp32: Linears through oneDNN-packed weights (see ``cpu_linear``).
        ``quantization="w8a8_int8"``: the layers' Linears and the token map's head rows in int8
        instead. ``fc`` stays fp32: its input, the concatenated target hidden states, has outlier
        channels that one activation scale per call cannot hold (greedy acceptance fell 3.4 -> 2.8
        with it quantised, 3.4 -> 3.37 without, on 8 GSM8K prompts)."""
        check_quantization(quantization, "draft")  # before any state changes
        self._quantization = quantization
        n = pack_linears(self.layers, quantization) + pack_linears(self.fc) + pack_linears(self.candidate_selector)
        if self._token_map is not None:
            ids, sub_weight, head, _ = self._token_map
            self._token_map = (ids, sub_weight, head, packed_or_none(sub_weight, quantization))
        return n

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap else logits

    def _mapped(self, lm_head_weight: torch.Tensor):
        tm = self._token_map
        return tm if tm is not None and tm[2] is lm_head_weight else None

    @staticmethod
    def _head(hidden: torch.Tensor, weight: torch.Tensor, packed=None) -> torch.Tensor:
        """The head's rows ``weight`` over ``hidden``, in the head's dtype (``packed``: its CPU-packed form)."""
        h = hidden.to(weight.dtype)
        return packed(h) if packed is not None else lm_head_matmul(h, weight)

    def compute_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits; with a token map, -inf outside it (multiplier and softcap are
        applied to the mapped rows first, so unmapped tokens stay -inf rather than -cap)."""
        tm = self._mapped(lm_head_weight)
        if tm is None:
            return self._finish_logits(self._head(hidden, lm_head_weight).float())
        ids, sub_weight, _, packed = tm
        sub = self._finish_logits(self._head(hidden, sub_weight, packed).float())
        logits = sub.new_full((*sub.shape[:-1], lm_head_weight.shape[0]), float("-inf"))
        logits[..., ids] = sub
        return logits

    def candidates(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's per-slot top-k ``(logits, token ids)``, as ``candidate_selector.candidates``
        of :meth:`compute_logits`. With a token map the top-k is taken over the mapped rows only: the
        ids are sorted, so the order (value, then lower id) is the same, and no full-vocabulary
        tensor is built (that cost ~3 ms a CPU step in fills and copies)."""
        return self._candidates(hidden, lm_head_weight, False)[:2]

    def scored_candidates(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`candidates`, and each slot's confidence ``[..., slots]``: the draft head's softmax
        probability of its top token. It depends on the block's hidden states only, never on the
        tokens a sampled walk draws, so a verify width chosen from it keeps every verifier lossless
        (the planner's :meth:`~dflash2.engine.planner.Planner.trim`)."""
        vals, ids, conf = self._candidates(hidden, lm_head_weight, True)
        assert conf is not None
        return vals, ids, conf

    def _candidates(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, confidence: bool):
        # the top-k of the head's own output (bf16 on the GPU), its k survivors then to fp32 and through
        # the multiplier and softcap: the same candidates (fp32 holds every bf16 value; both maps rise, the
        # config holds them positive) without an fp32 copy of every row. Why: at 64 rows on the H100 that
        # copy was 0.056 ms of a 1.09 ms draft, beside a 0.21 ms top-k (docs/benchmarks.md, forty-fifth
        # session)
        tm = self._mapped(lm_head_weight)
        ids = None if tm is None else tm[0]
        raw = self._head(hidden, lm_head_weight) if tm is None else self._head(hidden, tm[1], tm[3])
        vals, idx = self.candidate_selector.candidates(raw, self._finish_logits)
        conf = (vals[..., 0] - self._finish_logits(raw.float()).logsumexp(-1)).exp() if confidence else None
        return vals, idx if ids is None else ids[idx], conf
