"""The serving engine in-process, with both model runners: the paged one (CPU default) and the
static-slot one (the CUDA-graph runner, run eagerly here). Many requests of different lengths
through few slots, so requests finish, slots are refilled and moved, and some are preempted."""

import warnings

import pytest
import torch

from targets import VOCAB, build, inside_runner_step
from test_speculative import hf_greedy, random_draft
from dflash2.engine import graph_runner
from dflash2.engine.engine import EngineConfig, LLMEngine, RequestError
from dflash2.engine.graph_runner import PACKED_MAX_TOKENS, GraphModelRunner, pack_prefill
from dflash2.engine.model_runner import ModelRunner, PagedLayer
from dflash2.engine.planner import PlannerConfig
from dflash2.engine.request import Request
from dflash2.engine.steps import GraphTimer
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams

warnings.filterwarnings("ignore")


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(3, 20, (), generator=g)),), generator=g) for _ in range(n)]


def _run(
    target,
    draft,
    prompts,
    runner,
    width=5,
    block=False,
    max_running=3,
    max_total_tokens=4096,
    sampled=False,
    max_new=(30, 12, 21, 7),
    attention_backend="auto",
    sampler_backend="sort",
    mixed_chunk=False,
    graph_sampling="both",
):
    """``sampled``: True (every request at T=1 / top-p 0.9), False, or "mixed" (every other one)."""
    eng = LLMEngine(
        target,
        draft,
        EngineConfig(
            max_running_requests=max_running,
            speculative=draft is not None,
            num_draft_tokens=width,
            block_verification=block,
            context_length=128,
            max_total_tokens=max_total_tokens,
            page_size=8,
            runner=runner,
            speculative_planner="off",  # step for step against the reference loop / the other runner
            attention_backend=attention_backend,
            sampler_backend=sampler_backend,
            enable_mixed_chunk=mixed_chunk,
            graph_sampling=graph_sampling,
        ),
    )
    hot = [sampled is True or (sampled == "mixed" and i % 2 == 1) for i in range(len(prompts))]
    reqs = [
        Request(
            p.tolist(),
            SamplingParams(
                temperature=1.0 if hot[i] else 0.0,
                top_p=0.9 if hot[i] else 1.0,
                max_new_tokens=max_new[i % len(max_new)],
                seed=i,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert all(r.finish_reason in ("stop", "length") for r in reqs), [r.error for r in reqs]
    # the step counts agree with the requests' own: draft i + 1 accepted once per step that accepted more than i
    assert eng.stats.verify_steps == sum(r.verify_steps for r in reqs)
    hists = [r.accept_hist + [0] * (eng.width - len(r.accept_hist)) for r in reqs]
    assert eng.stats.accepted_by_position == [sum(sum(h[i + 1 :]) for h in hists) for i in range(eng.width - 1)]
    return eng, reqs


@pytest.fixture(scope="module")
def llama():
    t = TargetModel(build("llama", seed=3), layer_ids=[0, 2])
    return t, random_draft(t, 3).draft


def test_auto_picks_paged_on_cpu(llama):
    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=2))
    assert isinstance(eng.runner, ModelRunner)
    # one slot (batch-1 decoding) takes the static runner on the CPU too: no per-step cache rebuild
    assert isinstance(LLMEngine(t, d, EngineConfig(max_running_requests=1)).runner, GraphModelRunner)
    assert isinstance(LLMEngine(t, d, EngineConfig(max_running_requests=1, runner="paged")).runner, ModelRunner)
    assert isinstance(LLMEngine(t, d, EngineConfig(max_running_requests=2, runner="static")).runner, GraphModelRunner)
    with pytest.raises(ValueError, match="runner must be"):
        EngineConfig(runner="fast")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("width", [1, 5, 8])
def test_static_runner_greedy_equals_target(arch, width):
    t = TargetModel(build(arch, seed=width), layer_ids=[0, 2])
    draft = random_draft(t, width).draft if width > 1 else None
    prompts = _prompts(8, seed=width)
    eng, reqs = _run(t, draft, prompts, "static", width=width if draft is not None else 2)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
    assert eng.runner.occupant == [] and eng.runner.kv.num_free == eng.runner.kv.num_blocks == 3 * 3  # pages of 64


@pytest.mark.parametrize("block", [False, True])
def test_static_runner_sampled_equals_paged(llama, block):
    """Same seeds, same uniforms, logits equal to float32 rounding: the same tokens and acceptances."""
    t, d = llama
    prompts = _prompts(7, seed=11)
    _, paged = _run(t, d, prompts, "paged", block=block, sampled=True)
    _, static = _run(t, d, prompts, "static", block=block, sampled=True)
    assert [r.output_ids for r in static] == [r.output_ids for r in paged]
    assert [r.accept_hist for r in static] == [r.accept_hist for r in paged]


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_the_next_steps_draws_as_one_block_are_the_same_draws(llama, runner, monkeypatch):
    """A sampled step takes the block of rows drawn while the last step ran (steps.draw_ahead) where its batch
    is the last one's, else each request's row: the same uniforms either way, so the same tokens and
    acceptances as without the block, with the block taken in most steps (batches change as requests end)."""
    from dflash2.engine import engine as engine_mod
    from dflash2.engine.steps import BatchSampling

    t, d = llama
    prompts = _prompts(7, seed=5)
    real_ahead, real_draw = engine_mod.draw_ahead, BatchSampling.draw.__func__
    monkeypatch.setattr(engine_mod, "draw_ahead", lambda reqs, g, device=None: real_ahead(reqs, g))
    _, apart = _run(t, d, prompts, runner, block=True, sampled=True)
    monkeypatch.setattr(engine_mod, "draw_ahead", real_ahead)
    taken = []

    def draw(cls, reqs, g, device, stride=None, ahead=None, layout=None):
        taken.append(
            ahead is not None and len(reqs) == len(ahead[1]) and all(r.drawn is x for r, x in zip(reqs, ahead[1]))
        )
        return real_draw(cls, reqs, g, device, stride, ahead, layout)

    monkeypatch.setattr(BatchSampling, "draw", classmethod(draw))
    _, block = _run(t, d, prompts, runner, block=True, sampled=True)
    assert [r.output_ids for r in block] == [r.output_ids for r in apart]
    assert [r.accept_hist for r in block] == [r.accept_hist for r in apart]
    assert sum(taken) > len(taken) / 2 and not all(taken), taken


def test_graph_runner_loads_a_sampled_batch_where_its_graphs_read_it(llama):
    """The graph runner's sampling rows (one block a slot): a batch's parameters and draws, loaded in one
    copy where the block is laid out at the full width (the engine's, whatever the step's width) or in
    parts from a block of the step's own width (width 1, a planner width), read back by the graphs'
    view (_rows) as the batch that was loaded, at slots in order (a slice) or not (an index); the other
    slots' rows untouched."""
    from dflash2.engine.steps import BatchSampling

    t, d = llama
    runner = GraphModelRunner(t, d, 5, 6, 64, cuda_graph=False, block_verification=True)
    params = [SamplingParams(temperature=0.5 + i / 10, top_k=3 + i, top_p=0.9, min_p=0.01 * i) for i in range(3)]
    g_full = runner.w - 1
    for g, stride in [(g_full, g_full), (2, 2), (0, 0), (2, g_full), (0, g_full)]:
        for idx in (slice(0, 3), torch.tensor([4, 1, 3])):
            runner.sampling.fill_(7.0)
            block = BatchSampling.of(params, torch.rand(3, 2 * stride + 1), "cpu").rows
            batch = BatchSampling.from_rows(block, g, stride)
            runner._load_sampling(idx, batch)
            rows = runner._rows(6, False, g)
            assert rows is not None
            for f in ("temperature", "top_k", "top_p", "min_p", "propose_u", "accept_u", "emit_u"):
                assert torch.equal(getattr(rows, f)[idx], getattr(batch, f)), (g, f)
            assert rows.top_k.dtype == torch.long and batch.top_k.tolist() == [3, 4, 5]
            loaded = list(range(6))[idx] if isinstance(idx, slice) else idx.tolist()
            assert (runner.sampling[[s for s in range(6) if s not in loaded]] == 7.0).all()
    with pytest.raises(ValueError, match="BatchSampling.of"):
        runner._load_sampling(slice(0, 3), BatchSampling.of(params, torch.rand(3, 2 * g_full + 1), "cpu").trimmed(1))


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_graph_sampling_makes_one_kind_of_step_graph(llama, kind):
    """A run of one kind of request (bench acceptance) makes only that kind's step graphs, gives the
    tokens the engine with both gives, and refuses a request of the other kind by name."""
    t, d = llama
    prompts, sampled = _prompts(5, seed=13), kind == "sampled"
    _, both = _run(t, d, prompts, "static", block=True, sampled=sampled)
    eng, one = _run(t, d, prompts, "static", block=True, sampled=sampled, graph_sampling=kind)
    assert [r.output_ids for r in one] == [r.output_ids for r in both]
    assert [r.accept_hist for r in one] == [r.accept_hist for r in both]
    assert eng.runner.graphs and {key[2] for key in eng.runner.graphs} == {kind == "greedy"}
    eng.warm_up()  # runs its own kind of request only
    other = SamplingParams(temperature=0.0 if sampled else 1.0, max_new_tokens=4)
    with pytest.raises(RequestError, match=f"runs {kind} requests only"):
        eng.add_request(Request(prompts[0].tolist(), other))
    with pytest.raises(ValueError, match="graph_sampling must be"):
        EngineConfig(graph_sampling="greedy_only")
    # the planner's start-up profile times that kind's steps (no graphs of the other kind to replay)
    auto = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=3, num_draft_tokens=5, context_length=128, page_size=8, runner="static",
            speculative_planner="auto", graph_sampling=kind,
        ),
    )  # fmt: skip
    costs = auto.runner.profile(repeats=1)
    widths = (*auto.runner.verify_widths, *((0,) if auto.runner.plain_graphs else ()))
    assert set(costs) == {(B, w) for B in auto.runner.buckets for w in widths} and 5 in widths
    assert all(c > 0 for c in costs.values())


