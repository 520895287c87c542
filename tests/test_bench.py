"""Acceptance metrics, GPQA shuffling, and the acceptance benchmark against a live server."""

import json
import subprocess
import sys

import pytest

from dflash2.benchmark.metrics import aggregate, per_position
from dflash2.benchmark.suites import gpqa_shuffle


def test_aggregates_match_definitions():
    C, V = [10, 30, 5], [5, 10, 5]
    r = aggregate(C, V)
    L = [2.0, 3.0, 1.0]
    assert r["samples"] == 3
    assert r["acc_len"] == pytest.approx(sum(L) / 3)
    assert r["weighted_al"] == pytest.approx((10 * 2 + 30 * 3 + 5 * 1) / 45)
    assert r["pooled_al"] == pytest.approx(45 / 20)
    assert per_position([2, 3, 5]) == pytest.approx([0.8, 0.5])


def test_gpqa_shuffle_deterministic_and_keeps_answer():
    q, right, wrong = "Which is heavier?", "lead", ["air", "foam", "paper"]
    p1, l1 = gpqa_shuffle(q, right, wrong, seed=0, index=3)
    p2, l2 = gpqa_shuffle(q, right, wrong, seed=0, index=3)
    assert (p1, l1) == (p2, l2)
    assert f"{l1}) lead" in p1
    letters = {gpqa_shuffle(q, right, wrong, seed=0, index=i)[1] for i in range(40)}
    assert len(letters) > 1  # shuffled per question
    assert "Answer: $LETTER" in p1


