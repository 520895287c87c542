"""Verifiers as pure functions on small synthetic vocabularies."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dflash2.sampling import CandidateQ, SamplingParams
from dflash2.verification import block_verify, greedy_verify, probs_from_logits, sample_from_probs, token_level_verify
from dflash2.verification.verifiers import _assemble, _first_false, _q_parts

V, G = 4, 2  # vocabulary and drafts per step


def wrong_residual_verify(draft_tokens, q_draft, p_target, accept_uniforms, emit_uniforms):
    """Token-level acceptance with a deliberately wrong residual (samples p instead of max(p-q,0))."""
    B, g = draft_tokens.shape
    x = draft_tokens.unsqueeze(-1)
    px = p_target[:, :g].gather(-1, x).squeeze(-1)
    qx = q_draft.gather(-1, x).squeeze(-1)
    n = _first_false(accept_uniforms * qx < px)
    rows = torch.arange(B)
    return _assemble(draft_tokens, n, sample_from_probs(p_target[rows, n], emit_uniforms))


class ToyLM:
    """Context-dependent toy distributions: row = f(position, previous token)."""

    def __init__(self, seed, sharp):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.softmax(torch.randn(8, V + 1, V, generator=g) * sharp, -1)

    def dist(self, pos, prev):  # prev = V means "no previous token"
        return self.table[pos.clamp(max=7), prev]


def exact_joint(target, n_tokens):
    probs = torch.zeros([V] * n_tokens)
    for idx in torch.cartesian_prod(*[torch.arange(V)] * n_tokens):
        pr, prev = 1.0, V
        for pos, tok in enumerate(idx.tolist()):
            pr *= float(target.table[pos, prev, tok])
            prev = tok
        probs[tuple(idx.tolist())] = pr
    return probs.flatten()


def run_chain(verifier, target, draft, n_rows, n_tokens, gen):
    """Vectorised decode loop over ``n_rows`` independent sequences; returns their first tokens."""
    out = torch.full((n_rows, n_tokens + G + 1), -1, dtype=torch.long)
    length = torch.zeros(n_rows, dtype=torch.long)
    rows = torch.arange(n_rows)
    while bool((length < n_tokens).any()):
        prev = torch.where(length > 0, out[rows, (length - 1).clamp(min=0)], torch.full_like(length, V))
        drafts, qs, ps = [], [], []
        pos, p_prev = length.clone(), prev.clone()
        for i in range(G):
            q = draft.dist(pos, p_prev)
            x = sample_from_probs(q, torch.rand(n_rows, generator=gen))
            ps.append(target.dist(pos, p_prev))
            qs.append(q)
            drafts.append(x)
            pos, p_prev = pos + 1, x
        ps.append(target.dist(pos, p_prev))
        res = verifier(
            torch.stack(drafts, 1),
            torch.stack(qs, 1),
            torch.stack(ps, 1),
            torch.rand(n_rows, G, generator=gen),
            torch.rand(n_rows, generator=gen),
        )
        for j in range(G + 1):
            take = (j <= res.num_accepted) & (length < n_tokens)
            out[rows[take], length[take]] = res.tokens[take, j]
            length = length + take.long()
    return out[:, :n_tokens]


def chi_pvalue(samples, target, n_tokens):
    idx = (samples * torch.tensor([V ** (n_tokens - 1 - i) for i in range(n_tokens)])).sum(1)
    counts = torch.bincount(idx, minlength=V**n_tokens).double()
    expected = exact_joint(target, n_tokens).double() * len(samples)
    keep = expected > 5  # chi-square needs populated bins; pool the rest
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.parametrize("verifier", [token_level_verify, block_verify])
def test_emitted_sequences_follow_target(seed, verifier):
    gen = torch.Generator().manual_seed(seed)
    target, draft = ToyLM(seed, 1.5), ToyLM(seed + 1, 1.5)
    samples = run_chain(verifier, target, draft, 40000, 3, gen)
    assert chi_pvalue(samples, target, 3) > 1e-4


def test_chi_square_catches_wrong_residual(seed):
    gen = torch.Generator().manual_seed(seed)
    target, draft = ToyLM(seed, 1.5), ToyLM(seed + 1, 1.5)
    samples = run_chain(wrong_residual_verify, target, draft, 40000, 3, gen)
    assert chi_pvalue(samples, target, 3) < 1e-6


class TopTwoLM(ToyLM):
    """A draft that proposes from its two likeliest tokens only (as the selector from its candidates)."""

    def dist(self, pos, prev):
        d = super().dist(pos, prev)
        d = torch.zeros_like(d).scatter_(-1, d.topk(2, -1).indices, d.topk(2, -1).values)
        return d / d.sum(-1, keepdim=True)


def as_candidates(verifier):
    """``verifier`` given ``q_draft`` as a :class:`CandidateQ` of each row's two nonzero entries."""

    def run(drafts, q_draft, p_target, u, e):
        top = q_draft.topk(2, -1)
        return verifier(drafts, CandidateQ(top.indices, top.values), p_target, u, e)

    return run


