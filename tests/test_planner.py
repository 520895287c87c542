"""Adaptive speculation: the planner as a pure function of step costs and acceptance, then in the
engine: width 1 skips the draft forward, and output stays the target's (greedy equal, sampled
distribution exact) while the width changes from step to step."""

import random
import warnings

import numpy as np
import pytest
import torch

from targets import VOCAB, build, exact_joint, inside_runner_step, sharp_v8_llama, v8_draft
from test_hardening import _chi2_ok
from test_speculative import hf_greedy, random_draft
from dflash2.engine.engine import EngineConfig, LLMEngine
from dflash2.engine.planner import Planner, PlannerConfig, parse_schedule, parse_widths
from dflash2.engine.request import Request
from dflash2.model import DFlash2DraftModel
from dflash2.sampling import SamplingParams
from dflash2.target import TargetModel

warnings.filterwarnings("ignore")
W = 5


def _planner(full_ms, plain_ms, accepted, steps=20, **kw):
    """A planner that has seen ``steps`` full-width steps of 4 requests, each accepting ``accepted``
    of its 4 drafts, with the two step costs known."""
    p = Planner(W, PlannerConfig(**({"mode": "auto"} | kw)))
    rids = [f"r{i}" for i in range(4)]
    for _ in range(steps):
        p.observe(rids, [accepted] * 4, W, 4, full_ms / 1e3)
    p.costs[(4, 1)] = plain_ms / 1e3
    return p, rids


def test_planner_picks_width_1_when_drafting_cannot_pay():
    p, rids = _planner(full_ms=10.0, plain_ms=4.0, accepted=0)  # ~1 token per step either way
    assert p.choose(rids, 4) == 1
    assert p.expected_tokens(rids, 1) == pytest.approx(4.0)


def test_planner_keeps_the_full_width_when_drafting_pays():
    p, rids = _planner(full_ms=5.0, plain_ms=4.0, accepted=3)
    assert p.choose(rids, 4) == W
    assert p.expected_tokens(rids, W) > 2.5 * p.expected_tokens(rids, 1)


def test_planner_cold_start_probe_and_hysteresis():
    p = Planner(W, PlannerConfig(mode="auto"))
    assert p.choose(["a"], 1) == W  # nothing known: full blocks
    p.observe(["a"], [0], W, 1, 0.010)
    assert p.choose(["a"], 1) == 1  # width 1's cost at this bucket is unknown: tried once
    p.observe(["a"], [0], 1, 1, 0.004)
    for _ in range(10):  # the draft accepts nothing: width 1 from now on ...
        p.observe(["a"], [0], W, 1, 0.010)
    p.current = 1
    assert p.choose(["a"], 1) == 1
    for _ in range(p.cfg.probe_every):
        p.observe(["a"], [0], 1, 1, 0.004)
    assert p.choose(["a"], 1) == W  # ... but one full-width probe every probe_every steps
    # hysteresis: rates within 5% do not switch
    q, rids = _planner(full_ms=10.0, plain_ms=4.0, accepted=1)
    q.costs[(4, W)] = q.costs[(4, 1)] * q.expected_tokens(rids, W) / q.expected_tokens(rids, 1) * 0.97
    q.current = 1
    assert q.choose(rids, 4) == 1
    q.current = W
    assert q.choose(rids, 4) == W
    # a new request starts from the prior of every request's counts (here: low) and a fresh one
    # joins the plan without a history of its own
    low, rids = _planner(full_ms=10.0, plain_ms=4.0, accepted=0)
    assert low.alpha("new") < 0.5 < Planner(W, PlannerConfig(mode="auto")).alpha("new")


@pytest.mark.parametrize("accepted, then", [(0, 1), (1, W)])
def test_an_eager_cold_start_tries_width_2_then_1_and_costs_the_full_width_from_them(accepted, then):
    """Where every width can run (the eager runner), the cold start runs width 2 (it sees the first
    draft's acceptance) and width 1, not a full block; from then on a shape that has not run is priced
    by its tokens (rows x width: a fixed part and a part per token, fitted over what ran), at every
    batch size; drafting goes on only where it pays (``accepted``: the first draft's outcome)."""
    p = Planner(W, PlannerConfig(mode="auto"), widths=tuple(range(1, W + 1)))
    rids = [f"r{i}" for i in range(4)]
    assert p.choose(rids, 4) == 2
    p.observe(rids, [accepted] * 4, 2, 4, 0.006)
    assert p.choose(rids, 4) == 1
    p.observe(rids, [0] * 4, 1, 4, 0.004)
    assert p.cost(4, W) == pytest.approx(0.004 + 0.002 * (W - 1))  # 2 ms + 0.5 ms a token
    assert p.choose(rids, 4) == then
    rows8 = [f"r{i}" for i in range(8)]
    assert p.cost(8, W) == pytest.approx(0.002 + 0.0005 * 8 * W)  # another batch size: by its tokens
    assert p.choose(rows8, 8) != 2  # no second cold start
    p.observe(rows8, [0] * 8, 1, 8, 0.009)  # the fit follows what runs: 8 tokens at 9 ms
    assert p.cost(8, W) == pytest.approx(float(np.polyval(np.polyfit([8, 4, 8], [6, 4, 9], 1), 40)) / 1e3)
    slow = Planner(W, PlannerConfig(mode="auto"), widths=tuple(range(1, W + 1)))
    slow.observe(rids, [0] * 4, 2, 4, 0.006)
    slow.observe(rids, [0] * 4, 1, 4, 0.007)  # noise: one token a row dearer than two
    assert slow.cost(4, W) is None and slow.choose(rids, 4) == 1  # no fit that falls with tokens
    graphs = Planner(W, PlannerConfig(mode="auto"))  # two widths (graphs): full blocks first, as before
    assert graphs.choose(rids, 4) == W


def test_a_position_seldom_reached_is_guessed_from_the_one_before_it():
    """Every request's rate at a draft position that few steps reached leans on the position before it,
    not on the prior: width-2 steps (the eager cold start) that see the first draft pass one time in
    five leave every later position near 0.2 (with the prior's 0.9 there, a full block was priced at
    ~3.8 tokens a row); positions seen often enough keep their own rates."""
    p = Planner(W, PlannerConfig(mode="auto"))
    rids = [f"r{i}" for i in range(5)]
    for _ in range(40):
        p.observe(rids, [1, 0, 0, 0, 0], 2, 8, 0.01)
    rates = p.counts.prior_rates()
    assert rates[0] == pytest.approx(0.2, abs=0.06)
    assert all(abs(r - rates[0]) < 0.05 for r in rates[1:]), rates
    assert p.expected_tokens(rids, W) < 1.3 * len(rids)
    for _ in range(60):  # then full blocks whose drafts pass after the first: later positions high
        p.observe(rids, [0, 4, 0, 4, 0], W, 8, 0.01)
    rates = p.counts.prior_rates()
    assert rates[0] < 0.5 and min(rates[1:]) > 0.9, rates


def test_a_batch_size_that_has_not_run_is_costed_from_the_nearest_ones():
    """Without a profile (the eager runner: every batch size a bucket of its own), a batch size where
    a width has not run reads that width's cost between the nearest sizes where it ran (the nearest
    one outside them), so a new size does not begin with a full-width step and a width-1 step."""
    p, rids = _planner(full_ms=12.0, plain_ms=4.0, accepted=0)  # bucket 4: drafting cannot pay
    for _ in range(3):
        p.observe(["x"] * 8, [0] * 8, W, 8, 0.020)
    p.costs[(8, 1)] = 0.006
    assert p.cost(6, W) == pytest.approx(0.016) and p.cost(6, 1) == pytest.approx(0.005)  # between 4 and 8
    assert p.cost(3, W) == pytest.approx(0.012) and p.cost(16, 1) == pytest.approx(0.006)  # the nearest
    p.current = 1
    for b in (3, 5, 6, 7):  # a wave draining through sizes never seen: width 1, as at the sizes around it
        assert p.choose(rids[: min(b, 4)], b) == 1
    assert p.cost(6, 0) is None  # the target alone never ran anywhere
    p.observe_plain(4, 0.003)
    assert p.cost(6, 0) == pytest.approx(0.003)


def test_a_one_token_step_is_never_priced_above_a_wider_one():
    """Noise cannot price the target alone (or width 1) above a wider step measured at the same batch
    size, and a shape that seldom runs (a probe's) averages its first samples evenly, so one noisy pair
    of steps does not stand for it until many probes have run."""
    p = Planner(8, PlannerConfig(mode="auto"), widths=tuple(range(1, 9)))
    rids = [f"r{i}" for i in range(16)]
    for _ in range(2):  # two width-1 steps of a noisy moment
        p.observe(rids, [0] * 16, 1, 16, 0.427)
    p.observe(rids, [1] * 16, 8, 16, 0.700)
    for _ in range(10):
        p.observe(rids, [1] * 16, 2, 16, 0.248)
    assert p.cost(16, 1) == pytest.approx(0.248)
    p.observe_plain(16, 0.300)
    assert p.cost(16, 0) == pytest.approx(0.248)
    assert p.drafting_gain(16) < 2.0  # (the width-1 pair alone priced drafting at ~2x the target alone)
    p.observe(rids, [0] * 16, 1, 16, 0.200)  # a probe
    assert p.costs[(16, 1)] == pytest.approx((2 * 0.427 + 0.200) / 3)
    for _ in range(20):
        p.observe(rids, [1] * 16, 2, 16, 0.248)
    assert p.costs[(16, 2)] == pytest.approx(0.248)  # many samples: the moving average, as before


def test_planner_picks_a_width_between_when_the_runner_has_them():
    """Eager steps of any width, width 8: cost linear in the width (4 ms at 1, 11 ms at 8) and every
    step accepts its first 2 drafts and rejects the third. Tokens/ms about 0.25 at width 1, 0.5 at 3,
    0.27 at 8: width 3 beats both ends by more than the margin, where the graphs' choice between 1
    and 8 is 8; a width once run is costed by what it measured; a width between that gains less than
    the margin is not taken."""
    p = Planner(8, PlannerConfig(mode="auto"))
    rids = [f"r{i}" for i in range(4)]
    for _ in range(20):
        p.observe(rids, [2] * 4, 8, 4, 0.011)
    p.costs[(4, 1)] = 0.004
    assert p.choose(rids, 4) == 8
    p.widths = tuple(range(1, 9))
    assert p.cost(4, 4) == pytest.approx(7e-3)
    tokens = p.expected_by_width(rids) / 4
    assert tokens[2] == pytest.approx(3, abs=0.05) and tokens[7] < 3.2  # the third draft never passes
    assert p.choose(rids, 4) == 3
    p.observe(rids, [2] * 4, 3, 4, 0.012)  # width 3 measured slow: the measure replaces the estimate
    assert p.cost(4, 3) == pytest.approx(0.012)
    assert p.choose(rids, 4) == 4
    p.cfg.between_margin = 1.0  # 0.43 tokens/ms at width 4 is not 2 x 0.27: back to an end
    assert p.choose(rids, 4) == 8


