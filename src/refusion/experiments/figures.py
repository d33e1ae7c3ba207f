"""The one plot helper of the experiment commands: task panels in a row, a legend below them, PNG + SVG saved
so that the same rows give the same bytes (no dates, ids salted by the file's stem).

``bench`` (accuracy against tokens/s), ``batch-bench`` (throughput against batch size), ``ablate`` and the
results page (a metric against a metric or a swept knob) draw their panels on :func:`task_panels` and
write them with :func:`save`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def task_panels(n: int, height: float = 3.9, width: float = 4.2) -> tuple[Any, list[Any]]:
    """A figure of ``n`` panels side by side (one per task), each ``width`` x ``height`` inches; its axes."""
    fig, axes = pyplot().subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def legend_below(fig: Any, handles: Sequence[Any], labels: Sequence[str], ncol: int, title: str,
                 bottom: float = 0.07, **kw: Any) -> None:
    """A frameless legend centred under the panels (none without ``handles``), the figure's ``title``, and the
    panels laid out above ``bottom`` (a fraction of the height)."""
    if handles:
        fig.legend(list(handles), list(labels), loc="lower center", ncol=ncol, frameon=False, **kw)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, bottom, 1, 1))


def save(fig: Any, out: Path, stem: str) -> list[Path]:
    """Write ``OUT/STEM.png`` (130 dpi) and ``OUT/STEM.svg``, byte-identical for the same figure; close it."""
    import matplotlib

    plt = pyplot()
    paths = [Path(out) / f"{stem}.png", Path(out) / f"{stem}.svg"]
    with matplotlib.rc_context({"svg.hashsalt": stem}):
        fig.savefig(paths[0], dpi=130, metadata={"Software": None})
        fig.savefig(paths[1], metadata={"Date": None})
    plt.close(fig)
    return paths
