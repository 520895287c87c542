"""The server as a real process on a loopback port, driven by the official openai client."""

import concurrent.futures as cf
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]
openai = pytest.importorskip("openai")


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers as tf
    from dflash2.model import DFlash2DraftModel
    from dflash2.model.checkpoint import save_draft
    from dflash2.target.loading import default_target_path

    root = tmp_path_factory.mktemp("srv")
    tok = tf.AutoTokenizer.from_pretrained(default_target_path())
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=1,
        pad_token_id=0,
    )
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    dc = tiny_config(
        hidden_size=32,
        vocab_size=len(tok),
        mask_token_id=16,
        target_layer_ids=[0, 2],
        num_target_layers=3,
        rope_scaling=None,
    )
    save_draft(DFlash2DraftModel(dc).init_weights(std=0.2), root / "draft")
    return root, model, tok


def _start(root, *extra):
    from dflash2.server.launch import spawn_server

    return spawn_server(
        [
            "--model-path",
            str(root / "target"),
            "--speculative-draft-model-path",
            str(root / "draft"),
            "--dtype",
            "float32",
            "--context-length",
            "256",
            "--speculative-planner",  # seeded sampling is asserted to repeat token for token
            "off",
            *extra,
        ],
        REPO,
    )


@pytest.fixture(scope="module", params=["paged", "static"])
def server(models, request):
    """Both model runners: paged (the CPU default) and the static-slot CUDA-graph runner, eagerly."""
    root, model, tok = models
    proc, url = _start(
        root,
        "--max-running-requests",
        "8",
        "--max-total-tokens",
        "384",
        "--page-size",
        "8",
        "--speculative-num-draft-tokens",
        "5",
        "--model-runner",
        request.param,
        # the static one also runs new prompts inside decode steps (--enable-mixed-chunk)
        *(["--enable-spec-usage", "--enable-mixed-chunk"] if request.param == "static" else []),
    )
    yield url, model, tok
    proc.terminate()
    proc.wait(10)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


PROMPTS = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(18)]


def _chat(client, prompt, **kw):
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0, **kw
    )


def test_concurrent_greedy_equals_sequential_and_target(server):
    url, model, tok = server
    client = _client(url)
    with cf.ThreadPoolExecutor(18) as ex:
        together = list(ex.map(lambda p: _chat(client, p).choices[0].message.content, PROMPTS))
    alone = [_chat(client, p).choices[0].message.content for p in PROMPTS[:6]]
    assert together[:6] == alone
    for p, text in zip(PROMPTS[:6], together):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
        assert text == tok.decode(ref, skip_special_tokens=True)
    if httpx.get(url + "/server_info", timeout=60).json()["enable_mixed_chunk"]:  # some prompts joined steps
        assert _metrics(url)["dflash2_prompts_mixed_total"] > 0
    # streamed text equals the non-streamed text
    for p, text in zip(PROMPTS[:4], together):
        stream = _chat(client, p, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_seeded_sampling_reproducible(server):
    client = _client(server[0])
    a = [_chat(client, "hello there", seed=7).choices[0].message.content for _ in range(1)]
    kw = dict(
        model="default",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=20,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
    )
    r1 = client.chat.completions.create(**kw).choices[0].message.content
    r2 = client.chat.completions.create(**kw).choices[0].message.content
    assert r1 == r2 and a


def test_bad_inputs_get_4xx_while_others_complete(server):
    url = server[0]
    client = _client(url)
    with cf.ThreadPoolExecutor(4) as ex:
        good = [ex.submit(_chat, client, p) for p in PROMPTS[:4]]
        r = httpx.post(
            url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code == 400 and "error" in r.json()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], temperature=-1)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], top_p=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": "word " * 400}])
        assert "context length" in str(e.value)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "x"}], max_tokens=10_000
            )
        r = httpx.post(url + "/v1/chat/completions", json={"model": "default", "messages": []}, timeout=60)
        assert r.status_code == 400
        assert all(f.result().choices[0].finish_reason in ("stop", "length") for f in good)


def _metrics(url):
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_the_server_freezes_its_start_up_heap_and_counts_collections(server):
    """What lives for good (models, libraries) is frozen once the server is up, so no collection walks it
    (a full one paused 185 ms on the CPU); the collector's pauses show in /metrics."""
    url = server[0]
    frozen = httpx.get(url + "/server_info", timeout=60).json()["gc_frozen_objects"]
    assert frozen > 50_000  # the models and libraries, not a handful
    _chat(_client(url), PROMPTS[0])
    m = _metrics(url)
    # (no freeze since; a frozen object that dies by reference counting leaves the count: a few)
    assert 0.99 * frozen <= m["dflash2_gc_frozen_objects"] <= frozen
    assert m["dflash2_gc_pause_seconds_total"] >= 0 and 'dflash2_gc_collections_total{generation="0"}' in m