def test_a_width_between_under_the_margin_is_neither_kept_nor_admitted():
    """Eager widths 1-8 at 4 requests: two of every four rows accept their first draft and none a
    second (0.5, then 0). Width 2 makes 1.5 tokens a row for 1.38x a one-token step (1.09x its rate),
    under the 15% margin a width between must clear over both ends. After a probe runs width 2 the
    next step goes back to width 1 (the hysteresis kept it: 0.86-0.93x of the target alone on the CPU
    at 16 requests, T=1), and a new request is admitted without drafting; the running ones are not
    retired for it (retirement is for good: every width counts there)."""
    p = Planner(8, PlannerConfig(mode="auto"))
    p.widths = tuple(range(1, 9))
    rids = [f"r{i}" for i in range(4)]
    for _ in range(30):
        p.observe(rids, [1, 1, 0, 0], 8, 4, 0.700)
    p.costs[(4, 1)], p.costs[(4, 0)] = 0.200, 0.200
    p.observe(rids, [0] * 4, 1, 4, 0.200)
    p.observe(rids, [1, 0, 1, 0], 2, 4, 0.275)  # the probe
    tokens = p.expected_by_width(rids) / 4
    assert tokens[1] / 0.275 == pytest.approx(1.09 / 0.2, rel=0.03)  # width 2: 1.09x width 1's rate
    assert p.choose(rids, 4) == 1
    assert p.drafting_gain(4, strict=True) < 1 < p.drafting_gain(4) and not p.speculate_new(4, 4)
    p.cfg.between_margin = 0.0  # without the margin width 2 would be kept and admitted
    assert p.choose(rids, 4) == 2 and p.speculate_new(4, 4)


@torch.no_grad()
def _argmax_continuation(t, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(t.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _geometric(rng, rate, most):
    n = 0
    while n < most and rng.random() < rate:
        n += 1
    return n


def test_a_width_between_with_graphs_of_its_own_counts_without_the_margin():
    """CUDA graphs with --speculative-planner-widths 3 at width 5: every step accepts its first draft
    and half its second. Widths 1, 3 and 5 profiled at start-up at 1.0, 1.5 and 2.4 ms: tokens/ms 1.0,
    1.67 and ~1.0, so width 3 wins by far more than the hysteresis; the eager margin for widths priced
    by their tokens (15% over both ends) does not apply to a width whose cost was replayed. A new
    request is admitted drafting for it; without its graphs the planner keeps the full width."""
    p = Planner(W, PlannerConfig(mode="auto", widths=(3,), probe_every=1000))
    assert p.can_pick(3) and not p.can_pick(2)
    p.widths = (1, 3, W)
    p.profile.update({(4, 0): 0.0010, (4, 1): 0.0010, (4, 3): 0.0015, (4, W): 0.0024})
    rids = [f"r{i}" for i in range(4)]
    for i in range(40):
        p.observe(rids, [2 if i % 2 else 1] * 4, W, 4, None)
    tokens = p.expected_by_width(rids) / 4
    assert tokens[2] == pytest.approx(2.5, abs=0.1) and tokens[4] == pytest.approx(2.5, abs=0.1)
    assert p.choose(rids, 4) == 3 and p.speculate_new(4, 4)
    p.cfg.between_margin = 1.0  # a replayed cost: the margin is not its
    assert p.choose(rids, 4) == 3
    q = Planner(W, PlannerConfig(mode="auto", probe_every=1000))  # graphs of 1 and W only
    q.widths, q.profile = (1, W), {k: v for k, v in p.profile.items() if k[1] != 3}
    for i in range(40):
        q.observe(rids, [2 if i % 2 else 1] * 4, W, 4, None)
    assert q.choose(rids, 4) == W and not q.can_pick(3)


def test_planner_widths_are_checked_where_they_are_read(llama):
    assert parse_widths("3", 5) == (3,) and parse_widths("3,2,3", 5) == (2, 3) and parse_widths(None, 5) == ()
    for bad, why in (("1", "between 1 and"), ("5", "between 1 and"), ("two", "not a list")):
        with pytest.raises(ValueError, match=why):
            parse_widths(bad, 5)
    with pytest.raises(ValueError, match="needs --speculative-planner auto"):
        EngineConfig(num_draft_tokens=5, speculative_planner_widths="3")
    with pytest.raises(ValueError, match="no --speculative-width-schedule"):
        EngineConfig(
            num_draft_tokens=5, speculative_planner="auto", speculative_planner_widths="3",
            speculative_width_schedule="8:5",
        )  # fmt: skip
    with pytest.raises(ValueError, match="between 1 and the full width 5"):
        EngineConfig(num_draft_tokens=5, speculative_planner="auto", speculative_planner_widths="6")
    t, d = llama
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=2, num_draft_tokens=5, context_length=64, runner="static",
            speculative_planner="auto", speculative_planner_widths="3",
        ),
    )  # fmt: skip
    assert eng.runner.verify_widths == (1, 3, 5) and eng.planner.widths == (1, 3, 5)
    # another planner over the same graphs sees the widths an engine built with its flags would have
    auto, off = eng.planner_for("auto"), eng.planner_for("off")
    assert (auto.adapts, auto.widths, off.adapts, off.widths) == (True, (1, 5), False, (5,))
    assert eng.planner_for("auto", "3").widths == (1, 3, 5)
    with pytest.raises(ValueError, match=r"no verify graphs at width\(s\) \[2\]"):
        eng.planner_for("auto", "2,3")


def test_planners_swapped_into_one_engine_keep_greedy_output(llama):
    """The benchmarks' shared engine (engine_speed's ``SharedEngines``): the fixed width, the planner
    and the planner with a width between, swapped into one engine built with the union of their
    graphs, each run as it would on an engine of its own (widths it may pick, output = target)."""
    t, d = llama
    cfg = EngineConfig(
        max_running_requests=3, num_draft_tokens=W, context_length=128, runner="static",
        speculative_planner="auto", speculative_planner_widths="3",
    )  # fmt: skip
    eng = LLMEngine(t, d, cfg)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(3, 12, (), generator=g)),), generator=g) for _ in range(3)]
    for mode, between, allowed in (("off", None, {W}), ("auto", None, {1, W}), ("auto", "3", {1, 3, W})):
        eng.use_planner(eng.planner_for(mode, between))
        eng.stats = eng._new_stats()
        reqs = [Request(p.tolist(), SamplingParams(max_new_tokens=20)) for p in prompts]
        for r in reqs:
            eng.add_request(r)
        eng.run_until_done()
        assert set(eng.stats.steps_by_width) <= allowed, (mode, eng.stats.steps_by_width)
        for p, r in zip(prompts, reqs):
            assert r.output_ids == hf_greedy(t, p, 20)


def test_acceptance_is_estimated_per_position():
    """Drafts that pass in streaks (all or nothing) against drafts that pass independently at the same
    first-draft rate: the per-position estimate expects more tokens from the streaks at the full width,
    a one-rate (geometric) estimate could not tell them apart; a forgotten request's row starts again
    from the prior."""
    streaky, independent = Planner(W, PlannerConfig(mode="auto")), Planner(W, PlannerConfig(mode="auto"))
    rng, rids = random.Random(0), [f"r{i}" for i in range(16)]
    for _ in range(100):
        streaky.observe(rids, [rng.choice([0, W - 1]) for _ in rids], W, 16, 0.01)
        independent.observe(rids, [_geometric(rng, 0.5, W - 1) for _ in rids], W, 16, 0.01)
    a_s, a_i = (sum(p.alpha(r) for r in rids) / 16 for p in (streaky, independent))
    assert a_s == pytest.approx(0.5, abs=0.1) and a_i == pytest.approx(0.5, abs=0.1)
    e_s, e_i = (p.expected_tokens(rids, W) / 16 for p in (streaky, independent))  # truth: 3.0 and 1.94
    assert e_s == pytest.approx(3.0, abs=0.3) and e_i == pytest.approx(1.94, abs=0.2)
    rows = len(independent.counts.free)
    independent.forget("r0")  # (its row is freed at the next fold: while the device runs the next step)
    assert len(independent.counts.free) == rows
    # the engine's order: the step's commit forgets, then its own observation (on the critical path) frees nothing
    independent.observe(rids[1:], [1] * 15, W, 16, 0.01, defer=True)
    assert len(independent.counts.free) == rows and independent._gone == ["r0"]
    independent.fold()
    assert len(independent.counts.free) == rows + 1 and not independent._gone
    for i in range(300):  # no step folds (say, requests that end at their first token): still bounded
        independent.forget(f"gone{i}")
    assert len(independent._gone) < 256
    assert independent.alpha("r0") == pytest.approx(independent.prior_alpha())


def test_planner_off_and_schedule():
    p, rids = _planner(full_ms=10.0, plain_ms=4.0, accepted=0, mode="off")
    assert p.choose(rids, 4) == W
    sched = parse_schedule("16:5,4:5,64:1", W)
    assert sched == ((4, 5), (16, 5), (64, 1))
    p = Planner(W, PlannerConfig(schedule=sched))  # a schedule applies with the planner off too
    assert [p.choose(["r"] * n, n) for n in (1, 4, 5, 16, 17, 64, 65)] == [5, 5, 5, 5, 1, 1, 1]
    for bad in ("16:3", "x:5", "0:5"):
        with pytest.raises(ValueError, match="width-schedule"):
            parse_schedule(bad, W)
    with pytest.raises(ValueError, match="speculative-planner"):
        EngineConfig(speculative_planner="sometimes")


class RandomWidths(Planner):
    """Any width the runner can run, at random each step (seeded): the hardest case for losslessness."""

    rng = random.Random(0)

    def choose(self, rids, bucket):
        return self.rng.choice(self.widths or (1, self.width))


@pytest.fixture(scope="module")
def llama():
    t = TargetModel(build("llama", seed=3), layer_ids=[0, 2])
    return t, random_draft(t, 3).draft


