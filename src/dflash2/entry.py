"""The entry layer: the model flags every subcommand shares, :class:`ModelSpec` (those flags, typed)
and :func:`load`, the one place that loads a target with its drafter. Imports no subcommand (the CLI,
the server and the benchmarks import it)."""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DRAFT = REPO / "models" / "smollm2-135m-dflash2"


DTYPE_ALIASES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


def dtype_name(value: str) -> str:
    """SGLang's and vLLM's dtype spellings; float16 is refused with the reason (a flag never means less)."""
    if value in ("half", "float16", "fp16"):
        raise argparse.ArgumentTypeError(
            f"{value}: float16 is not supported (bf16 keeps float32's range; the "
            f"drafter's logits can overflow in fp16): use bfloat16"
        )
    if value not in DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"{value}: use auto, bfloat16 or float32")
    return DTYPE_ALIASES[value]


def resolve_device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model-path",
        "--model",
        default=None,
        help="target: folder with config.json or a .gguf (default: SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--speculative-algorithm", default="DFLASH", choices=["DFLASH", "NONE"])
    ap.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help=f"drafter folder (default: {DEFAULT_DRAFT.relative_to(REPO)})",
    )
    ap.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="verification width, counting the current token (default: the drafter's block_size)",
    )
    ap.add_argument("--speculative-use-block-verification", action="store_true")
    ap.add_argument(
        "--speculative-planner",
        default="auto",
        choices=["auto", "off"],
        help="auto (default): a request drafts only where drafting beats the target alone at the load it "
        "arrives in, and each step verifies the width that promises the most tokens/s from measured step "
        "costs and each request's acceptance per position (1: the target alone, no draft forward); "
        "lossless either way (docs/benchmarks.md, sixteenth session). off: always the full width, and a "
        "seeded sampled request repeats token for token under any load",
    )
    ap.add_argument(
        "--enable-speculative-trim",
        action="store_true",
        help="with --speculative-planner auto, where steps run eagerly (the CPU): a drafting step verifies "
        "only the drafts that the draft's own confidence, calibrated online by what was accepted, pays "
        "for (lossless). Off by default: on the CPU it lost at one request, and its gain at 16 (T=0) was "
        "within the planner's run-to-run spread (docs/benchmarks.md, thirty-eighth session)",
    )
    ap.add_argument(
        "--speculative-planner-widths",
        default=None,
        help="with --speculative-planner auto and CUDA graphs: verify widths between 1 and "
        "--speculative-num-draft-tokens to capture too, for the planner to pick among (e.g. 3 or 2,3; each "
        "adds a set of step graphs at start-up; eager runners run every width already; on the H200 width 3 "
        "beside 5 gained nothing: docs/benchmarks.md, fortieth session)",
    )
    ap.add_argument(
        "--speculative-width-schedule",
        default=None,
        help="pin widths by decode batch size, e.g. 16:5,64:1 (up to 16 running: width 5; up to 64: 1; "
        "more: 1); widths are 1 or --speculative-num-draft-tokens",
    )
    ap.add_argument(
        "--speculative-token-map",
        default=None,
        help="draft vocabulary subset (.pt or .json ids); default: token_map.pt beside the drafter "
        "when present; 'none' scores the full vocabulary",
    )
    ap.add_argument(
        "--speculative-draft-model-quantization",
        default="auto",
        choices=["auto", "none", "w8a8_int8"],
        help="w8a8_int8: the drafter's layers and head rows in int8 (CPU fp32 only; lossless, since "
        "the target verifies: the draft step gets cheaper, acceptance moves a little); "
        "auto (default): w8a8_int8 on the CPU in fp32, none elsewhere",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        type=dtype_name,
        help="auto (bfloat16 on CUDA, float32 on the CPU), bfloat16 (bf16), float32 (float, fp32)",
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when there is a GPU")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="on CUDA: run eagerly instead of replaying CUDA graphs over static buffers (per batch "
        "size; batch 1 is the engine with one slot), else the paged runner. "
        "Graphs need a dense full-attention Llama/Qwen/Mistral target; others run eagerly anyway",
    )
    ap.add_argument(
        "--disable-torch-compile",
        action="store_true",
        help="on CUDA with graphs: run the drafter's layers and context latents eagerly instead of through "
        "torch.compile (on by default there: it roughly halves the draft's graph time; start-up compiles ~20 s)",
    )
    ap.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "triton", "torch_native"],
        help="the static-slot runner's target attention: triton = a kernel that reads each request's live "
        "keys only; torch_native = masked SDPA over a buffer prefix; auto (default): triton on CUDA",
    )
    ap.add_argument(
        "--sampler-backend",
        default="auto",
        choices=["auto", "sort", "triton", "triton-fused"],
        help="the static runner's top-k / top-p / min-p inside its CUDA graphs: sort (every vocabulary row "
        "sorted), triton (a sort-free kernel), triton-fused (temperature, softmax and truncation in one "
        "kernel) or auto (default): triton-fused on CUDA",
    )
    ap.add_argument("--verify-manifest", default=None, help="refuse a drafter whose files fail this manifest")
    ap.add_argument("--manifest-signature", default=None)
    ap.add_argument("--manifest-public-key", default=None)


def add_tp_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--tp-size",
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism: the target's layers split over this many ranks, one process each "
        "(`torchrun --nproc-per-node N -m dflash2.cli ...`; gloo on the CPU, NCCL on GPUs); dense "
        "Llama-family targets (Llama, Qwen2, Qwen3, Mistral), without CUDA graphs so far",
    )