def test_disconnects_and_preemption_leave_pool_full(server):
    url = server[0]
    client = _client(url)

    def cut_stream(p):
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": p}], "max_tokens": 200, "stream": True, "temperature": 0},
            timeout=300,
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    return "cut"

    def long(p):
        c = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": p}],
            max_tokens=80,
            temperature=0,
            extra_body={"ignore_eos": True},
        ).choices[0]
        return c.finish_reason, c.message.content

    with cf.ThreadPoolExecutor(12) as ex:
        futs = [ex.submit(cut_stream, p) for p in PROMPTS[:4]] + [ex.submit(long, p) for p in PROMPTS[4:12]]
        results = [f.result() for f in futs]
    assert [r[0] for r in results[4:]] == ["length"] * 8
    # aborted streams and preempted requests moved and freed slots under the others: their text is unchanged
    # (the reference two at a time, for time: greedy fp32 text does not depend on the batch, as asserted here)
    with cf.ThreadPoolExecutor(2) as ex:
        reference = [t for _, t in ex.map(long, PROMPTS[4:12])]
    assert [r[1] for r in results[4:]] == reference
    for _ in range(300):
        m = _metrics(url)
        if m["dflash2_num_running_reqs"] == 0 and m["dflash2_num_waiting_reqs"] == 0:
            break
        time.sleep(0.2)
    assert m["dflash2_kv_blocks_used"] == 0
    # 8 x (prompt + 80) tokens cannot fit 384 KV tokens at once (pages of 8, or the static runner's of 64)
    assert m["dflash2_preemptions_total"] > 0


def test_generate_meta_metrics_and_usage_agree(server):
    url = server[0]
    before = _metrics(url)
    r = httpx.post(
        url + "/generate",
        json={"text": "Once upon a time", "sampling_params": {"max_new_tokens": 30, "temperature": 0}},
        timeout=300,
    ).json()
    meta = r["meta_info"]
    assert meta["completion_tokens"] == len(r["output_ids"]) > 0
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / max(meta["spec_verify_ct"], 1))
    after = _metrics(url)
    assert (
        after["dflash2_generation_tokens_total"] - before["dflash2_generation_tokens_total"]
        == meta["completion_tokens"]
    )
    assert (
        after["dflash2_spec_verify_steps_total"] - before["dflash2_spec_verify_steps_total"] == meta["spec_verify_ct"]
    )
    c = _client(url).completions.create(model="default", prompt="Once upon a time", max_tokens=30, temperature=0)
    assert c.usage.completion_tokens == meta["completion_tokens"] and c.choices[0].text == r["text"]
    # speculation's counters ride on usage only with --enable-spec-usage (the static server here)
    spec = httpx.get(url + "/server_info", timeout=60).json()["enable_spec_usage"]
    assert c.usage.model_extra.get("spec_verify_ct") == (meta["spec_verify_ct"] if spec else None)
    models = _client(url).models.list()
    assert len(models.data) == 1


def test_unsupported_flags_fail_at_start(models):
    root = models[0]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash2.cli",
            "serve",
            "--model-path",
            str(root / "target"),
            "--speculative-draft-model-path",
            str(root / "draft"),
            "--kv-cache-dtype",
            "fp8_e4m3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "kv-cache-dtype" in p.stderr