def _count_draft_forwards(monkeypatch) -> dict:
    """``{"n": draft forwards since}``, counted through the draft model's forward."""
    calls = {"n": 0}
    real = DFlash2DraftModel.forward

    def counted(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(DFlash2DraftModel, "forward", counted)
    return calls


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_width_1_runs_no_draft_forward(llama, runner, monkeypatch):
    """Injected costs where drafting cannot pay: after the cold start the planner picks width 1 and
    the draft forward is not called again."""
    t, d = llama
    calls = _count_draft_forwards(monkeypatch)
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=4, num_draft_tokens=W, context_length=128, runner=runner, speculative_planner="auto"
        ),
    )
    eng.planner.cfg = PlannerConfig(mode="auto", cost_decay=0.999, probe_every=1000)
    for B in (1, 2, 3, 4):  # a draft accepting nothing (random weights) and a full step 3x a plain one
        eng.planner.costs[(B, W)], eng.planner.costs[(B, 1)] = 0.030, 0.010
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    reqs = [Request(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    by_width = eng.stats.steps_by_width
    drafted = sum(n for w, n in by_width.items() if w > 1)
    assert by_width.get(1, 0) > 5 * drafted > 0, by_width
    assert calls["n"] == drafted  # one draft forward per drafting step, none at width 1
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, torch.tensor(p), 40)
    assert all(1 <= r.mean_width < W for r in reqs if r.verify_steps)  # /generate's spec_mean_width


@pytest.mark.parametrize(
    "runner, between, mixed", [("paged", None, False), ("static", None, False), ("static", "2,3", True)]
)
def test_greedy_equals_target_while_widths_change(llama, runner, between, mixed):
    """``between``: --speculative-planner-widths, verify widths between 1 and W with step graphs of
    their own (the draft builds its full block; the verify reads its first drafts), new prompts run
    inside steps of every width (--enable-mixed-chunk)."""
    t, d = llama
    # (planner auto: the static runner makes its width-1 graphs, which the random widths then use)
    cfg = EngineConfig(
        max_running_requests=3, num_draft_tokens=W, context_length=128, runner=runner, speculative_planner="auto",
        speculative_planner_widths=between, enable_mixed_chunk=mixed or None, page_size=8 if mixed else 16,
    )  # fmt: skip
    eng = LLMEngine(t, d, cfg)
    eng.planner = RandomWidths(W, widths=eng.runner.widths if runner == "paged" or between else ())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(3, 15, (), generator=g)),), generator=g) for _ in range(6)]
    reqs = [Request(p.tolist(), SamplingParams(max_new_tokens=25 + 5 * i)) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    # the paged runner runs every width (the planner's choices in between too), the graphs 1, W and those asked for
    static = {1, W} | ({2, 3} if between else set())
    assert set(eng.stats.steps_by_width) == (static if runner == "static" else set(range(1, W + 1)))
    if between:
        assert {k[4] for k in eng.runner.graphs if k[0] == "verify"} == {1, 2, 3, W}
    if mixed:
        assert eng.stats.prompts_mixed > 0
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)


def test_drafts_after_any_widths_are_the_drafts_of_the_committed_text(llama):
    """What the draft proposes at a step does not depend on the widths run before it: after random widths
    (1 or W) in the graph runner, each drafting step's drafts are those a fresh draft context over the
    committed text proposes at that anchor (the reference loop's proposer). Why: a width-1 step must
    write its position's draft latents as a drafting step does; a gap there keeps output lossless (the
    target verifies) but lowers acceptance after every change of width, which no other test sees."""
    from dflash2.engine.proposers import DFlashProposer

    t, d = llama
    cfg = EngineConfig(
        max_running_requests=3, num_draft_tokens=W, context_length=128, runner="static", speculative_planner="auto"
    )
    eng = LLMEngine(t, d, cfg)
    eng.planner = RandomWidths(W)
    seen: list[tuple[Request, int, list[int] | None]] = []  # (request, anchor position, its drafts; None: width 1)
    real = eng.runner.step

    def step(reqs, sampling, width=None, **kw):
        at = [(r, r.num_committed, r.slot) for r in reqs]
        out = real(reqs, sampling, width, **kw)
        seen.extend((r, p, eng.runner.ids[s, 1:W].tolist() if (width or W) > 1 else None) for r, p, s in at)
        return out

    eng.runner.step = step
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(3, 15, (), generator=g)),), generator=g) for _ in range(4)]
    reqs = [Request(p.tolist(), SamplingParams(max_new_tokens=30)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert set(eng.stats.steps_by_width) == {1, W}
    ref = DFlashProposer(d, t.embed, t.lm_head_weight)
    drafting = after_one = 0  # drafting steps; those whose request ran width 1 just before
    last: dict[str, bool] = {}  # each request's last step: width 1?
    for r, p, drafts in seen:
        if drafts is not None:
            text = r.prompt_ids + r.output_ids
            _, feats = t.forward(t.new_state(), torch.tensor(text[:p]))
            ref.begin(feats)
            want, _ = ref.propose(text[p], p, W - 1, r.sampling, torch.zeros(W - 1))
            assert drafts == want.tolist(), (r.request_id, p, last.get(r.request_id))
            drafting, after_one = drafting + 1, after_one + last.get(r.request_id, False)
        last[r.request_id] = drafts is None
    assert drafting > 20 and after_one > 5, (drafting, after_one)


def test_sampled_truncated_requests_run_at_every_width(llama):
    """Top-p / top-k requests through the paged runner at every width 1-W (width 2: a selector walk
    with one draft, whose later-slot scores are empty): every request finishes, none fails."""
    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=4, num_draft_tokens=W, context_length=128, runner="paged"))
    eng.planner = RandomWidths(W, widths=eng.runner.widths)
    reqs = [
        Request(
            [3, 4, 5 + i],
            SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_new_tokens=30, seed=i, ignore_eos=True),
        )
        for i in range(4)
    ]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert [r.finish_reason for r in reqs] == ["length"] * 4, [r.error for r in reqs]
    assert set(eng.stats.steps_by_width) == set(range(1, W + 1))


@pytest.mark.parametrize("method, runner", [("token", "paged"), ("block", "paged"), ("block", "static")])
def test_sampled_distribution_exact_while_widths_change(method, runner):
    """The first three sampled tokens follow the target's exact joint distribution (enumerated)
    while every step's width is any of 1 .. the full one at random (block verification included; the
    static runner's with --speculative-planner-widths 2,3: step graphs of every width)."""
    V = 8
    model = sharp_v8_llama(3)
    t, d = TargetModel(model, layer_ids=[0]), v8_draft(std=0.3)
    prompt = [1, 2, 3]
    joint = exact_joint(model, prompt, 3)
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=64,
            num_draft_tokens=4,
            context_length=64,
            block_verification=method == "block",
            max_total_tokens=64 * 16,
            page_size=8,
            runner=runner,
            speculative_planner="auto" if runner == "static" else "off",
            speculative_planner_widths="2,3" if runner == "static" else None,
        ),
    )
    eng.planner = RandomWidths(4, widths=eng.planner.widths)
    triples = _first_three_sampled(eng, prompt, V)
    assert set(eng.stats.steps_by_width) == {1, 2, 3, 4} and eng.stats.accepted_by_position[0] > 0
    assert _chi2_ok(triples, joint)


def _first_three_sampled(eng: LLMEngine, prompt: list[int], V: int, n: int = 4000) -> torch.Tensor:
    """``n`` seeded T=1 requests of three tokens through ``eng``: each one's tokens as one index < V**3."""
    reqs = [
        Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s, ignore_eos=True)) for s in range(n)
    ]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert all(r.finish_reason == "length" for r in reqs), {r.error for r in reqs}
    return torch.tensor([(r.output_ids[0] * V + r.output_ids[1]) * V + r.output_ids[2] for r in reqs])


def test_metrics_and_meta_show_the_widths(llama):
    from dflash2.server.metrics import render_metrics

    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=2, num_draft_tokens=W, context_length=128))
    eng.planner = RandomWidths(W)
    r = eng.add_request(Request([5, 6, 7, 8], SamplingParams(max_new_tokens=30, ignore_eos=True)))
    eng.run_until_done()
    text = render_metrics(eng)
    steps = {w: n for w, n in eng.stats.steps_by_width.items()}
    for w, n in steps.items():
        assert f'dflash2_spec_steps_by_width_total{{width="{w}"}} {float(n)}' in text
    mean = sum(w * n for w, n in steps.items()) / sum(steps.values())
    assert f"dflash2_spec_mean_width {mean}" in text and r.mean_width == pytest.approx(mean)
    assert "dflash2_spec_planner_alpha" in text and "dflash2_spec_observed_accept_rate" in text


def test_step_cost_table_profiles_every_bucket_and_width(llama):
    """``bench speed --breakdown``: the planner's start-up profile, one row per batch bucket."""
    from dflash2.benchmark.engine_speed import step_cost_table

    t, d = llama
    table = step_cost_table(t, d, W, 4, context_length=64).splitlines()
    assert table[0].startswith("weight-read floor: target ") and "TB/s copy bandwidth" in table[0]
    assert table[1].split()[:4] == ["bucket", f"w={W}", "ms", "w=1"]
    rows = [line.split() for line in table[2:]]
    assert [int(r[0]) for r in rows] == [1, 2, 4]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    # the floor columns are the step times over (weight bytes / bandwidth): far above 1 for a tiny model
    assert all(float(r[4]) > 1 and float(r[5]) > 1 for r in rows)


def test_bench_speed_breakdown_profiles_the_runner_it_asks_for(llama, monkeypatch, capsys):
    """The CLI's options reach the runner by name: CUDA graphs unless --disable-cuda-graph, the
    attention backend asked for, 1,024 positions of context."""
    import dflash2.engine.graph_runner as gr
    from dflash2.benchmark.cli import cmd_speed
    from dflash2.cli import build_parser

    t, d = llama
    seen: list[dict] = []

    class Recorded(gr.GraphModelRunner):
        def __init__(self, *a, **kw):
            seen.append({"max_len": a[4], **kw})
            super().__init__(*a, **kw)

    monkeypatch.setattr(gr, "GraphModelRunner", Recorded)
    monkeypatch.setattr("dflash2.entry.load_models", lambda args: (t, d, W))
    args = build_parser().parse_args(["bench", "speed", "--breakdown", "--concurrency", "2"])
    assert cmd_speed(args) == 0 and "bucket" in capsys.readouterr().out
    assert seen[-1]["cuda_graph"] is True and seen[-1]["attention"] is None  # (auto: the runner picks)
    assert seen[-1]["max_len"] == 1024 + W + 1
    args = build_parser().parse_args(["bench", "speed", "--breakdown", "--disable-cuda-graph"])
    args.attention_backend = "torch_native"
    assert cmd_speed(args) == 0 and seen[-1]["cuda_graph"] is False and seen[-1]["attention"] == "sdpa"


def test_speculate_new_requests_only_where_drafting_pays():
    """At admission: with the planner off, always; auto with nothing measured, yes (cold start); auto
    where the full width's expected tokens/s cannot beat the target alone's (width 0, else 1), no; a
    pinned schedule by its width at that many running requests."""
    p = Planner(W, PlannerConfig(mode="auto"))
    assert p.speculate_new(4, 4)  # cold start
    p.costs[(4, W)], p.costs[(4, 1)] = 0.050, 0.010  # prior 0.9: 4.1 tokens in 50 ms against 1 in 10
    assert not p.speculate_new(4, 4)
    p.costs[(4, W)] = 0.030  # 4.1 in 30 ms: drafting pays
    assert p.speculate_new(4, 4)
    p.costs[(4, W)] = 0.041 / 1.02  # pays by 2%: drafting goes on (to break-even)
    assert p.speculate_new(4, 4)
    p.costs[(4, W)] = 0.041 / 0.98
    assert not p.speculate_new(4, 4)
    p.costs[(4, W)] = 0.041 / 1.02  # from not drafting, within the hysteresis: the target alone
    assert not p.speculate_new(4, 4) and p.drafting_gain(4) > 1
    p.costs[(4, W)] = 0.030
    p.observe_plain(4, 0.005)  # the target alone measured cheaper than a drafting request's width 1
    assert p.speculate_new(4, 4) is False  # a Python bool: it reaches /generate's JSON meta
    # a turn of admission, each way, is kept once (not every admission) with what priced it
    kept = [(d["decision"], d["gain"], d["full"], d["plain"]) for d in p.state()["decisions"]]
    assert kept == [
        ("admit drafting", None, [None, "derived"], [None, "derived"]),  # the cold start: nothing priced yet
        ("admit not drafting", pytest.approx(0.82, abs=0.01), [50.0, "given"], [10.0, "given"]),
        ("admit drafting", pytest.approx(1.37, abs=0.01), [30.0, "given"], [10.0, "given"]),
        ("admit not drafting", pytest.approx(0.98, abs=0.01), [41.837, "given"], [10.0, "given"]),
    ]  # (the last answer, not drafting again with width 0 measured, is no turn)
    p.costs[(4, W)] = 0.010
    assert p.speculate_new(4, 4) and p.state()["decisions"][-1]["plain"] == [5.0, 1]  # one step measured
    assert Planner(W, PlannerConfig(mode="off")).speculate_new(64, 64) and not Planner(1).speculate_new(1, 1)
    sched = Planner(W, PlannerConfig(schedule=parse_schedule("8:5", W)))
    assert sched.speculate_new(8, 8) and not sched.speculate_new(9, 12)