def block_verify_without_off_mass(drafts, q_draft, p_target, u, e):
    """Block verification whose residual mass forgets p's mass off the candidates (a bug to catch)."""
    import dflash2.verification.verifiers as vf

    real = vf._residual_mass
    vf._residual_mass = lambda P, p, ids, q: (P[..., None] * p.gather(-1, ids) - q).clamp_min(0).sum(-1)
    try:
        return vf.block_verify(drafts, q_draft, p_target, u, e)
    finally:
        vf._residual_mass = real


@pytest.mark.parametrize("verifier", [token_level_verify, block_verify])
def test_candidate_q_draft_follows_target(seed, verifier):
    """q_draft as the selector gives it (values at a few ids): the emitted sequences still follow the
    target; a residual mass that forgets p off the candidates does not (the test can fail)."""
    target, draft = ToyLM(seed, 1.5), TopTwoLM(seed + 1, 1.5)
    samples = run_chain(as_candidates(verifier), target, draft, 40000, 3, torch.Generator().manual_seed(seed))
    assert chi_pvalue(samples, target, 3) > 1e-4
    if verifier is block_verify:
        wrong = as_candidates(block_verify_without_off_mass)
        samples = run_chain(wrong, target, draft, 40000, 3, torch.Generator().manual_seed(seed))
        assert chi_pvalue(samples, target, 3) < 1e-6


@pytest.mark.parametrize("verifier", [token_level_verify, block_verify])
@pytest.mark.parametrize("g", [0, 1, 4])
def test_candidate_q_draft_equals_dense(verifier, g):
    """The same draws through a CandidateQ and through its dense rows: the same tokens, row for row,
    with broken rows (NaN, negative) among them."""
    gen = torch.Generator().manual_seed(g)
    B, Vb, k = 512, 40, 5
    logits = torch.randn(B, g + 1, Vb, generator=gen) * 2
    logits[:64] *= 4  # sharp rows, drafted at their argmax below: whole blocks pass
    p = probs_from_logits(logits, 1.0, -1, 0.9)
    score = torch.rand(B, g, Vb, generator=gen)
    score[:64].scatter_(-1, p[:64, :g].argmax(-1, keepdim=True), 2.0)
    ids = score.argsort(-1, descending=True)[..., :k]  # distinct in a row
    vals = torch.softmax(torch.randn(B, g, k, generator=gen) * 2, -1)
    if g:
        vals[3, 0, 1], vals[7, g - 1, 0] = float("nan"), -0.5
    q = CandidateQ(ids, vals)
    drafts = ids.gather(-1, torch.randint(0, k, (B, g, 1), generator=gen)).squeeze(-1)
    drafts[:64] = ids[:64, :, 0]
    u, e = torch.rand(B, g, generator=gen), torch.rand(B, generator=gen)
    sparse, dense = verifier(drafts, q, p, u, e), verifier(drafts, q.dense(Vb), p, u, e)
    assert torch.equal(sparse.num_accepted, dense.num_accepted) and torch.equal(sparse.tokens, dense.tokens)
    if g == 4:
        assert sparse.num_accepted.max() == g and sparse.num_accepted.min() == 0
    assert _q_parts(q)[0] is ids and _q_parts(q.dense(Vb))[0] is None