def add_sampling_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=None)


@dataclass(frozen=True)
class ModelSpec:
    """What to load and how to run it: the model flags, typed (``from_args`` reads the parsed flags)."""

    model_path: str | None = None  # None: SmolLM2-135M-Instruct
    speculative: bool = True  # --speculative-algorithm DFLASH (False: NONE)
    draft_path: str | None = None  # None: the shipped drafter
    num_draft_tokens: int | None = None  # None: the drafter's block_size
    block_verification: bool = False
    token_map: str | None = None  # None: token_map.pt beside the drafter when present; "none": off
    quantization: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    verify_manifest: str | None = None
    manifest_signature: str | None = None
    manifest_public_key: str | None = None
    tp_size: int = 1  # --tp-size (serve and generate)

    @classmethod
    def from_args(cls, args) -> "ModelSpec":
        return cls(
            model_path=args.model_path,
            speculative=args.speculative_algorithm == "DFLASH",
            draft_path=args.speculative_draft_model_path,
            num_draft_tokens=args.speculative_num_draft_tokens,
            block_verification=args.speculative_use_block_verification,
            token_map=getattr(args, "speculative_token_map", None),
            quantization=getattr(args, "speculative_draft_model_quantization", "none"),
            dtype=args.dtype,
            device=args.device,
            trust_remote_code=args.trust_remote_code,
            verify_manifest=args.verify_manifest,
            manifest_signature=args.manifest_signature,
            manifest_public_key=args.manifest_public_key,
            tp_size=getattr(args, "tp_size", 1),
        )


@dataclass
class Models:
    """A loaded target with its drafter (None: the target alone), the width and the verifier."""

    target: Any
    draft: Any
    width: int
    block_verification: bool
    device: str


def load_models(args):
    """The CLI's form of :func:`load`: ``(target, draft, width)`` from the parsed flags (and the
    resolved device written back into them)."""
    m = load(ModelSpec.from_args(args))
    args.device = m.device
    return m.target, m.draft, m.width


def load(spec: ModelSpec) -> Models:
    """Target (+ drafter unless not speculative), width and verifier."""
    import torch
    from .model.checkpoint import CheckpointError, load_draft
    from .model.token_map import DEFAULT_NAME as TOKEN_MAP_NAME
    from .model.token_map import load_token_map
    from .target.loading import load_target, resolve_dtype
    from .target.tensor_parallel import init_tp

    device = resolve_device(spec.device)
    tp = init_tp(spec.tp_size, device)  # first: on CUDA it picks this rank's GPU
    draft, width = None, 1
    token_map: torch.Tensor | None = None
    path = Path(spec.draft_path or DEFAULT_DRAFT)
    if spec.speculative:
        if spec.verify_manifest:
            from .integrity.manifest import verify_folder

            if not verify_folder(
                path, spec.verify_manifest, spec.manifest_signature, spec.manifest_public_key, progress=False
            ):
                raise CheckpointError(f"{path}: refused, the files do not match {spec.verify_manifest}")
        dtype = resolve_dtype(spec.dtype, device)
        draft = load_draft(path, device=device, dtype=dtype)
        # inference only: a no-op off the CPU or in bf16
        quant = spec.quantization
        if quant == "auto":  # paired on the 2-core CPU: +4% tok/s at w=5, +9% at w=8 (docs/benchmarks.md)
            quant = "w8a8_int8" if device == "cpu" and dtype == torch.float32 else "none"
        draft.pack_cpu_linears(quant)
        width = draft.config.block_size
        if spec.num_draft_tokens is not None:
            if spec.num_draft_tokens < 2:
                raise SystemExit("--speculative-num-draft-tokens must be >= 2")
            if spec.num_draft_tokens != width:
                warnings.warn(
                    f"--speculative-num-draft-tokens {spec.num_draft_tokens} overrides the drafter's block_size {width}"
                )
            width = spec.num_draft_tokens
        # the token map read before the target's weights: a bad one is an error in a second, not after the load
        map_path: str | Path | None = spec.token_map
        if map_path is None and (path / TOKEN_MAP_NAME).is_file():
            map_path = path / TOKEN_MAP_NAME
        if map_path is not None and str(map_path).lower() != "none":
            if spec.verify_manifest and Path(map_path).resolve().parent != path.resolve():
                raise CheckpointError(f"{map_path}: refused, --verify-manifest covers only the files in {path}")
            token_map = load_token_map(map_path, draft.config.vocab_size)
    target = load_target(
        spec.model_path,
        spec.dtype,
        device,
        layer_ids=draft.config.target_layer_ids if draft else [],
        trust_remote_code=spec.trust_remote_code,
        tp=tp,
    )
    if draft is not None:
        if (
            draft.config.hidden_size != target.config.hidden_size
            or draft.config.vocab_size != target.lm_head_weight.shape[0]
        ):
            raise SystemExit(
                f"drafter (hidden {draft.config.hidden_size}, vocab {draft.config.vocab_size}) does not fit "
                f"the target (hidden {target.config.hidden_size}, vocab {target.lm_head_weight.shape[0]})"
            )
        if token_map is not None:
            draft.set_token_map(token_map, target.lm_head_weight)
    torch.set_grad_enabled(False)
    return Models(target, draft, width, spec.block_verification, device)


def sampling_from(args):
    from .verification import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