@pytest.mark.parametrize("slow", [0.98, 0.8])
def test_admission_and_retirement_read_the_slow_cost_not_the_last_steps(slow):
    """A step's cost grows with its requests' contexts, and a wave finishing runs its dearest steps just
    before the next admission: the lifetime decisions read the slow average (``decision_cost_decay``),
    the per-step width the fast one. Here 100 full-width steps at 20 ms, then the wave's last 10 at
    32 ms; the requests accept 1.8 of 4 drafts on average (2.8 tokens a step against 1 in 10 ms): 1.4x
    the target alone over the wave, 0.9x at its end. With the slow average as fast as the step's
    (0.8, the rule before), the next admission does not draft and the batch retires."""
    p = Planner(W, PlannerConfig(mode="auto", probe_every=4, retire_every=2, decision_cost_decay=slow))
    rids = [f"r{i}" for i in range(4)]
    p.costs[(4, 1)] = 0.010  # (given: the target alone's step)
    rng = np.random.default_rng(0)
    for k in range(110):
        p.observe(rids, rng.binomial(4, 0.45, 4).tolist(), W, 4, 0.020 if k < 100 else 0.032)
        p.fold()
    assert p.cost(4, W) > 0.030  # the fast average: the wave's end
    assert p.cost(4, W, lifetime=True) < 0.023 if slow == 0.98 else p.cost(4, W, lifetime=True) > 0.030
    gain = p.drafting_gain(4)
    assert p.speculate_new(4, 4) == (slow == 0.98) and (gain > 1.2 if slow == 0.98 else gain < 1.05)
    assert p.retire(4, rids) == (slow == 0.8)  # (priced on their own rates: 0.91)
    assert p.state()["decision_cost_ms"]["4x5"] == pytest.approx(1e3 * p.cost(4, W, lifetime=True), abs=1e-3)


def test_retire_only_after_costs_are_measured_and_drafting_cannot_pay():
    """Drafting requests stop for good only in auto, after probe_every steps, where the best drafting
    width falls short of the target alone; never while it pays (each check on its own: no average)."""
    p = Planner(W, PlannerConfig(mode="auto", probe_every=4, retire_every=2, retire_smoothing=0))
    p.costs[(4, W)], p.costs[(4, 1)] = 0.050, 0.010  # prior 0.9: 4.1 tokens in 50 ms against 1 in 10
    assert not p.retire(4)  # no steps yet
    for _ in range(4):
        p.observe(["a"], [0], 1, 4, 0.010)
    assert p.retire(4)
    p.observe(["a"], [0], 1, 4, 0.010)
    assert not p.retire(4)  # checked every retire_every steps only (host work), ...
    p.observe(["a"], [0], 1, 4, 0.010)
    assert p.retire(4)  # ... and then again
    p.costs[(4, W)] = 0.030  # 4.1 in 30 ms: drafting pays
    assert not p.retire(4)
    p.costs[(4, W)] = 0.041 / 1.02  # 2% over break-even: keep drafting
    assert not p.retire(4)
    p.costs[(4, W)] = 0.041 / 0.98  # 2% under: stop (for good, so no hysteresis)
    assert p.retire(4)
    # each stop is kept with what priced it (the state's "decisions")
    retired = [d for d in p.state()["decisions"] if d["decision"] == "retire"]
    assert len(retired) == 3 and retired[-1]["bucket"] == 4 and retired[-1]["gain"] == pytest.approx(0.98, abs=0.01)
    assert retired[-1]["full"][0] == pytest.approx(41 / 0.98, abs=0.01) and retired[-1]["plain"][0] == 10.0
    # with the step times measured last, oldest first (6 here; at most 16)
    assert retired[-1]["recent_ms"] == [["4x1", 10.0]] * 6
    for k in range(20):
        p.observe(["a"], [0], W, 4, 0.001 * k)
    p.costs[(4, W)] = 0.041 / 0.98
    p.steps += p.steps % 2
    assert p.retire(4)
    recent = p.state()["decisions"][-1]["recent_ms"]
    assert len(recent) == 16 and recent[-1] == [f"4x{W}", 19.0] and recent[0] == [f"4x{W}", 4.0]
    off = Planner(W, PlannerConfig(mode="off", probe_every=4))
    off.costs = dict(p.costs)
    off.steps = 10
    assert not off.retire(4)
    # eager (every width runs; acceptance seen from the cold start's width 2): from retire_every steps
    eager = Planner(W, PlannerConfig(mode="auto", probe_every=32, retire_every=2), widths=tuple(range(1, W + 1)))
    for w in (2, 1):
        eager.observe(["a"], [0], w, 4, 0.010 * w)
    assert eager.retire(4)  # (no start-up replays to misprice the one-token step: no wait for it)
    graphs = Planner(W, PlannerConfig(mode="auto", probe_every=32, retire_every=2))
    for w in (W, 1):
        graphs.observe(["a"], [0], w, 4, 0.010 * w)
    assert not graphs.retire(4)


def test_retirement_reads_the_batch_gain_averaged_over_its_checks():
    """A batch stops drafting for good on its gain averaged over its retirement checks (``retire_smoothing``
    0.9): one low reading among good ones does not stop it, a run of them does; a batch of new requests
    starts the average afresh; one request's batch is not averaged (its stop ends with it)."""
    p = Planner(W, PlannerConfig(mode="auto", probe_every=2, retire_every=2))
    p.costs[(4, 1)], p.costs[(1, 1)] = 0.010, 0.010  # the one-token step; prior 0.9: 4.0951 tokens a full step

    def check(bucket: int, gain: float, rids: list[str]) -> bool:
        p.costs[(bucket, W)] = 0.040951 / gain  # the full width's cost that prices drafting at ``gain``
        assert p.drafting_gain(bucket, rids=rids) == pytest.approx(gain, rel=1e-4)
        p.steps += 2
        return p.retire(bucket, rids)

    batch = ["a", "b", "c", "d"]
    assert not any(check(4, 1.07, batch) for _ in range(5))
    assert not check(4, 0.97, batch)  # one low reading: 1.06 on average
    assert [check(4, 0.9, batch) for _ in range(5)] == [False] * 4 + [True]  # 1.044, 1.030, 1.017, 1.005, 0.995
    assert p.state()["decisions"][-1]["gain"] == pytest.approx(0.9945, abs=1e-3)  # the average, as priced
    assert not check(4, 1.07, batch) and check(4, 0.97, ["e", "f", "g", "h"])  # new requests: their own reading
    assert not check(4, 1.07, batch) and not check(4, 0.97, ["d", "e", "f", "g"])  # (one of them is the same)
    assert not check(1, 1.07, ["x"]) and check(1, 0.99, ["x"])  # one request: each reading on its own


def test_retirement_prices_width_one_where_the_chooser_holds_the_batch_there():
    """A drafting batch held at width 1 (its last step ran there, and no drafting width beats width 1 by the
    hysteresis) reads the target alone's step over width 1's as its gain: it retires, though the full width
    priced against the target alone is above break-even; a batch at the full width, or at width 1 where the
    full width beats it by the hysteresis, reads the full width's gain as before."""
    rids = ["a", "b", "c", "d"]

    def retires(current: int, full_s: float) -> bool:
        p = Planner(W, PlannerConfig(mode="auto", probe_every=2, retire_every=2))
        p.costs[(4, 0)], p.costs[(4, 1)], p.costs[(4, W)] = 0.0099, 0.010, full_s  # prior 0.9: 4.0951 tokens
        p.current, p.steps = current, 2
        return p.retire(4, rids)

    # full width 0.0392 s: 104.5 tokens/s against width 1's 100 (within 5%), 1.034x the target alone's 101
    assert retires(1, 0.0392) and not retires(W, 0.0392)
    assert not retires(1, 0.0370)  # the full width 10.7% over width 1: the chooser leaves width 1


def test_admission_keeps_drafting_to_break_even_and_starts_it_by_the_hysteresis():
    """A request admitted while the load was last admitted drafting drafts down to break-even; one admitted
    after an answer not to draft, or after a retirement, drafts only past the hysteresis (1.05)."""
    p = Planner(W, PlannerConfig(mode="auto", probe_every=2, retire_every=2, retire_smoothing=0))
    p.costs[(4, 1)] = 0.010  # the one-token step; prior 0.9: 4.0951 tokens a full step

    def priced(gain: float) -> bool:
        p.costs[(4, W)] = 0.040951 / gain
        return p.speculate_new(4, 4)

    assert priced(1.2) and priced(1.03) and not priced(0.99)  # drafting, then to break-even
    assert not priced(1.03) and priced(1.06) and priced(1.01)  # from not drafting: past the hysteresis
    p.steps = 2
    p.costs[(4, W)] = 0.040951 / 0.98
    assert p.retire(4, ["a"])
    assert not priced(1.03) and priced(1.06)  # a retirement: past the hysteresis again


def _h200_at_128(x1_live: float) -> Planner:
    """A graph runner's planner as on the H200 at 128 requests: the replays (128 rows: full width 3.0 ms,
    width 1 1.5, the target alone 1.4) scale live by 1.5 for the target alone at 8 rows, where it ran,
    and the full width at 128 runs at 12 ms; then, once asked, width 1 at 128 runs at ``x1_live``."""
    profile = {(128, W): 3.0e-3, (128, 1): 1.5e-3, (128, 0): 1.4e-3, (8, W): 2.0e-3, (8, 1): 1.1e-3, (8, 0): 1.0e-3}
    p = Planner(W, PlannerConfig(mode="auto", probe_every=4, retire_every=2), profile=profile, widths=(1, W))
    p.observe_plain(8, 1.5e-3)
    rids = [f"r{i}" for i in range(128)]
    for _ in range(4):
        p.observe(rids, [W - 1] * 128, W, 128, 0.012)
    # priced from the other bucket's scale, the target alone reads 2.1 ms at 128: drafting looks a loss
    assert p.cost(128, 0) == pytest.approx(2.1e-3) and p.drafting_gain(128) < 1
    assert p.speculate_new(128, 128) and not p.retire(128) and p.want_plain == {128}  # not yet: measure it first
    assert p.choose(rids, 128) == 1  # the probe
    for _ in range(2):
        p.observe(rids, [0] * 128, 1, 128, x1_live)
    return p