@pytest.mark.parametrize("width", [1, 5])
def test_mixed_chunk_greedy_equals_target(width):
    """--enable-mixed-chunk: new prompts run inside decode steps' forwards (the verify block and the
    prompt share projections, MLP and LM head): greedy output is still the target's own, token for token."""
    t = TargetModel(build("llama", seed=7), layer_ids=[0, 2])
    draft = random_draft(t, 5).draft if width > 1 else None
    prompts = _prompts(9, seed=7)
    eng, reqs = _run(t, draft, prompts, "static", width=5, mixed_chunk=True)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
    assert eng.stats.prompts_mixed >= 4  # every admission after the first batch, bar those two at once
    assert eng.runner.prefill_shapes["mix128"][0] == eng.stats.prompts_mixed
    assert eng.runner.occupant == []


def test_mixed_chunk_by_default_where_it_applies(monkeypatch):
    """The flag unset (None) and its default on (on CUDA with graphs over pages: here forced): prompts
    join steps, as with the flag given. (A None flag once left the engine never offering a prompt,
    while the runner captured the mixed graphs: docs/benchmarks.md, thirty-fourth session.)"""
    from dflash2.engine import engine as engine_mod

    t = TargetModel(build("llama", seed=7), layer_ids=[0, 2])
    prompts = _prompts(9, seed=7)
    monkeypatch.setattr(engine_mod, "mixed_chunk_default", lambda paged, device, no_graphs: paged)
    eng, reqs = _run(t, random_draft(t, 5).draft, prompts, "static", width=5, mixed_chunk=None)
    assert eng.stats.prompts_mixed >= 4
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)


@pytest.mark.parametrize("block", [False, True])
def test_mixed_chunk_sampled_equals_unmixed(llama, block):
    """Same seeds: a prompt run inside a step gives each request the same draws, tokens and acceptances."""
    t, d = llama
    prompts = _prompts(7, seed=13)
    _, apart = _run(t, d, prompts, "static", block=block, sampled=True)
    eng, mixed = _run(t, d, prompts, "static", block=block, sampled=True, mixed_chunk=True)
    assert eng.stats.prompts_mixed > 0
    assert [r.output_ids for r in mixed] == [r.output_ids for r in apart]
    assert [r.accept_hist for r in mixed] == [r.accept_hist for r in apart]


def test_mixed_chunk_takes_whole_first_prompts_only(llama):
    """A prompt joins a step only whole, from its start, without prompt logprobs, within the lengths."""
    t, d = llama
    runner = GraphModelRunner(t, d, 5, num_slots=4, max_len=134, cuda_graph=False, page_size=64, num_pages=8,
                              mixed_chunk=True)  # fmt: skip
    assert runner.mixed_lengths == (128,)
    whole = Request(list(range(3, 40)), SamplingParams())
    assert runner.mixable(whole, 37) and not runner.mixable(whole, 20)  # a first chunk of a longer prompt
    assert not runner.mixable(Request(list(range(3, 140)), SamplingParams()), 137)  # past 128
    assert not runner.mixable(Request(list(range(3, 40)), SamplingParams(prompt_logprobs=0)), 37)
    whole.prefill_pos = 10
    assert not runner.mixable(whole, 27)
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):  # slot mode: no pool of pages
        GraphModelRunner(t, d, 5, num_slots=1, max_len=134, cuda_graph=False, mixed_chunk=True)


def test_mixed_chunk_only_in_small_steps(llama, monkeypatch):
    """A step past MIXED_MAX_STEP_TOKENS verify tokens takes no prompt (compute-bound there: the prompt
    would add its full cost), and no mixed graph is made for it; output is unchanged."""
    t, d = llama
    prompts = _prompts(7, seed=13)
    _, apart = _run(t, d, prompts, "static")
    monkeypatch.setattr(graph_runner, "MIXED_MAX_STEP_TOKENS", 4)  # width 5: every step is past it
    eng, gated = _run(t, d, prompts, "static", mixed_chunk=True)
    assert eng.stats.prompts_mixed == 0
    assert [r.output_ids for r in gated] == [r.output_ids for r in apart]
    assert not eng.runner.mixes(1, 5) and eng.runner.mixes(4, 1)
    monkeypatch.setattr(graph_runner, "MIXED_MAX_STEP_TOKENS", 5)
    assert eng.runner.mixes(1, 5) and not eng.runner.mixes(2, 5)


def test_mixed_chunk_keys_on_the_bucket_with_the_new_slot(llama, monkeypatch):
    """Two requests decoding (bucket 2) and a third admitted: seating it moves the step to bucket 3,
    where a width-5 step takes no prompt. The step must not mix there (it once asked for a graph that
    start-up never captured: on the H200 captured mid-step, it returned accepted counts past the
    width, thirty-sixth session); every step asks only for graphs made at start-up."""
    t, d = llama
    prompts = _prompts(7, seed=13)
    lengths = (30, 3, 3)  # two finish together: one decoding, a prompt joins at bucket 2
    _, apart = _run(t, d, prompts, "static", max_new=lengths)
    monkeypatch.setattr(graph_runner, "MIXED_MAX_STEP_TOKENS", 10)  # 2 x 5 mixes, 3 x 5 does not
    eng, mixed = _run(t, d, prompts, "static", max_new=lengths, mixed_chunk=True)
    assert eng.runner.mixes(2, 5) and not eng.runner.mixes(3, 5)
    assert eng.stats.prompts_mixed > 0
    assert [r.output_ids for r in mixed] == [r.output_ids for r in apart]
    with pytest.raises(RuntimeError, match="no graph was made at start-up"):
        eng.runner._graph("verify", 3, True, eng.runner._verify_kv(eng.runner.kv_buckets[0]), 5, 128)


def test_mixed_chunk_refused_by_the_paged_runner(llama):
    t, d = llama
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):
        LLMEngine(t, d, EngineConfig(max_running_requests=2, enable_mixed_chunk=True))
    # the default is "where it applies" (graphs on CUDA): neither the paged runner nor the CPU's static one
    assert not getattr(LLMEngine(t, d, EngineConfig(max_running_requests=2)).runner, "mixed_lengths", ())
    static = EngineConfig(max_running_requests=2, runner="static", context_length=64, max_total_tokens=512)
    assert LLMEngine(t, d, static).runner.mixed_lengths == ()