def test_block_accepts_at_least_token_level(seed):
    gen = torch.Generator().manual_seed(seed)
    B, g = 30000, 4
    p_rows = torch.softmax(torch.randn(1, g + 1, V, generator=gen) * 1.5, -1).expand(B, -1, -1)
    q_rows = torch.softmax(torch.randn(1, g, V, generator=gen) * 1.5, -1).expand(B, -1, -1)
    drafts = torch.stack([sample_from_probs(q_rows[:, i], torch.rand(B, generator=gen)) for i in range(g)], 1)
    u, e = torch.rand(B, g, generator=gen), torch.rand(B, generator=gen)
    tok = token_level_verify(drafts, q_rows, p_rows, u, e).num_accepted.double().mean()
    blk = block_verify(drafts, q_rows, p_rows, u, e).num_accepted.double().mean()
    assert blk >= tok - 0.02, (blk, tok)


def test_greedy_verify_cases():
    logits = torch.tensor([[[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0]]], dtype=torch.float)
    r = greedy_verify(torch.tensor([[1, 2]]), logits)
    assert r.row(0) == [1, 2, 0] and int(r.num_accepted[0]) == 2
    r = greedy_verify(torch.tensor([[1, 3]]), logits)
    assert r.row(0) == [1, 2]
    r = greedy_verify(torch.tensor([[0, 2]]), logits)
    assert r.row(0) == [1] and r.tokens[0].tolist() == [1, -1, -1]


@pytest.mark.parametrize("verifier", [token_level_verify, block_verify])
def test_one_hot_inputs_reduce_to_greedy(seed, verifier):
    B, g, Vb = 64, 4, 11
    logits = torch.randn(B, g + 1, Vb)
    p = probs_from_logits(logits, 0.0)
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(B, g) < 0.7, best[:, :g], torch.randint(0, Vb, (B, g)))
    q = torch.nn.functional.one_hot(drafts, Vb).float()
    got = verifier(drafts, q, p, torch.rand(B, g), torch.rand(B))
    ref = greedy_verify(drafts, logits)
    assert torch.equal(got.tokens, ref.tokens)


def test_logits_processing_semantics():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0), torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_k=2), torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    # top-p keeps the smallest prefix whose mass reaches p: 0.5+0.2 = 0.7 >= 0.6
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_p=0.6), torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    torch.testing.assert_close(
        probs_from_logits(logits, 1.0, top_p=0.7001), torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85
    )
    # min-p: keep tokens with p >= min_p * max_p = 0.25 * 0.5
    torch.testing.assert_close(
        probs_from_logits(logits, 1.0, min_p=0.25), torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85
    )
    # temperature sharpens; temperature 0 is one-hot
    t = probs_from_logits(logits, 0.5)
    torch.testing.assert_close(t, torch.softmax(logits / 0.5, -1))
    assert probs_from_logits(logits, 0.0).tolist() == [[1.0, 0, 0, 0, 0]]
    # per-row parameters
    two = probs_from_logits(logits.expand(2, -1), torch.tensor([0.0, 1.0]), torch.tensor([-1, 2]))
    assert two[0].tolist() == [1.0, 0, 0, 0, 0]
    torch.testing.assert_close(two[1], torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))


def test_sample_from_probs_never_picks_zero_mass(seed):
    p = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0]).expand(1000, -1)
    u = torch.cat([torch.zeros(1), torch.ones(1) - 1e-9, torch.rand(998)])
    s = sample_from_probs(p, u)
    assert set(s.tolist()) <= {1, 3}
    # a last token whose mass does not move the float cdf, the draw at the very top (u = 1): a token with mass
    tiny = torch.tensor([[0.0, 0.5, 0.5, 1e-9, 0.0, 0.0]] * 3)
    assert sample_from_probs(tiny, torch.tensor([1.0, 0.9999999, 0.0])).tolist() == [2, 2, 1]


