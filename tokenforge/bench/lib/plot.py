"""PNG plots of benchmark sweeps (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_sweep(points: list[dict], path: Path, title: str, baseline: float | None = None) -> Path:
    """Throughput against batch size: one line per figure in `points` ({batch_size, output_tok_s,
    total_tok_s}), log2 x axis, and the HF baseline as a dashed line when given."""
    import matplotlib  # noqa: PLC0415 - optional dependency, needed only here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    xs = [p["batch_size"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(xs, [p["output_tok_s"] for p in points], "o-", label="tokenforge output tok/s")
    ax.plot(xs, [p["total_tok_s"] for p in points], "s--", alpha=0.6, label="tokenforge total tok/s")
    if baseline:
        ax.axhline(baseline, color="gray", linestyle=":", label="HF transformers output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent requests (batch size)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