def test_mixed_batch_greedy_rows_equal_target(llama):
    """Greedy and sampled requests in one batch (the sampled path for all): greedy rows are the
    target's own greedy output, and every row matches the paged runner's."""
    t, d = llama
    prompts = _prompts(8, seed=21)
    _, static = _run(t, d, prompts, "static", sampled="mixed")
    _, paged = _run(t, d, prompts, "paged", sampled="mixed")
    assert [r.output_ids for r in static] == [r.output_ids for r in paged]
    for p, r in zip(prompts[::2], static[::2]):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)


def test_preemption_and_slot_moves(llama):
    """A KV budget too small for all three running requests: the newest is preempted and
    re-prefilled later, in both runners (pages of 8 in the paged one, of 64 in the static one: 3
    pages, and a request takes 2); finished requests' slots are refilled by moving the last one."""
    t, d = llama
    prompts = _prompts(9, seed=5)
    eng, paged = _run(t, d, prompts, "paged", max_total_tokens=96, max_new=(40, 33, 45))
    assert eng.stats.preemptions > 0
    eng, reqs = _run(t, d, prompts, "static", max_total_tokens=192, max_new=(40, 33, 45))
    assert eng.runner.paged and eng.stats.preemptions > 0 and eng.pool_usage() == (0, 3)
    for p, r, q in zip(prompts, reqs, paged):
        assert r.output_ids == q.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
    # the draft saw the same context in both runners, re-prefilled or not: the same drafts were accepted
    assert [r.accept_hist for r in reqs] == [r.accept_hist for r in paged]


def _schedule_run(t, d, prompts, stop: int, sampled: bool, **schedule):
    """A static-runner engine with 3 slots and a small pool (preemptions) under ``schedule`` (EngineConfig
    fields), through 9 requests: greedy or (``sampled``) every other one seeded T=1; request 1 ended by the
    stop id ``stop``, request 4 with min_tokens, request 6 asking logprobs. Returns the engine and requests."""
    cfg = EngineConfig(
        max_running_requests=3,
        num_draft_tokens=5,
        context_length=128,
        max_total_tokens=192,
        page_size=8,
        runner="static",
        sampler_backend="sort",
        **schedule,
    )
    eng = LLMEngine(t, d, cfg)
    reqs = []
    for i, p in enumerate(prompts):
        hot = sampled and i % 2 == 1
        sp = SamplingParams(
            temperature=1.0 if hot else 0.0,
            top_p=0.9 if hot else 1.0,
            max_new_tokens=(40, 33, 45)[i % 3],
            seed=i,
            stop_token_ids=(stop,) if i == 1 else (),
            min_tokens=10 if i == 4 else 0,
            logprobs=2 if i == 6 else None,
        )
        reqs.append(eng.add_request(Request(p.tolist(), sp)))
    return eng, reqs


@pytest.mark.parametrize("sampled", [False, True])
def test_overlap_schedule_commits_each_step_while_the_next_runs(llama, monkeypatch, sampled):
    """The static runner's steps committed while the next one runs (the default; SGLang's
    --disable-overlap-schedule commits each first): the same tokens, finishes, logprobs and counts as
    committing first, greedy and seeded sampled, through finishes, slot moves and preemptions, with a request
    that a stop id ends early, one with min_tokens and one asking logprobs (their batches commit first); most
    steps' commits ran inside the next step."""
    t, d = llama
    prompts = _prompts(9, seed=5)
    g = hf_greedy(t, prompts[1], 33)
    stop = g[min(5, len(g) - 1)]  # (greedy: request 1 ends at its sixth token or before)

    def run(disable: bool):
        eng, reqs = _schedule_run(t, d, prompts, stop, sampled, disable_overlap_schedule=disable)
        inside = {"n": 0}
        real = eng._settle

        def counted(p, rows=None, overlapped=False, t0=None):
            inside["n"] += overlapped
            return real(p, rows, overlapped, t0)

        monkeypatch.setattr(eng, "_settle", counted)
        eng.run_until_done()
        assert eng._pending is None and eng.pool_usage()[0] == 0
        return eng, reqs, inside["n"]

    first_eng, first, n_first = run(True)
    eng, reqs, n = run(False)
    assert n_first == 0 and n > eng.stats.steps // 4 and eng.stats.preemptions > 0
    assert len(reqs[1].output_ids) <= 6 or sampled
    for a, b in zip(first, reqs):
        assert (b.output_ids, b.finish_reason, b.accept_hist) == (a.output_ids, a.finish_reason, a.accept_hist)
        assert b.logprobs == a.logprobs and b.top_logprobs == a.top_logprobs
    s, s0 = eng.stats, first_eng.stats
    assert (s.verify_steps, s.steps, s.accepted_by_position) == (s0.verify_steps, s0.steps, s0.accepted_by_position)
    for i in (0, 2, 8):  # greedy, no stop ids: the target's own greedy output
        assert reqs[i].output_ids == hf_greedy(t, prompts[i], reqs[i].sampling.max_new_tokens)


@pytest.mark.parametrize("sampled", [False, True])
def test_async_scheduling_launches_each_step_before_the_last_is_read_back(llama, monkeypatch, sampled):
    """--async-scheduling: each step launched before the last one is read back (that one committed while this
    one runs): the same tokens, finishes, logprobs and acceptance counts as the overlap schedule, greedy and
    seeded sampled, through stop ids, finishes (a wasted row each), slot moves, preemptions (the step in flight
    read back first), new requests joining (their first tokens read after the next launch) and the batches
    that commit at once (min_tokens, logprobs); most steps launched ahead."""
    t, d = llama
    prompts = _prompts(9, seed=5)
    g = hf_greedy(t, prompts[1], 33)
    stop = g[min(5, len(g) - 1)]
    # attention prefixes a few positions apart, so one that misses the step in flight's block reads short
    monkeypatch.setattr(graph_runner, "KV_BUCKETS_EAGER", tuple(range(8, 128, 4)))

    def run(on: bool):
        eng, reqs = _schedule_run(t, d, prompts, stop, sampled, async_scheduling=on)
        early = {"n": 0}
        real = eng.runner.launch

        def counted(*a, ahead=False, **kw):
            early["n"] += ahead
            return real(*a, ahead=ahead, **kw)

        monkeypatch.setattr(eng.runner, "launch", counted)
        eng.run_until_done()
        assert eng._pending is None and eng._inflight is None and eng.pool_usage()[0] == 0
        return eng, reqs, early["n"]

    first_eng, first, n_first = run(False)
    eng, reqs, n = run(True)
    assert n_first == 0 and n > eng.stats.steps // 3 and eng.stats.preemptions > 0
    for a, b in zip(first, reqs):
        assert (b.output_ids, b.finish_reason, b.accept_hist) == (a.output_ids, a.finish_reason, a.accept_hist)
        # (float32 rounding: a finish's wasted row changes the batch of the step after it)
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-5)
        assert [[i for i, _ in x] for x in b.top_logprobs] == [[i for i, _ in x] for x in a.top_logprobs]
    s, s0 = eng.stats, first_eng.stats
    assert (s.verify_steps, s.accepted_by_position) == (s0.verify_steps, s0.accepted_by_position)
    for i in (0, 2, 8):  # greedy, no stop ids: the target's own greedy output
        assert reqs[i].output_ids == hf_greedy(t, prompts[i], reqs[i].sampling.max_new_tokens)


def test_a_deferred_row_is_committed_once(llama):
    """A step's rows asked for again (a request whose row went in early, e.g. one with stop strings, then
    preempted) are committed once: its tokens appended once, its counts once."""
    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=2, num_draft_tokens=5, context_length=128, runner="static"))
    reqs = [eng.add_request(Request(p.tolist(), SamplingParams(max_new_tokens=30))) for p in _prompts(2, seed=3)]
    while eng._pending is None:
        eng.step()
    p = eng._pending
    before = [len(r.output_ids) for r in reqs]
    eng._settle(p, [0])
    eng._settle(p, [0, 1])
    eng._settle(p)
    assert [len(r.output_ids) - n for r, n in zip(reqs, before)] == [len(x) for x in p.out.tokens]
    assert [r.verify_steps for r in reqs] == [eng.stats.steps] * 2 and eng._pending is None


