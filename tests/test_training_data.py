"""Broad training data (#23): prompt sources with domains, decontamination against evaluation
sets, the held-out split by conversation, the compact data file, and the recipe that
``dflash2 train --config`` runs end to end (answers, held-out acceptance per domain, curves)."""

import json
import warnings

import pytest
import torch

from dflash2.training.data import TokenDataset
from dflash2.training.recipe import DataRecipe
from dflash2.training.sources import (
    DOMAINS,
    Decontaminator,
    Prompt,
    build_prompts,
    classify,
    load_prompts,
    save_prompts,
    sharegpt_turns,
    stdlib_code,
)

warnings.filterwarnings("ignore")


def test_classify_domains():
    assert classify("Write a Python function that reverses a list") == "code"
    assert classify("Can you summarize this article for me?") == "summarization"
    assert classify("Solve the equation 3x + 5 = 20") == "math"
    assert classify("Write a short poem about autumn") == "writing"
    assert classify("What do you think about living in Paris?") == "chat"
    assert set(DOMAINS) == {"math", "code", "summarization", "writing", "chat"}


def test_sharegpt_turns_carry_their_context():
    turns = sharegpt_turns()
    later = [p for p in turns if p.turn > 0]
    assert len(turns) > 40_000 and len(later) > 20_000  # every human turn, not just the first
    for p in later[:500]:
        roles = [m["role"] for m in p.messages]
        assert roles[0] == "user" and roles[-1] == "user" and p.domain in DOMAINS
        assert sum(len(m["content"]) for m in p.messages) <= 3000 or len(p.messages) == 1
    assert any(len(p.messages) > 1 for p in later)


def test_stdlib_code_prompts():
    code = stdlib_code()
    assert len(code) > 1000 and all(p.domain == "code" for p in code)
    assert any("```python\ndef " in p.messages[0]["content"] for p in code)  # dedented source


def test_decontaminator_exact_near_and_clean():
    q = (
        "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
        "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg."
    )
    deco = Decontaminator({"gsm8k_test": [q], "tiny": ["what is two plus two"]})
    assert deco.match(f"Please help.\n{q}\nThanks") == ("gsm8k_test", "exact")
    near = q.replace("16 eggs", "17 eggs").upper()  # a number changed, case and spacing lost
    assert deco.match(near) == ("gsm8k_test", "near")
    assert deco.match("Janet's cats sleep all day and never lay eggs, which is how cats are.") is None
    assert deco.match("so, what is two plus two?") == ("tiny", "exact")
    assert deco.match("what is two plus three") is None


def test_build_prompts_split_by_key_and_report():
    def convs():
        out = []
        for c in range(300):
            for t in range(3):
                out.append(
                    Prompt(
                        [{"role": "user", "content": f"conv {c} turn {t} hello there"}],
                        "chat",
                        "sharegpt",
                        f"sharegpt:{c}",
                        t,
                    )
                )
        return out

    def math():
        return [
            Prompt([{"role": "user", "content": f"what is {i} plus {i}"}], "math", "gsm8k", f"gsm8k:{i}")
            for i in range(50)
        ]

    evals = {"gsm8k_test": ["what is 7 plus 7"]}
    ps = build_prompts({"sharegpt": None, "gsm8k": 10}, heldout_percent=10, heldout_per_domain=20,
                       eval_texts=evals, loaders={"sharegpt": convs, "gsm8k": math})  # fmt: skip
    train_keys = {p.key for p in ps.train}
    assert ps.heldout and not train_keys & {p.key for p in ps.heldout}
    assert all(p.turn > 0 and p.source == "sharegpt" for p in ps.heldout)  # no first turns, no GSM8K
    assert len(ps.heldout) == 20 and ps.report["heldout_by_domain"] == {"chat": 20}
    assert ps.report["sources"]["gsm8k"]["train"] == 10
    assert ps.report["dropped_as_evaluation"] == {"gsm8k_test:exact": 1}
    assert not any("what is 7 plus 7" == p.messages[0]["content"] for p in ps.train)
    held_convs = ps.report["sources"]["sharegpt"]["held_out_keys_prompts"]
    assert 0 < held_convs < 900 and held_convs % 3 == 0  # whole conversations, all three turns
    with pytest.raises(ValueError, match="unknown prompt source"):
        build_prompts({"wikipedia": 3}, eval_texts={}, loaders={"sharegpt": convs})


