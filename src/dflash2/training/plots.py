"""Training curves as one PNG: losses by step, and held-out acceptance length per domain."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: str | Path) -> bool:
    """Write the curves of ``history`` (the trainer's per-step records) to ``path``; False when
    matplotlib is not installed (the log still holds every number)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [h["step"] for h in history]
    evals = [h for h in history if "heldout" in h or "heldout_accept_length" in h]
    fig, (ax_loss, ax_al) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in ("loss", "ce", "kl", "selector", "selector_kl"):
        ys = [h.get(key, 0.0) for h in history]
        if any(ys):
            ax_loss.plot(steps, ys, label=key, linewidth=0.8)
    ax_loss.set(xlabel="step", ylabel="loss (nats)", title="training losses")
    ax_loss.legend()
    domains = sorted({d for h in evals for d in h.get("heldout", {})})
    for d in domains:
        pts = [(h["step"], h["heldout"][d]) for h in evals if d in h.get("heldout", {})]
        (line,) = ax_al.plot([s for s, _ in pts], [v["greedy"] for _, v in pts], marker="o", label=f"{d} greedy")
        ax_al.plot([s for s, _ in pts], [v["t1_block"] for _, v in pts], marker="x", linestyle="--",
                   color=line.get_color(), label=f"{d} T=1 block")  # fmt: skip
    plain = [(h["step"], h["heldout_accept_length"]) for h in evals if "heldout_accept_length" in h]
    if plain:
        ax_al.plot([s for s, _ in plain], [v for _, v in plain], marker="o", label="held-out greedy")
    ax_al.set(xlabel="step", ylabel="acceptance length", title="held-out acceptance length")
    if domains or plain:
        ax_al.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