@pytest.mark.parametrize("fast_top", [2, 4, 16, 1024])
def test_truncation_from_the_top_entries_equals_the_full_sort(monkeypatch, fast_top):
    """probs_from_logits truncates from each row's top entries when that is exact, and sorts the
    rest fully; both must give the full-sort result (ties included: coarse logits)."""
    import dflash2.sampling as lg

    g = torch.Generator().manual_seed(fast_top)
    V = 2048  # with k up to 8: fast_top 2 and 4 run stages of 8, 128 and 1,024, 16 of 16 and 256; then full sorts
    logits = torch.cat([torch.randn(40, V, generator=g) * s for s in (0.3, 1.0, 4.0)])
    logits[:20] = (logits[:20] * 2).round()  # many exact ties
    R = logits.shape[0]
    temp = torch.rand(R, generator=g) + 0.5
    top_k = torch.randint(0, 10, (R,), generator=g) - 1  # -1 / 0 (off) or 1..8: n = max(fast_top, max k)
    top_p = torch.rand(R, generator=g) * 0.9 + 0.1
    min_p = torch.where(torch.rand(R, generator=g) < 0.3, torch.rand(R, generator=g) * 0.2, torch.zeros(R))
    monkeypatch.setattr(lg, "FAST_TOP", 10**9)
    ref = lg.probs_from_logits(logits, temp, top_k, top_p, min_p)
    monkeypatch.setattr(lg, "FAST_TOP", fast_top)
    stages, top_kept, full = [], lg._top_kept, lg.truncate_sorted
    monkeypatch.setattr(lg, "_top_kept", lambda *a: stages.append((a[-1], len(a[0]))) or top_kept(*a))
    monkeypatch.setattr(lg, "truncate_sorted", lambda P, *a: stages.append(("sort", len(P))) or full(P, *a))
    got = lg.probs_from_logits(logits, temp, top_k, top_p, min_p)
    want = {2: [8, 128, 1024, "sort"], 4: [8, 128, 1024, "sort"], 16: [16, 256, "sort"], 1024: [1024, "sort"]}
    assert [n for n, _ in stages] == want[fast_top]  # each stage ran, on fewer rows each time
    assert all(a[1] > b[1] for a, b in zip(stages, stages[1:])) and stages[0][1] == R
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    got3 = lg.probs_from_logits(
        logits.view(3, 40, V), temp.view(3, 40), top_k.view(3, 40), top_p.view(3, 40), min_p.view(3, 40)
    )
    torch.testing.assert_close(got3.view(R, V), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("verify", [token_level_verify, block_verify])
def test_a_block_of_no_drafts_samples_the_target(verify):
    """Width 1 (the planner's "target alone" step): no drafts, the emitted token is a draw from
    ``p_target``'s only row."""
    torch.manual_seed(0)
    B, V = 20000, 6
    p_target = torch.softmax(torch.randn(1, 1, V) * 2, -1).expand(B, 1, V)
    res = verify(torch.empty(B, 0, dtype=torch.long), torch.empty(B, 0, V), p_target, torch.empty(B, 0), torch.rand(B))
    assert (res.num_accepted == 0).all() and res.tokens.shape == (B, 1)
    counts = torch.bincount(res.tokens[:, 0], minlength=V).double()
    expected = p_target[0, 0].double() / p_target[0, 0].double().sum() * B
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4


def test_first_tokens_of_a_batch_equal_one_by_one():
    """Rows with every kind of sampling (greedy, T=1, top-k, top-p, min-p, stop ids barred by
    min_tokens) drawn together give the tokens each draws alone from the same seed."""
    from dflash2.engine.steps import first_token, first_tokens, make_generator

    g = torch.Generator().manual_seed(3)
    V = 3000
    logits = torch.randn(8, V, generator=g) * torch.linspace(0.5, 4, 8)[:, None]
    samplings = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=1.3, top_k=2000, top_p=0.99),
        SamplingParams(temperature=1.0, min_tokens=3),
        SamplingParams(),
    ]
    stops = [None] * 6 + [[int(logits[6].argmax()), 7], [int(logits[7].argmax())]]
    for seed in range(20):
        got = first_tokens(logits, samplings, [make_generator(seed + i) for i in range(8)], stops).tolist()
        one = [first_token(logits[i], s, make_generator(seed + i), stops[i]) for i, s in enumerate(samplings)]
        assert got == one
        assert got[0] == int(logits[0].argmax()) and got[6] not in stops[6] and got[7] != stops[7][0]
        # the sync-free path (CUDA's default: whole-row truncation, no host read but the tokens)
        # keeps the same set and draws the same tokens from the same uniforms
        gens = [make_generator(seed + i) for i in range(8)]
        assert first_tokens(logits, samplings, gens, stops, sync_free=True).tolist() == got


