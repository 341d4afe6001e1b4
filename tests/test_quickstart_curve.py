"""The learning-curve PNG: its legends sit beside the plots, never over a curve."""

from __future__ import annotations

import pytest

from slime_stoa.quickstart.report import curve_figure

plt = pytest.importorskip("matplotlib.pyplot")


@pytest.mark.parametrize("task", ["synthetic", "search"])
def test_the_legends_do_not_cover_the_plots(task: str) -> None:
    summary = {
        "task": task,
        "reward_by_version": {str(v): 0.05 + 0.09 * v for v in range(11)},
        "search_rate_by_version": {str(v): 0.1 * v for v in range(11)},
        "patch_bytes_by_version": {str(v): 1000 * v for v in range(1, 11)},
        "full_bytes": 9_000, "chance": 0.25, "target": 0.9,
    }
    fig = curve_figure(summary)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for axes in fig.axes:
            legend = axes.get_legend()
            assert legend is not None
            box, plot = legend.get_window_extent(renderer), axes.get_window_extent(renderer)
            assert box.x0 >= plot.x1, (box, plot)  # wholly to the right of the plot area
            assert box.x1 <= fig.bbox.x1 + 1  # and inside the figure
    finally:
        plt.close(fig)
