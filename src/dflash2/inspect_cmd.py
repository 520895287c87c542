"""``dflash2 inspect``: config summary and parameter count by group (meta device)."""

from __future__ import annotations

from pathlib import Path

from .config import DFlash2Config
from .entry import DEFAULT_DRAFT, REPO
from .model.checkpoint import parameter_report


def inspect_path(path: str) -> str:
    p = Path(path)
    cfg = DFlash2Config.from_file(p)
    report = parameter_report(cfg)
    lines = [
        f"config: {p}",
        f"  hidden_size {cfg.hidden_size}, layers {cfg.num_hidden_layers}, heads {cfg.num_attention_heads}, "
        f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}",
        f"  MLA: q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, qk_nope {cfg.qk_nope_head_dim}, "
        f"qk_rope {cfg.qk_rope_head_dim}, v {cfg.v_head_dim}, softmax scale {cfg.softmax_scale():.6g}",
        f"  block_size {cfg.block_size}, target_layer_ids {cfg.target_layer_ids}, mask_token_id {cfg.mask_token_id}, "
        f"sliding_window {cfg.sliding_window}, is_causal {cfg.is_causal}",
        f"  conv kernel {cfg.conv_kernel_size}, group {cfg.conv_group_size}; selector rank {cfg.selector_rank}, "
        f"top_k {cfg.selector_top_k}, codebook rows {cfg.selector_vocab_size or cfg.vocab_size}"
        f"{' (mapped)' if cfg.selector_vocab_size else ''}; rope_scaling {cfg.rope_scaling}",
        "parameters:",
    ]
    for k in ("layers", "fc", "norms", "selector"):
        lines.append(f"  {k:<10}{report[k]:>16,}")
    lines.append(f"  {'total':<10}{report['total']:>16,}")
    return "\n".join(lines)


def cmd_inspect(args) -> int:

    print(inspect_path(args.path))
    return 0


def cmd_selfcheck(args) -> int:
    """Draft-model self-check on a tiny random config, plus the parameter report of the published config."""
    import torch
    from .config import DFlash2Config
    from .model import DFlash2DraftModel
    from .model.context_cache import DraftContextCache, draft_block

    cfg = DFlash2Config.from_file(DEFAULT_DRAFT)
    m = DFlash2DraftModel(cfg).init_weights()
    c = DraftContextCache(m)
    c.append(m, torch.randn(12, cfg.fc_in_features), 0)
    out = draft_block(
        m,
        [c],
        torch.tensor([1]),
        torch.tensor([12]),
        cfg.block_size,
        torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size),
        torch.randn(cfg.vocab_size, cfg.hidden_size),
    )
    logits = out.logits
    assert torch.isfinite(logits).all()
    print(f"draft forward ok: logits {tuple(logits.shape)}")
    print(inspect_path(str(REPO / "configs" / "kimi-k3.1-dflash2-preview.json")))
    return 0


def add_inspect_parsers(sub) -> None:
    p = sub.add_parser("inspect", help="config summary and parameter count (meta device)")
    p.add_argument("path")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("selfcheck", help="draft-model self-check and the published config's parameter report")
    p.set_defaults(fn=cmd_selfcheck)