def test_logprobs_are_the_targets(server):
    """Each output token's log-probability is the target's log-softmax there (float32), on all three
    routes; top alternatives come sorted; streams and bad combinations are refused by name."""
    url, model, tok = server
    client = _client(url)
    prompt = "Question 3: what is 3 plus 6?"
    g = httpx.post(
        url + "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "return_logprob": True,
              "top_logprobs_num": 2, "return_text_in_logprobs": True},
        timeout=120,
    ).json()  # fmt: skip
    ids, out = tok(prompt)["input_ids"], g["output_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1 :].float(), -1)
    got = g["meta_info"]["output_token_logprobs"]
    assert [x[1] for x in got] == out and [x[2] for x in got] == [tok.decode([t]) for t in out]
    assert torch.allclose(torch.tensor([x[0] for x in got]), lp.gather(1, torch.tensor(out)[:, None])[:, 0], atol=1e-4)
    top = g["meta_info"]["output_top_logprobs"]
    assert [[x[1] for x in row] for row in top] == lp.topk(2, -1).indices.tolist()

    chat_kw = dict(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    chat = client.chat.completions.create(**chat_kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for c in content:  # greedy: the chosen token is the most likely one
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
    plain = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=10, temperature=0
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content

    comp = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    lps = comp.choices[0].logprobs
    assert lps.tokens == [tok.decode([t]) for t in out]
    assert torch.allclose(torch.tensor(lps.token_logprobs), torch.tensor([x[0] for x in got]), atol=1e-5)
    assert all(len(d) <= 2 for d in lps.top_logprobs) and lps.text_offset[0] == 0

    # echo: the prompt's tokens first, the first without a logprob, the rest the target's (lm-eval's loglikelihood)
    echo = client.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    e = echo.choices[0].logprobs
    with torch.no_grad():
        plp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)[:-1]
    want = plp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert e.token_logprobs[0] is None and len(e.tokens) == len(ids) + 1 and echo.choices[0].text.startswith(prompt)
    assert torch.allclose(torch.tensor(e.token_logprobs[1 : len(ids)]), want, atol=1e-4)
    assert e.token_logprobs[len(ids)] == pytest.approx(lps.token_logprobs[0], abs=1e-5)
    g2 = httpx.post(
        url + "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True,
              "logprob_start_len": 2},
        timeout=120,
    ).json()["meta_info"]  # fmt: skip
    assert [x[1] for x in g2["input_token_logprobs"]] == ids[2:]
    assert torch.allclose(torch.tensor([x[0] for x in g2["input_token_logprobs"]]), want[1:], atol=1e-4)

    # streamed: the chunks' logprobs together are the whole answer's
    stream = client.chat.completions.create(stream=True, **chat_kw)
    streamed = [c for ch in stream if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    stream = client.completions.create(
        model="default", prompt=prompt, max_tokens=12, temperature=0, logprobs=2, stream=True
    )
    parts = [ch.choices[0] for ch in stream if ch.choices]
    assert sum((p.logprobs.token_logprobs for p in parts if p.logprobs), []) == lps.token_logprobs
    assert "".join(p.text for p in parts) == comp.choices[0].text

    for bad, param in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError, match=param):
            client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": prompt}], max_tokens=4, **bad
            )


def test_best_of_returns_the_most_likely_samples(server):
    """best_of=4, n=2: four samples, the two with the highest total log-probability come back (no
    logprobs shown unless asked); usage counts all four."""
    url, model, tok = server
    client = _client(url)
    kw = dict(model="default", prompt="Question 5: what is", max_tokens=8, temperature=1.0, seed=11)
    each = client.completions.create(n=4, logprobs=0, **kw)  # the same four samples (seeds 11 .. 14)
    totals = sorted(((sum(c.logprobs.token_logprobs), c.text) for c in each.choices), reverse=True)
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [t for _, t in totals[:2]]
    assert all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == each.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=3, best_of=2, **kw)


def test_streamed_choices_of_n_and_of_a_batch(server):
    """n=2 chat and a two-prompt completion, streamed: each choice's chunks (by index) join to the
    text the same request gives unstreamed; one usage chunk, for all of them, at the end."""
    url, model, tok = server
    client = _client(url)
    kw = dict(model="default", messages=[{"role": "user", "content": "Question 7: what is 7 plus 14?"}],
              max_tokens=12, temperature=1.0, seed=5, n=2)  # fmt: skip
    whole = client.chat.completions.create(**kw)
    parts: dict[int, str] = {}
    usage = []
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
        if ch.usage is not None:
            usage.append(ch.usage)
    assert parts == {c.index: c.message.content for c in whole.choices}
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    prompts = ["Question 8: what is", "Question 9: what is"]
    whole = client.completions.create(model="default", prompt=prompts, max_tokens=10, temperature=0)
    texts: dict[int, str] = {}
    for ch in client.completions.create(model="default", prompt=prompts, max_tokens=10, temperature=0, stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole.choices}


def test_min_tokens_on_every_route(server):
    """min_tokens (OpenAI / vLLM) and min_new_tokens (SGLang): the answer is at least that long."""
    url, model, tok = server
    client = _client(url)
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=30,
        temperature=0,
        extra_body={"min_tokens": 30},
    )
    assert chat.usage.completion_tokens == 30 and chat.choices[0].finish_reason == "length"
    g = httpx.post(
        url + "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 25, "min_new_tokens": 25, "temperature": 0}},
        timeout=120,
    ).json()
    assert len(g["output_ids"]) == 25
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model="default", prompt="Hi", max_tokens=4, extra_body={"min_tokens": 5})