def test_batch_sampling_rows_in_the_draw_order():
    """BatchSampling.of: each request's parameters as a column (float32, top_k int64) and its uniforms
    split in the one draw order (selector's g, verifier's g, the emitted token's); the device as a
    name or a torch.device."""
    from dflash2.engine.steps import BatchSampling

    sps = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1), SamplingParams(temperature=1.0)]
    u = torch.arange(2 * 7, dtype=torch.float32).reshape(2, 7) / 100
    for dev in ("cpu", torch.device("cpu")):
        b = BatchSampling.of(sps, u, dev)
        assert b.temperature.dtype == b.top_p.dtype == b.min_p.dtype == torch.float32 and b.top_k.dtype == torch.long
        assert b.top_k.tolist() == [5, -1] and b.min_p.tolist() == pytest.approx([0.1, 0.0])
        assert (
            torch.equal(b.propose_u, u[:, :3]) and torch.equal(b.accept_u, u[:, 3:6]) and torch.equal(b.emit_u, u[:, 6])
        )


def test_uniform_stream_is_one_rand_call_per_take():
    """steps.Uniforms reads a request's generator through a buffer: whatever the takes' lengths, and
    across refills, the same numbers in the same order as one torch.rand call per take (the draw
    order a seeded request's output depends on)."""
    from dflash2.engine.steps import Uniforms

    lengths = [1, 9, 3, 17, 1, 11, 600, 5] * 40
    for seed in (0, 7):
        gen, stream = torch.Generator().manual_seed(seed), Uniforms(seed, chunk=64)
        for n in lengths:
            want = torch.rand(n, generator=gen)
            got = stream.take(n)
            assert got.dtype == np.float32 and got.shape == (n,)
            assert torch.equal(torch.from_numpy(got.copy()), want)


def test_rows_drawn_ahead_are_the_rows_drawn_at_the_step():
    """steps.draw_ahead (the next step's rows, drawn while the device runs this one) leaves a seeded
    request's draws as drawing them at each step would: the same numbers in the same order, laid out at
    the given width with its parameters first; a finished request is not drawn for; a row drawn ahead
    is read once. BatchSampling.draw at a narrower width reads the first of each kind of draw. A request
    that does not draft draws one uniform a step (the target alone's), laid out at the full width."""
    from types import SimpleNamespace

    from dflash2.engine.steps import BatchSampling, Uniforms, draw_ahead, draw_uniforms

    sp = SamplingParams(temperature=0.7, top_k=9, top_p=0.9, min_p=0.05, seed=3)

    def req(finished=False, speculate=True):
        return SimpleNamespace(sampling=sp, generator=Uniforms(3), drawn=None, finished=finished, speculate=speculate)

    G, ahead, now, ref = 4, req(), req(), Uniforms(3)
    for step in range(5):
        g = (4, 2, 0, 4, 1)[step]
        a, b = BatchSampling.draw([ahead], g, "cpu", G), BatchSampling.draw([now], g, "cpu", G)
        u = torch.from_numpy(draw_uniforms(ref, G).copy())
        for x in (a, b):
            assert x.rows is not None and x.rows.shape == (1, 5 + 2 * G)
            assert torch.equal(x.rows[0, 4:], u), step
            assert torch.equal(x.propose_u[0], u[:g]) and torch.equal(x.accept_u[0], u[G : G + g])
            assert float(x.emit_u[0]) == float(u[2 * G]) and x.top_k.tolist() == [9]
            assert x.temperature.tolist() == pytest.approx([0.7]) and x.min_p.tolist() == pytest.approx([0.05])
        assert ahead.drawn is None  # read once
        draw_ahead([ahead], G)
        assert ahead.drawn is not None
    done = req(finished=True)
    draw_ahead([done], G)
    assert done.drawn is None and done.generator.pos == 0
    plain, ref = [req(speculate=False), req(speculate=False)], Uniforms(3)
    for step in range(3):
        block = draw_ahead(plain[:1], G, "cpu")
        assert block is not None and block[2].shape == (1, 5 + 2 * G)
        a, b = BatchSampling.draw(plain[:1], 0, "cpu", 0, block, G), BatchSampling.draw(plain[1:], 0, "cpu", 0, None, G)
        u = float(ref.take(1)[0])  # the target alone's one draw a step
        for x in (a, b):
            assert x.rows is not None and x.rows.shape == (1, 5 + 2 * G) and float(x.emit_u[0]) == u, step
            assert x.propose_u.shape == (1, 0) and x.top_k.tolist() == [9]
