"""Quality against latency, drawn twice: a PNG (matplotlib) and a terminal plot (plotext).

Both show every setting at (p50 latency, agreement), the Pareto front highlighted and the
recommended setting marked. matplotlib and plotext come with the `tune` extra; they are imported
here only, when a plot is drawn.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from engine.tuning.scoring import SettingResult

MARKERS = {"threshold": "o", "steps": "s"}
REFERENCE_MARKER = "D"


def missing_plot_packages(*, terminal: bool) -> list[str]:
    """The plotting packages that are not installed (plotext only when TERMINAL)."""
    import importlib.util

    wanted = ["matplotlib", *(["plotext"] if terminal else [])]
    return [name for name in wanted if importlib.util.find_spec(name) is None]


def quality_latency_png(
    results: Sequence[SettingResult], recommended: SettingResult | None, title: str
) -> bytes:
    """The PNG: one colour per block size, one marker per mode, the front joined by a line."""
    # The object API with an explicit Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    blocks = sorted({r.setting.block_size for r in results})
    colours = {b: f"C{i % 10}" for i, b in enumerate(blocks)}
    for block in blocks:
        for mode in ("threshold", "steps"):
            points = [
                r for r in results if r.setting.block_size == block and r.setting.mode == mode
            ]
            for reference in (False, True):
                chosen = [r for r in points if r.setting.reference == reference]
                if not chosen:
                    continue
                label = f"B={block} reference" if reference else f"B={block} {mode}"
                ax.scatter(
                    [r.p50_s for r in chosen],
                    [r.agreement for r in chosen],
                    color=colours[block],
                    marker=REFERENCE_MARKER if reference else MARKERS[mode],
                    s=36,
                    label=label,
                    zorder=3,
                )
    front = sorted((r for r in results if r.on_front), key=lambda r: r.p50_s)
    if front:
        ax.plot(
            [r.p50_s for r in front],
            [r.agreement for r in front],
            color="black",
            linewidth=1,
            drawstyle="steps-post",
            zorder=2,
        )
        ax.scatter(
            [r.p50_s for r in front],
            [r.agreement for r in front],
            s=140,
            facecolors="none",
            edgecolors="black",
            linewidths=1.2,
            label="Pareto front",
            zorder=4,
        )
        for r in front:
            ax.annotate(
                r.setting.label,
                (r.p50_s, r.agreement),
                textcoords="offset points",
                xytext=(6, -12),
                fontsize=7,
            )
    if recommended is not None:
        ax.scatter(
            [recommended.p50_s],
            [recommended.agreement],
            marker="*",
            s=320,
            color="gold",
            edgecolors="black",
            label="recommended",
            zorder=5,
        )
        ax.annotate(
            f"recommended: {recommended.setting.label}",
            (recommended.p50_s, recommended.agreement),
            textcoords="offset points",
            # Below and right: the best settings sit at the top, under the title.
            xytext=(30, -40),
            arrowprops={"arrowstyle": "->"},
            fontsize=9,
            fontweight="bold",
        )
    ax.margins(x=0.06, y=0.08)
    ax.set_xlabel("p50 latency per request (s)")
    ax.set_ylabel("agreement with the one-token-per-step decode")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def terminal_plot(
    results: Sequence[SettingResult],
    recommended: SettingResult | None,
    *,
    width: int,
    height: int = 20,
) -> str:
    """The same plot as text: `o` settings, `*` the Pareto front, `@` the recommendation.

    The legend is a line under the plot: plotext draws its own over the top-left points, where
    the fast settings of a sweep usually are.
    """
    import plotext

    groups = [
        ("o", [r for r in results if not r.on_front and r is not recommended]),
        ("*", [r for r in results if r.on_front and r is not recommended]),
        ("@", [recommended] if recommended is not None else []),
    ]
    series = [(marker, [r.p50_s for r in rs], [r.agreement for r in rs]) for marker, rs in groups]
    series = [s for s in series if s[1]]
    title = "agreement (y) vs p50 latency in s (x)"
    # plotext 6 draws through a figure object; 5.x through module-level functions.
    if hasattr(plotext, "figure") and hasattr(plotext.figure, "signal"):
        plot = _plot_v6(plotext, series, title, width, height)
    else:
        plot = _plot_v5(plotext, series, title, width, height)
    return plot.rstrip("\n") + "\n  o setting   * Pareto front   @ recommended"


Series = list[tuple[str, list[float], list[float]]]


def _plot_v6(plotext: Any, series: Series, title: str, width: int, height: int) -> str:
    figure = plotext.figure
    figure.clear()
    figure.plot_size(width, height)
    figure.title(title)
    for marker, xs, ys in series:
        figure.draw(figure.signal(xs, ys, marker=marker))
    return str(figure.build().string())


def _plot_v5(plotext: Any, series: Series, title: str, width: int, height: int) -> str:
    plotext.clear_figure()
    plotext.plotsize(width, height)
    plotext.title(title)
    for marker, xs, ys in series:
        plotext.scatter(xs, ys, marker=marker)
    return str(plotext.build())
