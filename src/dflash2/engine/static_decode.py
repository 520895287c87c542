"""Batch-1 decoding over preallocated buffers, replayed as CUDA graphs on the GPU.

On the H200 an eager step is launch-bound (a SmolLM2-135M forward costs ~30 ms of Python and
kernel launches for ~1 ms of GPU work). Here every step reads and writes fixed buffers: the
target's static KV cache (``StaticTarget``), the draft's latent context over all positions
(rows at or past the anchor are masked, so rejected rows need no rollback), and a few device
scalars (anchor, its position). A greedy speculative step is then two graph replays (draft
block + selector walk, then target verify + acceptance) and one read of ``w + 1`` integers;
the plain target is one replay and one read per token, so the side-by-side stays fair. Sampled
steps are graphs too, one pair per verifier and sampling parameters (captured on first use),
with the uniforms drawn on the host in ``speculative_generate``'s order and copied in. Without CUDA (or with
``cuda_graph=False``) the same functions run eagerly: that is what the CPU tests check.
"""
from __future__ import annotations

import gc
import time
import warnings

import torch

from ..model.attention import build_block_mask
from ..target import TargetModel
from ..target.static_llama import StaticTarget, unsupported_reason
from ..verification import SamplingParams, greedy_verify, probs_from_logits
from .speculative import (SAMPLED_VERIFIERS, GenerationResult, check_width, first_token, make_generator,
                          resolve_verify_method, stop_ids)


MAX_SAMPLED_GRAPHS = 8  # sets of sampling parameters whose graphs are kept (oldest dropped first)


class Replay:
    """``fn()`` over static buffers: captured once as a CUDA graph (after two warm-up calls on a
    side stream, as PyTorch requires), or called directly when graphs are off."""

    def __init__(self, fn, use_graph: bool, pool=None):
        self.fn, self.graph = fn, None
        if use_graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            # Python's cyclic GC must not run inside the capture: collecting an earlier engine frees
            # its graphs' memory, which invalidates the capture (seen on the H200 when bench speed
            # built engine after engine). Collect now, pause it while capturing.
            gc.collect()
            gc.disable()
            try:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool):
                    fn()
            finally:
                gc.enable()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def cuda_graphs_apply(target: TargetModel, disable_cuda_graph: bool = False) -> bool:
    """Whether batch-1 decoding of ``target`` runs as CUDA graphs: on CUDA, a supported target,
    graphs not disabled. Says why when a CUDA target cannot have them."""
    if disable_cuda_graph or target.device.type != "cuda":
        return False
    reason = unsupported_reason(target)
    if reason:
        warnings.warn(f"CUDA graphs off: the static forward does not support {reason}")
    return reason is None


def maybe_static_decoder(target: TargetModel, draft, width: int, max_len: int = 2048,
                         disable_cuda_graph: bool = False) -> "StaticDecoder | None":
    """The graphed decoder where :func:`cuda_graphs_apply`, else None (the caller uses
    ``speculative_generate``)."""
    if not cuda_graphs_apply(target, disable_cuda_graph):
        return None
    return StaticDecoder(target, draft, width, min(max_len, int(getattr(target.config, "max_position_embeddings", max_len))))


