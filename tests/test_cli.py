"""The command line on the shipped default (SmolLM2-135M-Instruct + the committed drafter)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*args, check=True):
    p = subprocess.run(
        [sys.executable, "-m", "dflash2.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=900
    )
    if check and p.returncode:
        raise AssertionError(p.stderr[-3000:])
    return p


def test_inspect_published_config():
    out = run("inspect", "configs/kimi-k3.1-dflash2-preview.json").stdout
    assert "2,784,811,008" in out and "selector" in out


def test_inspect_errors_name_the_key(tmp_path):
    cfg = json.loads((REPO / "configs/kimi-k3.1-dflash2-preview.json").read_text())
    cfg["dflash_config"]["conv_group_size"] = 10
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = run("inspect", str(tmp_path), check=False)
    assert p.returncode == 2 and "conv_group_size" in p.stderr and "Traceback" not in p.stderr


@pytest.fixture
def restore_grad_mode():
    import torch

    mode = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(mode)  # load_models turns autograd off for the process; later tests train


def test_generate_default_fp32_lossless(restore_grad_mode, capsys, monkeypatch):
    """DFlash2 and the target alone give the same tokens (float32, greedy) on the real default, through
    ``dflash2 generate`` in this process (a subprocess each paid ~10 s of imports and loading; the
    entry point itself runs in the subprocess tests above and below)."""
    from dflash2.cli import main

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_SDPA_FORCE_GQA"):
        monkeypatch.delenv(var, raising=False)  # (restored after: main and the CPU kernels set them)
    prompt = "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many apples are left?"
    flags = ["generate", "--prompt", prompt, "--max-new-tokens", "48", "--dtype", "float32", "--json"]
    out = []
    for extra in ([], ["--speculative-algorithm", "NONE"]):
        assert main(flags + extra) == 0
        out.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    spec, base = out
    assert spec["token_ids"] == base["token_ids"]
    # the default drafter on the CPU is int8 (auto); the drafter only proposes, so its fp32 form (which
    # test_draft_quantization_auto_is_int8_on_cpu_fp32_only loads) needs no run of its own here
    assert spec["completion_tokens"] == len(spec["token_ids"])
    assert spec["accept_length"] > 1.5  # the shipped drafter really drafts
    assert set(spec) >= {"text", "token_ids", "completion_tokens", "verify_steps", "accept_length", "tokens_per_s"}


def test_draft_quantization_auto_is_int8_on_cpu_fp32_only(restore_grad_mode):
    import torch
    from dflash2.cli import build_parser, load_models
    from dflash2.model.cpu_linear import Int8Weight, PackedWeight, int8_available

    if not int8_available():
        pytest.skip("this torch build has no fbgemm/x86 quantized engine")
    for extra, kind in (
        ([], Int8Weight),
        (["--speculative-draft-model-quantization", "none"], PackedWeight),
        (["--speculative-draft-model-quantization", "w8a8_int8"], Int8Weight),
    ):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "float32", *extra])
        _, draft, _ = load_models(args)
        assert isinstance(draft._token_map[3], kind), extra
        x = torch.randn(2, draft.config.fc_in_features)
        with torch.no_grad():  # fc stays fp32 in every case (its input has outlier channels)
            torch.testing.assert_close(
                draft.fc(x), torch.nn.functional.linear(x, draft.fc.weight), rtol=1e-4, atol=1e-4
            )
    args = build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "bfloat16"])
    _, draft, _ = load_models(args)
    assert draft._token_map[3] is None  # bf16: nothing packed, nothing quantised


def test_corrupt_drafter_is_a_clear_error(tmp_path):
    import shutil

    d = tmp_path / "draft"
    shutil.copytree(REPO / "models/smollm2-135m-dflash2", d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])
    p = run("generate", "--prompt", "hi", "--speculative-draft-model-path", str(d), check=False)
    assert p.returncode == 2 and "model.safetensors" in p.stderr and "Traceback" not in p.stderr


def test_bad_token_map_is_a_clear_error(tmp_path):
    (tmp_path / "map.json").write_text("[1, 2, 999999]")
    p = run(
        "generate",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "--speculative-token-map",
        str(tmp_path / "map.json"),
        check=False,
    )
    assert p.returncode == 2 and "map.json" in p.stderr and "49152" in p.stderr and "Traceback" not in p.stderr


def test_model_spec_from_flags_is_what_load_reads():
    """The typed entry layer: every model flag lands in ModelSpec; a NONE algorithm loads no drafter."""
    from dflash2.cli import build_parser
    from dflash2.entry import ModelSpec

    args = build_parser().parse_args(
        [
            "bench",
            "speed",
            "--speculative-num-draft-tokens",
            "6",
            "--speculative-use-block-verification",
            "--speculative-token-map",
            "none",
            "--dtype",
            "fp32",
            "--device",
            "cpu",
        ]
    )
    spec = ModelSpec.from_args(args)
    assert (spec.num_draft_tokens, spec.block_verification, spec.token_map, spec.dtype, spec.device) == (
        6,
        True,
        "none",
        "float32",
        "cpu",
    )
    assert spec.speculative and spec.draft_path is None and spec.quantization == "auto"
    none = ModelSpec.from_args(build_parser().parse_args(["bench", "speed", "--speculative-algorithm", "NONE"]))
    assert not none.speculative