def test_raising_a_source_limit_keeps_the_heldout_prompts_and_extends_training():
    """A later data call may ask a source for more prompts (same seed): its held-out evaluation prompts stay
    the ones earlier stages were measured on, and its training prompts extend the earlier ones (the shuffle
    comes before the cut), so stage-to-stage acceptance rows stay comparable."""

    def convs():
        return [
            Prompt([{"role": "user", "content": f"conv {c} turn {t}"}], "chat", "sharegpt", f"sharegpt:{c}", t)
            for c in range(400)
            for t in range(2)
        ]

    def code():
        return [
            Prompt([{"role": "user", "content": f"def f{i}(): pass"}], "code", "code", f"code:{i}") for i in range(90)
        ]

    def build(limits):
        return build_prompts(limits, heldout_percent=10, heldout_per_domain=15, seed=3, eval_texts={},
                             loaders={"sharegpt": convs, "code": code})  # fmt: skip

    small, big = build({"sharegpt": 100, "code": 20}), build({"sharegpt": 500, "code": 60})
    assert [p.key + str(p.turn) for p in small.heldout] == [p.key + str(p.turn) for p in big.heldout]
    for source, n in (("sharegpt", 100), ("code", 20)):
        assert [p for p in small.train if p.source == source] == [p for p in big.train if p.source == source][:n]
    assert len(big.train) == 560 and len(small.train) == 120
    other = build_prompts({"sharegpt": 100, "code": 20}, heldout_percent=10, heldout_per_domain=15, seed=4,
                          eval_texts={}, loaders={"sharegpt": convs, "code": code})  # fmt: skip
    assert [p.key for p in other.train] != [p.key for p in small.train]  # (the seed does move them)


def test_prompt_files_and_compact_dataset_roundtrip(tmp_path):
    ps = [Prompt([{"role": "user", "content": "héllo"}], "chat", "sharegpt", "sharegpt:x", 2)]
    save_prompts(ps, tmp_path / "p.jsonl.gz")
    assert load_prompts(tmp_path / "p.jsonl.gz") == ps
    rows = [
        {"ids": torch.tensor([5, 6, 7, 60000], dtype=torch.int32), "prompt_len": 2, "domain": "code"},
        {"ids": torch.tensor([1, 2], dtype=torch.int32), "prompt_len": 1, "domain": "chat"},
    ]
    TokenDataset(rows).save(tmp_path / "d.npz")
    back = TokenDataset.load(tmp_path / "d.npz").rows
    assert [r["ids"].tolist() for r in back] == [r["ids"].tolist() for r in rows]
    assert [(r["prompt_len"], r["domain"]) for r in back] == [(2, "code"), (1, "chat")]
    big = [{"ids": torch.tensor([70000, 3], dtype=torch.int32), "prompt_len": 1}]  # ids past uint16
    TokenDataset(big).save(tmp_path / "b.npz")
    assert TokenDataset.load(tmp_path / "b.npz").rows[0]["ids"].tolist() == [70000, 3]


def test_data_recipe_validation():
    r = DataRecipe.from_dict(
        {"sources": {"gsm8k": 5}, "answers": [{"fraction": 0.5}, {"fraction": 0.5, "temperature": 1, "top_p": 0.95}]}
    )
    assert r.answers[1].temperature == 1
    for bad, msg in (
        ({"sources": {"gsm8k": 5}, "sorces": 1}, "unknown data recipe key"),
        ({}, "sources"),
        ({"sources": {"gsm8k": 5}, "answers": [{"fraction": 0.7}, {"fraction": 0.7}]}, "fractions"),
        ({"sources": {"gsm8k": 5}, "answers": [{"fraction": 1, "temprature": 1}]}, "unknown key"),
        ({"sources": {"gsm8k": 5}, "answers": [{"fraction": 1, "top_p": 0}]}, "top_p"),
        ({"sources": {"gsm8k": 5}, "generator": "vllm"}, "generator"),
        ({"sources": {"gsm8k": 5}, "answer_order_seed": "1"}, "answer_order_seed"),
        ({"sources": {"gsm8k": 5}, "answers": [{"fraction": 1}, {"fraction": 1.5, "again": True}]}, "fractions"),
        ({"sources": {"gsm8k": 5}, "answers": [{"fraction": 1, "domains": "math"}]}, "domains"),
    ):
        with pytest.raises(ValueError, match=msg):
            DataRecipe.from_dict(bad)
    from dflash2.training.trainer import TrainConfig

    with pytest.raises(ValueError, match="unknown data recipe key"):
        TrainConfig(data="x", output_dir="y", draft_config={}, prepare={"sources": {"gsm8k": 1}, "bogus": 1})


