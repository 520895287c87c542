"""Draft vocabulary subset (--speculative-token-map): logits, file errors, building, losslessness."""

import json

import pytest
import torch

from targets import VOCAB, build
from test_speculative import hf_greedy, random_draft
from dflash2.engine import speculative_generate
from dflash2.model.token_map import TokenMapError, build_token_map, load_token_map, save_token_map
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams


@pytest.fixture(scope="module")
def target():
    return TargetModel(build("llama", seed=2), layer_ids=[0, 2])


def test_mapped_logits_equal_full_logits_on_the_map(target):
    draft = random_draft(target).draft
    ids = torch.arange(0, VOCAB, 2)
    hidden = torch.randn(2, 4, target.config.hidden_size)
    full = draft.compute_logits(hidden, target.lm_head_weight)
    draft.set_token_map(ids, target.lm_head_weight)
    mapped = draft.compute_logits(hidden, target.lm_head_weight)
    torch.testing.assert_close(mapped[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[ids] = False
    assert torch.isneginf(mapped[..., off]).all()
    other_head = torch.randn_like(target.lm_head_weight)  # e.g. training with another head: map not used
    assert torch.isfinite(draft.compute_logits(hidden, other_head)).all()
    draft.set_token_map(None)
    torch.testing.assert_close(draft.compute_logits(hidden, target.lm_head_weight), full)


def test_mapped_candidates_equal_candidates_of_full_logits(target):
    """Decoding takes the selector's top-k over the mapped rows only; it must give the same values,
    ids and order (ties to the lower id) as top-k over the full -inf-filled logits, with a
    softcap too (unmapped tokens stay -inf, never -cap)."""
    draft = random_draft(target).draft
    ids = torch.arange(1, VOCAB, 3)
    draft.set_token_map(ids, target.lm_head_weight)
    hidden = torch.randn(3, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for cap in (None, 0.5):
        draft.config.final_logit_softcapping = cap
        vals, cand = draft.candidates(hidden, target.lm_head_weight)
        ref_vals, ref_cand = draft.candidate_selector.candidates(draft.compute_logits(hidden, target.lm_head_weight))
        assert torch.equal(cand, ref_cand)
        torch.testing.assert_close(vals, ref_vals)
        assert set(cand.flatten().tolist()) <= set(ids.tolist())
    draft.config.final_logit_softcapping = None


def test_bf16_candidates_are_the_fp32_logits_top_k(target):
    """The top-k is taken on the head's bf16 output and only the survivors go to fp32 (and through the
    softcap): the same values as the top-k of the full fp32 logits, each at its own token's logit, in
    order; with a token map and without. (Ids may differ only among equal values at the k-th place.)"""
    draft = random_draft(target).draft.to(torch.bfloat16)
    head = target.lm_head_weight.to(torch.bfloat16)
    hidden = torch.randn(3, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for ids in (None, torch.arange(1, VOCAB, 3)):
        draft.set_token_map(ids, head)
        for cap in (None, 0.5):
            draft.config.final_logit_softcapping = cap
            vals, cand = draft.candidates(hidden, head)
            logits = draft.compute_logits(hidden, head)
            assert vals.dtype == torch.float32
            ref_vals, _ = draft.candidate_selector.candidates(logits)
            assert torch.equal(vals, ref_vals)
            assert torch.equal(logits.gather(-1, cand), vals)
            if ids is not None:
                assert set(cand.flatten().tolist()) <= set(ids.tolist())
    draft.config.final_logit_softcapping = None
    draft.set_token_map(None)


def test_greedy_with_token_map_equals_target(target):
    """Lossless: tokens outside the map are never proposed, yet the output is the target's."""
    prop = random_draft(target, 1)
    ids = torch.arange(3, VOCAB, 3)
    prop.draft.set_token_map(ids, target.lm_head_weight)
    g = torch.Generator().manual_seed(0)
    proposed = set()
    orig = prop.propose

    def spy(*a, **k):
        toks, q = orig(*a, **k)
        proposed.update(toks.tolist())
        assert q is None  # temperature 0: one-hot, rebuilt by the loop for token / block
        return toks, q

    prop.propose = spy
    for _ in range(3):
        prompt = torch.randint(3, VOCAB, (8,), generator=g)
        ref = hf_greedy(target, prompt, 24)
        for method in ("greedy", "token", "block"):
            r = speculative_generate(
                target, prop, prompt, SamplingParams(max_new_tokens=24), width=5, verify_method=method
            )
            assert r.token_ids == ref
    assert proposed and proposed <= set(ids.tolist())


def test_token_map_files(tmp_path):
    save_token_map(torch.tensor([5, 1, 5, 3]), tmp_path / "m.pt")
    assert load_token_map(tmp_path / "m.pt", 10).tolist() == [1, 3, 5]
    (tmp_path / "m.json").write_text(json.dumps([2, 0]))
    assert load_token_map(tmp_path / "m.json", 10).tolist() == [0, 2]
    with pytest.raises(TokenMapError, match="not found"):
        load_token_map(tmp_path / "missing.pt", 10)
    with pytest.raises(TokenMapError, match=r"\[0, 4\)"):
        load_token_map(tmp_path / "m.pt", 4)
    (tmp_path / "bad.pt").write_bytes((tmp_path / "m.pt").read_bytes()[:20])
    with pytest.raises(TokenMapError, match="bad.pt: not a token map"):
        load_token_map(tmp_path / "bad.pt", 10)


def test_token_map_smaller_than_the_selector_is_refused(target):
    draft = random_draft(target).draft
    with pytest.raises(TokenMapError, match="selector_top_k"):
        draft.set_token_map(torch.arange(draft.config.selector_top_k - 1), target.lm_head_weight)


def test_build_token_map_keeps_the_most_frequent_and_the_forced():
    toks = torch.tensor([7, 7, 7, 2, 2, 9, 4, 4, 4, 4])
    assert build_token_map(toks, 2, 12).tolist() == [4, 7]
    assert build_token_map(toks, 3, 12, always=[11]).tolist() == [4, 7, 11]