def test_acceptance_bench_against_live_server(tmp_path, models):
    from test_server import REPO, _start

    root = models[0]
    proc, url = _start(root, "--max-running-requests", "4")
    try:
        data = tmp_path / "g.jsonl"
        data.write_text("\n".join(json.dumps({"question": f"What is {i} + {i}?", "answer": "x"}) for i in range(6)))
        from dflash2.training.sources import Prompt, save_prompts

        held = tmp_path / "heldout_prompts.jsonl"  # a recipe's held-out split: multi-turn, two domains
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        save_prompts(
            [
                Prompt(turns + [{"role": "user", "content": f"more {i}"}], d, "sharegpt", f"k{i}", 1)
                for i, d in enumerate(["chat", "code", "chat"])
            ],  # fmt: skip
            held,
        )
        out = tmp_path / "res.json"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "dflash2.cli",
                "bench",
                "acceptance",
                "--base-url",
                url,
                "--tokenizer-path",
                str(root / "target"),
                "--dataset",
                "gsm8k,heldout",
                "--gsm8k-path",
                str(data),
                "--heldout-path",
                str(held),
                "--max-tokens",
                "16",
                "--num-workers",
                "3",
                "--output",
                str(out),
                "--plot",
                str(tmp_path / "al.png"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        res = json.loads(out.read_text())["gsm8k"]
        assert res["samples"] == 6 and len(res["C"]) == 6 and len(res["V"]) == 6
        assert {"acc_len", "weighted_al", "pooled_al"} <= set(res)
        assert res["pooled_al"] == pytest.approx(sum(res["C"]) / sum(res["V"]))
        assert "gsm8k" in p.stdout and (tmp_path / "al.png").stat().st_size > 1000
        all_res = json.loads(out.read_text())
        assert [all_res[k]["samples"] for k in ("heldout/chat", "heldout/code", "heldout/all")] == [2, 1, 3]
        pooled = all_res["heldout/all"]
        assert pooled["pooled_al"] == pytest.approx(sum(pooled["C"]) / sum(pooled["V"]))
        assert sorted(pooled["C"]) == sorted(all_res["heldout/chat"]["C"] + all_res["heldout/code"]["C"])
    finally:
        proc.terminate()
        proc.wait(10)


def test_engine_speed_rows(tmp_path):
    import torch
    from targets import build
    from test_speculative import random_draft
    from dflash2.benchmark.engine_speed import measure, save, table
    from dflash2.target import TargetModel

    t = TargetModel(build("llama"), layer_ids=[0, 2])
    draft = random_draft(t).draft
    ids = [torch.randint(3, 96, (6,)).tolist() for _ in range(3)]
    rows = [measure(t, None, ids, 1, False, 2, 8, 0.0, "target")]
    for c in (1, 2):
        r = measure(t, draft, ids, 5, True, c, 8, 0.0, "dflash2 w=5 block")
        r.speedup = r.tokens_per_s / rows[0].tokens_per_s
        rows.append(r)
    assert all(r.output_tokens == 3 * 8 for r in rows[1:]) and rows[1].verify_ms_per_step > 0
    # host time outside the runner's step: some, and less than the whole step
    step_ms = [r.draft_ms_per_step + r.verify_ms_per_step + r.overhead_ms_per_step for r in rows]
    assert all(0 < r.host_ms_per_step < ms for r, ms in zip(rows, step_ms))
    # its parts: the planner's calls, the batch's draws, the tokens' commit (some), within it
    parts = [r.plan_ms_per_step + r.draw_ms_per_step + r.commit_ms_per_step for r in rows]
    assert all(r.commit_ms_per_step > 0 and p <= r.host_ms_per_step * (1 + 1e-9) for r, p in zip(rows, parts))
    # each round's steps by width: the target alone's at 1; the fixed width's at 5, none retired
    assert rows[0].round_widths == [{"1": rows[0].round_widths[0]["1"], "plain": 0, "retired": 0, "not_drafting": 0}]
    assert rows[0].round_widths[0]["1"] >= 8
    assert all(r.round_widths[0].get("5", 0) > 0 and r.round_widths[0]["retired"] == 0 for r in rows[1:])
    assert all(r.gc_ms_per_step >= 0 and len(r.gc_collections) == 3 for r in rows)
    save(rows, tmp_path / "s.json", tmp_path / "s.png")
    assert "dflash2 w=5 block" in table(rows) and (tmp_path / "s.png").stat().st_size > 1000


def test_gc_pauses_count_collections_by_generation():
    import gc

    from dflash2.benchmark.engine_speed import GCPauses

    pauses = GCPauses()
    gc.callbacks.append(pauses)
    try:
        gc.collect()
        gc.collect(0)
    finally:
        gc.callbacks.remove(pauses)
    assert pauses.count[2] >= 1 and pauses.count[0] >= 1 and pauses.seconds > 0


def test_engine_speed_shares_engines_across_levels_and_temperatures(monkeypatch):
    """With ``slots`` every config builds one engine for all its levels and both temperatures: each
    level caps the running requests at its concurrency and starts with a planner that learnt nothing."""
    import torch
    from targets import build
    from test_speculative import random_draft
    from dflash2.benchmark import engine_speed as es
    from dflash2.target import TargetModel

    t = TargetModel(build("llama"), layer_ids=[0, 2])
    draft = random_draft(t).draft
    built = []
    real = es.LLMEngine

    def counting(*a, **kw):
        built.append(real(*a, **kw))
        return built[-1]

    monkeypatch.setattr(es, "LLMEngine", counting)
    monkeypatch.setattr(es, "render", lambda tok, p: torch.randint(3, 96, (6,)).tolist())
    from dflash2.engine.planner import Planner

    fresh, restarted = Planner.fresh, []
    monkeypatch.setattr(Planner, "fresh", lambda self: restarted.append(self) or fresh(self))
    shared = es.SharedEngines("auto")
    args = (t, draft, ["a", "b", "c"], [5], ["block"], [1, 2], 6)
    rows = es.run(*args, 0.0, requests_per_slot=2, slots=2, shared=shared, adaptive=True, warmup=False)
    rows += es.run(*args, 1.0, requests_per_slot=2, slots=2, shared=shared, adaptive=True, warmup=False)
    # the target, and one engine with the planner's graphs for both w5 rows (fixed, auto): for 4 levels
    assert len(built) == 2 and len(shared.engines) == 2
    assert all(e.cfg.max_running_requests == 2 and e.cfg.graph_sampling == "both" for e in built)
    assert [p.cfg.mode for p in shared.planners.values()] == ["off", "auto", "off"]  # target, build, fixed
    assert [r.mean_width for r in rows if r.config == "dflash2 w=5 block"] == [5.0] * 4  # fixed: always w5
    assert len(restarted) == 3 * 3  # every level after the first starts each planner afresh
    with pytest.raises(ValueError, match="built for planner 'auto', this run needs 'auto:3'"):
        es.run(*args, 0.0, slots=2, shared=shared, adaptive=True, planner_widths="3")
    for r in rows:  # each level held its own concurrency: every step of c=1 a batch of one
        buckets = {int(k.split("x")[0]) for k in r.step_ms_by_shape}
        assert r.requests == (2 if r.concurrency == 1 else 3)
        assert buckets == {1} if r.concurrency == 1 else max(buckets) == 2
        # every shape's graphs timed apart from its wall (on the CPU the forwards' host time): within it
        assert r.device_ms_by_shape.keys() == r.step_ms_by_shape.keys()
        for k, (n, ms) in r.device_ms_by_shape.items():
            assert n == r.step_ms_by_shape[k][0] and 0 < ms <= r.step_ms_by_shape[k][1]
    with pytest.raises(ValueError, match="slots 1 below"):
        es.run(*args, 0.0, slots=1)


def test_engine_speed_times_the_static_runners_graphs(monkeypatch):
    """The static runner's steps (the CUDA-graph runner, eager on the CPU) are timed apart from their wall
    by shape, the target's and the drafter's engines alike: the wall over the graphs is host or waiting."""
    import torch
    from targets import build
    from test_speculative import random_draft
    from dflash2.benchmark import engine_speed as es
    from dflash2.target import TargetModel

    t = TargetModel(build("llama"), layer_ids=[0, 2])
    draft = random_draft(t).draft
    monkeypatch.setattr(es, "render", lambda tok, p: torch.randint(3, 96, (6,)).tolist())
    rows = es.run(t, draft, ["a", "b", "c"], [3], ["block"], [2], 5, 1.0, warmup=False, engine_kw={"runner": "static"})
    assert [r.config for r in rows] == ["target", "dflash2 w=3 block"]
    for r, line in zip(rows, es.table(rows).splitlines()[1:]):
        assert r.device_ms_by_shape and r.device_ms_by_shape.keys() == r.step_ms_by_shape.keys()
        for k, (n, ms) in r.device_ms_by_shape.items():
            assert n == r.step_ms_by_shape[k][0] and 0 < ms <= r.step_ms_by_shape[k][1]
        wall, dev = (float(x) for x in line.split()[-3].split("/"))  # the table's step/dev column: the means
        n = sum(k for k, _ in r.step_ms_by_shape.values())
        assert wall == pytest.approx(sum(k * ms for k, ms in r.step_ms_by_shape.values()) / n, abs=0.006)
        assert 0 < dev <= wall + 0.01
        # the read-back's wait (a CPU tensor's: the copy alone), in the table's column before the last
        assert 0 < r.wait_ms_per_step < wall and float(line.split()[-2]) == pytest.approx(r.wait_ms_per_step, abs=0.006)
        # the prefills: the steps' overlap over the packed replays' own time, in the last column
        overlap, replays = (float(x) for x in line.split()[-1].split("/"))
        assert replays == pytest.approx(r.prefill_device_seconds, abs=0.006) and overlap >= 0
        assert r.prefill_shapes and 0 < r.prefill_device_seconds < r.seconds  # (packed replays ran, each timed)


def test_read_back_wait_is_the_time_blocked_on_the_step():
    """A step's ``wait_s`` is the host's time blocked at its read-back: the launched step's event (async
    scheduling) and the rows' copy, not the work before it."""
    import time

    import torch
    from dflash2.engine.graph_runner import GraphModelRunner, Launched
    from dflash2.engine.request import Request
    from dflash2.verification import SamplingParams

    class SlowEvent:  # a step still running on the device for 30 ms
        def synchronize(self) -> None:
            time.sleep(0.03)

    reqs = [Request([1, 2], SamplingParams(max_new_tokens=4)) for _ in range(2)]
    rows = torch.tensor([[5, 6, 1], [7, 0, 0]])  # tokens, then the number accepted
    t0 = time.perf_counter() - 0.05  # (launched 50 ms ago: not a wait)
    launched = Launched(reqs, rows, SlowEvent(), t0, t0, None, None, None, None, None)  # type: ignore[arg-type]
    out = GraphModelRunner.collect(None, launched)  # type: ignore[arg-type]
    assert out.tokens == [[5, 6], [7]] and [r.num_committed for r in reqs] == [2, 1]
    assert 0.03 <= out.wait_s < out.verify_s - 0.04  # (the 50 ms before the read-back are not in it)


def test_engine_speed_schedules_run_each_row_under_each_schedule(monkeypatch):
    """``schedules``: every row once per schedule in one run (the overlap schedule off, on, and async
    scheduling), each speedup against the target under the same schedule, each schedule's rows with a planner
    of their own; the static runner defers its commits where the overlap schedule is on, and launches ahead
    under async scheduling only."""
    import torch
    from targets import build
    from test_speculative import random_draft
    from dflash2.benchmark import engine_speed as es
    from dflash2.engine.engine import LLMEngine
    from dflash2.engine.graph_runner import GraphModelRunner
    from dflash2.target import TargetModel

    t = TargetModel(build("llama"), layer_ids=[0, 2])
    monkeypatch.setattr(es, "render", lambda tok, p: torch.randint(3, 96, (6,)).tolist())
    row, seen, early = [""], {}, {}
    measure, defers, launch = es.measure, LLMEngine._defers, GraphModelRunner.launch
    monkeypatch.setattr(es, "measure", lambda *a, **kw: row.__setitem__(0, a[8]) or measure(*a, **kw))
    monkeypatch.setattr(
        LLMEngine, "_defers", lambda self, reqs: seen.setdefault(row[0], set()).add(d := defers(self, reqs)) or d
    )

    def counted(self, *a, ahead=False, **kw):
        early[row[0]] = early.get(row[0], 0) + ahead
        return launch(self, *a, ahead=ahead, **kw)

    monkeypatch.setattr(GraphModelRunner, "launch", counted)
    shared = es.SharedEngines("off")
    rows = es.run(
        t, random_draft(t).draft, ["a", "b", "c"], [3], ["block"], [2], 5, 1.0, requests_per_slot=2, slots=2,
        warmup=False, schedules="no-overlap,overlap,async", engine_kw={"runner": "static"}, shared=shared,
    )  # fmt: skip
    # one engine per runner, and a planner of its own for each schedule's rows (its step costs are the schedule's)
    assert len(shared.engines) == 2 and len({k[2] for k in shared.planners if k[0][0] == 3}) == 3
    names = [f"{c} {k}" for k in ("no-overlap", "overlap", "async") for c in ("target", "dflash2 w=3 block")]
    assert [r.config for r in rows] == names
    assert seen == {n: {"no-overlap" not in n} for n in names}
    assert {n: early.get(n, 0) > 0 for n in names} == {n: n.endswith("async") for n in names}
    by = {r.config: r for r in rows}
    for k in ("no-overlap", "overlap", "async"):
        assert by[f"dflash2 w=3 block {k}"].speedup == pytest.approx(
            by[f"dflash2 w=3 block {k}"].tokens_per_s / by[f"target {k}"].tokens_per_s
        )


def test_widths_between_serve_the_wider_engines_only(monkeypatch):
    """``--speed-widths 3,5 --planner-widths 3``: the width-3 engine runs plain auto (3 is not between 1 and 3),
    the width-5 one auto with a width-3 verify among its choices, and no "+w3" row is made for width 3."""
    import torch
    from targets import build
    from test_speculative import random_draft
    from dflash2.benchmark import engine_speed as es
    from dflash2.target import TargetModel

    t = TargetModel(build("llama"), layer_ids=[0, 2])
    monkeypatch.setattr(es, "render", lambda tok, p: torch.randint(3, 96, (6,)).tolist())
    shared = es.SharedEngines("auto:3")
    rows = es.run(
        t, random_draft(t).draft, ["a", "b"], [3, 5], ["block"], [2], 4, 0.0, requests_per_slot=1, slots=2,
        shared=shared, adaptive=True, planner_widths="3", warmup=False,
    )  # fmt: skip
    assert [r.config for r in rows] == [
        "target", "dflash2 w=3 block", "dflash2 w=5 block", "dflash2 w=3 block adaptive",
        "dflash2 w=5 block adaptive", "dflash2 w=5 block adaptive+w3",
    ]  # fmt: skip
    built = {key[0]: e.cfg.speculative_planner_widths for key, e in shared.engines.items()}  # their graphs
    assert built == {1: None, 3: None, 5: "3"}
    assert {(k[0][0], p.cfg.widths) for k, p in shared.planners.items() if p.cfg.mode == "auto"} == {
        (3, ()),
        (5, ()),
        (5, (3,)),
    }


def test_engine_speed_rounds_pool_and_rotate(monkeypatch):
    """Rounds run every config once each, in an order rotated per round, each round on texts of its
    own (its seeds), and pool as sum(tokens) / sum(seconds); speedup is against the pooled target row."""
    from dflash2.benchmark import engine_speed as es

    order, speed, warm, seeds = [], {"target": [10.0, 30.0], "dflash2 w=5 block": [40.0, 40.0]}, [], set()

    def fake_measure(target, draft, ids, w, block, c, mnt, temp, name, rps=None, **kw):
        seeds.add((name, kw["seed"]))
        if name == "warm-up":
            warm.append((c, w, len(order)))
            return None
        order.append(name)
        tps = speed[name][(sum(1 for n in order if n == name) - 1) % 2]
        row = es.ConcurrencyRow(name, c, 2, 100, 100 / tps, tps, 2.0 if draft else 1.0, 1.0, 2.0, 3.0)
        row.gc_seconds = 0.25 if draft else 0.0  # a collection in each of the drafting row's rounds
        row.prefill_shapes = {"128": [2, 200]} if len(order) % 2 else {"128": [1, 90], "64": [1, 50]}
        return row

    class T:
        tokenizer = None

        def set_layer_ids(self, ids):
            pass

    class D:
        class config:
            target_layer_ids = [0]

    monkeypatch.setattr(es, "measure", fake_measure)
    monkeypatch.setattr(es, "render", lambda tok, p: [1, 2])
    seen = []
    rows = es.run(
        T(),
        D(),
        ["a"],
        [5],
        ["block"],
        [4, 8],
        8,
        0.0,
        rounds=2,
        on_level=lambda r: seen.append([(x.config, x.concurrency) for x in r]),
    )
    assert order == ["target", "dflash2 w=5 block", "dflash2 w=5 block", "target"] * 2
    # every config runs once untimed at each level before its timed rounds (first-shape costs)
    assert warm == [(4, 1, 0), (4, 5, 0), (8, 1, 4), (8, 5, 4)]
    R = es.ROUND_SEEDS  # every config the same seeds in a round, another round others, the warm-up its own
    assert seeds == {(n, k * R) for n in ("target", "dflash2 w=5 block") for k in (0, 1)} | {("warm-up", 2 * R)}
    # each finished level is handed over at once (a run cut by a time limit keeps it)
    assert seen == [
        [("target", 4), ("dflash2 w=5 block", 4)],
        [("target", 4), ("dflash2 w=5 block", 4), ("target", 8), ("dflash2 w=5 block", 8)],
    ]
    target, spec = rows[:2]
    assert target.tokens_per_s == pytest.approx(200 / (10 + 100 / 30))  # pooled, not the mean of 10 and 30
    assert (target.tokens_per_s_min, target.tokens_per_s_max, target.rounds) == (10.0, 30.0, 2)
    assert (target.round_tokens_per_s, target.round_slots) == ([10.0, 30.0], [0, 3])
    assert spec.speedup == pytest.approx(40.0 / target.tokens_per_s)
    assert spec.accept_length == pytest.approx(2.0)
    # the collections' time over the rounds, in the table's gc column (ms); no step timed here: "-" after it
    assert (target.gc_seconds, spec.gc_seconds) == (0.0, 0.5)
    # the packed prefills: every round's replays and tokens, as the other counts (not the last round's)
    assert target.prefill_shapes == spec.prefill_shapes == {"128": [3, 290], "64": [1, 50]}
    lines = es.table(rows).splitlines()
    assert lines[0].split()[-9:] == ["gc", "ms", "step/dev", "ms", "wait", "ms", "prefill", "ovl/dev", "s"]
    assert [x.split()[-4:] for x in lines[1:3]] == [["0", "-", "0.00", "0.00/0.00"], ["500", "-", "0.00", "0.00/0.00"]]


def test_engine_speed_stops_rounds_and_levels_at_the_deadline(monkeypatch):
    """Past the deadline no further round of a level starts (the level keeps the rounds it ran), and
    a level does not start with less time left than the last one took."""
    from dflash2.benchmark import engine_speed as es

    clock = [0.0]
    monkeypatch.setattr(es.time, "time", lambda: clock[0])

    def fake_measure(target, draft, ids, w, block, c, mnt, temp, name, rps=None, **kw):
        clock[0] += 10.0  # every run, warm-up included, takes 10 s
        return None if name == "warm-up" else es.ConcurrencyRow(name, c, 2, 100, 10.0, 10.0, 1.0, 1.0, 2.0, 3.0)

    monkeypatch.setattr(es, "measure", fake_measure)
    monkeypatch.setattr(es, "render", lambda tok, p: [1, 2])

    def rows_with(deadline):
        clock[0] = 0.0
        target = type("T", (), {"tokenizer": None})()
        rows = es.run(target, "draft", ["a"], [5], ["block"], [4, 8], 8, 0.0, rounds=3, deadline=deadline)
        assert len(rows) % 2 == 0 and all(r.config == "target" for r in rows[::2])  # target, then w=5, a level
        return [(r.concurrency, r.rounds) for r in rows[::2]]

    # a level: 20 s of warm-up (target and w=5), then 20 s a round
    assert rows_with(None) == [(4, 3), (8, 3)]
    assert rows_with(45.0) == [(4, 2)]  # round 3 would start at 60 s; c=8 has no time left
    # c=4 done at 80 s: 60 s left is less than the 80 s it took, so c=8 is not started
    assert rows_with(140.0) == [(4, 3)]
    assert rows_with(170.0) == [(4, 3), (8, 3)]


def test_side_by_side_pairs_prompts_and_rotates(monkeypatch):
    """Batch-1 side by side: every prompt runs every config back to back, the order rotated per
    prompt; rows pool tokens over seconds and speedup is against the target row."""
    from types import SimpleNamespace

    from dflash2.benchmark import speed as sp

    calls = []

    class FakeEngine:  # one per config: the batch-1 engine with one slot
        def __init__(self, target, draft, cfg):
            assert cfg.max_running_requests == 1 and cfg.speculative == (draft is not None)
            self.width = cfg.num_draft_tokens if draft is not None else 1

        def generate(self, prompts, sampling):
            calls.append((prompts[0][0], self.width, sampling.seed))
            secs = 2.0 if self.width == 1 else 1.0  # the draft doubles tokens/s
            steps = 10 if self.width == 1 else 4
            return [
                SimpleNamespace(
                    completion_tokens=10, verify_steps=steps, total_s=secs, accept_hist=[0] * (self.width - 1) + [steps]
                )
            ]

    class T:
        tokenizer = None
        config = SimpleNamespace(max_position_embeddings=2048)

    class D:
        class config:
            target_layer_ids = [0]

    monkeypatch.setattr(sp, "LLMEngine", FakeEngine)
    monkeypatch.setattr(sp, "render", lambda tok, p: [int(p)])
    rows = sp.side_by_side(T(), D(), ["7", "8", "9"], widths=(5, 8), temperatures=(0.0,), verifies=("block",))
    warm, calls = calls[:3], calls[3:]  # one untimed short run of each config first
    assert [(c[0], c[1]) for c in warm] == [(7, 1), (7, 5), (7, 8)]
    assert [(c[0], c[1]) for c in calls] == [(7, 1), (7, 5), (7, 8), (8, 5), (8, 8), (8, 1), (9, 8), (9, 1), (9, 5)]
    assert {c[2] for c in calls if c[0] == 8} == {1}  # same seed for every config of a prompt
    assert [r.name for r in rows] == ["target T=0.0", "dflash2 w=5 block T=0.0", "dflash2 w=8 block T=0.0"]
    assert rows[0].tokens_per_s == pytest.approx(30 / 6.0) and rows[0].prompts == 3
    assert rows[1].speedup == pytest.approx(2.0) and rows[1].accept_length == pytest.approx(30 / 12)
    assert rows[2].accept_hist[-1] == 12


def test_side_by_side_on_a_tiny_model(monkeypatch):
    """The batch-1 side by side end to end on a tiny random target and draft (no fakes but the
    tokenizer): every row decodes every prompt, and the greedy rows count the same tokens."""
    import torch
    from targets import build
    from test_speculative import random_draft
    from dflash2.benchmark import speed as sp
    from dflash2.target import TargetModel

    t = TargetModel(build("llama"), layer_ids=[0, 2])
    draft = random_draft(t).draft
    prompts = {str(i): torch.randint(3, 96, (6,)).tolist() for i in range(3)}
    monkeypatch.setattr(sp, "render", lambda tok, p: prompts[p])
    rows = sp.side_by_side(
        t, draft, list(prompts), widths=(4,), temperatures=(0.0, 1.0), max_new_tokens=10, verifies=("token", "block")
    )
    assert [r.name for r in rows] == [
        "target T=0.0",
        "dflash2 w=4 greedy T=0.0",
        "dflash2 w=4 block T=0.0",
        "target T=1.0",
        "dflash2 w=4 token T=1.0",
        "dflash2 w=4 block T=1.0",
    ]
    assert all(r.prompts == 3 and r.seconds > 0 and r.accept_length >= 1 for r in rows)
    assert {r.completion_tokens for r in rows[:3]} == {rows[0].completion_tokens}
    assert sum(rows[1].accept_hist) == rows[1].verify_steps


def test_bench_speed_uses_the_loaded_width_and_verifier():
    """--speculative-num-draft-tokens and --speculative-use-block-verification reach bench speed."""
    from dflash2.benchmark.cli import cmd_speed, speed_configs
    from dflash2.cli import build_parser

    parse = lambda *a: build_parser().parse_args(["bench", "speed", *a])
    assert speed_configs(parse(), 8) == ([8], ["token"])
    assert speed_configs(parse("--speculative-num-draft-tokens", "6", "--speculative-use-block-verification"), 6) == (
        [6],
        ["block"],
    )
    assert speed_configs(parse("--widths", "5,8", "--verifiers", "token,block"), 6) == ([5, 8], ["token", "block"])
    with pytest.raises(SystemExit):
        speed_configs(parse("--verifiers", "greedy"), 5)
    with pytest.raises(SystemExit, match="--enable-mixed-chunk needs --concurrency"):  # before any model loads
        cmd_speed(parse("--enable-mixed-chunk"))


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_acceptance_bench_in_process(tmp_path, models, temperature):
    """Without --base-url the suites run through one in-process engine (one slot: the static runner) that
    makes only the step graphs of its one kind of request (greedy or sampled): every request finishes."""
    from test_server import REPO

    root = models[0]
    data = tmp_path / "g.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {i} + {i}?", "answer": "x"}) for i in range(4)))
    out = tmp_path / "res.json"
    p = subprocess.run(
        [sys.executable, "-m", "dflash2.cli", "bench", "acceptance", "--model-path", str(root / "target"),
         "--speculative-draft-model-path", str(root / "draft"), "--dtype", "float32", "--device", "cpu",
         "--gsm8k-path", str(data), "--max-tokens", "12", "--temperature", temperature, "--top-p", "0.95",
         "--max-running-requests", "1", "--num-workers", "2", "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())["gsm8k"]
    assert res["samples"] == 4 and res["failed"] == 0 and all(v > 0 for v in res["V"])