def test_a_stop_for_good_waits_for_the_one_token_step_measured_at_its_bucket():
    """Retirement and admission without drafting are for good (a batch that mixes cannot draft), so
    they wait until the one-token step ran at that bucket (``plain_probes`` steps at width 1, asked for
    by the planner), and the target alone is then priced from that step and the two replays. Why: on
    the H200 at 128 requests the target alone read 15-25% cheaper than it ran, and drafting stopped
    where the fixed width served 1.18-1.27x of the target alone (docs/benchmarks.md, forty-second
    session)."""
    rids = [f"r{i}" for i in range(128)]
    pays = _h200_at_128(x1_live=3.2e-3)  # live, the target alone costs 3.2 x 1.4 / 1.5 = 2.99 ms there
    assert pays.cost(128, 0) == pytest.approx(3.2e-3 * 1.4 / 1.5)
    assert pays.drafting_gain(128) > 1.2 and not pays.retire(128) and pays.speculate_new(128, 128)
    assert pays.choose(rids, 128) == W
    assert [d["decision"] for d in pays.state()["decisions"]] == ["admit drafting"]  # never turned
    loses = _h200_at_128(x1_live=2.2e-3)  # measured cheap: drafting does not pay there, and stops
    assert loses.drafting_gain(128) < 1 and loses.retire(128) and not loses.speculate_new(128, 128)
    retired = next(d for d in loses.state()["decisions"] if d["decision"] == "retire")
    assert retired["plain"] == [pytest.approx(2.2 * 1.4 / 1.5, abs=1e-3), "profile"]
    # prompts mixed into every probe void its time: after 2 x plain_probes tries the estimate decides
    p = Planner(W, PlannerConfig(mode="auto", probe_every=4, retire_every=2), widths=(1, W))
    p.profile.update({(128, 0): 1.4e-3, (128, 1): 1.5e-3})
    p.costs.update({(128, W): 0.012, (8, 0): 1.5e-3})
    p.steps = 4
    p.want_plain.add(128)
    for _ in range(4):
        assert not p._plain_known(128)
        p.observe(rids, [0] * 128, 1, 128, None)
    assert p._plain_known(128)


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_drafting_requests_retire_when_drafting_stops_paying(llama, runner, monkeypatch):
    """Three requests draft from the cold start; then their steps are measured to cost 5x the target
    alone's: after probe_every steps they stop drafting for good (no draft context, no drafter call,
    width 1, lookahead 1, counted in the stats and /metrics' counter), and the output is still the
    target's greedy one."""
    t, d = llama
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=4, num_draft_tokens=W, context_length=128, runner=runner, speculative_planner="auto"
        ),
    )
    eng.planner.cfg = PlannerConfig(mode="auto", cost_decay=0.999, probe_every=4, retire_every=2)
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    reqs = [Request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    eng.step()
    assert all(r.speculate for r in reqs)
    for B in range(1, 5):
        eng.planner.costs[(B, W)], eng.planner.costs[(B, 1)] = 0.050, 0.010
    calls = _count_draft_forwards(monkeypatch)
    # the check runs inside the runner's step (its overlap, behind the device on CUDA), not between steps
    inside, checks, real_retire = inside_runner_step(eng, monkeypatch), [], eng.planner.retire

    def retire(*a, **k):
        checks.append(inside[0])
        return real_retire(*a, **k)

    monkeypatch.setattr(eng.planner, "retire", retire)
    for _ in range(6):
        eng.step()
    assert checks and all(checks)
    assert not any(r.speculate for r in reqs) and eng.stats.requests_retired == 3
    assert all(r.draft_cache is None for r in reqs) and eng.scheduler.lookahead(reqs[0]) == 1
    from dflash2.server.metrics import render_metrics

    assert "dflash2_spec_requests_retired_total 3.0" in render_metrics(eng)
    calls["n"] = 0
    before = [(r.width_sum, r.verify_steps) for r in reqs]
    eng.run_until_done()
    assert calls["n"] == 0 and all(r.width_sum - w == r.verify_steps - n for r, (w, n) in zip(reqs, before))
    shapes = eng.stats.step_s_by_shape  # live step times by "bucket x width": the retired ones' are width 0
    assert sum(n for n, _ in shapes.values()) == eng.stats.steps and any(k.endswith("x0") for k in shapes)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == _argmax_continuation(t, p, 40)


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_requests_admitted_where_drafting_cannot_pay_run_the_target_alone(llama, runner, monkeypatch):
    """The first two requests arrive before anything is measured and draft; then drafting is measured
    not to pay, and the next four are admitted without drafting: no draft context for them (not in
    their prefill, and no drafter work at all once the two are done), width 1 for every batch they
    are in, one token of KV lookahead, and every output still the target's greedy one. The first two,
    now in a batch that cannot draft, stop drafting (before probe_every steps: retire alone would
    not act yet)."""
    t, d = llama
    rows = {"prefill": 0, "late": 0}
    real_rows, real_forward = DFlash2DraftModel.context_rows, DFlash2DraftModel.forward
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=6, num_draft_tokens=W, context_length=128, runner=runner, speculative_planner="auto"
        ),
    )
    eng.planner.cfg = PlannerConfig(mode="auto", cost_decay=0.999, probe_every=1000)
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    reqs = [
        Request(p, SamplingParams(max_new_tokens=8 if i < 2 else 30, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    in_prefill = {"on": False}
    inner = eng._prefill_chunks

    def prefill(chunks):
        in_prefill["on"] = True
        try:
            inner(chunks)
        finally:
            in_prefill["on"] = False

    def count(n):
        if in_prefill["on"]:
            rows["prefill"] += n
        elif reqs[0].finished and reqs[1].finished:
            rows["late"] += n

    def counted_rows(self, feats, pos):
        count(pos.numel())
        return real_rows(self, feats, pos)

    def counted_forward(self, *a, **k):
        count(1)
        return real_forward(self, *a, **k)

    monkeypatch.setattr(eng, "_prefill_chunks", prefill)
    monkeypatch.setattr(DFlash2DraftModel, "context_rows", counted_rows)
    monkeypatch.setattr(DFlash2DraftModel, "forward", counted_forward)
    for r in reqs[:2]:
        eng.add_request(r)
    eng.step()  # admitted (cold start: they draft) and prefilled
    assert all(r.speculate for r in reqs[:2]) and rows["prefill"] >= 12
    for B in range(1, 7):
        eng.planner.costs[(B, W)], eng.planner.costs[(B, 1)] = 0.050, 0.010
    for r in reqs[2:]:
        eng.add_request(r)
    rows["prefill"] = 0
    eng.step()
    assert not any(r.speculate for r in reqs[2:]) and eng.stats.requests_not_drafting == 4
    assert rows["prefill"] == 0  # their prefill wrote no draft context
    eng.step()  # (prefilled inside the last step, they join the batch at this one)
    # the batch now mixes in requests that do not draft (so it cannot draft): the first two stop too
    assert eng.scheduler.lookahead(reqs[2]) == 1 and eng.scheduler.lookahead(reqs[0]) == 1
    assert not reqs[0].speculate and eng.stats.requests_retired == 2
    eng.run_until_done()
    assert rows["late"] == 0 and all(r.finished_at > reqs[1].finished_at for r in reqs[2:])  # then the target only
    assert all(r.width_sum == r.verify_steps for r in reqs[2:])  # width 1 whenever they ran
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _argmax_continuation(t, p, r.sampling.max_new_tokens)  # EOS ignored


def test_an_admission_round_prices_each_bucket_once(llama, monkeypatch):
    """Six requests admitted in one step ask the planner once (one batch bucket: the queue's size), and
    each gets the answer it would have got alone: drafting where it pays, not drafting where it does not;
    a round that admits a request without drafting admits the rest without too (a batch is one or the
    other), with no further pricing."""
    t, d = llama
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=6, num_draft_tokens=W, context_length=128, runner="static", speculative_planner="auto"
        ),
    )
    calls = {"n": 0}
    real = eng.planner.speculate_new

    def counted(n, bucket):
        calls["n"] += 1
        return real(n, bucket)

    monkeypatch.setattr(eng.planner, "speculate_new", counted)
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(12)]
    for p in prompts[:6]:
        eng.add_request(Request(p, SamplingParams(max_new_tokens=4)))
    eng._admit()
    assert calls["n"] == 1 and all(r.speculate for r in eng.scheduler.running)  # cold start: all draft
    eng.run_until_done()
    planner = eng.planner.fresh()  # (what the run measured, timing-dependent, left out)
    planner.cfg = PlannerConfig(mode="auto", cost_decay=0.999)
    for B in range(1, 7):  # given: drafting cannot pay
        planner.costs[(B, W)], planner.costs[(B, 1)] = 0.050, 0.010
    eng.use_planner(planner)
    real = planner.speculate_new
    monkeypatch.setattr(planner, "speculate_new", counted)
    assert not real(6, eng.runner.bucket(6))
    calls["n"] = 0
    for p in prompts[6:]:
        eng.add_request(Request(p, SamplingParams(max_new_tokens=4)))
    eng._admit()
    assert calls["n"] == 1 and not any(r.speculate for r in eng.scheduler.running)
    assert eng.stats.requests_not_drafting == 6


def test_admissions_join_a_drafting_batch_at_its_load_and_are_priced_above_it(llama, monkeypatch):
    """Auto: requests admitted into a batch where every request drafts, at the load where drafting ran (its
    bucket or below), draft without asking the planner (retirement decides whether drafting still pays
    there); admissions that make a larger batch are priced, while a step runs where requests wait (the
    answer depends on the bucket alone), and the round then admits with that answer, asking nothing."""
    t, d = llama
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=4, num_draft_tokens=W, context_length=128, runner="static", speculative_planner="auto"
        ),
    )
    calls = {"n": 0}
    real = eng.planner.speculate_new

    def counted(n, bucket):
        calls["n"] += 1
        return real(n, bucket)

    monkeypatch.setattr(eng.planner, "speculate_new", counted)
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(7)]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reqs = [eng.add_request(Request(p, sp)) for p in prompts[:2]]
    while eng.stats.steps == 0:
        eng.step()
    assert all(r.speculate for r in reqs) and calls["n"] == 1  # the cold start: priced, drafts
    reqs += [eng.add_request(Request(p, sp)) for p in prompts[2:6]]
    eng.step()  # two admitted into a batch of 4 (priced), two wait: their round priced while the step runs
    assert calls["n"] == 3 and eng._admit_ahead == (eng.runner.bucket(4), True)
    assert all(r.speculate for r in reqs[:4]) and reqs[4] in eng.scheduler.waiting
    while eng._drafted_at < eng.runner.bucket(4):  # until all four draft in one step
        eng.step()
    n = calls["n"]
    eng.step()
    assert calls["n"] == n and eng._admit_ahead is None  # the batch drafts at this load: nothing to price
    eng.abort(reqs[0].request_id)
    eng._admit()
    assert calls["n"] == n and reqs[4] in eng.scheduler.running and reqs[4].speculate  # joined, unpriced
    eng._drafted_at = 0  # (as after a step that did not draft): the next round is priced, here ahead
    eng._admit_ahead = (eng.runner.bucket(4), False)  # (an answer a step could have given)
    eng.abort(reqs[1].request_id)
    eng._admit()
    assert calls["n"] == n and reqs[5] in eng.scheduler.running and not reqs[5].speculate
    assert eng._admit_ahead is None  # read once


