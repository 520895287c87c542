"""Hardening regressions (issue 19), in-process: sampling bounds, verifiers over a broken q_draft,
drafter config and checkpoint refusals, manifest-bound folders, fetch against hostile sources,
linear-time parsers, and an engine whose loop survives any failing step."""

import http.server
import json
import math
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_config
from targets import VOCAB, build, exact_joint, sharp_v8_llama, v8_draft
from test_speculative import hf_greedy, random_draft
from dflash2.config import ConfigError, DFlash2Config
from dflash2.engine import engine as engine_mod
from dflash2.engine.engine import EngineConfig, LLMEngine, RequestError
from dflash2.engine.request import Request
from dflash2.integrity.manifest import ManifestError, fetch, read_manifest, verify_folder, write_manifest
from dflash2.model import DFlash2DraftModel
from dflash2.model.checkpoint import CheckpointError, load_draft, save_draft
from dflash2.server.parsers import ToolCallParser
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams, block_verify, probs_from_logits, token_level_verify

warnings.filterwarnings("ignore")


# ---- sampling values ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", 1e39),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_k", 2**63),
        ("top_k", -2),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("top_p", math.nan),
        ("min_p", -0.1),
        ("max_new_tokens", 0),
        ("stop_token_ids", (-1,)),
    ],
)
def test_sampling_values_are_bounded(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-40).temperature == 0.0
    assert not SamplingParams(temperature=1e-4).greedy
    logits = torch.randn(3, 50)
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), 50).float()
    assert torch.equal(probs_from_logits(logits, 1e-40), onehot)
    rows = probs_from_logits(logits, torch.tensor([1e-40, 1.0, 0.0]))
    assert torch.equal(rows[0], onehot[0]) and torch.equal(rows[2], onehot[2]) and torch.isfinite(rows).all()


# ---- verifiers over a q_draft that is not a distribution --------------------------------------------
def _chi2_ok(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test over the outcomes expected at least 5 times, the rest pooled into one bin (the
    statistic is not chi-square distributed over bins expected 0.01 times: one hit there reads as
    p = 1e-12); outcomes of probability 0 must never occur."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    exp = probs.double() / probs.double().sum() * tokens.numel()
    if counts[exp == 0].sum() > 0:
        return False
    big, small = exp >= 5, (exp > 0) & (exp < 5)
    obs, want = counts[big], exp[big]
    if small.any():
        obs, want = torch.cat([obs, counts[small].sum()[None]]), torch.cat([want, exp[small].sum()[None]])
    return chisquare(obs.numpy(), (want * obs.sum() / want.sum()).numpy()).pvalue > 1e-4


def test_chi2_ok_has_power_and_no_false_alarm_from_rare_outcomes():
    """Over 512 outcomes, most expected under once in 4,000 draws (the engine tests' shape): exact draws
    pass, a shift of 7% of the mass (total variation) toward the likely outcomes fails, a draw of a probability-0 outcome fails."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(512, generator=gen) * 2.5, -1)
    assert sum(_chi2_ok(torch.multinomial(probs, 4000, True, generator=gen), probs) for _ in range(5)) >= 4
    skewed = 0.7 * probs + 0.3 * torch.softmax(torch.log(probs) * 2, -1)
    assert not _chi2_ok(torch.multinomial(skewed, 4000, True, generator=gen), probs)
    zero = probs.clone()
    zero[0] = 0
    assert not _chi2_ok(torch.tensor([0] + [1] * 99), zero)


@pytest.mark.parametrize("verifier", [token_level_verify, block_verify])
@pytest.mark.parametrize("bad", ["all", "nan_in_slot_1", "inf", "negative"])
def test_broken_q_draft_falls_back_to_p_target(verifier, bad):
    """The emitted tokens keep the target's distribution whatever a broken drafter hands over."""
    V, g, N = 6, 3, 30000
    gen = torch.Generator().manual_seed(0)
    p_target = torch.softmax(torch.randn(g + 1, V, generator=gen) * 1.5, -1).expand(N, -1, -1)
    q_ok = torch.softmax(torch.randn(g, V, generator=gen), -1).expand(N, -1, -1).clone()
    drafts = torch.multinomial(q_ok[0], N, replacement=True, generator=gen).T
    q = q_ok.clone()
    if bad == "all":
        q[:] = math.nan
    elif bad == "nan_in_slot_1":
        q[:, 1, 2] = math.nan
    elif bad == "inf":
        q[:, 0, 0] = math.inf
    else:
        q[:, 2, 1] = -0.5
    res = verifier(drafts, q, p_target, torch.rand(N, g, generator=gen), torch.rand(N, generator=gen))
    first = res.tokens[:, 0]
    assert (res.tokens[torch.arange(N), res.num_accepted] >= 0).all()
    if verifier is block_verify or bad in ("all", "inf"):
        assert int(res.num_accepted.max()) == 0  # nothing of a broken block is trusted
    else:
        assert int(res.num_accepted.max()) <= (1 if bad == "nan_in_slot_1" else 2)
    assert _chi2_ok(first, p_target[0, 0])
    # the token after an accepted first draft follows p_target's second row
    acc = res.num_accepted >= 1
    if int(acc.sum()) > 1000:
        assert _chi2_ok(res.tokens[acc, 1], p_target[0, 1])


# ---- drafter config and checkpoint ----------------------------------------------------------------
@pytest.mark.parametrize(
    "key,value",
    [
        ("rope_theta", 0),
        ("rms_norm_eps", -1),
        ("block_size", 4096),
        ("output_multiplier", math.nan),
        ("output_multiplier", 0),
        ("final_logit_softcapping", math.inf),
        ("rope_theta", math.nan),
        ("sliding_window", 10**9),
    ],
)
def test_config_values_that_break_serving_are_refused(tmp_path, key, value):
    raw = tiny_config(rope_scaling=None).to_dict()
    (raw["dflash_config"] if key in raw["dflash_config"] else raw)[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))  # json writes NaN / Infinity as Python reads them
    with pytest.raises(ConfigError, match=key):
        DFlash2Config.from_file(tmp_path)