def test_answer_passes_deal_by_answer_order_seed_and_again_answers_once_more():
    """The passes without 'again' deal the prompts (each answered at most once, a pass's fraction of them);
    without answer_order_seed the deal follows seed (as before the key existed), with it another deal, so a
    rerun answers at T=0 prompts answered at T=1 before. A pass with 'again' draws on its own."""
    from dflash2.training.recipe import answer_chunks

    prompts = [Prompt([{"role": "user", "content": f"q{i}"}], "chat", "sharegpt", f"s:{i}", 0) for i in range(200)]
    answers = [{"fraction": 0.5}, {"fraction": 0.25, "temperature": 1, "top_p": 0.95}]
    base = answer_chunks(prompts, DataRecipe.from_dict({"sources": {"sharegpt": None}, "answers": answers, "seed": 3}))
    assert [len(c) for c in base] == [100, 50]
    keys = [p.key for c in base for p in c]
    assert len(set(keys)) == 150 and set(keys) <= {p.key for p in prompts}
    same = DataRecipe.from_dict({"sources": {"sharegpt": None}, "answers": answers, "seed": 3, "answer_order_seed": 3})
    assert [[p.key for p in c] for c in answer_chunks(prompts, same)] == [[p.key for p in c] for c in base]
    other = DataRecipe.from_dict({"sources": {"sharegpt": None}, "answers": answers, "seed": 3, "answer_order_seed": 4})
    greedy_before, greedy_now = {p.key for p in base[0]}, {p.key for p in answer_chunks(prompts, other)[0]}
    assert 30 < len(greedy_before & greedy_now) < 70  # about half by chance, not the same deal
    # a pass with "again" answers prompts once more: its domains only, by its own draw, outside the deal
    mixed = [Prompt(p.messages, "math" if i % 4 == 0 else "chat", p.source, p.key, 0) for i, p in enumerate(prompts)]
    again = {"fraction": 1.0, "temperature": 1, "top_p": 0.95, "seed": 9, "again": True, "domains": ["math"]}
    half = {"fraction": 0.5, "temperature": 1, "top_p": 0.95, "seed": 7, "again": True}
    r = DataRecipe.from_dict({"sources": {"sharegpt": None}, "answers": [*answers, again, half]})
    chunks = answer_chunks(mixed, r)
    assert [len(c) for c in chunks] == [100, 50, 50, 100]
    assert sorted(p.key for p in chunks[2]) == sorted(p.key for p in mixed if p.domain == "math")
    assert len({p.key for p in chunks[3]}) == 100 and {p.key for p in chunks[3]} != {p.key for p in chunks[0]}


def test_shipped_recipe_is_valid():
    from dflash2.entry import REPO
    from dflash2.training.trainer import TrainConfig

    tc = TrainConfig.from_file(REPO / "models" / "smollm2-135m-dflash2" / "recipe.json")
    assert tc.prepare and set(tc.prepare["sources"]) == {"gsm8k", "sharegpt", "code", "summarization"}