def test_pack_prefill_packs_chunks_into_the_smallest_totals():
    """Packed prefill's plan: longest chunk first into the first replay with room (tokens and rows),
    each replay the smallest total that holds its chunks; one chunk past every total: no plan."""
    totals = (32, 64, 128, 256, 512, 1024, 2048)
    assert pack_prefill([100] * 5, totals, 16) == [(512, [0, 1, 2, 3, 4])]
    assert pack_prefill([30, 200, 30], totals, 16) == [(512, [1, 0, 2])]
    assert pack_prefill([3000], totals, 16) is None and pack_prefill([5], (), 4) is None
    # rows bound a replay: 5 chunks, 4 a replay
    assert pack_prefill([10] * 5, totals, 4) == [(64, [0, 1, 2, 3]), (32, [4])]
    # past PACKED_MAX_TOKENS several replays, every chunk once; a chunk longer than it goes alone
    lengths = [PACKED_MAX_TOKENS // 4 + 1] * 7 + [1500]
    plan = pack_prefill(lengths, totals, 64)
    assert plan[0] == (2048, [7]) and sorted(i for _, idx in plan for i in idx) == list(range(8))
    assert all(sum(lengths[i] for i in idx) <= T for T, idx in plan)
    assert all(sum(lengths[i] for i in idx) <= PACKED_MAX_TOKENS for _, idx in plan[1:])


def test_first_chunks_pack_beside_a_later_chunk(llama):
    """A batch of chunks with the rest of a prompt cut by the chunked-prefill budget: the first chunks
    still go through the packed functions (they once all fell back to the eager forward, the target
    alone's usual case at 64 requests), the later chunk runs eagerly, and every last logits row equals
    the unpacked runner's."""
    t, d = llama
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (40, 30, 25)]
    out = {}
    for packed in (True, False):
        runner = GraphModelRunner(t, d, 5, num_slots=3, max_len=130, cuda_graph=False, page_size=64, num_pages=6)
        if not packed:
            runner.prefill_tokens, runner.prefill_graphs = (), {}
        replays: list[int] = []
        inner = runner._replay_prefill
        runner._replay_prefill = lambda chunks, T: replays.append(T) or inner(chunks, T)
        reqs = [Request(x, SamplingParams()) for x in prompts]
        for r in reqs:
            runner.kv.grow(r, len(r.prompt_ids) + 5)
        assert runner.prefill_batch([(reqs[0], 20)]) == [None]  # the first 20 of 40
        out[packed] = runner.prefill_batch([(reqs[0], 20), (reqs[1], 30), (reqs[2], 25)])
        assert replays == ([32, 64] if packed else [])  # the cut prompt's first chunk, then the two whole ones
        assert [r.prefill_pos for r in reqs] == [40, 30, 25]
    for a, b in zip(out[True], out[False]):
        assert a is not None and b is not None and torch.allclose(a, b, atol=1e-4)


def test_release_keeps_slots_contiguous(llama):
    t, d = llama
    runner = GraphModelRunner(t, d, 5, num_slots=4, max_len=64, cuda_graph=False)
    reqs = [Request([5 + i, 6, 7, 8 + i], SamplingParams()) for i in range(3)]
    for r in reqs:
        runner.prefill(r)
    k_last = runner.static.k_cache[:, 2, :, :4].clone()
    runner.release(reqs[0])
    assert runner.occupant == [reqs[2], reqs[1]] and (reqs[2].slot, reqs[1].slot, reqs[0].slot) == (0, 1, None)
    assert torch.equal(runner.static.k_cache[:, 0, :, :4], k_last)
    runner.release(reqs[1])
    assert runner.occupant == [reqs[2]]


def test_paged_slots_move_tables_not_data(llama):
    """Paged static runner: a moved request keeps its pages (its table row moves), a freed slot's
    table points at the scratch page, and the KV written through the tables is the slot's own."""
    t, d = llama
    runner = GraphModelRunner(t, d, 5, num_slots=3, max_len=130, cuda_graph=False, page_size=64, num_pages=6)
    reqs = [Request([5 + i, 6, 7, 8 + i], SamplingParams()) for i in range(3)]
    for r in reqs:
        runner.kv.grow(r, 70)  # two pages each, as the scheduler reserves them
        runner.prefill(r)
    pages = [list(r.block_table) for r in reqs]
    assert sorted(sum(pages, [])) == list(range(6))
    k_last = runner.static.k_cache[:, pages[2][0], :, :4].clone()
    runner.release(reqs[0])
    assert runner.occupant == [reqs[2], reqs[1]] and reqs[2].slot == 0
    scratch = runner.static.scratch  # 6: the pool's extra page; a table has 3 entries (130 positions)
    assert runner.tables[0].tolist() == pages[2] + [scratch] and runner.tables[2].tolist() == [scratch] * 3
    assert torch.equal(runner.static.k_cache[:, pages[2][0], :, :4], k_last)  # nothing copied


def test_paged_verify_gathers_each_layer_without_keeping_it(llama, monkeypatch):
    """The eager paged runner's verify cache (:class:`PagedLayer`): rows of different lengths, left
    padded, give the target's greedy output while every fresh buffer starts as NaN (the padding is
    written, not left to whatever memory held), and no layer keeps its gathered past after the
    forward (only the new rows, for the commit)."""
    t, d = llama
    prompts = _prompts(6, seed=11)
    empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: empty(self, *a, **k).fill_(float("nan")))
    kept = []
    real = PagedLayer.update

    def update(self, k, v, *a, **kw):
        out = real(self, k, v, *a, **kw)
        assert out[0].shape[-2] == self.length + k.shape[-2]
        kept.append(self)
        return out

    monkeypatch.setattr(PagedLayer, "update", update)
    eng, reqs = _run(t, d, prompts, "paged", max_running=3)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
    assert kept and all(vars(layer).keys().isdisjoint({"keys", "values"}) or layer.keys is None for layer in kept)


def test_warm_up_drafts_then_starts_fresh(llama):
    """``warm_up`` (the server's, before it serves): steps that draft, then nothing of it is left: the
    planner's costs, steps and acceptance are its start-up ones, the counters are zero, every page is
    free, and what runs next equals the target's greedy output."""
    t, d = llama
    cfg = EngineConfig(max_running_requests=3, num_draft_tokens=5, context_length=128, max_total_tokens=4096,
                       page_size=8, speculative_planner="auto", speculative_trim=True)  # fmt: skip
    eng = LLMEngine(t, d, cfg)
    widths = []
    step = eng.runner.step

    def counted(reqs, sampling, width=None, overlap=None, prefill=None, trim=None):
        widths.append(width)
        return step(reqs, sampling, width, overlap=overlap, prefill=prefill, trim=trim)

    eng.runner.step = counted  # type: ignore[method-assign]
    eng.warm_up()
    assert widths and max(w or 0 for w in widths) >= 2  # the cold start drafts (eager: width 2 first)
    assert eng.planner.costs == {} and eng.planner.steps == 0 and eng.planner.widths == eng.runner.widths
    assert eng.planner.trim_widths == eng.runner.trim_widths != () and eng.planner.trims  # the cut after the draft
    assert eng.planner.counts.prior_rates().tolist() == pytest.approx([eng.planner.cfg.prior] * 4)
    assert eng.stats.steps == eng.stats.completed == eng.stats.generated_tokens == 0
    assert eng.runner.kv.num_free == eng.runner.kv.num_blocks
    prompts = _prompts(3, seed=5)
    res = eng.generate([p.tolist() for p in prompts], SamplingParams(max_new_tokens=12))
    for p, r in zip(prompts, res):
        assert r.token_ids == hf_greedy(t, p, 12)
    assert eng.stats.completed == 3