class StaticDecoder:
    """One request at a time, ``generate`` like :func:`speculative_generate` (same result type).
    ``draft=None``: the target alone. ``max_len`` bounds prompt + new tokens + width."""

    def __init__(self, target: TargetModel, draft=None, width: int = 5, max_len: int = 2048,
                 cuda_graph: bool = True):
        check_width(draft is not None, width)
        self.target, self.draft, self.max_len = target, draft, max_len
        self.w = width if draft is not None else 1
        if draft is not None:
            target.set_layer_ids(draft.config.target_layer_ids)
        self.static = StaticTarget(target, max_len)
        self.check_diff = self.static.check()  # refuse a layout the hand-written forward does not reproduce
        dev = target.device
        self.use_graph = cuda_graph and dev.type == "cuda"
        lng = dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(self.w, **lng)          # the block to verify: [anchor, drafts...]
        self.apos = torch.zeros((), **lng)             # position of the anchor
        self.commit = torch.zeros((), **lng)           # first position of the rows in feats
        self.out = torch.zeros(self.w + 1, **lng)      # the verifier's emitted row, then n accepted
        self.ar = torch.arange(max(self.w, 1), **lng)
        if draft is not None:
            cfg = draft.config
            self.feats = torch.zeros(self.w, cfg.fc_in_features, dtype=target.dtype, device=dev)
            p = next(draft.parameters())
            self.lat = torch.zeros(cfg.num_hidden_layers, 1, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                   dtype=p.dtype, device=dev)
            self.ctx_pos = torch.arange(max_len, **lng)[None]
            self.ctx_valid = torch.ones(1, max_len, dtype=torch.bool, device=dev)  # the mask's k < anchor decides
            k = cfg.selector_top_k
            self.U = torch.zeros(1, self.w - 1, k, dtype=torch.float32, device=dev)
            self.cand = torch.zeros(1, self.w - 1, k, **lng)
            self.hidden = torch.zeros(1, self.w - 1, cfg.hidden_size, dtype=p.dtype, device=dev)
        g = self.w - 1
        self.uniforms = torch.zeros(2 * g + 1, dtype=torch.float32, device=dev)  # propose g | accept g | emit 1
        self.q_draft = torch.zeros(g, target.config.vocab_size, dtype=torch.float32, device=dev)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        with torch.no_grad():
            self.greedy_step = [Replay(f, self.use_graph, self.pool) for f in self._greedy_fns()]
        self.sampled_steps: dict[tuple, list[Replay]] = {}  # per (verifier, sampling parameters), captured on first use

    # ---- the captured functions ---------------------------------------------------------------
    def _greedy_fns(self):
        def verify():
            logits, feats = self.static.forward(self.ids, self.apos)
            self._accept(greedy_verify(self.ids[None, 1:], logits[None]), feats)
        if self.draft is None:
            return [verify]

        def draft():
            self._draft_forward()
            sel = self.draft.candidate_selector.walk(
                (self.U, self.cand), self.hidden, self.ids[:1],
                torch.zeros(1, device=self.U.device), all_greedy=True)
            self.ids[1:].copy_(sel.tokens[0])
        return [draft, verify]

    def _sampled_fns(self, method: str, sp: SamplingParams):
        """Draft + walk, then verify + accept, for one verifier and one set of sampling
        parameters (they are baked into the graph); uniforms come from ``self.uniforms``."""
        g = self.w - 1
        params = (sp.temperature, sp.top_k, sp.top_p, sp.min_p)

        def verify():
            logits, feats = self.static.forward(self.ids, self.apos)
            p_target = probs_from_logits(logits, *params, capturable=True)
            self._accept(SAMPLED_VERIFIERS[method](self.ids[None, 1:], self.q_draft[None], p_target[None], self.uniforms[None, g:2 * g],
                            self.uniforms[2 * g:]), feats)
        if self.draft is None:
            return [verify]

        def draft():
            self._draft_forward()
            temp = torch.full((1,), sp.temperature, device=self.U.device)
            sel = self.draft.candidate_selector.walk(
                (self.U, self.cand), self.hidden, self.ids[:1], temp, self.uniforms[None, :g],
                sp.top_k, sp.top_p, sp.min_p, all_greedy=sp.greedy, capturable=True)
            self.ids[1:].copy_(sel.tokens[0])
            self.q_draft.copy_(sel.dense_q(self.q_draft.shape[-1])[0])
        return [draft, verify]

    def _accept(self, result, feats) -> None:
        """Write the verifier's row and count for the host's one read, and move the anchor to
        the emitted token (rows of ``feats`` past it are masked from the next draft)."""
        n = result.num_accepted[0]
        self.out.copy_(torch.cat([result.tokens[0], n[None]]))
        anchor = result.tokens[0].gather(0, n[None])[0]
        if self.draft is not None:
            self.feats.copy_(feats)
        self.commit.copy_(self.apos)
        self.ids[0].copy_(anchor)
        self.apos.add_(n + 1)

    def _draft_forward(self) -> None:
        """Project the last verify's rows into the latent context (rows past the new anchor are
        rejected or unused: masked now, overwritten when their position is committed), then draft
        the block ``[anchor, MASK...]`` and its candidates."""
        d, w = self.draft, self.w
        rows = self.commit + self.ar
        self.lat[:, 0].index_copy_(1, rows, d.context_rows(self.feats, rows).to(self.lat.dtype))
        q_pos = (self.apos + self.ar)[None]
        mask = build_block_mask(q_pos, self.apos.expand(1, w), torch.zeros_like(q_pos), self.ctx_pos,
                                self.ctx_valid, d.config.sliding_window, d.config.is_causal)
        block = torch.cat([self.ids[:1], torch.full((w - 1,), d.config.mask_token_id, device=q_pos.device)])
        hidden = d(self.target.embed(block[None]), q_pos, self.lat, mask, w)[:, 1:]
        U, cand = d.candidates(hidden, self.target.lm_head_weight)
        self.hidden.copy_(hidden); self.U.copy_(U); self.cand.copy_(cand)

    # ---- the loop -----------------------------------------------------------------------------
    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a request stays inside the buffers (positions up to the last block's end)."""
        return prompt_len + max_new_tokens + self.w <= self.max_len

    @torch.no_grad()
    def generate(self, prompt_ids, sampling: SamplingParams, verify_method: str | None = None) -> GenerationResult:
        method = resolve_verify_method(sampling, verify_method)
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1).to(self.target.device)
        L = prompt.numel()
        if not self.fits(L, sampling.max_new_tokens):
            raise ValueError(f"prompt ({L}) + max_new_tokens ({sampling.max_new_tokens}) + width ({self.w}) "
                             f"exceeds the static decoder's max_len {self.max_len}")
        sampled = method != "greedy"
        key = (method, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        if sampled and key not in self.sampled_steps:  # capture now: the prefill below resets every buffer
            if len(self.sampled_steps) >= MAX_SAMPLED_GRAPHS:  # bound the graphs a long-lived process keeps
                del self.sampled_steps[next(iter(self.sampled_steps))]
            self.apos.zero_(); self.commit.zero_()
            self.sampled_steps[key] = [Replay(f, self.use_graph, self.pool) for f in self._sampled_fns(method, sampling)]
        steps = self.sampled_steps[key] if sampled else self.greedy_step
        gen = make_generator(sampling.seed)
        stops = stop_ids(self.target, sampling)
        g = self.w - 1
        res = GenerationResult([], 0, 0, [0] * self.w)
        t0 = time.perf_counter()
        logits, feats = self.static.forward(prompt, torch.zeros((), dtype=torch.long, device=prompt.device))
        out = [first_token(logits[-1], sampling, gen)]
        if self.draft is not None:
            self.lat[:, 0, :L].copy_(self.draft.context_rows(feats, torch.arange(L, device=prompt.device)))
        self.apos.fill_(L); self.commit.fill_(L); self.ids[0].fill_(out[0])
        res.prefill_s = time.perf_counter() - t0
        while out[-1] not in stops and len(out) < sampling.max_new_tokens:
            if sampled:  # the dynamic loop's draws, in its order: propose g, accept g, emit 1
                u = [torch.rand(g, generator=gen)] if self.draft is not None else []
                u += [torch.rand(1, g, generator=gen).view(-1), torch.rand(1, generator=gen)]
                self.uniforms.copy_(torch.cat(u))
            for step in steps:
                step()
            row = self.out.tolist()  # the one read-back of a step
            n = row[-1]
            new = row[:n + 1]
            res.verify_steps += 1
            res.accept_hist[n] += 1
            for tok in new:
                out.append(tok)
                if tok in stops or len(out) >= sampling.max_new_tokens:
                    break
        res.total_s = time.perf_counter() - t0
        res.token_ids, res.completion_tokens = out, len(out)
        res.finish_reason = "stop" if out[-1] in stops else "length"
        return res

