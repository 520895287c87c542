"""grow-draft: the selector's codebooks over a token map, a higher selector rank, more layers, and the
drafter still proposing exactly what it proposed (issue 23: the 48 MB budget spent where acceptance gains)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash2.cli import main
from dflash2.config import ConfigError
from dflash2.model import DFlash2DraftModel
from dflash2.model.checkpoint import CheckpointError, load_draft, read_state_dict, save_draft
from dflash2.model.context_cache import DraftContextCache, draft_block
from dflash2.training.grow import grow_draft
from targets import tiny_config

IDS = torch.arange(0, 97, 2)  # a token map of the even ids (49 of 97; the mask token 96 among them)


def trained_like(cfg) -> DFlash2DraftModel:
    """Random weights with every part live: pair scores as large as the logits, block convolutions not
    the identity (a growth that broke either would change the proposals)."""
    m = DFlash2DraftModel(cfg).init_weights(std=0.2)
    with torch.no_grad():
        m.candidate_selector.successor_codebook.normal_(0, 2.0)
        m.candidate_selector.predecessor_codebook.normal_(0, 2.0)
        for layer in m.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.normal_(0, 0.1)
    return m


def propose(draft, feats, anchors, lm, emb, temperature, uniforms):
    caches = []
    for f in feats:
        c = DraftContextCache(draft)
        c.append(draft, f, 0)
        caches.append(c)
    pos = torch.tensor([len(f) for f in feats])
    out = draft_block(draft, caches, anchors, pos, 5, emb, lm)
    return out.hidden, draft.candidate_selector.walk(out.candidates(), out.hidden, anchors, temperature, uniforms)


@pytest.mark.parametrize("mapped,rank,layers", [(True, None, None), (False, 12, None), (False, None, 3), (True, 12, 4)])
def test_grown_drafter_proposes_what_it_proposed(seed, mapped, rank, layers):
    cfg = tiny_config()  # vocab 97, rank 8, 2 layers
    old = trained_like(cfg)
    grown = grow_draft(old, IDS if mapped else None, rank, layers, generator=torch.Generator().manual_seed(seed))
    assert grown.config.selector_rank == (rank or 8) and grown.config.num_hidden_layers == (layers or 2)
    sel = grown.candidate_selector
    if mapped:
        assert grown.config.selector_vocab_size == len(IDS) + 1 == sel.predecessor_codebook.shape[0]
        assert torch.equal(sel.codebook_rows[IDS], torch.arange(len(IDS)))
        assert bool((sel.codebook_rows[1::2] == len(IDS)).all())  # every other token: the shared row
    else:
        assert sel.codebook_rows is None and sel.predecessor_codebook.shape[0] == 97
    lm, emb = torch.randn(97, 32), torch.nn.Embedding(97, 32)
    for m in (old, grown):
        m.set_token_map(IDS if mapped else None, lm)
    feats = [torch.randn(n, cfg.fc_in_features) for n in (7, 12, 3)]
    anchors = IDS[torch.randint(0, len(IDS), (3,))]
    temperature, uniforms = torch.tensor([0.0, 1.0, 0.7]), torch.rand(3, 4)
    h_old, s_old = propose(old, feats, anchors, lm, emb, temperature, uniforms)
    h_new, s_new = propose(grown, feats, anchors, lm, emb, temperature, uniforms)
    assert torch.equal(h_old, h_new)  # a new layer is the identity on the residual stream, exactly
    assert torch.equal(s_old.cand_ids, s_new.cand_ids) and torch.equal(s_old.tokens, s_new.tokens)
    torch.testing.assert_close(s_old.q_draft, s_new.q_draft, rtol=1e-5, atol=1e-6)
    # the grown parts still learn: the new rank's successor columns and the new layers' outputs take gradients
    if rank or layers:
        grown.train().float()
        hidden = torch.randn(2, 4, 32)
        W = grown.candidate_selector.pair_weights(hidden, torch.randint(0, 97, (2, 4, 6)))
        (
            W.sum()
            + grown(
                torch.randn(2, 5, 32),
                torch.arange(5).expand(2, 5),
                torch.zeros(grown.config.num_hidden_layers, 2, 0, 16),
                torch.ones(2, 5, 5, dtype=torch.bool),
                5,
            ).sum()
        ).backward()
        if rank:
            assert grown.candidate_selector.successor_codebook.grad[:, 8:].abs().sum() > 0
        if layers:
            assert grown.layers[-1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_mapped_drafter_saves_loads_and_names_bad_rows(tmp_path):
    grown = grow_draft(trained_like(tiny_config()), IDS, 12, 3)
    save_draft(grown, tmp_path / "g", dtype=torch.bfloat16)
    raw = json.loads((tmp_path / "g" / "config.json").read_text())
    assert raw["dflash_config"]["selector_vocab_size"] == len(IDS) + 1 and len(raw["layer_types"]) == 3
    assert "selector_vocab_size" not in tiny_config().to_dict()["dflash_config"]  # the published layout, unchanged
    back = load_draft(tmp_path / "g")
    rows = back.candidate_selector.codebook_rows
    assert rows.dtype == torch.long and torch.equal(rows, grown.candidate_selector.codebook_rows)
    assert back.fc.weight.dtype == torch.bfloat16
    state = read_state_dict(tmp_path / "g")
    state["candidate_selector.codebook_rows"][5] = len(IDS) + 1  # past the codebooks
    save_file(state, str(tmp_path / "g" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="codebook_rows"):
        load_draft(tmp_path / "g")
    del state["candidate_selector.codebook_rows"]
    save_file(state, str(tmp_path / "g" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor: candidate_selector.codebook_rows"):
        load_draft(tmp_path / "g")


@pytest.mark.parametrize("value", [0, 98, True, 1.5])
def test_selector_vocab_size_is_validated(value):
    raw = tiny_config().to_dict()
    raw["dflash_config"]["selector_vocab_size"] = value
    with pytest.raises(ConfigError, match="selector_vocab_size"):
        type(tiny_config()).from_dict(raw)
    raw = tiny_config().to_dict()
    raw["layer_types"] = ["sliding_attention"]  # two layers
    with pytest.raises(ConfigError, match="layer_types"):
        type(tiny_config()).from_dict(raw)


def test_growth_only_adds_and_the_cli_writes_a_loadable_folder(tmp_path, capsys):
    old = trained_like(tiny_config())
    with pytest.raises(ValueError, match="rank 4 is below"):
        grow_draft(old, selector_rank=4)
    with pytest.raises(ValueError, match="1 layers is below"):
        grow_draft(old, num_layers=1)
    with pytest.raises(ValueError, match="rank 0 is below"):  # never read as "unset"
        grow_draft(old, selector_rank=0)
    with pytest.raises(ValueError, match="selector_top_k"):
        grow_draft(old, IDS[:3])
    with pytest.raises(ValueError, match="mapped already"):
        grow_draft(grow_draft(old, IDS), IDS)
    save_draft(old, tmp_path / "d")
    torch.save(IDS.to(torch.int32), tmp_path / "map.pt")
    args = ["grow-draft", "--draft", str(tmp_path / "d"), "--token-map", str(tmp_path / "map.pt")]
    assert main([*args, "--num-layers", "3", "--output", str(tmp_path / "g")]) == 0
    assert "-> " in capsys.readouterr().out
    grown = load_draft(tmp_path / "g")
    assert grown.config.num_hidden_layers == 3 and (tmp_path / "g" / "token_map.pt").is_file()
    assert main([*args, "--output", str(tmp_path / "d")]) == 2  # never over the drafter it grows
    assert "own folder" in capsys.readouterr().err
    assert main([*args, "--selector-rank", "2", "--output", str(tmp_path / "h")]) == 2
    assert "below" in capsys.readouterr().err


@pytest.mark.parametrize("runner", ["static", "paged"])
def test_grown_drafter_serves_through_the_engine(runner):
    """Through both runners (the codebook rows are a buffer that must follow the drafter to its device and
    dtype): rank and layers grown, the same output and acceptance as before (a random drafter accepts little:
    the proposals themselves are compared above); codebooks mapped (the engine here scores the whole vocabulary,
    so unmapped candidates share a row), still the target's own greedy output."""
    from test_engine import _prompts, _run
    from test_speculative import hf_greedy, random_draft

    from dflash2.target import TargetModel
    from targets import VOCAB, build

    t = TargetModel(build("llama", seed=3), layer_ids=[0, 2])
    d = random_draft(t, 3).draft
    with torch.no_grad():
        d.candidate_selector.successor_codebook.normal_(0, 2.0)
    prompts = _prompts(6)
    _, base = _run(t, d, prompts, runner)
    _, same = _run(t, grow_draft(d, None, 12, 3), prompts, runner)
    assert [r.output_ids for r in same] == [r.output_ids for r in base]
    assert [r.accept_hist for r in same] == [r.accept_hist for r in base]
    _, mapped = _run(t, grow_draft(d, torch.arange(0, VOCAB, 2)), prompts, runner)
    for p, r in zip(prompts, mapped):
        assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)