def test_steps_of_the_target_alone_fade_what_drafts_showed(llama, monkeypatch):
    """Auto, requests admitted without drafting (the planner's answer): each of their steps fades every
    request's observed acceptance toward the prior (``plain_fade``), so a load that stopped drafting
    tries again later; the output is still the target's greedy."""
    t, d = llama
    cfg = EngineConfig(max_running_requests=2, num_draft_tokens=5, context_length=128, max_total_tokens=4096,
                       page_size=8, speculative_planner="auto")  # fmt: skip
    eng = LLMEngine(t, d, cfg)
    p = eng.planner
    monkeypatch.setattr(p, "speculate_new", lambda n, b: False)
    p.counts.total[:] = [[10.0] * 4, [200.0] * 4]  # drafts seldom passed (rate 0.05), long ago
    p.counts.pseudo = 0.0
    p.counts._prior_rates = p.counts._rates_of_total()
    before = p.counts.prior_rates().copy()
    prompts = _prompts(2, seed=3)
    res = eng.generate([x.tolist() for x in prompts], SamplingParams(max_new_tokens=10))
    for x, r in zip(prompts, res):
        assert r.token_ids == hf_greedy(t, x, 10)
    steps = eng.stats.steps
    assert eng.stats.requests_not_drafting == 2 and steps >= 9
    assert p.counts.total[1, 0] == pytest.approx(200.0 * p.cfg.plain_fade**steps)
    assert (p.counts.prior_rates() > before).all()


@pytest.mark.parametrize("lengths,rows", [((40,), 4), ((40, 17, 5), 4), ((40, 17, 5, 30, 9), 4)])
def test_packed_prefill_equals_the_eager_prefill(llama, lengths, rows):
    """New requests' first chunks, prefilled alone or together, packed back to back and padded to a
    token total (the function a CUDA graph replays on the GPU; the padding continues the last prompt):
    each last logits row is the target's, and the K/V and draft latents of every real token equal the
    unpadded eager prefill's (one request does not draft). Five chunks over four slots' rows: two
    replays, the first one's outputs kept while the second overwrites the graph's."""
    t, d = llama
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    out = {}
    for packed in (True, False):
        slots = max(len(lengths), rows) if packed else len(lengths)
        runner = GraphModelRunner(t, d, 5, num_slots=slots, max_len=130, cuda_graph=False, page_size=64, num_pages=8)
        if not packed:  # (the graphs were made at construction)
            runner.prefill_tokens, runner.prefill_graphs = (), {}
        else:
            assert runner.prefill_tokens == (32, 64, 128)
            runner.pf_last = runner.pf_last[:rows]
            for key, (replay, res) in runner.prefill_graphs.items():  # outputs in place, as a CUDA graph's

                def in_place(replay=replay, res=res, buf={}):
                    replay()
                    buf.setdefault("pf_logits", res["pf_logits"]).copy_(res["pf_logits"])
                    res["pf_logits"] = buf["pf_logits"]

                runner.prefill_graphs[key] = (in_place, res)
        runner.timer = GraphTimer(torch.device("cpu"))  # (as bench speed sets it: the prefill replays timed too)
        replays: list[int] = []
        inner = runner._replay_prefill
        runner._replay_prefill = lambda chunks, T: replays.append(T) or inner(chunks, T)
        reqs = [Request(x, SamplingParams()) for x in prompts]
        reqs[-1].speculate = len(reqs) == 1  # the last of several does not draft
        for r in reqs:
            runner.kv.grow(r, len(r.prompt_ids) + 5)
        logits = (
            runner.prefill_batch([(r, len(r.prompt_ids)) for r in reqs]) if len(reqs) > 1 else [runner.prefill(reqs[0])]
        )
        rows_out = []
        for r, lg in zip(reqs, logits):
            page, n = r.block_table[0], len(r.prompt_ids)
            lat = runner.lat[:, page, :n].clone() if r.speculate else None
            rows_out.append((lg, runner.static.k_cache[:, page, :, :n].clone(), lat))
        out[packed] = rows_out
        want = {1: [64], 3: [64], 5: [128, 32]}[len(lengths)]  # 40+30+17+9 in 128, then the 5
        assert replays == (want if packed else [])
        # the padding tally (bench speed's prefill_shapes): replays and real tokens by total
        tally = {"128": [1, 96], "32": [1, 5]} if len(lengths) == 5 else {"64": [1, sum(lengths)]}
        assert runner.prefill_shapes == (tally if packed else {})
        assert (runner.take_prefill_device_s() > 0) == packed and runner.take_prefill_device_s() == 0  # (taken once)
    for x, (got, ref) in zip(prompts, zip(out[True], out[False])):
        with torch.no_grad():
            torch.testing.assert_close(got[0], t.model(torch.tensor([x])).logits[0, -1], atol=1e-4, rtol=1e-4)
        for a, b in zip(got, ref):
            if b is not None:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("speculate", [True, False])
def test_one_slot_packed_prefill_equals_the_eager_prefill(llama, speculate):
    """Batch 1 (one slot, no pool of pages) with prefill graphs, as on CUDA: the prompt alone padded to
    a token total gives the target's last logits row and the eager prefill's K/V and draft latents."""
    t, d = llama
    x = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for packed in (True, False):
        runner = GraphModelRunner(t, d, 5, num_slots=1, max_len=130, cuda_graph=False, prefill_graphs=packed)
        assert runner.prefill_tokens == ((32, 64, 128) if packed else ())
        replays: list[int] = []
        inner = runner._replay_prefill
        runner._replay_prefill = lambda chunks, T: replays.append(T) or inner(chunks, T)
        req = Request(x, SamplingParams())
        req.speculate = speculate
        runner.kv.grow(req, len(x) + 5)
        lg = runner.prefill(req)
        assert replays == ([64] if packed else [])
        out[packed] = (lg, runner.static.k_cache[:, 0, :, :40].clone(), runner.lat[:, 0, :40].clone())
    with torch.no_grad():
        torch.testing.assert_close(out[True][0], t.model(torch.tensor([x])).logits[0, -1], atol=1e-4, rtol=1e-4)
    for a, b in zip(out[True], out[False][: 3 if speculate else 2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the one-slot default: graphs where they are captured (CUDA), else the exact-length eager prefill
    assert GraphModelRunner(t, d, 5, num_slots=1, max_len=130, cuda_graph=False).prefill_tokens == ()


@pytest.mark.parametrize("runner", ["paged", "static"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_engine_sampled_equals_single_request_loop(llama, runner, method):
    """One request at a time, the engine draws each request's uniforms in the single-request loop's
    order, so a seeded sampled request gives ``speculative_generate``'s tokens (whose distribution the
    statistical tests check) through either runner."""
    from dflash2.engine import speculative_generate
    from dflash2.engine.proposers import DFlashProposer

    t, d = llama
    prop = DFlashProposer(d, t.embed, t.lm_head_weight)
    for k in range(3):
        prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(k))
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=30, seed=k, ignore_eos=True)
        ref = speculative_generate(t, prop, prompt, sp, width=5, verify_method=method)
        eng = LLMEngine(
            t,
            d,
            EngineConfig(
                max_running_requests=1,
                num_draft_tokens=5,
                block_verification=method == "block",
                context_length=128,
                max_total_tokens=1024,
                page_size=8,
                runner=runner,
                speculative_planner="off",
            ),
        )
        r = eng.add_request(Request(prompt.tolist(), sp))
        eng.run_until_done()
        assert r.output_ids == ref.token_ids and r.accept_hist == ref.accept_hist


def test_static_runner_kv_buckets(llama, monkeypatch):
    """Requests grow across a short attention prefix (24 positions) and the whole buffer: steps
    switch from the prefix graphs to the full ones, output unchanged (greedy = the target's)."""
    from dflash2.engine import graph_runner

    monkeypatch.setattr(graph_runner, "KV_BUCKETS_EAGER", (24, 40))
    t, d = llama
    prompts = _prompts(6, seed=8)
    eng, reqs = _run(t, d, prompts, "static", max_new=(40, 9, 30))
    assert eng.runner.kv_buckets == [24, 40, 134]
    used = {k[3] for k in eng.runner.graphs}
    assert used == {24, 40, 134}
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
    _, paged = _run(t, d, prompts, "paged", max_new=(40, 9, 30))
    assert [r.accept_hist for r in reqs] == [r.accept_hist for r in paged]


def test_static_runner_budget_is_pages(llama):
    """64 running requests with a 32,768-token context: the static runner holds a pool of pages the
    size of the KV budget (not 64 slots of the whole context), and serves from it."""
    t, d = llama
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=64,
            num_draft_tokens=5,
            context_length=32768,
            max_total_tokens=4096,
            runner="static",
            speculative_planner="off",
        ),
    )
    assert eng.runner.paged and eng.runner.static.k_cache.shape[1] == 4096 // 64 + 1  # + the scratch page
    assert eng.runner.kv.capacity == 4096 and eng.runner.tables.shape == (64, -(-(32768 + 6) // 64))
    prompts = _prompts(5, seed=9)
    reqs = [eng.add_request(Request(p.tolist(), SamplingParams(max_new_tokens=12))) for p in prompts]
    eng.run_until_done()
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, 12)


def test_request_arriving_after_admission_is_not_failed(llama):
    """A request queued between a step's admission and its decode, while nothing runs (the last one
    finished at its prefill: max_tokens 1, as lm-eval's loglikelihood requests), waits for the next
    step; it was failed as 'does not fit the KV pool' (found by lm-eval against the server)."""
    t, d = llama
    for runner in ("paged", "static"):
        eng = LLMEngine(t, d, EngineConfig(max_running_requests=2, context_length=128, runner=runner))
        a = eng.add_request(Request([5, 6, 7], SamplingParams(max_new_tokens=1)))
        eng._admit()
        eng._prefill_some()  # a's only token comes from its prefill: it is done, nothing runs
        assert a.finish_reason == "length" and not eng.scheduler.running
        b = eng.add_request(Request([8, 9, 10], SamplingParams(max_new_tokens=3)))
        assert eng._decode_batch() == [] and b.finish_reason is None
        eng.run_until_done()
        assert b.finish_reason == "length" and len(b.output_ids) == 3


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_prefill_runs_inside_the_decode_step(llama, runner, monkeypatch):
    """A request admitted while others decode is prefilled inside the runner's step (its overlap:
    on CUDA, while the device computes the step), its first token read after the step's own read-back
    and emitted in the same engine step; nothing is prefilled outside a step while requests decode,
    and every output still equals the target's greedy one."""
    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=2, num_draft_tokens=4, context_length=128,
                                       runner=runner, speculative_planner="off"))  # fmt: skip
    in_step, where, real_chunks = inside_runner_step(eng, monkeypatch), [], eng._prefill_chunks

    def chunks(c):
        decoding = [r for r in eng.scheduler.running if r.output_ids and not r.finished]
        where.append((in_step[0], bool(decoding), [r.request_id for r, _ in c]))
        return real_chunks(c)

    monkeypatch.setattr(eng, "_prefill_chunks", chunks)
    prompts = _prompts(5, seed=11)
    reqs = [
        eng.add_request(Request(p.tolist(), SamplingParams(max_new_tokens=n))) for p, n in zip(prompts, (9, 3, 6, 4, 7))
    ]
    while eng.has_work():
        eng.step()
        for r in reqs:  # a request whose prompt is in has its first token by the end of the step
            assert r.prefill_pos < len(r.prompt_ids) or r.output_ids, r.request_id
    assert any(inside for inside, _, _ in where), where  # the later admissions were prefilled in a step
    assert all(inside == decoding for inside, decoding, _ in where), where
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)