def _saved_draft(folder: Path, **kw) -> DFlash2DraftModel:
    torch.manual_seed(0)
    m = DFlash2DraftModel(tiny_config(rope_scaling=None)).init_weights(std=0.2)
    save_draft(m, folder, **kw)
    return m


def test_non_finite_tensor_is_refused_by_name(tmp_path):
    m = _saved_draft(tmp_path / "ok")
    load_draft(tmp_path / "ok")
    name = (
        "layers.1.mlp.down_proj.weight"
        if "layers.1.mlp.down_proj.weight" in m.state_dict()
        else sorted(k for k, v in m.state_dict().items() if v.is_floating_point())[-1]
    )
    with torch.no_grad():
        m.state_dict()[name].view(-1)[3] = math.nan
    save_draft(m, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*non-finite"):
        load_draft(tmp_path / "bad")


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/tmp/abs.safetensors", "sub/x.safetensors", "config.json"]
)
def test_index_shards_must_be_plain_names_inside(tmp_path, shard):
    _saved_draft(tmp_path / "d", max_shard_bytes=20_000)
    index = tmp_path / "d" / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    first = next(iter(raw["weight_map"]))
    raw["weight_map"][first] = shard
    index.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="plain"):
        load_draft(tmp_path / "d")


def test_verify_refuses_unlisted_loadable_files(tmp_path):
    d = tmp_path / "d"
    _saved_draft(d)
    write_manifest(d, tmp_path / "M.json")
    lines = []
    assert verify_folder(d, tmp_path / "M.json", progress=False, out=lines.append)
    (d / "README.md").write_text("notes")  # not something a loader reads
    assert verify_folder(d, tmp_path / "M.json", progress=False, out=lines.append)
    for extra in ("model.safetensors.index.json", "token_map.pt", "model-00001-of-00002.safetensors"):
        (d / extra).write_bytes(b"{}")
        lines.clear()
        assert not verify_folder(d, tmp_path / "M.json", progress=False, out=lines.append)
        assert any(l.startswith(f"FAIL {extra}") and "not listed" in l for l in lines)
        (d / extra).unlink()


