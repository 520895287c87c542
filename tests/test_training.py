"""Drafter training end to end on a tiny target (CPU): loss falls, the checkpoint loads,
acceptance beats the untrained draft."""

import warnings

import pytest
import torch

from targets import build
from dflash2.config import ConfigError
from dflash2.model import DFlash2DraftModel
from dflash2.model.checkpoint import load_draft
from dflash2.target import TargetModel
from dflash2.training.data import TokenDataset
from dflash2.training.losses import distill_kl, sample_blocks, selector_distill
from dflash2.training.trainer import TrainConfig, heldout_acceptance, train

warnings.filterwarnings("ignore")

# a drafter small enough to train in seconds on the CPU (the end-to-end and data-parallel tests)
TINY_DRAFT = dict(
    num_hidden_layers=1,
    num_attention_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    intermediate_size=64,
    target_layer_ids=[1, 3],
    block_size=5,
    mask_token_id=0,
    sliding_window=64,
    conv_group_size=4,
    selector_rank=8,
    selector_top_k=8,
    is_causal=True,
)


def test_sample_blocks_shapes_and_masks():
    ids = torch.arange(20).view(1, 20)
    loss_mask = torch.zeros(1, 20, dtype=torch.bool)
    loss_mask[0, 8:] = True
    b = sample_blocks(
        ids, loss_mask, num_anchors=6, width=4, mask_token_id=99, gamma=4.0, generator=torch.Generator().manual_seed(0)
    )
    assert b.block_ids.shape == (1, 6, 4) and (b.block_ids[..., 1:] == 99).all()
    for n in range(6):
        a = int(b.anchors[0, n])
        assert a + 1 >= 8 and b.block_ids[0, n, 0] == a  # anchor token, first label is a response token
        for k in range(1, 4):
            if a + k < 20:
                assert b.labels[0, n, k - 1] == a + k
                assert abs(float(b.weights[0, n, k - 1]) - torch.exp(torch.tensor(-(k - 1) / 4.0)).item()) < 1e-6
            else:
                assert b.weights[0, n, k - 1] == 0


def test_distill_kl_matches_torch():
    torch.manual_seed(0)
    q_logits, p_logits = torch.randn(2, 3, 4, 11), torch.randn(2, 3, 4, 11)
    w = torch.rand(2, 3, 4)
    w[0, 0] = 0
    ref = torch.nn.functional.kl_div(
        torch.log_softmax(q_logits, -1), torch.log_softmax(p_logits, -1), log_target=True, reduction="none"
    ).sum(-1)
    torch.testing.assert_close(distill_kl(q_logits, p_logits, w), (ref * w).sum() / w.sum())
    assert distill_kl(p_logits, p_logits, w).abs() < 1e-6


def test_selector_distill_is_kl_over_candidates():
    torch.manual_seed(0)
    V, k = 13, 4
    p_logits = torch.randn(2, 3, V)
    cand = torch.stack([torch.randperm(V)[:k] for _ in range(6)]).view(2, 3, k)
    w = torch.rand(2, 3)
    # the renormalised target over the candidates, by hand
    p_c = torch.softmax(p_logits, -1).gather(-1, cand)
    p_c = p_c / p_c.sum(-1, keepdim=True)
    scores = torch.randn(2, 3, k)
    ref = (p_c * (p_c.log() - torch.log_softmax(scores, -1))).sum(-1)
    torch.testing.assert_close(selector_distill(scores, cand, p_logits, w), (ref * w).sum() / w.sum())
    # zero exactly when the selector matches the target there (logits of the target, any shift)
    matched = p_logits.gather(-1, cand) + 3.0
    assert selector_distill(matched, cand, p_logits, w).abs() < 1e-6
    # mass outside the candidates does not count: raising a non-candidate's logit changes nothing
    outside = torch.ones(V, dtype=torch.bool)
    outside[cand[0, 0]] = False
    bumped = p_logits.clone()
    bumped[0, 0, outside.nonzero()[0]] += 5.0
    w1 = torch.zeros(2, 3)
    w1[0, 0] = 1
    torch.testing.assert_close(selector_distill(scores, cand, bumped, w1), selector_distill(scores, cand, p_logits, w1))