def _admission_steps(eng, monkeypatch) -> list[tuple[int, bool, int]]:
    """(decode steps so far, whether a request was decoding, requests admitted) at each admission round that
    admitted something."""
    rounds, real = [], eng.scheduler.admit

    def admit(speculate=None):
        decoding = any(r not in eng.prefilling for r in eng.scheduler.running)
        got = real(speculate)
        if got:
            rounds.append((eng.stats.steps, decoding, len(got)))
        return got

    monkeypatch.setattr(eng.scheduler, "admit", admit)
    return rounds


@pytest.mark.parametrize("steps", [1, 3])
def test_continuous_decode_steps_admit_every_n_steps(llama, monkeypatch, steps):
    """``--num-continuous-decode-steps N``: while requests decode, an admission round runs once N decode
    steps have passed since the last one that admitted (so requests finishing a few steps apart share one
    prefill); where nothing decodes, at once. Lossless: greedy outputs equal the target's."""
    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=3, num_draft_tokens=4, context_length=128,
                                       runner="paged", speculative_planner="off",
                                       num_continuous_decode_steps=steps))  # fmt: skip
    rounds = _admission_steps(eng, monkeypatch)
    prompts = _prompts(9, seed=5)
    lengths = (9, 3, 6, 4, 7, 2, 8, 5, 3)
    reqs = [eng.add_request(Request(p.tolist(), SamplingParams(max_new_tokens=n))) for p, n in zip(prompts, lengths)]
    eng.run_until_done()
    gaps = [b[0] - a[0] for a, b in zip(rounds, rounds[1:]) if b[1]]  # rounds while others decoded
    assert gaps and min(gaps) >= steps, rounds
    if steps > 1:  # some round admitted two requests that finished apart
        assert eng.stats.admissions_held > 0 and len(rounds) < 9, rounds
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
    with pytest.raises(ValueError, match="num-continuous-decode-steps"):
        EngineConfig(num_continuous_decode_steps=0)


def test_admission_interval_weighs_a_prefill_replay_against_idle_rows():
    """The auto interval between admission rounds, a pure function: 1 where nothing joins or a replay is cheap
    against the rows that would wait; longer, up to ADMIT_MAX_INTERVAL, as the replay's price grows against a
    row's step cost or as requests join faster (the 8B shape's H100 costs: 8 ms a replay)."""
    from dflash2.engine.engine import ADMIT_MAX_INTERVAL, admission_interval

    assert admission_interval(0.008, 0.0, 0.0013) == 1  # nothing joins: no round to merge with
    assert admission_interval(1e-6, 1.0, 0.0004) == 1  # a replay costs nothing
    assert admission_interval(1.0, 1.0, 0.0004) == ADMIT_MAX_INTERVAL
    # 32 requests of 13.4 ms steps, one finishing a step: a few steps; a small model's replay (1 ms) at 8
    # requests of 2.6 ms steps, one finishing every ~4 steps: every step
    assert 1 < admission_interval(0.009, 1.0, 0.0134 / 32) <= ADMIT_MAX_INTERVAL
    assert admission_interval(0.001, 0.27, 0.0026 / 8) == 1
    widths = [admission_interval(0.009, r, 0.0134 / 32) for r in (0.05, 0.2, 0.5, 1.0)]
    assert widths == sorted(widths) and widths[0] < widths[-1]


def test_auto_admission_rounds_come_every_priced_interval(llama, monkeypatch):
    """Auto (the default): where the runner prices a prefill replay, admission rounds come every
    ``admission_interval`` decode steps (requests finish every few steps here, more waiting than fit): a
    replay priced far above a step's rows, the longest interval, once a request has finished; unpriced (the
    CPU's runners) or cheap, the rounds of ``--num-continuous-decode-steps 1``. The price is injected."""
    from dflash2.engine import engine as engine_mod

    t, d = llama
    prompts, lengths = _prompts(9, seed=5), (24, 3, 6, 4, 17, 2, 18, 5, 3)
    runs = {}
    for price in (None, 0.0, 1e-12, 1e9):
        eng = LLMEngine(t, d, EngineConfig(max_running_requests=3, num_draft_tokens=4, context_length=128,
                                           runner="paged", speculative_planner="off",
                                           num_continuous_decode_steps=1 if price is None else None))  # fmt: skip
        assert not hasattr(eng.runner, "prefill_replay_s")
        if price is not None:
            eng.runner.prefill_replay_s = price
        rounds = _admission_steps(eng, monkeypatch)
        reqs = [
            eng.add_request(Request(p.tolist(), SamplingParams(max_new_tokens=n))) for p, n in zip(prompts, lengths)
        ]
        eng.run_until_done()
        for p, r in zip(prompts, reqs):
            assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
        runs[price] = (rounds, eng.stats.admissions_held)
    assert runs[0.0] == runs[1e-12] == runs[None] and runs[None][1] == 0
    # a replay worth any wait: each round at the longest interval, once a request has finished (none joins before)
    rounds, held = runs[1e9]
    gaps = [b[0] - a[0] for a, b in zip(rounds, rounds[1:]) if b[1]]
    assert len(gaps) > 1 and min(gaps[1:]) >= engine_mod.ADMIT_MAX_INTERVAL and held > 0, rounds
    assert len(rounds) < len(runs[None][0])


