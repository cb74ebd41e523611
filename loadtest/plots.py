"""The bar charts the benches draw (longctx, mixed, handoff): side-by-side panels, each a group
of bars per x label and a bar per series in a group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    title: str
    xlabels: Sequence[str]
    series: Mapping[str, Sequence[float]]  # name -> a value per x label
    labels: str | Sequence[str] | None = None  # on the bars: a format ("%.1f"), or the texts


def grouped_bars(
    path: Path, panels: Sequence[Panel], *, ylabel: str = "", title: str = "", log: bool = False
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        n, width = len(panel.xlabels), 0.8 / len(panel.series)
        for j, (name, values) in enumerate(panel.series.items()):
            bars = ax.bar([i + j * width for i in range(n)], values, width, label=name)
            if isinstance(panel.labels, str):
                ax.bar_label(bars, fmt=panel.labels)
            elif panel.labels is not None:
                ax.bar_label(bars, labels=list(panel.labels), fontsize=8)
        ax.set_xticks([i + width * (len(panel.series) - 1) / 2 for i in range(n)], panel.xlabels)
        ax.set(title=panel.title, ylabel=ylabel)
        if log:
            ax.set_yscale("log")
        if len(panel.series) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
