"""Draft network against references written from the spec's formulas."""

import math

import pytest
import torch

from conftest import tiny_config
from dflash2.config import ConfigError, DFlash2Config, yarn_get_mscale
from dflash2.model import DFlash2DraftModel, build_block_mask
from dflash2.model.checkpoint import parameter_report
from dflash2.model.context_cache import DraftContextCache, append_many, draft_block
from dflash2.model.conv import BlockConv
from dflash2.model.rope import rope_inv_freq


# ---------------------------------------------------------------- reference (float64, loops)
def ref_mask(q_pos, q_anchor, q_seq, q_blk, k_pos, k_seq, k_blk, window, causal):
    """k_blk = -1 marks a context key."""
    m = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
    for i in range(len(q_pos)):
        for j in range(len(k_pos)):
            if k_blk[j] < 0:
                m[i, j] = k_seq[j] == q_seq[i] and k_pos[j] < q_anchor[i] and q_pos[i] - k_pos[j] < window
            else:
                m[i, j] = k_blk[j] == q_blk[i] and (not causal or k_pos[j] <= q_pos[i])
    return m


def rope64(x, pos, cfg):
    inv, msc = rope_inv_freq(cfg)
    out = x.clone()
    for i in range(x.shape[-1] // 2):
        ang = pos * inv[i]
        c, s = math.cos(ang) * msc, math.sin(ang) * msc
        a, b = x[..., 2 * i].clone(), x[..., 2 * i + 1].clone()
        out[..., 2 * i], out[..., 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def rms64(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_attention(attn, cfg, h, q_pos, ctx, ctx_pos, mask):
    """Straight from spec section 2: MLA, keys/values from context rows then block rows."""
    W = {k: v.double() for k, v in attn.state_dict().items()}
    n, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    h, ctx = h.double(), ctx.double()
    q = rms64(h @ W["q_a_proj.weight"].T, W["q_a_layernorm.weight"], cfg.rms_norm_eps) @ W["q_b_proj.weight"].T
    q = q.view(len(h), n, dn + dr)
    ys = torch.cat([ctx, h])
    ps = torch.cat([ctx_pos, q_pos])
    ckv = ys @ W["kv_a_proj_with_mqa.weight"].T
    c, kpe = ckv[:, : cfg.kv_lora_rank], ckv[:, cfg.kv_lora_rank :]
    kv = (rms64(c, W["kv_a_layernorm.weight"], cfg.rms_norm_eps) @ W["kv_b_proj.weight"].T).view(len(ys), n, dn + dv)
    scale = cfg.qk_head_dim**-0.5 * yarn_get_mscale(cfg.rope_scaling["factor"], 1.0) ** 2
    out = torch.zeros(len(h), n, dv, dtype=torch.float64)
    for i in range(len(h)):
        qi_pe = rope64(q[i, :, dn:], float(q_pos[i]), cfg)
        for hd in range(n):
            scores = []
            for j in range(len(ys)):
                kj_pe = rope64(kpe[j], float(ps[j]), cfg)
                s = (q[i, hd, :dn] @ kv[j, hd, :dn] + qi_pe[hd] @ kj_pe) * scale
                scores.append(s if mask[i, j] else -math.inf)
            w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            out[i, hd] = (w[:, None] * kv[:, hd, dn:]).sum(0)
    return out.view(len(h), n * dv) @ W["o_proj.weight"].T


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_float64_reference_packed(seed, causal):
    cfg = tiny_config(is_causal=causal, sliding_window=7)
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    attn = model.layers[0].self_attn
    # two requests packed in one row: request 0 has 9 context rows, request 1 has 12; widths 5
    w = 5
    ctx_pos = torch.cat([torch.arange(9), torch.arange(12)])
    ctx_seq = torch.tensor([0] * 9 + [1] * 12)
    anchors = [9, 6]  # request 1's anchor sits before its last context rows: those must stay hidden
    q_pos = torch.cat([torch.arange(a, a + w) for a in anchors])
    q_anchor = torch.tensor([anchors[0]] * w + [anchors[1]] * w)
    q_seq = torch.tensor([0] * w + [1] * w)
    q_blk = torch.tensor([0] * w + [1] * w)
    h = torch.randn(2 * w, cfg.hidden_size)
    ctx = torch.randn(len(ctx_pos), cfg.hidden_size)
    mask = build_block_mask(
        q_pos[None],
        q_anchor[None],
        q_blk[None],
        ctx_pos[None],
        torch.ones(1, len(ctx_pos), dtype=torch.bool),
        cfg.sliding_window,
        causal,
        q_seq[None],
        ctx_seq[None],
    )[0]
    expect = ref_mask(
        q_pos,
        q_anchor,
        q_seq,
        q_blk,
        torch.cat([ctx_pos, q_pos]),
        torch.cat([ctx_seq, q_seq]),
        torch.cat([torch.full_like(ctx_seq, -1), q_blk]),
        cfg.sliding_window,
        causal,
    )
    assert torch.equal(mask, expect)
    lat = attn.latent(ctx[None], ctx_pos[None])
    got = attn(h[None], q_pos[None], lat, mask[None])[0]
    ref = ref_attention(attn, cfg, h, q_pos, ctx, ctx_pos, mask)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_mask_never_leaks(seed):
    """Perturbing rows a query must not see leaves its output unchanged."""
    cfg = tiny_config(sliding_window=6)
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    w, T, anchor = 5, 14, 10
    feats = torch.randn(1, T, cfg.fc_in_features)
    pos = torch.arange(T)[None]
    blk_pos = torch.arange(anchor, anchor + w)[None]
    emb = torch.randn(1, w, cfg.hidden_size)

    def run(f):
        lat = model.context_latents(model.fuse(f), pos)
        m = build_block_mask(
            blk_pos,
            torch.full_like(blk_pos, anchor),
            torch.zeros_like(blk_pos),
            pos,
            torch.ones_like(pos, dtype=torch.bool),
            cfg.sliding_window,
            cfg.is_causal,
        )
        return model(emb, blk_pos, lat, m, w)

    base = run(feats)
    for k in list(range(anchor, T)) + list(range(0, anchor + w - cfg.sliding_window)):
        f2 = feats.clone()
        f2[0, k] += 5 * torch.randn(cfg.fc_in_features)
        out = run(f2)
        # the last query is the one whose window starts latest; any key it cannot see and that the
        # anchor query cannot see either must change nothing
        visible_to_any = k < anchor and anchor - k < cfg.sliding_window
        if not visible_to_any:
            torch.testing.assert_close(out, base, rtol=0, atol=0)
    f2 = feats.clone()
    f2[0, anchor - 1] += 5.0
    assert not torch.allclose(run(f2), base)  # a visible key does matter


@pytest.mark.parametrize("width", [5, 8])
def test_conv_block_boundaries(seed, width):
    conv = BlockConv(32, kernel_size=3, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    N = 3
    x = torch.randn(1, N * width, 32)
    y, dyn = conv.prepare(x, width)
    # packed equals each block alone
    for b in range(N):
        blk = x[:, b * width : (b + 1) * width]
        yb, _ = conv.prepare(blk, width)
        torch.testing.assert_close(y[:, b * width : (b + 1) * width], yb)
    # explicit formula: slot 0 reads zeros before it, slot 1 reads the anchor (slot 0)
    coef = dyn[0, :, 0].repeat_interleave(4, -1) + conv.base_kernel[0]  # [L, kernel, H]
    for b in range(N):
        for t in range(width):
            row = b * width + t
            expect = sum(coef[row, o] * (x[0, row - o] if t - o >= 0 else 0) for o in range(3))
            torch.testing.assert_close(y[0, row], expect)
    # perturbing block 1 changes nothing in blocks 0 and 2
    x2 = x.clone()
    x2[:, width : 2 * width] += 1.0
    y2, _ = conv.prepare(x2, width)
    torch.testing.assert_close(y2[:, :width], y[:, :width])
    torch.testing.assert_close(y2[:, 2 * width :], y[:, 2 * width :])


def test_conv_identity_init():
    conv = BlockConv(16, 2, 4)
    x = torch.randn(2, 10, 16)
    y, dyn = conv.prepare(x, 5)
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(conv.finish(x * 2, dyn, 5), x * 2)


def test_yarn_frequencies_and_mscale():
    cfg = tiny_config(
        qk_rope_head_dim=16,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    inv, msc = rope_inv_freq(cfg)
    d, base, L, s = 16, 10000.0, 64, 32.0
    corr = lambda r: d * math.log(L / (r * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), d - 1)
    for i in range(d // 2):
        extra = base ** (-2 * i / d)
        inter = extra / s
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        assert inv[i].item() == pytest.approx(inter * ramp + extra * (1 - ramp), rel=1e-12)
    assert msc == pytest.approx(1.0)  # mscale / mscale_all_dim, both 1
    assert cfg.softmax_scale() == pytest.approx((cfg.qk_head_dim**-0.5) * (0.1 * math.log(32) + 1) ** 2)
    plain = tiny_config(rope_scaling=None)
    assert plain.softmax_scale() == pytest.approx(plain.qk_head_dim**-0.5)


def _selector_inputs(cfg, B=3, g=4):
    model = DFlash2DraftModel(cfg).init_weights()
    sel = model.candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 0.5)
        sel.predecessor_codebook.normal_(0, 0.5)
    return (
        sel,
        torch.randn(B, g, cfg.vocab_size) * 2,
        torch.randn(B, g, cfg.hidden_size),
        torch.randint(0, cfg.vocab_size, (B,)),
    )


def test_selector_greedy_is_argmax_path(seed):
    cfg = tiny_config()
    sel, logits, hidden, anchor = _selector_inputs(cfg)
    with torch.no_grad():  # a pair term as large as the unary gaps, so a wrong predecessor changes the path
        sel.successor_codebook.mul_(4)
    out = sel.walk(sel.candidates(logits), hidden, anchor, torch.zeros(3))
    A, Bc = sel.predecessor_codebook.double(), sel.successor_codebook.double()
    proj = sel.hidden_projection(hidden).double()
    for b in range(3):
        prev = int(anchor[b])
        for t in range(4):
            cands = logits[b, t].topk(cfg.selector_top_k).indices.tolist()
            scores = {c: logits[b, t, c].double() + (A[prev] * proj[b, t] * Bc[c]).sum() for c in cands}
            best = max(cands, key=lambda c: (scores[c], -c))
            assert int(out.tokens[b, t]) == best
            prev = best
    assert torch.equal(out.q_draft.max(-1).values, torch.ones(3, 4))


def test_selector_sampled_q_is_softmax_of_pair_scores(seed):
    """Each returned q row is the processed softmax of S_t(prev, .) for the predecessor the walk
    actually took; a temperature-0 row in the same batch stays on its greedy path with one-hot q."""
    from dflash2.sampling import probs_from_logits

    cfg = tiny_config()
    sel, logits, hidden, anchor = _selector_inputs(cfg)
    temp, top_p = torch.tensor([0.8, 0.0, 1.3]), torch.tensor([0.9, 1.0, 1.0])
    out = sel.walk(sel.candidates(logits), hidden, anchor, temp, torch.rand(3, 4), -1, top_p)
    greedy = sel.walk(sel.candidates(logits), hidden, anchor, torch.zeros(3))
    assert torch.equal(out.tokens[1], greedy.tokens[1])
    assert torch.equal(out.q_draft[1], greedy.q_draft[1])
    A, Bc = sel.predecessor_codebook.double(), sel.successor_codebook.double()
    proj = sel.hidden_projection(hidden).double()
    for b in (0, 2):
        prev = int(anchor[b])
        for t in range(4):
            cands = out.cand_ids[b, t]
            S = logits[b, t, cands].double() + (A[prev] * proj[b, t] * Bc[cands]).sum(-1)
            ref = probs_from_logits(S.float(), float(temp[b]), -1, float(top_p[b]))
            assert torch.allclose(out.q_draft[b, t], ref, atol=1e-5), (b, t)
            j = int((cands == out.tokens[b, t]).nonzero()[0, 0])
            assert out.q_draft[b, t, j] > 0  # the chosen token had mass
            prev = int(out.tokens[b, t])
    with pytest.raises(ValueError, match="uniforms"):  # a sampled row without draws would return a q it did not use
        sel.walk(sel.candidates(logits), hidden, anchor, temp)


def test_selector_fresh_init_is_top1(seed):
    cfg = tiny_config()
    sel = DFlash2DraftModel(cfg).init_weights().candidate_selector
    logits = torch.randn(2, 4, cfg.vocab_size)
    out = sel.walk(sel.candidates(logits), torch.randn(2, 4, cfg.hidden_size), torch.tensor([1, 2]), torch.zeros(2))
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_selector_sampling_matches_q_product(seed):
    """Empirical path frequencies vs the product of the returned q_draft rows (chi-square)."""
    from scipy.stats import chisquare

    cfg = tiny_config(vocab_size=10, selector_top_k=3, mask_token_id=9)
    sel, logits, hidden, anchor = _selector_inputs(cfg, B=1, g=2)
    n = 20000
    out = sel.walk(
        sel.candidates(logits.expand(n, -1, -1)),
        hidden.expand(n, -1, -1),
        anchor.expand(n),
        torch.full((n,), 0.8),
        torch.rand(n, 2),
    )
    assert torch.allclose(out.q_draft.sum(-1), torch.ones(n, 2), atol=1e-5)
    # probability of each observed path = q1(x1) * q2(x2 | x1), read from the returned rows
    paths = {}
    for i in range(n):
        key = tuple(out.tokens[i].tolist())
        paths.setdefault(key, [0, None])[0] += 1
        if paths[key][1] is None:
            j1 = (out.cand_ids[i, 0] == key[0]).nonzero()[0, 0]
            j2 = (out.cand_ids[i, 1] == key[1]).nonzero()[0, 0]
            paths[key][1] = float(out.q_draft[i, 0, j1] * out.q_draft[i, 1, j2])
    # every path with mass: also the unseen ones (9 in all)
    total_p = sum(p for _, p in paths.values())
    assert total_p == pytest.approx(1.0, abs=1e-3) or len(paths) < 9
    obs = [c for c, _ in paths.values()]
    exp = [p * n / total_p for _, p in paths.values()]
    assert chisquare(obs, exp).pvalue > 1e-4


@pytest.mark.parametrize("width", [5, 8])
def test_incremental_context_cache_equals_recompute(seed, width):
    cfg = tiny_config(sliding_window=12, is_causal=False)
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm = torch.randn(cfg.vocab_size, cfg.hidden_size)
    T = 40
    feats = torch.randn(T, cfg.fc_in_features)
    cache = DraftContextCache(model)
    committed = 0
    for anchor in [5, 9, 16, 23, 31, 39]:  # grows past the window
        cache.append(model, feats[committed:anchor], committed)
        committed = anchor
        tok = torch.tensor([anchor % cfg.vocab_size])
        inc = draft_block(model, [cache], tok, torch.tensor([anchor]), width, emb, lm)
        fresh = DraftContextCache(model)
        fresh.append(model, feats[:anchor], 0)
        full = draft_block(model, [fresh], tok, torch.tensor([anchor]), width, emb, lm)
        torch.testing.assert_close(inc.logits, full.logits, rtol=1e-4, atol=1e-4)
        assert len(cache) <= cfg.sliding_window
    assert len(cache) < T


def test_batched_draft_equals_single(seed):
    cfg = tiny_config()
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm = torch.randn(cfg.vocab_size, cfg.hidden_size)
    caches = []
    for T in (3, 11):
        c = DraftContextCache(model)
        c.append(model, torch.randn(T, cfg.fc_in_features), 0)
        caches.append(c)
    anchors, pos = torch.tensor([4, 7]), torch.tensor([3, 11])
    both = draft_block(model, caches, anchors, pos, 5, emb, lm)
    for b in range(2):
        one = draft_block(model, [caches[b]], anchors[b : b + 1], pos[b : b + 1], 5, emb, lm)
        torch.testing.assert_close(both.logits[b], one.logits[0], rtol=1e-4, atol=1e-4)


def test_append_many_equals_one_by_one(seed):
    cfg = tiny_config()
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    feats = [torch.randn(n, cfg.fc_in_features) for n in (3, 0, 5)]
    pos = [7, 4, 20]
    one = [DraftContextCache(model) for _ in feats]
    for c, f, p in zip(one, feats, pos):
        c.append(model, f, p)
    many = [DraftContextCache(model) for _ in feats]
    append_many(model, many, feats, pos)
    for a, b in zip(one, many):
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)


def test_published_parameter_count():
    cfg = DFlash2Config.from_file("configs/kimi-k3.1-dflash2-preview.json")
    r = parameter_report(cfg)
    assert r["total"] == 2_784_811_008
    assert r["layers"] == 5 * 478_158_848
    assert r["fc"] == 7168 * 43008
    assert r["selector"] == 256 * 7168 + 2 * 163840 * 256


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("conv_group_size", 5, "conv_group_size"),
        ("target_layer_ids", [1, 1], "target_layer_ids"),
        ("target_layer_ids", [-1], "target_layer_ids"),
        ("target_layer_ids", [7], "num_target_layers"),
        ("sliding_window", 0, "sliding_window"),
        ("selector_top_k", 1000, "selector_top_k"),
        ("block_size", 1, "block_size"),
        ("qk_rope_head_dim", 3, "qk_rope_head_dim"),
    ],
)
def test_config_errors_name_the_key(key, value, needle):
    raw = tiny_config().to_dict()
    if key in raw["dflash_config"]:
        raw["dflash_config"][key] = value
    else:
        raw[key] = value
    with pytest.raises(ConfigError, match=needle):
        DFlash2Config.from_dict(raw)


def test_config_precedence_and_unknown_keys():
    raw = tiny_config().to_dict()
    raw["block_size"] = 3
    raw["dflash_config"]["block_size"] = 8
    raw["some_future_key"] = {"a": 1}
    cfg = DFlash2Config.from_dict(raw)
    assert cfg.block_size == 8 and cfg.extra["some_future_key"] == {"a": 1}
    assert DFlash2Config.from_dict(cfg.to_dict()).extra["some_future_key"] == {"a": 1}
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        DFlash2Config.from_dict(raw)


def test_logits_multiplier_and_softcap(seed):
    cfg = tiny_config(output_multiplier=0.5, final_logit_softcapping=3.0)
    model = DFlash2DraftModel(cfg).init_weights()
    h, W = torch.randn(2, 4, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)
    raw = (h @ W.T) * 0.5
    torch.testing.assert_close(model.compute_logits(h, W), 3.0 * torch.tanh(raw / 3.0), rtol=1e-5, atol=1e-5)
    assert model.compute_logits(h, W).abs().max() < 3.0


def test_context_cache_stays_contiguous(seed):
    cfg = tiny_config()
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    c = DraftContextCache(model)
    c.append(model, torch.randn(4, cfg.fc_in_features), 3)
    assert (c.start, c.end, c.positions.tolist()) == (3, 7, [3, 4, 5, 6])
    with pytest.raises(ValueError, match="must start at 7"):
        c.append(model, torch.randn(2, cfg.fc_in_features), 8)
    c.trim(6 + cfg.sliding_window - 1)  # rows k <= anchor - window go: here 3..5
    assert c.positions.tolist() == [6] and c.start == 6 and c.latents.shape[1] == 1
