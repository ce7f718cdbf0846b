"""Headless figures for reports (latency profiles, bench plots): matplotlib on Agg, optional."""

from __future__ import annotations

from pathlib import Path

from specrt.files import atomic_file


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (no plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def finish_figure(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label, grid, legend to the right of the axes, then save_figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """Lay out, write (PNG, 110 dpi, atomically) and release a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_file(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")  # bbox keeps legends placed outside the axes
    plt.close(fig)