# ---- manifests and fetch against hostile sources -----------------------------------------------------
@pytest.mark.parametrize("path", ["", ".", "a/../b", "/etc/passwd", "a//b", "./x"])
def test_manifest_paths_must_name_files_inside(tmp_path, path):
    (tmp_path / "M.json").write_text(json.dumps({"files": [{"path": path, "size": 1, "sha256": "0" * 64}]}))
    with pytest.raises(ManifestError, match="unsafe path|not a file name"):
        read_manifest(tmp_path / "M.json")


@pytest.mark.parametrize(
    "body",
    [
        "[]",
        '{"files": 3}',
        '{"files": [{"path": "a", "size": -1, "sha256": "00"}]}',
        '{"files": [{"path": "a", "size": 1, "sha256": "zz"}]}',
        "\xff",
    ],
)
def test_malformed_manifest_is_one_line_and_exit_1(tmp_path, capsys, body):
    from dflash2.cli import main

    (tmp_path / "M.json").write_text(body, encoding="latin-1")
    for argv in (
        ["verify", str(tmp_path), str(tmp_path / "M.json")],
        ["fetch", str(tmp_path / "M.json"), "--dir", str(tmp_path / "x"), "--source", "file:///nowhere"],
        ["verify", str(tmp_path), str(tmp_path / "missing.json")],
    ):
        assert main(argv) == 1
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err and ("REJECTED" in out.out)