def test_admissions_that_do_not_draft_are_priced_at_the_plain_prefill_replay(llama, monkeypatch):
    """Auto admission where new requests join a batch that does not draft (the planner admits none drafting):
    the interval is priced at the prefill replay without the drafter's latents (``plain_prefill_replay_s``),
    not at the drafting one's. Injected prices: the one read decides whether rounds wait."""
    t, d = llama
    prompts, lengths = _prompts(9, seed=5), (24, 3, 6, 4, 17, 2, 18, 5, 3)
    held = {}
    for drafting_s, plain_s in ((1e9, 0.0), (0.0, 1e9)):
        eng = LLMEngine(t, d, EngineConfig(max_running_requests=3, num_draft_tokens=4, context_length=128,
                                           runner="paged", speculative_planner="auto"))  # fmt: skip
        monkeypatch.setattr(eng.planner, "speculate_new", lambda n, b: False)
        eng.runner.prefill_replay_s, eng.runner.plain_prefill_replay_s = drafting_s, plain_s
        reqs = [
            eng.add_request(Request(p.tolist(), SamplingParams(max_new_tokens=n))) for p, n in zip(prompts, lengths)
        ]
        eng.run_until_done()
        assert not any(r.speculate for r in reqs) and eng.stats.requests_not_drafting == len(reqs)
        for p, r in zip(prompts, reqs):
            assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
        held[plain_s] = eng.stats.admissions_held
    assert held[0.0] == 0 and held[1e9] > 0, held


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_step_costs_leave_out_the_prefill_inside_the_step(llama, runner, monkeypatch):
    """The step cost the planner learns is the step's own: a prefill run inside the step (its overlap)
    is reported apart (``overlap_s``) and left out, so the drafting steps of an admission wave do not
    look dearer than the same steps later (on the H200 they looked 25% dearer and drafting stopped)."""
    import time as _time

    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=3, num_draft_tokens=4, context_length=128,
                                       runner=runner, speculative_planner="auto"))  # fmt: skip
    eng.planner.cfg = PlannerConfig(mode="auto", retire_every=1000)  # every step drafts: each one observed
    real_chunks, slow = eng._prefill_chunks, 0.25

    def chunks(c):  # a prefill that takes long on the host (the CPU has no device to overlap with)
        _time.sleep(slow)
        return real_chunks(c)

    seen, outs = [], []
    real_observe, real_step = eng.planner.observe, eng.runner.step
    monkeypatch.setattr(eng, "_prefill_chunks", chunks)
    monkeypatch.setattr(
        eng.planner, "observe", lambda rids, acc, w, b, sec, **k: seen.append(sec) or real_observe(rids, acc, w, b, sec, **k)
    )  # fmt: skip
    monkeypatch.setattr(eng.runner, "step", lambda *a, **k: outs.append(real_step(*a, **k)) or outs[-1])
    prompts = _prompts(3, seed=5)
    eng.add_request(Request(prompts[0].tolist(), SamplingParams(max_new_tokens=12)))
    eng.step()  # its prefill alone
    for p in prompts[1:]:
        eng.add_request(Request(p.tolist(), SamplingParams(max_new_tokens=4)))
    eng.run_until_done()
    inside = [o.overlap_s for o in outs if o.overlap_s > slow / 2]
    assert inside and min(inside) >= slow  # the later prompts were prefilled inside steps, reported apart
    assert len(seen) == len(outs) and max(seen) < slow, (seen, inside)  # and not in any step's cost