def test_train_end_to_end(tmp_path):
    model = build("llama", seed=1)
    target = TargetModel(model)
    torch.manual_seed(0)
    prompts = torch.randint(3, 96, (240, 8))
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=40, do_sample=False, min_new_tokens=40)
    rows = [{"ids": r.to(torch.int32), "prompt_len": 8} for r in out]
    TokenDataset(rows).save(tmp_path / "data.pt")
    tc = TrainConfig(
        data=str(tmp_path / "data.pt"),
        output_dir=str(tmp_path / "draft"),
        draft_config=TINY_DRAFT,
        steps=160,
        batch_size=16,
        max_len=64,
        anchors_per_seq=16,
        lr=3e-3,
        warmup=20,
        eval_every=160,
        eval_prompts=2,
        eval_max_new_tokens=16,
        save_every=80,
    )
    res = train(tc, target=target)
    h = res["history"]
    first = sum(r["ce"] for r in h[:10]) / 10
    last = sum(r["ce"] for r in h[-10:]) / 10
    assert last < first - 0.5, (first, last)
    assert "heldout_accept_length" in h[-1]
    draft = load_draft(tmp_path / "draft")
    held = rows[:8]
    trained = heldout_acceptance(target, draft, held, 5, 24)
    untrained = heldout_acceptance(target, DFlash2DraftModel(draft.config).init_weights(), held, 5, 24)
    assert trained > untrained + 0.1, (trained, untrained)
    # resume continues from the saved step
    tc.resume, tc.steps = True, 170
    assert train(tc, target=target)["steps"] == 170
    # init_from + distillation: starts from the trained weights (CE far below a fresh start), KL logged
    tc2 = TrainConfig(
        **{
            **tc.__dict__,
            "output_dir": str(tmp_path / "distilled"),
            "resume": False,
            "steps": 10,
            "init_from": str(tmp_path / "draft"),
            "kl_weight": 1.0,
            "selector_kl_weight": 1.0,
            "eval_every": 0,
            "warmup": 1,
        }
    )
    h2 = train(tc2, target=target)["history"]
    assert h2[0]["ce"] < first - 0.5 and all(0 < r["kl"] < 50 for r in h2)
    assert all(0 < r["selector_kl"] < 20 for r in h2)
    # a grown drafter (codebooks over a token map, a layer and rank more) trains on from where it was
    from dflash2.model.checkpoint import save_draft
    from dflash2.training.grow import grow_draft

    vocab = draft.config.vocab_size
    save_draft(grow_draft(draft, torch.arange(0, vocab, 2), 12, 2), tmp_path / "grown")
    tc3 = TrainConfig(
        **{**tc2.__dict__, "output_dir": str(tmp_path / "grown_out"), "init_from": str(tmp_path / "grown")}
    )
    h3 = train(tc3, target=target)["history"]
    assert h3[0]["ce"] < first - 0.5 and load_draft(tmp_path / "grown_out").config.selector_vocab_size == vocab // 2 + 1
    with pytest.raises(ConfigError, match="selector_vocab_size"):  # from scratch: nothing to map its rows
        train(
            TrainConfig(
                **{
                    **tc.__dict__,
                    "resume": False,
                    "output_dir": str(tmp_path / "scratch"),
                    "draft_config": {**TINY_DRAFT, "selector_vocab_size": 4},
                }
            ),
            target=target,
        )


def test_training_prompts_and_generated_data():
    """GSM8K train prompts carry the card's suffix; test questions are dropped even when mixed in;
    ShareGPT first turns load from the package; responses generated in left-padded batches equal
    the target's own greedy answer to each prompt alone, and the loss mask covers the response only."""
    import transformers as tf
    from dflash2.target.loading import default_target_path
    from dflash2.training.data import (
        GSM8K_SUFFIX,
        SHARED,
        generate_responses,
        gsm8k_prompts,
        render,
        sharegpt_prompts,
        without_eval_prompts,
    )

    gsm = SHARED / "data" / "gsm8k"
    train_p, test_p = gsm8k_prompts(gsm / "train.jsonl", 4), gsm8k_prompts(gsm / "test.jsonl", 3)
    assert all(p.endswith(GSM8K_SUFFIX) for p in train_p)
    kept, dropped = without_eval_prompts(test_p[:2] + train_p + [test_p[2].removesuffix(GSM8K_SUFFIX).strip()])
    assert kept == train_p and dropped == 3
    share = sharegpt_prompts(3)
    assert len(share) == 3 and all(10 < len(p) <= 1500 for p in share)

    tok = tf.AutoTokenizer.from_pretrained(default_target_path())
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=1,
        pad_token_id=0,
    )
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    prompts = [train_p[0], "Hi", share[0][:200], train_p[1]]  # different lengths: left padding in a batch
    rows = generate_responses(model, tok, prompts, batch_size=3, max_new_tokens=12)
    by_prompt = {tuple(r["ids"][: r["prompt_len"]].tolist()): r for r in rows}
    for p in prompts:
        ids = render(tok, p)
        r = by_prompt[tuple(ids)]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
        assert r["ids"].tolist() == ref and r["prompt_len"] == len(ids)
    ds = TokenDataset(rows)
    ids, loss_mask, valid = ds.batch(list(range(len(rows))), max_len=512, pad_id=0)
    for b, r in enumerate(rows):
        n, P = len(r["ids"]), r["prompt_len"]
        assert not loss_mask[b, :P].any() and loss_mask[b, P:n].all() and not loss_mask[b, n:].any()
        assert valid[b, :n].all() and not valid[b, n:].any()


def _dp_rank(rank: int, world: int, port: int, tmp: str, queue) -> None:
    """One rank of ``torchrun --nproc-per-node 2 dflash2 train``: the environment torchrun sets."""
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    tc = TrainConfig(
        data=f"{tmp}/data.pt",
        output_dir=f"{tmp}/draft",
        draft_config=TINY_DRAFT,
        steps=6,
        batch_size=4,
        max_len=32,
        anchors_per_seq=8,
        lr=3e-3,
        warmup=1,
        eval_every=0,
        save_every=1000,
    )
    res = train(tc, target=TargetModel(build("llama", seed=1)))
    flat = torch.cat([p.detach().flatten() for p in res["draft"].parameters()])
    queue.put((rank, flat.sum().item(), flat.abs().sum().item(), [r["loss"] for r in res["history"]]))


def test_data_parallel_two_ranks_on_the_cpu(tmp_path):
    """Two gloo ranks: each trains on its own batches, gradients are averaged, so both end with the
    same weights; only rank 0 writes the drafter."""
    import socket

    import torch.multiprocessing as mp

    model = build("llama", seed=1)
    torch.manual_seed(0)
    prompts = torch.randint(3, 96, (32, 8))
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    TokenDataset([{"ids": r.to(torch.int32), "prompt_len": 8} for r in out]).save(tmp_path / "data.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dp_rank, args=(r, 2, port, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (queue.get(timeout=240) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (sum0, abs0, loss0), (sum1, abs1, loss1) = got[0], got[1]
    assert sum0 == pytest.approx(sum1, rel=1e-6, abs=1e-6) and abs0 == pytest.approx(abs1, rel=1e-6)
    assert loss0 != loss1  # different batches on the two ranks
    assert (tmp_path / "draft" / "config.json").is_file()
