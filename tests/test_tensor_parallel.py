"""Tensor parallelism (``--tp-size``): the target's layers split over two gloo ranks on the CPU, the
engine in lockstep on both. Lossless: the split target's greedy output is the whole target's, DFlash2
over it equals it token for token, and sampled output equals the unsplit engine's for the same seeds."""

import copy
import os
import socket
import warnings

import pytest
import torch

import transformers as tf

from targets import _common, build
from test_engine import _prompts
from test_server import REPO
from test_speculative import hf_greedy, random_draft
from dflash2.engine.engine import EngineConfig, LLMEngine
from dflash2.engine.request import Request
from dflash2.target import TargetModel
from dflash2.target.tensor_parallel import TensorParallelError, TPGroup, init_tp, shard_reason, shard_target
from dflash2.verification import SamplingParams

warnings.filterwarnings("ignore")
MAX_NEW = (30, 12, 21, 7)


def _engine(target, draft, planner: str = "off", block: bool = False, runner: str = "paged") -> LLMEngine:
    return LLMEngine(
        target,
        draft,
        EngineConfig(
            max_running_requests=3,
            speculative=draft is not None,
            num_draft_tokens=5,
            block_verification=block,
            context_length=128,
            max_total_tokens=4096,
            page_size=8,
            speculative_planner=planner,
            runner=runner,
        ),
    )


def _requests(prompts, sampled: bool, seeds=None) -> list[Request]:
    return [
        Request(
            p.tolist(),
            SamplingParams(
                temperature=1.0 if sampled else 0.0,
                top_p=0.9 if sampled else 1.0,
                max_new_tokens=MAX_NEW[i % len(MAX_NEW)],
                seed=None if seeds is None else seeds[i],
            ),
        )
        for i, p in enumerate(prompts)
    ]


def _lockstep(eng: LLMEngine, prompts, sampled: bool, abort_last: bool = False, warm_up: bool = False, seeds=None):
    """Rank 0 drives the engine (and aborts its last request after a few steps); the other rank
    follows. Returns rank 0's requests (None elsewhere) and what every rank's counters saw."""
    reqs = None
    if warm_up:  # on every rank, as generate()
        eng.warm_up()
    if eng.tp.leader:
        reqs = [eng.add_request(r) for r in _requests(prompts, sampled, seeds)]
        assert eng.request_ids() == [r.request_id for r in reqs]  # (not handed out yet: abort_all sees them)
        for _ in range(3 if abort_last else 0):
            eng.step()
        if abort_last:
            eng.abort(reqs[-1].request_id)
        eng.run_until_done()
        eng.shutdown()
    else:
        eng.follow()
    s = eng.stats
    return reqs, (s.steps, s.verify_steps, dict(s.steps_by_width), list(s.accepted_by_position), s.drafts_proposed)


def _tp_rank(rank: int, port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    try:
        tp = init_tp(2, "cpu")
        model = build("llama", seed=3)
        whole = TargetModel(copy.deepcopy(model), layer_ids=[0, 2])
        draft = random_draft(whole, 3).draft
        shard_target(model, tp)
        split = TargetModel(model, layer_ids=[0, 2])
        split.tp = tp
        ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(0))
        logits_diff = (split.model(ids).logits - whole.model(ids).logits).abs().max().item()
        torch.manual_seed(5)  # every Linear biased: o / down's bias must be added once
        biased = tf.LlamaForCausalLM(tf.LlamaConfig(**_common(attention_bias=True, mlp_bias=True))).eval()
        with torch.no_grad():
            for name, p in biased.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
        for other in (build("qwen2", seed=4), build("qwen3", seed=4), biased):  # + per-head q/k norms
            ref = copy.deepcopy(other)(ids).logits
            logits_diff = max(logits_diff, (shard_target(other, tp)(ids).logits - ref).abs().max().item())
        prompts = _prompts(7, seed=11)
        runs = {
            "target": _lockstep(_engine(split, None), prompts, False),
            "greedy": _lockstep(_engine(split, draft), prompts, False),
            "sampled": _lockstep(_engine(split, draft), prompts, True, abort_last=True),
            "block_auto": _lockstep(_engine(split, draft, "auto", True), prompts, True, warm_up=True),
            "static_greedy": _lockstep(_engine(split, draft, runner="static"), prompts, False),
        }
        # offline generate(), called on every rank: each returns the same results (sampled, seeds drawn by rank 0)
        hot = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12)
        spmd = _engine(split, draft).generate([p.tolist() for p in prompts], hot)
        seeds = tp.share([r.sampling.seed for r in runs["sampled"][0]] if tp.leader else None)
        runs["static_sampled"] = _lockstep(_engine(split, draft, runner="static"), prompts, True, seeds=seeds)
        out = {"logits_diff": logits_diff, "stats": {k: v[1] for k, v in runs.items()}}
        out["spmd"] = [(g.token_ids, g.accept_hist) for g in spmd]
        if tp.leader:
            out["outputs"] = {
                k: [(r.output_ids, r.accept_hist, r.finish_reason) for r in v[0]] for k, v in runs.items()
            }
            out["hf"] = [hf_greedy(whole, p, MAX_NEW[i % len(MAX_NEW)]) for i, p in enumerate(prompts)]
            ref = _engine(whole, draft)
            ref_reqs = [ref.add_request(r) for r in _requests(prompts[:-1], True, seeds)]
            ref.run_until_done()
            out["whole_sampled"] = [(r.output_ids, r.accept_hist) for r in ref_reqs]
        queue.put((rank, out))
    except BaseException as e:  # the parent reports it rather than waiting out its timeout
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise


