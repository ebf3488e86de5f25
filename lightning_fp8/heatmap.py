"""The amax heatmap: layers x logging steps, log10(amax), one panel per quantized tensor (matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_fp8.recipe import ROLES


def amax_heatmap_figure(layers: Sequence[str], steps: Sequence[int], amax: Sequence[Sequence[Sequence[float]]]) -> Any:
    """Draw the heatmap and return the matplotlib ``Figure``.

    Args:
        layers: layer names (rows).
        steps: the global step of each column.
        amax: ``amax[column][layer][role]``.

    Non-positive or non-finite amaxes are drawn as blank cells (masked).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.asarray(amax, dtype=np.float64).reshape(len(steps), len(layers), len(ROLES))
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.where((data > 0) & np.isfinite(data), np.log10(data), np.nan)
    height = max(2.5, 0.22 * len(layers) + 1.5)
    fig, axes = plt.subplots(1, len(ROLES), figsize=(5 * len(ROLES), height), squeeze=False, constrained_layout=True)
    for role, ax in enumerate(axes[0]):
        panel = np.ma.masked_invalid(logged[:, :, role].T)
        image = ax.imshow(panel, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_title(f"{ROLES[role]}: log10(amax)")
        ax.set_xlabel("step")
        ticks = np.linspace(0, len(steps) - 1, num=min(6, len(steps))).round().astype(int) if steps else []
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(steps[i]) for i in ticks])
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers if role == 0 else [""] * len(layers), fontsize=7)
        fig.colorbar(image, ax=ax, shrink=0.8)
    return fig


def finite_positive(values: Sequence[float]) -> list[float]:
    """The entries of an amax history worth plotting (recorded, finite)."""
    return [v for v in values if v > 0 and math.isfinite(v)]