def test_a_runner_without_replays_measures_the_one_token_step_before_it_stops():
    """A static runner without CUDA graphs (widths 1 and W, no start-up profile): at 128 requests only
    the full width has run, and width 1 read off it by a small batch's ratio (0.2) prices drafting at a
    loss. Drafting must not stop on that: the planner measures width 1 there first (as it does where
    replays price it), and measured at 9.5 ms the full block pays. The eager runner (every width, priced
    by tokens) still decides at once."""
    p = Planner(W, PlannerConfig(mode="auto"), widths=(1, W))
    p.costs[(4, 1)], p.costs[(4, W)], p.costs[(128, W)] = 0.002, 0.010, 0.0174
    p.ratio = 0.2
    assert p.drafting_gain(128, strict=True) < 1
    assert p.speculate_new(128, 128) and p.want_plain == {128} and not p.retire(128)
    rids = [f"r{i}" for i in range(128)]
    assert p.choose(rids, 128) == 1  # measure it
    for _ in range(2):
        p.observe(rids, [0] * 128, 1, 128, 0.0095)
    assert p.drafting_gain(128, strict=True) > 1.5 and p.speculate_new(128, 128) and not p.retire(128)
    eager = Planner(W, PlannerConfig(mode="auto"), widths=tuple(range(1, W + 1)))
    assert eager._plain_known(128)


def test_a_bad_streak_does_not_pin_width_one_until_the_probe():
    """Every other step accepts all drafts (drafting pays: 3 tokens in 4 ms against 1 in 1.8 ms),
    then steps that reject the first draft send the planner to width 1 (13 of them with a request's
    estimate holding 8 pseudo-drafts of every request's rates, 8 with 2). With no drafts to see, the
    request's estimate drifts back to every request's, so it drafts again well before the probe (6
    steps on; 12 with 2); and the prior of 0.9 fades as drafts are seen (kept, it would hold the rate at
    0.54, not 0.5)."""
    p = Planner(W, PlannerConfig(mode="auto"))
    p.costs[(1, W)], p.costs[(1, 1)] = 0.004, 0.0018
    for i in range(600):
        p.observe(["a"], [(W - 1) * (i % 2)], W, 1, 0.004)
    assert p.prior_alpha() == pytest.approx(0.5, abs=0.01)
    p.observe(["a"], [0], 1, 1, 0.0018)  # width 1's probe, done
    bad = 0
    while p.choose(["a"], 1) == W and bad < 40:
        p.observe(["a"], [0], W, 1, 0.004)
        bad += 1
    assert p.choose(["a"], 1) == 1 and bad >= 8, bad  # a few bad steps are not enough
    back = None
    for step in range(p.cfg.probe_every - 2):
        p.observe(["a"], [0], 1, 1, 0.0018)
        if p.choose(["a"], 1) == W:
            back = step
            break
    assert back is not None and back < p.cfg.probe_every // 2, back


def test_every_requests_estimate_spans_the_same_drafts_at_every_load():
    """The global counts fade per request-step: 200 steps of one request and 25 steps of eight leave
    the same estimate (per step, one request's would be its last few dozen steps alone, and the prior
    would outweigh eight requests' drafts)."""
    one, eight = Planner(W, PlannerConfig(mode="auto")), Planner(W, PlannerConfig(mode="auto"))
    for _ in range(200):
        one.observe(["a"], [0], W, 1, 0.004)
    for _ in range(25):
        eight.observe([str(i) for i in range(8)], [0] * 8, W, 8, 0.004)
    assert one.prior_alpha() == pytest.approx(eight.prior_alpha(), rel=0.05)  # (old per-step decay: 10x apart)
    assert 0.02 < one.prior_alpha() < 0.2  # the prior of 0.9 mostly faded, not gone


def test_a_shape_that_has_not_run_costs_its_profile_times_what_the_run_ones_cost_live():
    """The start-up profile is read where a shape has not run, scaled by live / profiled over the
    shapes of that width that ran (the replays leave out host work), or of the other widths where
    none of its shapes ran: so a drafting bucket that has not run is not costed below what drafting
    costs live, nor an unrun target alone below what it will cost, and requests are neither admitted
    drafting where drafting cannot pay nor retired where it does."""
    p = Planner(W, PlannerConfig(mode="auto"))
    p.profile.update({(4, W): 0.020, (8, W): 0.025, (4, 0): 0.010, (8, 0): 0.010, (4, 1): 0.012, (8, 1): 0.012})
    rids = [f"r{i}" for i in range(4)]
    for _ in range(40):  # 4 requests accept 2 of 4 drafts: ~3.1 expected tokens a step
        p.observe(rids, [2] * 4, W, 4, 0.030)  # live: 1.5x the profile
    assert p.cost(4, W) == pytest.approx(0.030) and p.cost(8, W) == pytest.approx(0.025 * 1.5)
    # no plain step has run: its profile times the widths' that ran (the replays' bias is the whole
    # step's; read unscaled, 10 ms, drafting would look a loss, gain 0.83, and retire)
    assert p.cost(8, 0) == pytest.approx(0.015) and p.cost(8, 1) == pytest.approx(0.018)
    assert p.state()["profile_scale"] == {W: pytest.approx(1.5)}
    assert p.drafting_gain(8) == pytest.approx(p.expected_tokens(["new"], W) / 2.5, rel=1e-6)
    assert 1.1 < p.drafting_gain(8) < 1.4 and p.speculate_new(8, 8) and not p.retire(8)
    p.observe_plain(4, 0.010)  # the target alone runs at its profile, so 10 ms at 8: drafting cannot pay
    assert p.cost(8, 0) == pytest.approx(0.010) and p.state()["profile_scale"] == {0: 1.0, W: pytest.approx(1.5)}
    assert p.cost(8, 1) == pytest.approx(0.012)  # width 1 borrows width 0's scale: the other one-token step
    assert 0.7 < p.drafting_gain(8) < 0.95
    # a stop for good waits until the one-token step has run at that bucket (plain_probes steps)
    assert p.speculate_new(8, 8) and not p.retire(8) and p.want_plain == {8}
    for _ in range(2):
        p.observe_plain(8, 0.010)
    assert not p.speculate_new(8, 8) and p.retire(8)
    p.costs[(4, W)] = 0.012  # given, not run: read as it is, and the scale stays what ran said
    assert p.cost(4, W) == 0.012 and p.cost(8, W) == pytest.approx(0.025 * 1.5)


def test_the_target_alone_is_costed_from_the_one_token_step_not_the_drafting_width():
    """The H200 at 64 requests, T=1 (profile and live costs in ms): the drafting width runs at 1.87x its
    profile, a width-1 probe at 2.4x its own (host work is a larger share of a cheap step). The target
    alone, not run yet, is costed from the width-1 step at that bucket and the profile's ratio of the
    two (2.73 ms), not from the drafting width's scale (2.15): so drafting at an AL of 2.4 pays, and
    the drafting requests do not retire; before any one-token step has a cost, they do not retire at all
    (the planner retired drafting there at an estimated break-even and served 0.89x, where drafting
    served 1.03x)."""
    p = Planner(W, PlannerConfig(mode="auto", probe_every=4, retire_every=1))
    p.widths = (1, W)
    p.profile.update({(64, 0): 1.15e-3, (64, 1): 1.17e-3, (64, W): 3.02e-3})
    rids = [f"r{i}" for i in range(64)]
    for _ in range(40):  # ~0.6 of the drafts at each position: ~2.4 expected tokens a step
        p.observe(rids, [0, 1, 2, 3] * 16, W, 64, 5.64e-3)
    p.profile[(64, 0)] /= 4  # (as a cheap plain profile would read, scaled by the drafting width: drafting pays less)
    assert not p.retire(64)  # no one-token step measured yet: no retirement, whatever the estimate
    p.profile[(64, 0)] *= 4
    p.observe(rids, [0] * 64, 1, 64, 2.78e-3)  # a width-1 probe
    assert p.cost(64, 0) == pytest.approx(2.78e-3 * 1.15 / 1.17)
    gain = p.drafting_gain(64)
    assert gain is not None and 1.1 < gain < 1.3
    assert p.speculate_new(64, 64) and not p.retire(64)
    p.scale.pop(1)  # what the old estimate read: the drafting width's scale
    assert p.profile[(64, 0)] * p._scale_of(W) == pytest.approx(2.15e-3, rel=0.01)


def test_auto_admits_without_drafting_while_a_request_that_does_not_draft_runs(llama):
    """In auto a batch drafts or does not: while a request that does not draft runs, a new one does
    not draft either, even where drafting would pay; once it is done, new requests draft again. The
    output is the target's greedy one throughout."""
    t, d = llama
    eng = LLMEngine(
        t, d, EngineConfig(max_running_requests=4, num_draft_tokens=W, context_length=128, speculative_planner="auto")
    )
    eng.planner.cfg = PlannerConfig(mode="auto", cost_decay=0.999, probe_every=1000)
    for B in range(1, 5):  # every width (the eager runner runs any): drafting cannot pay
        for w in range(1, W + 1):
            eng.planner.costs[(B, w)] = 0.010 * w
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    reqs = [Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, (12, 4, 4))]
    eng.add_request(reqs[0])
    eng.step()
    assert not reqs[0].speculate
    for B in range(1, 5):  # now drafting pays (4.1 tokens in 20 ms against 1 in 10)
        for w in range(2, W + 1):
            eng.planner.costs[(B, w)] = 0.010 + 0.0025 * (w - 1)
    assert eng.planner.speculate_new(2, 2)
    eng.add_request(reqs[1])
    eng.step()
    assert not reqs[1].speculate  # joined a batch that does not draft: admitted so, not retired
    assert eng.stats.requests_not_drafting == 2 and eng.stats.requests_retired == 0
    while not reqs[0].finished:
        eng.step()
    for B in range(1, 5):  # the plain steps measured on this CPU (both averages): set back, so drafting pays
        eng.planner.costs[(B, 0)] = eng.planner.slow_costs[(B, 0)] = 0.010
    eng.add_request(reqs[2])
    eng.run_until_done()
    assert reqs[2].speculate and reqs[2].width_sum > reqs[2].verify_steps  # drafted, at full width
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _argmax_continuation(t, p, r.sampling.max_new_tokens)


