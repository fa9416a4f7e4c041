"""The Pareto plot of a serving search: output tokens/s per GPU against tokens/s per user (1 / TPOT),
every fitting plan as a point, the frontier as a line, the chosen plan marked (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from autoplan.serve.search import Scored, pareto


def pareto_png(scored: list[Scored], path: str | Path, *, title: str = "", best: Scored | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    for disagg, color, label in ((False, "tab:blue", "aggregated"), (True, "tab:orange", "disaggregated")):
        pts = [s for s in scored if s.estimate.fits and s.estimate.stable and s.config.disaggregated is disagg]
        if pts:
            ax.scatter([s.estimate.tokens_per_s_per_user for s in pts], [s.estimate.tokens_per_s_per_gpu for s in pts],
                       s=12, alpha=0.5, color=color, label=label)
    front = pareto(scored)
    if front:
        ax.plot([s.estimate.tokens_per_s_per_user for s in front], [s.estimate.tokens_per_s_per_gpu for s in front],
                color="black", lw=1.2, label="Pareto frontier")
    if best is not None and best.estimate.fits:
        ax.scatter([best.estimate.tokens_per_s_per_user], [best.estimate.tokens_per_s_per_gpu], marker="*", s=160,
                   color="red", zorder=5, label="chosen")
    ax.set_xlabel("tokens/s per user (1 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title or "serving plans")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
