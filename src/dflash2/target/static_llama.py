"""A Llama-family target forward over a preallocated KV cache, for CUDA-graph replay.

Hugging Face's forward grows its cache with ``torch.cat`` and builds its mask in Python, so no
two steps have the same memory addresses, and its cache classes change between releases (5.17
on the H200, 5.24 here). This forward reuses the model's own modules (norms, projections,
rotary embedding, MLP, head) and keeps only the attention loop by hand, over a static cache
``[layers, slots, kv_heads, max_len, head_dim]`` written at the query positions (one slot per
request: the batch-1 decoder uses one, the serving engine one per running request). Rolling back is
free: rows past the committed length are hidden by the mask (key index <= query position) and
overwritten by the next step. Dense full-attention Llama / Qwen2 / Qwen3 / Mistral only;
:meth:`StaticTarget.check` compares its logits with Hugging Face's before it is trusted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.layer_ops import add_rms_norm, rope_kv_write, silu_mul
from ..kernels.live_attention import live_attention, use_triton
from .adapter import TargetModel


@dataclass
class Rows:
    """One group of a forward's rows (:meth:`StaticTarget.forward_rows`): ``ids [B, L]``, row ``b``
    from position ``start[b]`` through its pages ``tables[b]``; ``kv_len``, ``last`` and ``slot`` as
    in :meth:`StaticTarget.forward`.

    ``segment [T]``: the group is packed, prompts back to back (``ids [T, 1]``): row ``t`` is one
    token, of prompt ``segment[t]`` at position ``start[t]`` through ``tables[t]``. Every prompt
    starts at position 0 and has all its tokens here, so a token attends to its own prompt's tokens
    up to its position and to nothing in the cache; ``last [R]``: the token rows whose logits come out.
    Why: prompts padded to a shared (rows, length) shape did 1.6x the compute of their tokens at
    64 requests of the 8B shape (docs/benchmarks.md, thirty-fourth session)."""

    ids: torch.Tensor
    start: torch.Tensor
    tables: torch.Tensor
    kv_len: int | None = None
    last: torch.Tensor | None = None
    slot: int = 0
    segment: torch.Tensor | None = None


@dataclass
class _Part:
    """A group prepared for the layers: its tokens are ``s .. e`` of the forward's ``[T, H]``."""

    rows: Rows
    B: int
    L: int
    s: int
    e: int
    pos: torch.Tensor
    mask: torch.Tensor | None  # None: the live kernel
    cos: torch.Tensor
    sin: torch.Tensor
    at: tuple[torch.Tensor, torch.Tensor] | None = None  # packed: each token's (page, offset)


SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ATTENTIONS = ("sdpa", "matmul", "live")
LIVE_MAX_ROWS = 64  # query rows (heads per KV head x tokens) per kernel tile; prefill chunks take SDPA
PAGE_ALIGN = 64  # the live kernel reads keys in tiles of 64: the buffer's length is a multiple


def unsupported_reason(target: TargetModel) -> str | None:
    """Why the static forward cannot serve this target, or None when it can."""
    cfg = target.config
    kind = getattr(cfg, "model_type", "")
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} (static forward: {', '.join(SUPPORTED_TYPES)})"
    if target.is_hybrid:
        return "a hybrid (recurrent) target"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if types != {"full_attention"} or window:
        return "sliding-window layers (a ring-buffer cache cannot roll back rejected tokens)"
    inner = getattr(target.model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "norm"):
        return "no model.rotary_emb / model.norm"
    return None