def test_train_config_runs_the_recipe_end_to_end(tmp_path):
    """``dflash2 train --config`` with a ``prepare`` section: the target answers the prompts (greedy
    and sampled passes), the held-out prompts become their own file, every evaluation reports
    acceptance per domain (greedy and T=1 block), and the curves are a PNG."""
    import transformers as tf
    from test_training import TINY_DRAFT

    from dflash2.target import TargetModel
    from dflash2.target.loading import default_target_path
    from dflash2.training.trainer import TrainConfig, train

    tok = tf.AutoTokenizer.from_pretrained(default_target_path())
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=1, pad_token_id=0)  # fmt: skip
    target = TargetModel(tf.LlamaForCausalLM(cfg).eval(), tok)
    data_dir = tmp_path / "data"
    train_p = [Prompt([{"role": "user", "content": f"question {i}: tell me about {w}"}], d, "sharegpt", f"s:{i}", 1)
               for i, (w, d) in enumerate([("cats", "chat"), ("def f(x)", "code")] * 6)]  # fmt: skip
    held_p = [
        Prompt([{"role": "user", "content": f"held {w}"}], d, "sharegpt", f"h:{d}", 1)
        for w, d in (("dogs", "chat"), ("a loop", "code"))
    ]
    save_prompts(train_p, data_dir / "train_prompts.jsonl.gz")  # prompts built elsewhere are reused
    save_prompts(held_p, data_dir / "heldout_prompts.jsonl")
    recipe = {"sources": {"sharegpt": None}, "max_new_tokens": 12, "gen_batch": 8,
              "answers": [{"fraction": 0.5, "seed": 1}, {"fraction": 0.5, "temperature": 1.0, "top_p": 0.95, "seed": 2}]}  # fmt: skip
    tc = TrainConfig(data=str(data_dir / "data.npz"), output_dir=str(tmp_path / "draft"), draft_config=TINY_DRAFT,
                     steps=4, batch_size=4, max_len=64, anchors_per_seq=4, warmup=1, eval_every=4, eval_prompts=1,
                     eval_max_new_tokens=6, save_every=4, prepare=recipe, eval_width=4)  # fmt: skip
    res = train(tc, target=target)
    report = json.loads((data_dir / "data_report.json").read_text())
    assert report["sequences"] == 12 and [p["sequences"] for p in report["passes"]] == [6, 6]
    assert set(report["by_domain"]) == {"chat", "code"}
    ds = TokenDataset.load(data_dir / "data.npz")
    assert len(ds) == 12 and all(len(r["ids"]) > r["prompt_len"] for r in ds.rows)
    held = TokenDataset.load(data_dir / "heldout.npz").rows
    assert [r["domain"] for r in held] == ["chat", "code"] and all(len(r["ids"]) == r["prompt_len"] for r in held)
    last = res["history"][-1]["heldout"]
    assert set(last) == {"chat", "code"} and all(
        1.0 <= v["greedy"] <= 4 and 1.0 <= v["t1_block"] <= 4 for v in last.values()
    )
    assert (tmp_path / "draft" / "train_curves.png").stat().st_size > 1000
    # the batched (engine) evaluation agrees with one prompt at a time through speculative_generate
    from dflash2.training.trainer import heldout_acceptance, heldout_by_domain

    draft = res["draft"].eval()
    batched = heldout_by_domain(target, draft, held, 4, 6, 1)
    for r in held:
        assert batched[r["domain"]]["greedy"] == pytest.approx(heldout_acceptance(target, draft, [r], 4, 6))
    # resumed: the log keeps the earlier steps, the curves go on
    tc.resume, tc.steps = True, 6
    train(tc, target=target)
    log = [json.loads(l) for l in (tmp_path / "draft" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]


def test_engine_answers_equal_hf_generate():
    """The recipe's ``generator: engine``: greedy answers through our engine (target alone, continuous
    batching over more prompts than running slots) equal Hugging Face ``generate``'s, EOS included;
    sampled answers stop at EOS or the length; a deadline already past starts nothing."""
    import time

    import transformers as tf

    from dflash2.target import TargetModel
    from dflash2.target.loading import default_target_path
    from dflash2.training.data import engine_responses, generate_responses, render

    tok = tf.AutoTokenizer.from_pretrained(default_target_path())
    torch.manual_seed(0)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=eos, bos_token_id=1, pad_token_id=0)  # fmt: skip
    model = tf.LlamaForCausalLM(cfg).eval()
    prompts = [f"question {i}: tell me about {w}" for i, w in enumerate(["cats", "loops", "rain", "tea", "maps"])]
    with torch.no_grad():  # EOS's logit near the top one along the mean final hidden state: some greedy answers stop
        h = torch.cat(
            [model(torch.tensor([render(tok, p)]), output_hidden_states=True).hidden_states[-1][0] for p in prompts]
        )
        model.lm_head.weight[eos] = 0.4 * h.mean(0) / h.mean(0).norm() ** 2
    target = TargetModel(model, tok)
    hf = generate_responses(model, tok, prompts, batch_size=1, max_new_tokens=20, domains=list("abcde"))
    ours = engine_responses(target, prompts, max_running=2, max_new_tokens=20, domains=list("abcde"))
    key = lambda rows: sorted((r["domain"], r["ids"].tolist(), r["prompt_len"]) for r in rows)  # noqa: E731
    assert key(ours) == key(hf)
    assert any(len(r["ids"]) - r["prompt_len"] < 20 and int(r["ids"][-1]) == eos for r in ours)  # EOS, kept
    sampled = engine_responses(target, prompts, max_running=3, max_new_tokens=20, temperature=1.0, top_p=0.95)
    assert len(sampled) == 5
    for r in sampled:
        answer = r["ids"][r["prompt_len"] :].tolist()
        assert 1 <= len(answer) <= 20 and (answer[-1] == eos or len(answer) == 20) and eos not in answer[:-1]
    assert engine_responses(target, prompts, deadline=time.perf_counter() - 1) == []


def test_prepare_data_cli_prompts_only(tmp_path, monkeypatch):
    from dflash2.cli import main
    from dflash2.training import recipe as recipe_mod

    def tiny(sources, *a, **k):
        return build_prompts(
            sources,
            *a,
            eval_texts={},
            loaders={
                "gsm8k": lambda: [
                    Prompt([{"role": "user", "content": f"q{k}"}], "math", "gsm8k", f"g:{k}") for k in range(20)
                ]
            },
        )

    monkeypatch.setattr(recipe_mod, "build_prompts", tiny)
    (tmp_path / "r.json").write_text(json.dumps({"prepare": {"sources": {"gsm8k": None}}}))
    assert (
        main(
            [
                "prepare-data",
                "--recipe",
                str(tmp_path / "r.json"),
                "--output-dir",
                str(tmp_path / "o"),
                "--prompts-only",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "o" / "prompts_report.json").read_text())
    assert 15 <= len(load_prompts(tmp_path / "o" / "train_prompts.jsonl.gz")) == report["train"] <= 20