def test_a_burst_is_admitted_by_the_batch_it_makes(llama):
    """Four requests arrive at once where drafting pays for one request but not for four: none of
    them drafts (asked one by one at 1, 2, 3, 4 running, the first would draft into a batch of four,
    then retire there)."""
    t, d = llama
    eng = LLMEngine(
        t, d, EngineConfig(max_running_requests=4, num_draft_tokens=W, context_length=128, speculative_planner="auto")
    )
    for B in range(1, 5):
        eng.planner.costs[(B, W)], eng.planner.costs[(B, 1)] = (0.020 if B == 1 else 0.050), 0.010
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    reqs = [Request(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert eng.stats.requests_not_drafting == 4 and eng.stats.requests_retired == 0
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _argmax_continuation(t, p, 6)


def test_width_one_is_probed_only_where_it_could_be_the_better_width():
    """After probe_every steps at the full width, width 1 is probed where its estimated tokens/s is
    within probe_reach of the full width's, not where drafting is far ahead (each probe costs a step's
    drafts)."""
    far, rids = _planner(full_ms=5.0, plain_ms=4.0, accepted=4, steps=40)  # ~5 tokens in 5 ms against 1 in 4
    assert far.steps - far.last_run.get(1, 0) >= far.cfg.probe_every
    assert far.choose(rids, 4) == W
    near, rids = _planner(full_ms=10.0, plain_ms=4.0, accepted=2, steps=40)  # ~3 in 10 ms against 1 in 4
    assert near.choose(rids, 4) == 1  # the probe
    near.observe(rids, [0] * 4, 1, 4, 0.004)
    assert near.choose(rids, 4) == W  # and back


@pytest.mark.parametrize("widths, probe", [((), W), ((1, 2, 3, 4, W), 2)])
def test_a_batch_at_width_1_probes_drafting_at_the_cheapest_width_that_sees_acceptance(widths, probe):
    """Sitting at width 1, the planner probes drafting every ``probe_every`` steps: at the full width where
    the runner has two widths (graphs), at width 2 where it can run every width (eager: a full-width step
    cost ~4x a one-token one on the CPU at 16 rows, and width 2 sees the first draft's acceptance); and
    the step after a probe does not probe the full width."""
    p, rids = _planner(full_ms=10.0, plain_ms=4.0, accepted=0, probe_every=8)
    p.widths = widths
    for w in (2, 3, 4):
        p.costs[(4, w)] = (4.0 + 1.5 * (w - 1)) / 1e3
    chosen = []
    for _ in range(40):
        w = p.choose(rids, 4)
        chosen.append(w)
        p.observe(rids, [0] * 4, w, 4, p.cost(4, w))
    assert chosen[0] == 1 and set(chosen) == {1, probe}, chosen
    assert 3 <= chosen.count(probe) <= 5, chosen  # one probe per probe_every steps, no more
    assert all(a == 1 or b == 1 for a, b in zip(chosen, chosen[1:])), chosen  # each probe alone


def test_deferred_counts_fold_in_order_and_forget_leaves_no_row():
    """``observe(defer=True)`` counts the step and its width now, its acceptance and cost at ``fold``
    (the engine's overlap with the next step): the same estimates as folding at once, a choice in
    between reads the counts and costs as they were, and a forgotten request keeps no row; a step of
    the target alone (``observe_plain(defer=True)``) waits the same way, each folded in its order."""
    now, later = Planner(W, PlannerConfig(mode="auto")), Planner(W, PlannerConfig(mode="auto"))
    rids = ["a", "b", "c"]
    for k in range(12):
        acc = [k % 5, (k + 2) % 5, 4]
        now.observe(rids, acc, W, 4, 0.01 + 0.001 * k)
        before, costs = later.expected_by_width(rids), dict(later.costs)
        later.observe(rids, acc, W, 4, 0.01 + 0.001 * k, defer=True)
        assert later.steps == now.steps and later.current == W
        assert (later.expected_by_width(rids) == before).all() and later.costs == costs  # not folded yet
        later.fold()
        assert later.expected_by_width(rids) == pytest.approx(now.expected_by_width(rids), abs=0)
        assert later.costs == now.costs and later.slow_costs == now.slow_costs
    later.observe(rids, [1, 1, 1], W, 4, 0.01, defer=True)
    later.forget("b")  # folds the pending step first: "b" is not counted again after it is gone
    later.fold()
    assert "b" not in later.counts.row and set(later.counts.row) == {"a", "c"}
    prior = later.counts.prior_rates().copy()
    later.observe([], [], W, 4, 0.01, defer=True)  # a step whose requests all finished: nothing to count
    later.fold()
    assert list(later.counts.prior_rates()) == list(prior) and later.steps == now.steps + 2
    # a step of the target alone (the engine's): its cost and the fade wait for the fold too, in order
    later.observe_plain(4, 0.004, fade=True, defer=True)
    assert (4, 0) not in later.costs and list(later.counts.prior_rates()) == list(prior)
    later.observe(rids, [4, 4, 4], W, 4, 0.02, defer=True)  # folds the plain step first
    assert later.costs[(4, 0)] == 0.004 and list(later.counts.prior_rates()) != list(prior)
    faded = later.counts.prior_rates().copy()
    later.observe_plain(4, 0.006, fade=True, defer=True)  # folds the drafting step first
    assert later.costs[(4, W)] != now.costs[(4, W)] and list(later.counts.prior_rates()) != list(faded)
    later.fold()
    assert later.costs[(4, 0)] == pytest.approx(0.005)  # (the mean of its first samples)


@pytest.mark.parametrize("widths", [(), (1, 2, 3, 4, W)])
def test_choice_ahead_is_the_choice_after_the_running_step(widths):
    """``choose_ahead`` (made while a step runs, before it is observed) is the choice ``choose`` makes
    once that step is observed at the cost it was priced at (its acceptance deferred, as the engine
    does): probes, hysteresis and switches included. None while the running shape has no cost."""
    rng = random.Random(4)
    p = Planner(W, PlannerConfig(mode="auto", probe_every=6, stale_after=10**6))
    p.widths = widths
    rids = [f"r{i}" for i in range(4)]
    assert p.choose_ahead(rids, 4, W) is None  # the cold start: the first full-width step's cost is awaited
    p.observe(rids, [4] * 4, W, 4, 0.010)
    assert p.choose_ahead(rids, 4, 1) is None  # width 1 never ran at 4 rows
    p.costs[(4, 1)] = 0.004
    width, seen = p.choose(rids, 4), set()
    for k in range(120):
        good = k // 30 % 2 == 0  # drafting pays, then not, then again
        acc = [rng.randint(2, 4) if good else rng.randint(0, 1) for _ in rids] if width > 1 else [0] * 4
        p.fold()  # the engine's overlap: the last step's counts first
        ahead = p.choose_ahead(rids, 4, width)
        p.observe(rids, acc, width, 4, p.cost(4, width), defer=True)
        width = p.choose(rids, 4)
        assert ahead == width, k
        seen.add(width)
    assert {1, W} <= seen


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_engine_takes_the_width_chosen_during_the_last_step(llama, runner, monkeypatch):
    """With the planner on, the engine chooses the next step's width inside the running step (its
    overlap), so most steps start without calling ``choose``; a step whose batch bucket changed
    chooses afresh. Output is the target's greedy one."""
    t, d = llama
    cfg = EngineConfig(max_running_requests=3, num_draft_tokens=W, context_length=128, runner=runner,
                       speculative_planner="auto")  # fmt: skip
    eng = LLMEngine(t, d, cfg)
    eng.planner.cfg = PlannerConfig(mode="auto", retire_every=1000)  # the random drafter keeps drafting
    calls = {"choose": 0, "ahead": 0}
    real_choose, real_ahead = eng.planner.choose, eng.planner.choose_ahead
    monkeypatch.setattr(eng.planner, "choose", lambda *a: calls.update(choose=calls["choose"] + 1) or real_choose(*a))
    monkeypatch.setattr(
        eng.planner, "choose_ahead", lambda *a: calls.update(ahead=calls["ahead"] + 1) or real_ahead(*a)
    )
    prompts = [torch.randint(3, VOCAB, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    reqs = [Request(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    # (steps of requests that no longer draft choose nothing: the random drafter accepts little)
    assert calls["ahead"] >= 10 and calls["choose"] < calls["ahead"] / 3, (calls, eng.stats.steps)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, torch.tensor(p), r.sampling.max_new_tokens)


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_engine_folds_counts_while_the_step_runs_and_keeps_no_finished_row(llama, runner, monkeypatch):
    """The engine's planner folds the last step's acceptance inside the runner's step (between its
    launch and its read-back: hidden behind the device on CUDA), and after every request finished
    no acceptance row is left behind; output is still the target's greedy one."""
    t, d = llama
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=3, num_draft_tokens=W, context_length=128, runner=runner, speculative_planner="auto"
        ),
    )
    eng.planner.cfg = PlannerConfig(mode="auto", retire_every=1000)  # the random drafter keeps drafting
    inside, folds, real_fold = inside_runner_step(eng, monkeypatch), {"in": 0, "out": 0}, eng.planner.fold

    def fold():
        if eng.planner._pending is not None:
            folds["in" if inside[0] else "out"] += 1
        real_fold()

    monkeypatch.setattr(eng.planner, "fold", fold)
    prompts = [torch.randint(3, VOCAB, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(5)]
    reqs = [Request(p, SamplingParams(max_new_tokens=20 + 3 * i)) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert folds["in"] > 10 and folds["in"] > 5 * folds["out"], folds
    assert not eng.planner.counts.row  # every finished request's row freed
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, torch.tensor(p), r.sampling.max_new_tokens)


def test_a_cost_measured_long_ago_falls_back_to_the_profile():
    """A shape's measured cost not refreshed in ``stale_after`` steps is dropped, with its part of the
    live scale: a few plain steps at a transition (dear) do not price the target alone for the rest of
    the run, which would keep a batch drafting at a loss. Given costs never expire."""
    p = Planner(W, PlannerConfig(mode="auto", stale_after=100))
    p.profile.update({(8, 0): 0.010, (8, W): 0.020})
    rids = [f"r{i}" for i in range(8)]
    p.observe_plain(8, 0.021)  # at a transition: 2.1x its profile
    p.costs[(16, 0)] = 0.5  # given
    for _ in range(100):
        p.observe(rids, [1] * 8, W, 8, 0.024)  # drafting runs at 1.2x its profile
    assert p.cost(8, 0) == pytest.approx(0.021)  # 100 steps old: still measured
    assert p.state()["profile_scale"] == {0: pytest.approx(2.1), W: pytest.approx(1.2)}
    for _ in range(8):  # expiry is checked every retire_every (8) steps
        p.observe(rids, [1] * 8, W, 8, 0.024)
    assert (8, 0) not in p.costs and p.cost(8, 0) == pytest.approx(0.010 * 1.2)  # borrows drafting's scale
    assert p.state()["profile_scale"] == {W: pytest.approx(1.2)}
    assert p.cost(8, W) == pytest.approx(0.024) and p.costs[(16, 0)] == 0.5
    p.observe_plain(8, 0.011)  # run again: measured again
    assert p.cost(8, 0) == pytest.approx(0.011)
    with pytest.raises(ValueError, match="stale_after"):
        PlannerConfig(stale_after=0)


# ---- the verify width cut after the draft, from its confidence (Planner.trim) ----------------------
def test_confidence_calibration_recovers_a_logistic_acceptance():
    """Counts drawn from a known ``P(accept | confidence)`` per position: the fit finds its bias and
    slope, and says nothing before ``min_reached`` first drafts were seen."""
    from dflash2.engine.planner import ConfidenceCalibration

    rng = np.random.default_rng(0)
    cal = ConfidenceCalibration(3, decay=1.0)
    true = np.array([[0.5, 1.0], [-0.5, 0.8], [0.0, 0.5]])  # (bias, slope) on logit(confidence)
    for step in range(400):
        conf = rng.uniform(0.02, 0.999, size=(8, 3))
        z = true[None, :, 0] + true[None, :, 1] * np.log(conf / (1 - conf))
        ok = rng.uniform(size=(8, 3)) < 1 / (1 + np.exp(-z))
        n = np.argmin(np.concatenate([ok, np.zeros((8, 1), bool)], 1), axis=1)  # the first rejection
        cal.observe(conf, list(n), 3)
        if step == 0:
            assert not cal.fitted  # 8 first drafts: the cold start verifies what it drafts
    assert cal.fitted
    assert np.allclose(cal.coef[:2], true[:2], atol=0.25), cal.coef
    hi, lo = cal.rates(np.array([[0.99, 0.99, 0.99], [0.1, 0.1, 0.1]]))
    assert (hi > lo + 0.3).all()


def _trimming_planner(per_token_ms: float) -> Planner:
    """A fitted calibration where acceptance follows confidence steeply, a draft of 3 ms and verify
    costs of a fixed part plus ``per_token_ms`` a token, timed apart (``observe_split``) at widths 1,
    2 and the full one (the widths between: on the line between those)."""
    p = Planner(W, PlannerConfig(mode="auto", trim=True))
    p.widths, p.trim_widths = tuple(range(1, W + 1)), tuple(range(2, W + 1))
    for w in (1, 2, W):
        p.observe_split(4, w, 3e-3, (7.0 + per_token_ms * 4 * w) / 1e3)
    p.calibration.coef[:] = [0.0, 1.5]
    p.calibration.fitted = True
    return p


def test_trim_verifies_what_the_confidence_pays_for():
    confident, doubtful = np.full((4, W - 1), 0.99), np.full((4, W - 1), 0.1)
    p = _trimming_planner(per_token_ms=2.0)
    assert p.trims and p.trim(4, W, confident) == W
    assert p.trim(4, W, doubtful) == 2  # (after the draft: 2 at the least, its cost is spent)
    mixed = np.concatenate([np.full((4, 2), 0.99), np.full((4, W - 3), 0.05)], 1)
    assert p.trim(4, W, mixed) == 3  # the confident drafts, not the doubtful ones after them
    even = np.full((4, W - 1), 0.5)  # each draft accepted half the time
    assert p.trim(4, W, even) == 2
    p.calibration.fitted = False  # cold start: what was drafted is verified
    assert p.trim(4, W, doubtful) == W
    cheap = _trimming_planner(per_token_ms=0.01)  # a verified token costs ~nothing: keep every draft
    assert cheap.trim(4, W, even) == W
    assert not Planner(W, PlannerConfig(mode="auto")).trims  # (off by default)
    # priced from whole steps, a width between 1 (no draft) and the full one would look cheaper by the
    # draft's cost: the verify's own times, a flat verify, keep every draft
    flat = _trimming_planner(per_token_ms=0.0)
    flat.costs[(4, 1)], flat.costs[(4, W)] = 7e-3, 10e-3  # whole steps: the full one with its draft
    assert flat.trim(4, W, even) == W
    assert flat._verify_cost(4, 3) == pytest.approx(7e-3)
    assert Planner(W, PlannerConfig(mode="auto"))._verify_cost(4, 3) is None  # nothing timed: no cut


class FullThenTrim(Planner):
    """The full width every step, then :meth:`Planner.trim` with a fixed, steep calibration over step
    costs that make the cut follow the draft's confidence: widths 2 .. full within one run."""

    def choose(self, rids, bucket):
        return self.width

    def speculate_new(self, n_running, bucket):
        return True

    def retire(self, bucket, rids=None):
        return False

    def _draft_cost(self, bucket):
        return 0.4

    def _verify_cost(self, bucket, width):
        return 0.6 + 0.6 * width

    def fold(self):  # the calibration stays as set (no refit): the cut is the test's
        self._pending = None


def _trim_engine(t, d, width, coef, **cfg) -> LLMEngine:
    """``coef``: the calibration's (bias, slope), set where the drafter's confidence spans the cut."""
    eng = LLMEngine(
        t, d, EngineConfig(num_draft_tokens=width, speculative_planner="auto", speculative_trim=True, **cfg)
    )
    p = FullThenTrim(width, PlannerConfig(mode="auto", trim=True))
    p.widths, p.trim_widths = eng.runner.widths, eng.runner.trim_widths
    p.calibration.coef[:] = coef
    p.calibration.fitted = True
    eng.planner = p
    return eng


@pytest.mark.parametrize("runner, slots", [("paged", 3), ("static", 3), ("static", 1)])
def test_greedy_equals_target_while_the_confidence_trims(llama, runner, slots):
    """The paged runner and the static one run eagerly (the CPU's batch 1 is the static runner's one slot)."""
    t, d = llama
    # (this random drafter's confidence: logit -3.2 .. -2.3)
    eng = _trim_engine(t, d, W, (13.0, 4.0), max_running_requests=slots, context_length=128, runner=runner)
    assert eng.runner.trim_widths == tuple(range(2, W + 1))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(3, 15, (), generator=g)),), generator=g) for _ in range(5)]
    reqs = [Request(p.tolist(), SamplingParams(max_new_tokens=30)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert eng.stats.steps_trimmed > 0 and len(set(eng.stats.steps_by_width)) >= 2, eng.stats.steps_by_width
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, 30)


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampled_distribution_exact_while_the_confidence_trims(method):
    """The first three sampled tokens follow the target's exact joint distribution while each step's
    verify width is cut after the draft from the draft's confidence (block verification included)."""
    V = 8
    model = sharp_v8_llama(3)
    t, d = TargetModel(model, layer_ids=[0]), v8_draft(std=0.3)
    prompt = [1, 2, 3]
    joint = exact_joint(model, prompt, 3)
    eng = _trim_engine(
        t,
        d,
        4,
        (1.5, 2.0),  # (its confidence: logit -0.8 .. 2.1)
        max_running_requests=64,
        context_length=64,
        block_verification=method == "block",
        max_total_tokens=64 * 16,
        page_size=8,
    )
    triples = _first_three_sampled(eng, prompt, V)
    widths = eng.stats.steps_by_width
    assert eng.stats.steps_trimmed > 0 and len([w for w in widths if w > 1]) >= 2, widths
    assert _chi2_ok(triples, joint)


def test_a_load_that_stopped_drafting_tries_again_once_what_it_saw_is_old():
    """One request at a time (H100-like one-request costs): requests whose drafts seldom pass stop the
    next admission drafting; steps of the target alone then fade what was seen back toward the prior
    (nothing new is observed without drafts), so a later request drafts again and measures; and not
    before the window of ``plain_fade`` has mostly passed (no drafting request after every plain one)."""
    p = Planner(W, PlannerConfig(mode="auto"), costs={(1, 0): 1.6e-3, (1, 1): 1.7e-3, (1, W): 2.6e-3})
    for k in range(4):  # four requests of 64 steps whose first draft passes one time in five
        for i in range(64):
            p.observe([f"r{k}"], [int(i % 5 == 0)], W, 1, 2.6e-3)
        p.forget(f"r{k}")
    p.fold()
    assert p.drafting_gain(1) < 1 and not p.speculate_new(1, 1)
    gains = []
    for _ in range(12):  # twelve requests of 128 tokens, the target alone
        for _ in range(128):
            p.observe_plain(1, 1.6e-3, fade=True)
        gains.append(p.drafting_gain(1))
    assert gains == sorted(gains)  # the observed rates fade toward the prior, step by step
    assert gains[0] < 1 and p.speculate_new(1, 1)
    drafts_again = next(i for i, g in enumerate(gains) if g >= 1 + p.cfg.hysteresis)
    assert 2 <= drafts_again <= 8, gains
    p.observe_plain(1, 1.6e-3)  # a cost alone (not the engine's step): nothing fades
    assert p.drafting_gain(1) == gains[-1]


def test_a_request_retires_on_its_own_rates_where_every_requests_are_still_hopeful():
    """At one request after a fade (every request's rates back near the prior), a request admitted to try
    drafting again whose drafts fail retires on its own rates at the next check, where every request's
    rates alone would keep it drafting (at width 1, paying the drafter's upkeep, for the rest of its output);
    a request whose drafts pass does not."""
    costs = {(1, 0): 1.6e-3, (1, 1): 1.7e-3, (1, W): 2.6e-3}
    for accepted, retires in ((0, True), (3, False)):
        p = Planner(W, PlannerConfig(mode="auto"), costs=dict(costs))
        p.steps = 10 * p.cfg.retire_every  # long past the cold start
        for _ in range(3 * p.cfg.retire_every):
            p.observe(["probe"], [accepted], W, 1, 2.6e-3)
        p.fold()
        assert p.steps % p.cfg.retire_every == 0
        assert p.drafting_gain(1) > 1 and not p.retire(1)  # every request's rates: the prior's weight
        assert p.retire(1, ["probe"]) is retires


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_a_request_kept_from_drafting_samples_the_target_alones_text(llama, runner):
    """Seeded T=1 requests that never draft (a pinned schedule of width 1 at every load) draw one uniform a
    step, as the target alone does, so each one's text is the target alone's with the same seed, through
    continuous batching (3 slots, 6 requests of other lengths). Drawn at the full width, they were other
    samples of the same distribution."""
    t, d = llama
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(3, 12, (), generator=g)),), generator=g) for _ in range(6)]

    def texts(draft, **kw) -> list[list[int]]:
        cfg = EngineConfig(max_running_requests=3, context_length=128, runner=runner, **kw)
        eng = LLMEngine(t, draft, cfg)
        sp = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12 + 3 * i, seed=40 + i) for i in range(6)]
        reqs = [Request(p.tolist(), s) for p, s in zip(prompts, sp)]
        for r in reqs:
            eng.add_request(r)
        eng.run_until_done()
        if draft is not None:
            assert eng.stats.steps_by_width.keys() == {1} and eng.stats.requests_not_drafting == 6
        return [r.output_ids for r in reqs]

    alone = texts(None, speculative=False)
    assert texts(d, num_draft_tokens=W, speculative_width_schedule="1:1") == alone
    assert texts(d, num_draft_tokens=W, speculative_planner="auto", speculative_width_schedule="1:1") == alone