class StaticTarget:
    """``forward(ids [L], start [] long tensor) -> (logits [L, V] fp32, features [L, K*H])`` with
    ``start`` a device tensor, so one captured graph serves every position; or batched,
    ``ids [B, L]`` and ``start [B]`` over slots ``slot .. slot+B-1``, each row at its own position.

    The cache is a pool of pages ``[layers, pages, kv_heads, page_size, head_dim]`` read through
    block tables ``[B, max_pages]`` (device tensors, so a graph replays whatever pages a row holds).
    Without ``page_size`` each slot is one page of ``max_len`` positions and row ``b`` of slot
    ``s`` reads page ``s`` (the one-slot batch-1 engine: plain views, no gather); with it, the
    pool has ``num_pages`` pages plus one scratch page (:attr:`scratch`) that idle rows write to,
    and the caller passes each row's table."""

    def __init__(
        self,
        target: TargetModel,
        max_len: int,
        slots: int = 1,
        attention: str = "sdpa",
        page_size: int | None = None,
        num_pages: int | None = None,
        fused: bool | None = None,
    ):
        """``fused``: each layer as ten kernels (kernels/layer_ops.py, q|k|v and gate|up as one
        matmul each); default on CUDA where the layout allows it (SiLU MLP, no per-head q/k norm)."""
        reason = unsupported_reason(target)
        if reason:
            raise ValueError(f"static forward does not support {reason}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        self.target, self.max_len, self.attention = target, max_len, attention
        cfg, dev = target.config, target.device
        self.inner = target.model.model
        attn = self.inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        # this rank's heads (tensor_parallel.py); o_proj and down_proj sum the ranks' shares
        ranks = target.tp.size if target.tp is not None else 1
        self.n_heads, self.n_kv = cfg.num_attention_heads // ranks, cfg.num_key_value_heads // ranks
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.slots = slots
        buf_len = -(-max_len // PAGE_ALIGN) * PAGE_ALIGN
        self.paged = page_size is not None
        if page_size is not None:
            if page_size % PAGE_ALIGN:
                raise ValueError(f"page size {page_size} must be a multiple of {PAGE_ALIGN}")
            if not num_pages:
                raise ValueError("a paged static cache needs num_pages")
            self.page_size, self.scratch = page_size, num_pages
            pages = num_pages + 1
        else:
            self.page_size, self.scratch, pages = buf_len, -1, slots
        self.max_pages = -(-buf_len // self.page_size)
        shape = (len(self.inner.layers), pages, self.n_kv, self.page_size, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=target.dtype, device=dev)
        self.v_cache = torch.zeros(shape, dtype=target.dtype, device=dev)
        self.kv_index = torch.arange(buf_len, device=dev)
        # slot mode: slot s is page s; paged: the caller's tables (this one serves check())
        self.block_table = (
            torch.arange(slots, dtype=torch.int32, device=dev)[:, None]
            if not self.paged
            else torch.arange(self.max_pages, dtype=torch.int32, device=dev).clamp_(max=num_pages - 1)[None]
        )
        self.neg = torch.finfo(target.dtype).min
        layer0 = self.inner.layers[0]
        fusable = getattr(cfg, "hidden_act", "silu") == "silu" and not hasattr(attn, "q_norm")
        fusable = fusable and all(hasattr(layer0.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        if fused and not (fusable and use_triton(dev)):
            raise ValueError("fused layers need Triton (CUDA) and a SiLU-MLP layer without q/k norms")
        self.fused = fusable and use_triton(dev) and dev.type == "cuda" if fused is None else fused
        if self.fused:
            self.qkv = [concat_linears(lay.self_attn, ("q_proj", "k_proj", "v_proj")) for lay in self.inner.layers]
            self.gate_up = [concat_linears(lay.mlp, ("gate_proj", "up_proj")) for lay in self.inner.layers]

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        start: torch.Tensor,
        slot: int = 0,
        kv_len: int | None = None,
        tables: torch.Tensor | None = None,
        last: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_len``: attend over the first ``kv_len`` positions only (every query row of interest
        must lie below it; rows are still written at their positions in the full buffer). With
        ``attention="live"`` a decode or verify block reads only each row's live keys, whatever
        ``kv_len``; a longer chunk (prefill) takes the masked SDPA over ``kv_len``. ``tables``:
        each row's pages (default: slots ``slot .. slot+B-1`` of slot mode, or check()'s table; in
        slot mode they must be those slots' pages, which the masked SDPA reads as views). ``last [B]``:
        logits of row ``b``'s token ``last[b]`` only (``[B, 1, V]``: a prefill's LM head over one row,
        not the chunk's)."""
        if ids.dim() == 1:
            t = None if tables is None else tables.view(1, -1)
            logits, feats = self.forward(ids[None], start.view(1), slot, kv_len, t)
            return logits[0], feats[0]
        if tables is None:
            B = ids.shape[0]
            tables = self.block_table[slot : slot + B] if not self.paged else self.block_table.expand(B, -1)
        return self.forward_rows([Rows(ids, start, tables, kv_len, last, slot)])[0]

    @torch.no_grad()
    def forward_rows(self, groups: list[Rows]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`forward` of several groups of rows (say a verify block and a prefill chunk) in one
        pass: every projection, MLP and the LM head run once over all the groups' tokens, only the
        attention runs per group. Why: a small batch's forward is bound by reading the weights (an
        8B target's 16 GB, ~3.8 ms on the H200), so a prefill run beside a verify block shares that
        read instead of paying its own (docs/benchmarks.md, thirty-first session)."""
        parts, xs, s = [], [], 0
        for g in groups:
            B, L = g.ids.shape
            pos = g.start[:, None] + self.kv_index[:L]  # [B, L]
            mask = None  # live: the kernel reads each row's keys 0 .. its position, nothing stale
            at = None
            if g.segment is not None:  # packed: key j visible to token t iff same prompt and j's position <= t's
                seg, p = g.segment, g.start
                seen = (seg[:, None] == seg[None, :]) & (p[None, :] <= p[:, None])
                mask = torch.where(seen, 0.0, self.neg).to(self.target.dtype)[None, None]
                page, off = g.tables.gather(1, pos // self.page_size).long(), pos % self.page_size
                at = (page[:, 0], off[:, 0])
            elif not (self.attention == "live" and L * (self.n_heads // self.n_kv) <= LIVE_MAX_ROWS):
                # additive mask: key j is visible to the query at position p iff j <= p (stale rows are > p)
                kv_index = self.kv_index[: g.kv_len]
                mask = torch.where(kv_index <= pos[..., None], 0.0, self.neg).to(self.target.dtype)[:, None]
            x = self.inner.embed_tokens(g.ids)
            cos, sin = self.inner.rotary_emb(x, pos)
            parts.append(_Part(g, B, L, s, s + B * L, pos, mask, cos, sin, at))
            xs.append(x.reshape(B * L, -1))
            s += B * L
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        h, feats = self._layers_fused(x, parts) if self.fused else self._layers(x, parts)
        # the LM head once, over each group's rows of interest: all of them, or each row's `last`
        heads = [  # (a device arange: an index from the host would be copied in, which a graph capture refuses)
            h[p.s : p.e]
            if p.rows.last is None
            else h[p.s : p.e][p.rows.last]
            if p.at is not None
            else h[p.s : p.e].view(p.B, p.L, -1)[torch.arange(p.B, device=h.device), p.rows.last]
            for p in parts
        ]
        logits = self.target.model.lm_head(heads[0] if len(heads) == 1 else torch.cat(heads)).float()
        out, at = [], 0
        for p, head in zip(parts, heads):
            n = 1 if p.rows.last is not None else p.L
            lg = logits[at : at + head.shape[0]].view(-1, n, logits.shape[-1])
            at += head.shape[0]
            f = feats[p.s : p.e].view(p.B, p.L, -1) if feats is not None else x.new_empty(p.B, p.L, 0)
            out.append((lg, f))
        return out

    def _layers(self, x: torch.Tensor, parts: list[_Part]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers over the groups' tokens ``x [T, H]``: the final norm's output and the
        captured layers' features ``[T, K*H]`` (None without layer ids)."""
        feats = {}
        for i, layer in enumerate(self.inner.layers):
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), parts, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.target.layer_ids:
                feats[i] = x
        return self.inner.norm(x), self._features(feats)

    def _layers_fused(self, x: torch.Tensor, parts: list[_Part]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`_layers`, each residual add fused into the next norm: the residual stream ``res``
        after layer ``i`` comes out of layer ``i + 1``'s input norm (or the final one)."""
        layers = self.inner.layers
        h, res = add_rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.variance_epsilon)
        feats = {}
        for i, layer in enumerate(layers):
            w, b = self.qkv[i]
            qkv = F.linear(h, w, b)
            outs = [
                self._attend(
                    rope_kv_write(
                        qkv[p.s : p.e].view(p.B, p.L, -1),
                        p.cos,
                        p.sin,
                        self.k_cache[i],
                        self.v_cache[i],
                        p.rows.tables,
                        p.rows.start,
                        self.n_heads,
                        self.n_kv,
                    ),
                    p,
                    i,
                )  # fmt: skip
                for p in parts
            ]
            out = layer.self_attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
            norm = layer.post_attention_layernorm
            h, res = add_rms_norm(out, norm.weight, norm.variance_epsilon, res)
            w, b = self.gate_up[i]
            out = layer.mlp.down_proj(silu_mul(F.linear(h, w, b)))
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.inner.norm
            h, res = add_rms_norm(out, norm.weight, norm.variance_epsilon, res)
            if i in self.target.layer_ids:
                feats[i] = res
        return h, self._features(feats)

    def _features(self, feats: dict[int, torch.Tensor]) -> torch.Tensor | None:
        return torch.cat([feats[i] for i in self.target.layer_ids], -1) if feats else None

    def _attention(self, attn, h: torch.Tensor, parts: list[_Part], layer: int) -> torch.Tensor:
        """One layer's attention over the groups' tokens ``h [T, H]`` (normed): projections once,
        then each group's RoPE, cache write (row ``b``'s tokens at its positions, through its table)
        and attention."""
        q_all, k_all, v_all = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        outs = []
        for p in parts:
            q = q_all[p.s : p.e].view(p.B, p.L, self.n_heads, self.head_dim)
            k = k_all[p.s : p.e].view(p.B, p.L, self.n_kv, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), p.cos, p.sin)
            v = v_all[p.s : p.e].view(p.B, p.L, self.n_kv, self.head_dim)
            page, off = p.rows.tables.gather(1, p.pos // self.page_size).long(), p.pos % self.page_size
            self.k_cache[layer, page, :, off] = k.transpose(1, 2)
            self.v_cache[layer, page, :, off] = v
            outs.append(self._attend(q, p, layer))
        return attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _attend(self, q: torch.Tensor, p: _Part, layer: int) -> torch.Tensor:
        """``q [B, H, L, d]`` (rotated; this block's K/V already in the cache) -> ``[B*L, H*d]``, the
        input of ``o_proj``."""
        B, L, tables = p.B, p.L, p.rows.tables
        if p.at is not None:  # packed: its own tokens' K/V, just written, read back as one sequence
            return self._attend_packed(q, p, layer)
        if p.mask is None:  # live
            out = live_attention(q, self.k_cache[layer], self.v_cache[layer], tables, p.rows.start, self.scaling)
            return out.transpose(1, 2).reshape(B * L, self.n_heads * self.head_dim)
        n = p.rows.kv_len or self.kv_index.shape[0]
        if self.paged:  # the row's pages gathered into one sequence
            pages = tables[:, : -(-n // self.page_size)].long()
            k_cache = self.k_cache[layer, pages].transpose(1, 2).flatten(2, 3)[:, :, :n]
            v_cache = self.v_cache[layer, pages].transpose(1, 2).flatten(2, 3)[:, :, :n]
        else:  # slot mode: views of slots slot .. slot+B-1
            slot = p.rows.slot
            k_cache = self.k_cache[layer, slot : slot + B, :, :n]
            v_cache = self.v_cache[layer, slot : slot + B, :, :n]
        if self.attention != "matmul":
            out = F.scaled_dot_product_attention(
                q, k_cache, v_cache, attn_mask=p.mask, scale=self.scaling, enable_gqa=self.n_kv != self.n_heads
            )
        else:
            out = self._grouped_attention(q, k_cache, v_cache, p.mask)
        return out.transpose(1, 2).reshape(B * L, self.n_heads * self.head_dim)

    def _attend_packed(self, q: torch.Tensor, p: _Part, layer: int) -> torch.Tensor:
        """A packed group's attention: ``q [T, H, 1, d]`` over the group's ``T`` keys under its
        segment-causal mask. The KV heads are repeated to the query heads (``[T, H, d]``, a few MB) so
        SDPA takes a masked kernel without ``enable_gqa``."""
        T, g = p.B, self.n_heads // self.n_kv
        page, off = p.at
        k = self.k_cache[layer][page, :, off].repeat_interleave(g, 1).transpose(0, 1)[None]  # [1, H, T, d]
        v = self.v_cache[layer][page, :, off].repeat_interleave(g, 1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 2), k, v, attn_mask=p.mask, scale=self.scaling)
        return out[0].transpose(0, 1).reshape(T, self.n_heads * self.head_dim)

    def _grouped_attention(self, q, k_cache, v_cache, mask):
        """Attention as two batched matmuls, the query heads of each KV head stacked as rows (head
        ``h`` reads KV head ``h // group``, as HF's ``repeat_kv``): no expanded K/V, no choice of
        SDPA backend, scores and softmax in fp32. ``q [B, H, L, d]``, caches ``[B, kv, S, d]``."""
        B, H, L, d = q.shape
        g, S = H // self.n_kv, k_cache.shape[2]
        scores = torch.matmul(q.reshape(B, self.n_kv, g * L, d), k_cache.transpose(-1, -2)).float()
        scores = scores.view(B, self.n_kv, g, L, S) * self.scaling + mask[:, :, None]
        probs = scores.softmax(-1).to(q.dtype).view(B, self.n_kv, g * L, S)
        return torch.matmul(probs, v_cache).view(B, H, L, d)

    @torch.no_grad()
    def check(self, length: int = 12, atol: float | None = None) -> float:
        """Largest logit difference against Hugging Face's forward on ``length`` random tokens: a
        prefill, three wrong rows that are then rolled back, two right rows (the stale third must
        stay hidden) and the last one; raises when over ``atol`` (default: 1e-3 in float32; in half
        precision 10% of the largest logit, where two orders of the same sums differ by rounding: a
        random 8B-shaped target's small logits moved by 4-7% in bf16 on the H200, fused or not, while a
        layout the forward does not reproduce moves them by their own size)."""
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.target.config.vocab_size, (length,), generator=gen).to(self.target.device)
        ref = self.target.model(input_ids=ids[None], use_cache=False).logits[0].float()
        n = length - 3
        start = torch.zeros((), dtype=torch.long, device=self.target.device)
        a, _ = self.forward(ids[:n], start)
        self.forward((ids[n:] + 1) % self.target.config.vocab_size, start + n)  # rejected rows
        b, _ = self.forward(ids[n : n + 2], start + n)
        c, _ = self.forward(ids[n + 2 :], start + n + 2)
        diff = (torch.cat([a, b, c]) - ref).abs().max().item()
        tol = (
            atol if atol is not None else (1e-3 if self.target.dtype == torch.float32 else 0.1 * ref.abs().max().item())
        )
        if not diff <= tol:
            raise RuntimeError(
                f"static forward differs from Hugging Face's by {diff:.3g} (> {tol}): "
                f"{type(self.target.model).__name__} is not the Llama layout it assumes"
            )
        return diff


def concat_linears(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``(weight, bias)`` for the projections ``names`` of ``module`` stacked by output rows, so
    they run as one matmul. The modules' own parameters become views of it: no second copy of the
    weights, Hugging Face's forward unchanged. Done once per module (a second StaticTarget reuses it)."""
    key = "_dflash2_" + "_".join(names)
    done = getattr(module, key, None)
    linears = [getattr(module, n) for n in names]
    if done is not None and done[0].data_ptr() == linears[0].weight.data_ptr():
        return done
    weight = torch.cat([lin.weight.data for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    bias = torch.cat([lin.bias.data for lin in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:  # some with, some without: zeros stand in for the missing ones
        bias = torch.cat(
            [lin.bias.data if lin.bias is not None else weight.new_zeros(lin.out_features) for lin in linears]
        )
    rows = [lin.out_features for lin in linears]
    for lin, w in zip(linears, weight.split(rows)):
        lin.weight.data = w
    if bias is not None:
        for lin, b in zip(linears, bias.split(rows)):
            if lin.bias is not None:
                lin.bias.data = b
    setattr(module, key, (weight, bias))
    return weight, bias
