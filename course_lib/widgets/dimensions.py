"""Lab 10's figures: a pipeline timeline (which micro-batch each stage runs when) and an all-to-all traffic matrix
(who sends how many tokens to whom). Plain data in -- ``(stage, kind, mb, start, end)`` rows, a list of rows of
counts -- so a simulated schedule and a measured run draw the same way; matplotlib ``Figure``\\ s that show
themselves (:func:`course_lib.widgets.base.new_figure`)."""
from __future__ import annotations

from typing import Sequence

from course_lib.widgets.base import new_figure, rank_color

__all__ = ["pipeline_figure", "matrix_figure"]


def pipeline_figure(panels: Sequence[tuple[str, Sequence[tuple]]], p: int, unit: str = "schedule units"):
    """One panel per ``(title, rows)``; a row ``(stage, kind, mb, start, end)`` is drawn as a box on its stage's
    line, labelled ``F3`` / ``B3``; forwards light, backwards dark, the empty stretches are the bubble."""
    fig = new_figure(figsize=(11, 1.0 + 1.3 * p * len(panels) / 2))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, rows) in zip(axes, panels):
        t0 = min((r[3] for r in rows), default=0.0)
        span = max((r[4] for r in rows), default=1.0) - t0
        for stage, kind, mb, start, end in rows:
            color = rank_color(stage)
            ax.barh(stage, end - start, left=start - t0, height=0.8, color=color, alpha=0.45 if kind == "F" else 0.95,
                    edgecolor="black", linewidth=0.5)
            if (end - start) / span > 0.012:
                ax.text(start - t0 + (end - start) / 2, stage, f"{kind}{mb}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1].set_xlabel(unit)
    fig.tight_layout()
    return fig


def matrix_figure(matrix: Sequence[Sequence[float]], title: str, side: Sequence[tuple[str, Sequence[float]]] = ()):
    """A heat map of ``matrix[src][dst]`` with each count written in its cell; ``side``: extra bar charts
    ``(title, values)`` beside it (tokens per expert, dropped per rank)."""
    import numpy as np
    m = np.asarray(matrix, dtype=float)
    fig = new_figure(figsize=(4.2 + 3.6 * len(side), 3.6))
    axes = fig.subplots(1, 1 + len(side), squeeze=False)[0]
    ax = axes[0]
    ax.imshow(m, cmap="Blues")
    for (i, j), v in np.ndenumerate(m):
        ax.text(j, i, f"{v:g}", ha="center", va="center", color="white" if v > m.max() * 0.6 else "black")
    ax.set_xticks(range(m.shape[1]), [f"to {j}" for j in range(m.shape[1])])
    ax.set_yticks(range(m.shape[0]), [f"from {i}" for i in range(m.shape[0])])
    ax.set_title(title, fontsize=10)
    for a, (name, values) in zip(axes[1:], side):
        a.bar(range(len(values)), values, color=[rank_color(i * m.shape[0] // max(len(values), 1))
                                                 for i in range(len(values))])
        a.set_xticks(range(len(values)))
        a.set_title(name, fontsize=10)
    fig.tight_layout()
    return fig