def test_batched_prefill_equals_one_at_a_time(llama, monkeypatch):
    """Several admitted prompts of different lengths, some longer than the prefill budget (chunks
    across steps), prefilled as one padded forward: the same outputs, first tokens and prompt
    logprobs as one forward per request; when the batched forward fails, each goes alone."""
    t, d = llama
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in (5, 40, 17, 3, 29, 11)]

    def broken(chunks):
        raise RuntimeError("batched forward failed")

    def serve(batch_mode):
        eng = LLMEngine(t, d, EngineConfig(max_running_requests=4, num_draft_tokens=4, context_length=128,
                                               max_total_tokens=4096, page_size=8, runner="static",
                                               chunked_prefill_size=24, speculative_planner="off"))  # fmt: skip
        calls = []
        real = eng.runner.prefill_batch
        if batch_mode == "off":
            monkeypatch.setattr(
                eng.runner, "prefill_batch", lambda chunks: [eng.runner.prefill(r, n) for r, n in chunks]
            )
        elif batch_mode == "fails":
            monkeypatch.setattr(eng.runner, "prefill_batch", broken)
        else:
            monkeypatch.setattr(eng.runner, "prefill_batch", lambda chunks: calls.append(len(chunks)) or real(chunks))
        reqs = [
            Request(
                p.tolist(), SamplingParams(max_new_tokens=9, ignore_eos=True, prompt_logprobs=2 if i % 3 == 0 else None)
            )
            for i, p in enumerate(prompts)
        ]
        for r in reqs:
            eng.add_request(r)
        eng.run_until_done()
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        return reqs, calls, list(eng.stats.accepted_by_position)

    batched, calls, accepted = serve("on")
    assert max(calls) > 1  # several requests' chunks did go through one forward
    for mode in ("off", "fails"):
        alone, _, acc = serve(mode)
        assert acc == accepted  # the same drafts: the draft's latents of the padded rows are not kept
        for a, b in zip(batched, alone):
            assert a.output_ids == b.output_ids
            assert a.prompt_logprobs == pytest.approx(b.prompt_logprobs, abs=1e-4)
    for p, r in zip(prompts, batched):
        ids = p.tolist()
        for _ in range(9):  # the target's own greedy continuation, EOS included (ignore_eos)
            ids.append(int(t.model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert r.output_ids == ids[p.numel() :]
        assert (r.prompt_logprobs != []) == (r.sampling.prompt_logprobs is not None)


def test_prefill_budget_cuts_only_prompts_longer_than_it(llama, monkeypatch):
    """--chunked-prefill-size 24: a prompt that one step's budget holds is never cut (it waits for
    the next step when others spent part of the budget: a cut rest cannot pack), a longer one is cut
    into chunks; no step's chunks pass the budget; greedy output is the target's."""
    t, d = llama
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in (15, 20, 17, 40, 9, 11)]
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=4, num_draft_tokens=4, context_length=128,
                                       max_total_tokens=4096, page_size=8, runner="static",
                                       chunked_prefill_size=24, speculative_planner="off"))  # fmt: skip
    seen: list[list[tuple[int, int, int]]] = []
    real = eng._prefill_chunks
    monkeypatch.setattr(
        eng, "_prefill_chunks", lambda c: seen.append([(len(r.prompt_ids), r.prefill_pos, n) for r, n in c]) or real(c)
    )
    reqs = [Request(p.tolist(), SamplingParams(max_new_tokens=6)) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert all(sum(n for *_, n in call) <= 24 for call in seen)
    assert all(n == length and pos == 0 for call in seen for length, pos, n in call if length <= 24), seen
    long = [n for call in seen for length, _, n in call if length == 40]
    assert len(long) > 1 and sum(long) == 40
    for p, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(t, p, 6)


def _block_inputs(t, d, B, W, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = d.config
    page, pages = 16, 80
    lat = torch.randn(cfg.num_hidden_layers, pages, page, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g)
    tables = torch.randperm(pages, generator=g)[: B * 8].view(B, 8).int()
    anchors = torch.randint(3, VOCAB, (B,), generator=g)
    apos = torch.randint(W // 2, 120, (B,), generator=g)  # some rows' windows start before the prompt
    return d, t.embed, lat, tables, page, anchors, apos, torch.arange(W)[None], 5


def test_compiled_draft_layers_equal_eager(llama):
    """The draft's layers as the graph runner compiles them on CUDA: traced here with the aot_eager
    backend (no C++ compiler needed), the same hidden states at several batch sizes and window
    prefixes; a graph break fails ``fullgraph``, a fallback to eager warns (an error here), and the
    layers share their compilations (few, whatever the shapes)."""
    import copy

    import torch._dynamo

    from dflash2.engine.graph_runner import paged_block_hidden

    t, d = llama
    compiled = copy.deepcopy(d)
    compiled.compile_layers(backend="aot_eager")
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (B, W) in enumerate([(1, 16), (4, 32), (3, 64), (8, 32), (2, 16)]):
            args = _block_inputs(t, d, B, W, seed=i)
            with torch.no_grad():
                torch.testing.assert_close(
                    paged_block_hidden(compiled, *args[1:]), paged_block_hidden(*args), rtol=1e-5, atol=1e-5
                )
        # the captured graphs' latents (graph_rows): verify steps' block rows, padded prefill chunks
        for B, w in [(1, 5), (4, 5), (8, 5), (2, 1), (8, 1), (1, 32), (4, 64)]:
            feats = torch.randn(B, w, d.fc.in_features)
            pos = torch.randint(0, 100, (B, 1)) + torch.arange(w)
            with torch.no_grad():
                torch.testing.assert_close(compiled.graph_rows(feats, pos), d.context_rows(feats, pos))
    assert compiled._layer_fn.compiled is not None and compiled._rows_fn.compiled is not None
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < frames <= 8, frames  # not one per layer, nor one per shape
    compiled.compile_off()
    assert compiled._layer_fn is None and compiled._rows_fn is None


def test_compiled_or_eager_compiles_past_dynamos_default_limit():
    """Engines of several widths in one process compile the draft layer once per width (a Python int, a
    guard) and once more for batch 1: more than dynamo's default 8 compilations, past which it would run
    the layer eagerly without a word. A tiny function stands in for the layer (the same wrapper; the
    layer itself took 73 s of CI for this)."""
    import torch._dynamo

    from dflash2.model.compiled import CompiledOrEager

    def f(x, width):
        return x[:width] * width

    # dynamo's default limit, whatever ran before; a compilation per width
    with torch._dynamo.config.patch(recompile_limit=8, automatic_dynamic_shapes=False):
        fn = CompiledOrEager(f, "f", backend="eager")
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        x = torch.arange(16.0)
        for width in range(1, 13):
            torch.testing.assert_close(fn(x, width), x[:width] * width)
    assert fn.compiled is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 12


def test_compiled_draft_layers_fall_back_to_eager(llama):
    import copy

    from dflash2.engine.graph_runner import paged_block_hidden

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    t, d = llama
    compiled = copy.deepcopy(d)
    compiled.compile_layers(backend=broken)
    args = _block_inputs(t, d, 2, 16, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with grad (training): the eager layers, no compile tried
        paged_block_hidden(compiled, *args[1:]).sum().backward()
        compiled.graph_rows(torch.randn(1, 5, d.fc.in_features), torch.arange(5)[None])
    with pytest.warns(UserWarning, match="torch.compile of the draft layer failed"), torch.no_grad():
        out = paged_block_hidden(compiled, *args[1:])
    with torch.no_grad():
        torch.testing.assert_close(out, paged_block_hidden(*args))
    assert compiled._layer_fn.compiled is None


def test_disable_torch_compile_reaches_the_runner(llama, monkeypatch):
    """``--disable-torch-compile`` is parsed by every command that builds an engine and reaches the
    graph runner, which then runs the draft eagerly even where an earlier engine compiled it."""
    import copy

    from dflash2.cli import build_parser
    from dflash2.engine import engine as engine_mod

    for cmd in (["serve"], ["run"], ["generate", "--prompt", "x"], ["bench", "speed"], ["bench", "acceptance"]):
        assert build_parser().parse_args([*cmd, "--disable-torch-compile"]).disable_torch_compile, cmd
        assert not build_parser().parse_args(cmd).disable_torch_compile
    seen = []

    class Spy(GraphModelRunner):
        def __init__(self, *a, **kw):
            seen.append(kw["compile_draft"])
            super().__init__(*a, **kw)

    monkeypatch.setattr(engine_mod, "GraphModelRunner", Spy)
    t, d = llama
    d = copy.deepcopy(d)
    for off in (True, False):
        d.compile_layers(backend="aot_eager")
        LLMEngine(t, d, EngineConfig(max_running_requests=1, disable_torch_compile=off))
        assert d._layer_fn is None  # on the CPU the runner never compiles; an earlier compile is undone
    assert seen == [False, True]


def test_cpu_engine_keeps_freed_memory_in_the_heap(llama, monkeypatch):
    """An engine on the CPU tunes glibc's malloc once (freed activations stay in the heap, so a forward
    does not page-fault its buffers in again after a larger one); on glibc the three settings apply."""
    import platform

    import dflash2.engine.engine as engine_mod
    from dflash2.engine.model_runner import tune_cpu_malloc

    calls = []
    monkeypatch.setattr(engine_mod, "tune_cpu_malloc", lambda: calls.append(1) or True)
    t, d = llama
    LLMEngine(t, d, EngineConfig(max_running_requests=2, num_draft_tokens=4, context_length=64))
    assert calls == [1]
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert tune_cpu_malloc() is True and tune_cpu_malloc() is True  # once a process, then remembered


def test_request_length_and_anchor_without_building_the_context():
    """Request.num_tokens / last_id (read per token and per step) agree with all_ids, before and after
    outputs."""
    req = Request([5, 6, 7], SamplingParams())
    assert (req.num_tokens, req.last_id) == (len(req.all_ids), req.all_ids[-1]) == (3, 7)
    req.output_ids += [9, 4]
    assert (req.num_tokens, req.last_id) == (len(req.all_ids), req.all_ids[-1]) == (5, 4)


def test_a_stop_string_ends_the_output_at_the_token_that_completes_it(llama):
    """_append finds a stop string with one decode of the step's tail (every token's tail on top of the
    output) and only then looks for the token that completed it: the output ends exactly where a decode a
    token would end it, whatever the step's size, across token boundaries, and a string that never
    appears does not stop it."""
    import transformers as tf

    from dflash2.target.loading import default_target_path

    t, d = llama
    eng = LLMEngine(t, d, EngineConfig(max_running_requests=2, context_length=128))
    tok = tf.AutoTokenizer.from_pretrained(default_target_path())
    eng.target.tokenizer = tok
    ids = tok("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda", add_special_tokens=False)["input_ids"]
    for stop in ("a gam", "ta th", "lambda", "zeta eta", "omega"):
        hits = [k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k][-32:], skip_special_tokens=True)]
        for step in (1, 2, 3, 5, 8):
            req = Request([1, 2], SamplingParams(max_new_tokens=100), stop_strings=(stop,))
            while not req.finished and len(req.output_ids) < len(ids):
                n = len(req.output_ids)
                eng._append(req, ids[n : n + step])
            if hits:
                assert req.output_ids == ids[: hits[0]] and req.finish_reason == "stop" and req.matched_stop == stop
            else:
                assert req.output_ids == ids and not req.finished


def test_append_ends_a_request_where_the_per_token_rules_do(llama):
    """A step's tokens go in at once where none of them can end the request (no EOS or stop id, room
    under ``max_new_tokens`` and the context); wherever one might, the rules run token by token. Either
    way the output, finish reason and matched stop are the per-token rules' (``stop_reason`` over each
    token as it is appended, then the context length), over random blocks, stop ids, ``min_tokens``,
    ``ignore_eos``, length limits and context lengths."""
    from dflash2.engine.steps import stop_reason

    t, d = llama
    g = torch.Generator().manual_seed(7)
    for ctx in (24, 40, 128):
        eng = LLMEngine(t, d, EngineConfig(max_running_requests=2, context_length=ctx))
        eng.eos = {3}
        for case in range(60):
            r = lambda n: int(torch.randint(0, n, (), generator=g))  # noqa: E731
            max_new = 1 + r(30)
            sp = SamplingParams(
                max_new_tokens=max_new,
                min_tokens=min(r(6), max_new),
                ignore_eos=bool(r(4) == 0),
                stop_token_ids=[4 + r(3)] if r(2) else [],
            )
            prompt = list(range(5, 5 + 2 + r(12)))
            req, ref, reason, matched = Request(prompt, sp), [], None, None
            while not req.finished and len(req.output_ids) < 40:
                block = [int(x) for x in torch.randint(3, 12, (1 + r(6),), generator=g)]
                eng._append(req, block)
                for tok in block:  # the reference: every rule after every token
                    if reason:
                        break
                    ref.append(tok)
                    reason = stop_reason(tok, len(ref), sp, eng.eos)
                    matched = tok if reason == "stop" else None
                    if reason is None and len(prompt) + len(ref) >= ctx:
                        reason = "length"
                assert req.output_ids == ref, (ctx, case)
                assert req.finish_reason == reason and req.matched_stop == matched, (ctx, case)
            assert req.finished or len(req.output_ids) >= 40