def test_two_ranks_are_lossless_and_in_lockstep():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():  # a rank stuck in a collective its peer never joined
                p.kill()
    assert "error" not in got[0] and "error" not in got[1], (got[0].get("error"), got[1].get("error"))
    assert all(p.exitcode == 0 for p in procs)
    lead, follower = got[0], got[1]
    assert lead["logits_diff"] < 1e-5 and follower["logits_diff"] < 1e-5  # the split sums what the whole adds
    # every rank ran the same steps at the same widths with the same acceptances (the planner's too)
    assert lead["stats"] == follower["stats"]
    assert lead["spmd"] == follower["spmd"] and len(lead["spmd"]) == 7
    assert lead["stats"]["block_auto"][0] > 0
    out = lead["outputs"]
    assert [o for o, _, _ in out["target"]] == lead["hf"]  # the split target greedy = the whole one's
    assert [o for o, _, _ in out["greedy"]] == lead["hf"]  # DFlash2 over it: the target's own
    assert [o for o, _, _ in out["static_greedy"]] == lead["hf"]  # the static-slot runner's forward too
    assert out["sampled"][-1][2] == "abort"
    assert [(o, h) for o, h, _ in out["sampled"][:-1]] == lead["whole_sampled"]  # same seeds, same tokens
    assert [(o, h) for o, h, _ in out["static_sampled"][:-1]] == lead["whole_sampled"]
    assert all(f in ("stop", "length") for _, _, f in out["block_auto"])


def test_split_refusals_name_the_reason(monkeypatch):
    assert shard_reason(build("llama"), 2) is None
    assert "num_attention_heads = 4 is not a multiple of --tp-size 3" in shard_reason(build("llama"), 3)
    assert "no self_attn.q_proj" in shard_reason(build("deepseek_v3"), 2)  # MLA + experts
    assert "layer types" in shard_reason(build("kimi_linear"), 2)

    with pytest.raises(TensorParallelError, match="not a multiple"):
        shard_target(build("llama"), TPGroup(rank=0, size=3))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(TensorParallelError, match="torchrun --nproc-per-node 2"):
        init_tp(2, "cpu")
    assert init_tp(1, "cpu") is None


def test_torchrun_generate_equals_the_target_alone(models):
    """``torchrun --nproc-per-node 2 -m dflash2.cli generate --tp 2``: rank 0 prints DFlash2's greedy
    output over the split target, which is the whole target's own."""
    import json
    import subprocess
    import sys

    root = models[0]
    args = ["generate", "--model-path", str(root / "target"), "--speculative-draft-model-path", str(root / "draft")]
    args += ["--dtype", "float32", "--prompt", "Count to ten.", "--max-new-tokens", "24", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    alone = run(sys.executable, "-m", "dflash2.cli", *args, "--speculative-algorithm", "NONE")
    split = run(
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "dflash2.cli", *args, "--tp", "2"
    )
    # (the ranks' own stderr comes first, torchrun's report of a failed rank last)
    why = f"stdout:\n{split.stdout[-1500:]}\nstderr:\n{split.stderr[:4000]}\n...\n{split.stderr[-1500:]}"
    assert alone.returncode == 0 and split.returncode == 0, why
    want = json.loads(alone.stdout.strip().splitlines()[-1])["token_ids"]
    lines = [ln for ln in split.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    assert json.loads(lines[0])["token_ids"] == want and len(want) > 0


def test_torchrun_serve_tp(models):
    """``torchrun --nproc-per-node 2 -m dflash2.cli serve --tp 2``: rank 0 serves, rank 1 steps with it;
    greedy output is the whole target's own (planner auto, the server's default), a sampled request
    runs."""
    import httpx

    from dflash2.server.launch import spawn_server

    root, model, tok = models
    args = ["--model-path", str(root / "target"), "--speculative-draft-model-path", str(root / "draft")]
    args += ["--dtype", "float32", "--context-length", "256", "--max-running-requests", "4", "--tp", "2"]
    proc, url = spawn_server(args, REPO, ranks=2)
    try:
        ids = tok("Once upon a time")["input_ids"]
        want = hf_greedy(TargetModel(model), torch.tensor(ids), 20)
        post = lambda sp: httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=300)
        greedy = post({"max_new_tokens": 20, "temperature": 0}).json()
        assert greedy["output_ids"] == want
        # (the planner's widths follow rank 0's clock, so a seeded request need not repeat: sampled, it runs)
        hot = post({"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True}).json()
        assert len(hot["output_ids"]) == 20
        assert httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=60).json() == {"aborted": []}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
            raise
