"""Target adapter over a Hugging Face causal LM.

Gives the draft what it needs: the residual stream after each decoder layer in
``target_layer_ids`` (forward hooks, so no full ``hidden_states`` tuple is materialised), the
token embedding and the LM head. Keeps one KV cache per request and rolls it back after a
partial acceptance. Layers with a recurrent state (linear attention / SSM) roll back too: for
supported kernels (KimiLinear, see recurrent.py) every verify pass records the state after each
position and the accepted one is restored; other hybrids are snapshotted before the pass and,
on a partial acceptance, restored and advanced over the accepted tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from . import recurrent
from .tensor_parallel import TPGroup


class UnsupportedTargetError(RuntimeError):
    pass


@dataclass
class TargetState:
    cache: DynamicCache
    length: int = 0  # committed tokens in the cache
    snapshot: dict | None = field(default=None)  # recurrent state before the pending verify pass
    pending: tuple | None = None  # (ids, n) of the last forward, until commit
    positions: recurrent.PositionRecorder | None = None  # per-position recurrent states of the last forward


def _decoder_layers(model) -> torch.nn.ModuleList:
    for path in ("model.layers", "backbone.layers", "transformer.h", "model.decoder.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise UnsupportedTargetError(
        f"{type(model).__name__}: cannot find the decoder layer list "
        "(looked for model.layers, backbone.layers, transformer.h)"
    )


class TargetModel:
    def __init__(self, model, tokenizer=None, layer_ids: list[int] | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.layers = _decoder_layers(model)
        self.num_layers = len(self.layers)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if self._cache_kw not in params:
            raise UnsupportedTargetError(f"{type(model).__name__}.forward takes no KV cache argument")
        self._accepts_keep = "logits_to_keep" in params
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self.layer_ids: list[int] = []
        self.set_layer_ids(layer_ids or [])
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if emb is None or head is None:
            raise UnsupportedTargetError(f"{type(model).__name__} has no input embedding or LM head")
        self.embed, self.lm_head_weight = emb, head.weight
        types = getattr(self.config, "layer_types", None) or []
        self.is_hybrid = any(t in ("linear_attention", "mamba", "ssm", "recurrent") for t in types) or getattr(
            self.config, "model_type", ""
        ) in ("mamba", "mamba2", "falcon_mamba")
        # per-position states where the kernels are known; snapshot + replay otherwise
        self.per_position_states = self.is_hybrid and recurrent.install(model)
        self.tp: TPGroup | None = None  # this rank's place when the layers are split (tensor_parallel.py)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer on this rank, at the model's dtype (a full-attention
        estimate)."""
        cfg = self.config
        kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) // (self.tp.size if self.tp else 1)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize

    def use_fast_cpu_kernels(self) -> int:
        """On the CPU in float32: grouped-query attention without copying K/V, and Linears through
        weights packed once for oneDNN.

        Attention: with a mask (every verify pass of more than one token) Hugging Face's SDPA path
        repeats each K/V head for its query heads, a copy of the whole cache per layer per pass
        (SmolLM2: 3 -> 9 heads; at a 400-token context the 8-row pass took 149 ms against 133 ms
        without it, paired). ``TRANSFORMERS_SDPA_FORCE_GQA=1`` is transformers' own switch to pass
        ``enable_gqa`` instead, which PyTorch's CPU kernel takes with a mask; same logits. Set
        only if the user has not set it.

        Linears: route bias-free Linears through weights packed once for oneDNN
        (``cpu_linear.py``): a verify pass over 5-8 tokens then costs 1.2-1.5 one-token steps
        instead of 5-8 (AVX2 machines have no fast bf16 GEMM, and PyTorch's default path is slow for a few rows).
        Without oneDNN, MKL's transposed orientation. Same function; only float rounding differs.
        Returns how many layers were switched."""
        import types

        from ..model.cpu_linear import lm_head_matmul, pack_linears

        if self.device.type != "cpu" or self.dtype != torch.float32:
            return 0
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
        n = pack_linears(self.model)
        if n:
            return n
        for mod in self.model.modules():
            if type(mod) is torch.nn.Linear and mod.bias is None:
                mod.forward = types.MethodType(lambda m, x: lm_head_matmul(x, m.weight), mod)
                n += 1
        return n

    # ---- hooks ------------------------------------------------------------------------------
    def set_layer_ids(self, layer_ids: list[int]) -> None:
        for h in self._hooks:
            h.remove()
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise UnsupportedTargetError(
                f"target_layer_ids {bad} out of range: the target has {self.num_layers} layers"
            )
        self.layer_ids = list(layer_ids)
        self._hooks = [self.layers[i].register_forward_hook(self._make_hook(i)) for i in self.layer_ids]

    def _make_hook(self, idx: int):
        def hook(_module, _inputs, output):
            self._captured[idx] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    # ---- state ------------------------------------------------------------------------------
    def new_state(self) -> TargetState:
        try:
            cache = DynamicCache(config=self.config)
        except TypeError:
            cache = DynamicCache()
        return TargetState(cache=cache)

    @torch.no_grad()
    def forward(
        self, state: TargetState, input_ids: torch.Tensor, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``input_ids [L]`` after the committed tokens. Returns logits ``[L, V]`` (float32; only
        the last ``logits_to_keep`` rows when given: a prefill needs one row, not a vocabulary per token)
        and the concatenated hooked features ``[L, K*H]``. Tokens are appended to the cache as
        pending; call :meth:`commit` to keep a prefix."""
        L = input_ids.shape[-1]
        record = self.per_position_states and state.length > 0
        if self.is_hybrid and not record:
            state.snapshot = self._snapshot(state)
        state.positions = recurrent.PositionRecorder(L) if record else None
        pos = torch.arange(state.length, state.length + L, device=self.device)[None]
        self._captured.clear()
        with state.positions or contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids.view(1, L).to(self.device),
                position_ids=pos,
                use_cache=True,
                **{self._cache_kw: state.cache},
                **self._keep_kw(logits_to_keep),
            )
        feats = (
            torch.cat([self._captured[i][0] for i in self.layer_ids], -1)
            if self.layer_ids
            else torch.empty(L, 0, device=self.device)
        )
        state.pending = (input_ids.view(-1), L)
        state.length += L
        return out.logits[0].float(), feats

    @torch.no_grad()
    def batched_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Hugging Face forward over ``input_ids [B, L]`` (with an optional cache that it extends,
        and a padding mask): logits ``[B, L, V]`` (in the model's dtype) and the hooked features ``[B, L, K*H]``
        (``[B, L, 0]`` with no layer ids). The paged runner's verify and the trainer's teacher use it."""
        self._captured.clear()
        kw = {self._cache_kw: cache, "use_cache": True} if cache is not None else {"use_cache": False}
        out = self.model(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask, position_ids=position_ids, **kw
        )
        B, L = input_ids.shape
        feats = (
            torch.cat([self._captured[i] for i in self.layer_ids], -1)
            if self.layer_ids
            else torch.empty(B, L, 0, device=self.device)
        )
        return out.logits, feats

    def _keep_kw(self, n: int) -> dict:
        return {"logits_to_keep": n} if n and self._accepts_keep else {}

    @torch.no_grad()
    def commit(self, state: TargetState, keep: int) -> None:
        """Keep the first ``keep`` of the tokens of the last :meth:`forward`; drop the rest."""
        ids, L = state.pending
        drop = L - keep
        if drop <= 0:
            state.snapshot = state.positions = None
            return
        base = state.length - L
        if state.positions is not None:
            recurrent.rewind(state.cache, state.positions, keep)
            state.positions = None
            self._crop_attention(state, drop)
            state.length = base + keep
            return
        if self.is_hybrid:
            self._restore(state, state.snapshot)
            self._crop_attention(state, L)
            state.length = base
            state.snapshot = None
            if keep:
                self.forward(state, ids[:keep])  # advance the recurrent state over the accepted tokens
                state.snapshot = None
            return
        state.cache.crop(-drop)
        state.length = base + keep

    # ---- recurrent-state snapshots -------------------------------------------------------------
    def _linear_layers(self, state: TargetState):
        return [l for l in getattr(state.cache, "layers", []) if hasattr(l, "recurrent_states")]

    def _snapshot(self, state: TargetState) -> list:
        snap = []
        for layer in self._linear_layers(state):
            snap.append(
                {
                    "conv": {k: (v.clone() if v is not None else None) for k, v in layer.conv_states.items()},
                    "rec": {k: (v.clone() if v is not None else None) for k, v in layer.recurrent_states.items()},
                    "has_prev": dict(layer.has_previous_state),
                    "conv_init": dict(layer.is_conv_states_initialized),
                    "rec_init": dict(layer.is_recurrent_states_initialized),
                }
            )
        return snap

    def _restore(self, state: TargetState, snap: list) -> None:
        for layer, s in zip(self._linear_layers(state), snap):
            for k, v in s["conv"].items():
                if v is None:
                    layer.conv_states[k] = None
                elif layer.conv_states.get(k) is not None and layer.conv_states[k].shape == v.shape:
                    layer.conv_states[k].copy_(v)
                else:
                    layer.conv_states[k] = v
            for k, v in s["rec"].items():
                if v is None:
                    layer.recurrent_states[k] = None
                elif layer.recurrent_states.get(k) is not None:
                    layer.recurrent_states[k].copy_(v)
                else:
                    layer.recurrent_states[k] = v
            layer.has_previous_state.update(s["has_prev"])
            layer.is_conv_states_initialized.update(s["conv_init"])
            layer.is_recurrent_states_initialized.update(s["rec_init"])

    def _crop_attention(self, state: TargetState, drop: int) -> None:
        for layer in getattr(state.cache, "layers", []):
            if not hasattr(layer, "recurrent_states"):
                layer.crop(-drop)