class _Hostile(http.server.BaseHTTPRequestHandler):
    mode = "huge"

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.mode == "garbage":
            self.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
            return
        self.send_response(200)
        self.end_headers()  # no Content-Length: the source decides how much it writes
        try:
            if self.mode == "huge":
                for _ in range(50):  # 50 MB if nobody stops reading
                    self.wfile.write(b"x" * (1 << 20))
            else:  # a trickle: one byte every 0.2 s, never a read timeout
                for _ in range(10_000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _hostile(mode):
    handler = type("H", (_Hostile,), {"mode": mode})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("mode", ["huge", "slow", "garbage"])
def test_fetch_bounds_a_hostile_source_and_uses_the_next(tmp_path, mode):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(4096))
    write_manifest(src, tmp_path / "M.json")
    srv, url = _hostile(mode)
    lines = []
    t0 = time.monotonic()
    try:
        assert fetch(tmp_path / "M.json", tmp_path / "dl", [url, f"file://{src}"], out=lines.append, deadline_s=2.0)
    finally:
        srv.shutdown()
    assert time.monotonic() - t0 < 60
    assert (tmp_path / "dl" / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    assert any(f"from file://{src}" in l for l in lines), lines
    if mode == "huge":
        assert any("more than the manifest" in l for l in lines), lines
    if mode == "slow":
        assert any("deadline" in l for l in lines), lines


def test_fetch_never_writes_through_a_symlink(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(1000))
    (src / "sub").mkdir()
    (src / "sub" / "v.bin").write_bytes(os.urandom(1000))
    write_manifest(src, tmp_path / "M.json")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep me")
    dl = tmp_path / "dl"
    dl.mkdir()
    (dl / "w.bin").symlink_to(outside / "victim")
    (dl / "sub").symlink_to(outside)
    lines = []
    assert not fetch(tmp_path / "M.json", dl, [f"file://{src}"], out=lines.append)
    assert (outside / "victim").read_bytes() == b"keep me" and sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert sum("symlink" in l for l in lines) == 2, lines


# ---- parsers -----------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_tool_call_parsers_are_linear_in_a_whitespace_run():
    """A run of whitespace after an opening tag made the old regexes cubic (4,000 spaces: 17 s a search)."""
    for kind, open_, close in (
        ("hermes", "<tool_call>", "</tool_call>"),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>f", "<|tool_call_end|><|tool_calls_section_end|>"),
    ):
        p = ToolCallParser(kind)
        assert p.feed("hi " + open_) == ("hi ", [])
        for _ in range(4000):
            assert p.feed(" ") == ("", [])
        if kind == "kimi_k2":
            p.feed("<|tool_call_argument_begin|>")
        content, calls = p.feed(' {"name": "f", "arguments": {"x": 1}} ' if kind == "hermes" else '{"x": 1}')
        content2, calls2 = p.feed(close)
        assert [c["function"]["name"] for c in calls + calls2] == ["f"]
        text = "a" + open_ + " " * 200_000 + "z"
        assert ToolCallParser.parse(kind, text)[1] == []


# ---- the engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    t = TargetModel(build("llama", seed=3), layer_ids=[0, 2])
    return t, random_draft(t, 3).draft


def _engine(llama, **kw):
    t, d = llama
    cfg = dict(max_running_requests=4, num_draft_tokens=5, context_length=128, max_total_tokens=4096, page_size=8)
    cfg.update(kw)
    return LLMEngine(t, d, EngineConfig(**cfg))


def _req(prompt, n=12, **kw):
    return Request(list(prompt), SamplingParams(max_new_tokens=n, **kw))


def _wait(reqs, timeout=120):
    t0 = time.monotonic()
    while not all(r.finished for r in reqs):
        assert time.monotonic() - t0 < timeout, "requests did not finish"
        time.sleep(0.01)


def test_first_tokens_of_one_prefill_fail_alone(llama, monkeypatch):
    """Prompts prefilled in one call draw their first tokens in one call; if it raises, they are
    drawn one by one, so only the request whose draw fails ends in error."""
    ref = _req([5, 6, 7, 8])
    eng = _engine(llama)
    eng.add_request(ref)
    eng.run_until_done()
    real = engine_mod.first_tokens
    sizes = []

    def poisoned(logits, samplings, gens, stops, *rest):
        sizes.append(len(samplings))
        if any(s.max_new_tokens == 7 for s in samplings):
            raise RuntimeError("poisoned row")
        return real(logits, samplings, gens, stops, *rest)

    monkeypatch.setattr(engine_mod, "first_tokens", poisoned)
    pair = [_req([5, 6, 7, 8], n=7), _req([5, 6, 7, 8]), _req([9, 6, 7, 8])]
    for r in pair:
        eng.add_request(r)
    eng.run_until_done()
    assert sizes[0] == 3, sizes  # one call for the three
    assert pair[0].finish_reason == "error" and "poisoned" in pair[0].error
    assert pair[1].output_ids == ref.output_ids and pair[2].finish_reason in ("stop", "length")


def test_engine_loop_survives_failing_steps(llama, monkeypatch):
    eng = _engine(llama)
    eng.start()
    try:
        ok = _req([5, 6, 7, 8])
        eng.add_request(ok)
        _wait([ok])
        ref = list(ok.output_ids)
        # 1. the first-token sampling of one prefill raises (as a tensor overflow did)
        real = engine_mod.first_tokens
        calls = {"n": 0}

        def once(*a, **k):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("value cannot be converted to type float without overflow")
            return real(*a, **k)

        monkeypatch.setattr(engine_mod, "first_tokens", once)
        bad, good = _req([5, 6, 7, 8]), _req([5, 6, 7, 8])
        eng.add_request(bad)
        _wait([bad])
        eng.add_request(good)
        _wait([good])
        assert bad.finish_reason == "error" and "overflow" in bad.error
        assert good.finish_reason in ("stop", "length") and good.output_ids == ref
        # 2. the scheduler itself raises once, outside every per-request handler
        real_reserve = eng.scheduler.reserve_step
        state = {"armed": True}

        victims = [_req([5, 6, 7, 8], n=40) for _ in range(2)]

        def reserve(extra: int = 0):  # once both victims are running (they are added one after the other)
            if state["armed"] and all(r.output_ids and r in eng.scheduler.running for r in victims):
                state["armed"] = False
                raise RuntimeError("scheduler broke")
            return real_reserve(extra)

        monkeypatch.setattr(eng.scheduler, "reserve_step", reserve)
        for r in victims:
            eng.add_request(r)
        _wait(victims)
        assert all(r.finish_reason == "error" and "scheduler broke" in r.error for r in victims)
        assert eng._thread.is_alive() and eng.health() is None
        after = _req([5, 6, 7, 8])
        eng.add_request(after)
        _wait([after])
        assert after.output_ids == ref
        assert eng.stats.failed == 3 and eng.stats.completed == 3
        assert eng.pool_usage()[0] == 0
    finally:
        eng.shutdown()
    assert eng.health() is not None  # a stopped engine is reported


def test_admission_refuses_bad_ids_and_what_cannot_fit(llama):
    eng = _engine(llama, max_total_tokens=64)
    for prompt, sp, param in (
        ([VOCAB], {}, "prompt"),
        ([-1, 3], {}, "prompt"),
        ([], {}, "prompt"),
        ([3, 4], {"stop_token_ids": (VOCAB + 5,)}, "stop_token_ids"),
    ):
        with pytest.raises(RequestError) as e:
            eng.add_request(_req(prompt, **sp))
        assert e.value.param == param
    with pytest.raises(RequestError, match="KV pool") as e:
        eng.add_request(_req(list(range(3, 13)), n=100))  # 10 + 100 tokens > 64 KV positions
    assert e.value.param == "max_tokens"
    eng.add_request(_req(list(range(3, 13)), n=20))  # fits


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_chunked_prefill_keeps_output_and_interleaves(llama, runner):
    t, _ = llama
    g = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(3, VOCAB, (70,), generator=g)
    ref = hf_greedy(t, long_prompt, 10)
    eng = _engine(llama, chunked_prefill_size=16, runner=runner)
    short = _req([5, 6, 7, 8], n=60, ignore_eos=True)
    eng.add_request(short)
    eng.step()
    eng.step()
    assert short.output_ids
    long = _req(long_prompt.tolist(), n=10, ignore_eos=True)
    eng.add_request(long)
    before = len(short.output_ids)
    eng.step()
    assert long.prefill_pos == 16 and not long.output_ids and len(short.output_ids) > before  # short kept decoding
    eng.run_until_done()
    assert long.output_ids == ref
    whole = _engine(llama, chunked_prefill_size=-1, runner=runner)
    again = _req([5, 6, 7, 8], n=60, ignore_eos=True)
    whole.add_request(again)
    whole.run_until_done()
    assert again.output_ids == short.output_ids


@pytest.mark.parametrize("method", ["token", "block"])
def test_nan_drafter_keeps_the_target_distribution(method):
    """A drafter with one NaN weight (loaded past the checks) can cost speed, never correctness:
    the first two sampled tokens through the engine follow the target's exact joint distribution."""
    V = 8
    model = sharp_v8_llama(3)
    t, d = TargetModel(model, layer_ids=[0]), v8_draft()
    with torch.no_grad():
        d.fc.weight.view(-1)[0] = math.nan
    prompt = [1, 2, 3]
    joint = exact_joint(model, prompt, 2)
    eng = LLMEngine(
        t,
        d,
        EngineConfig(
            max_running_requests=64,
            num_draft_tokens=4,
            block_verification=method == "block",
            context_length=64,
            max_total_tokens=64 * 16,
            page_size=8,
        ),
    )
    n = 3000
    reqs = [
        Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=s, ignore_eos=True)) for s in range(n)
    ]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    assert all(r.finish_reason == "length" for r in reqs), {r.error for r in reqs}
    assert eng.stats.accepted_by_position[0] == 0  # every draft was rejected
    pairs = torch.tensor([r.output_ids[0] * V + r.output_ids[1] for r in reqs])
    assert _chi2_ok(pairs, joint)
