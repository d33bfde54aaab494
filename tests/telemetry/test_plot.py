"""Timeline plots: every run's phases shaded (one axvspan per phase span), the legend outside the data."""

from __future__ import annotations

import pytest

from memascend.telemetry.plot import plot_timelines, timeline_figure

HEADER = "t_s,phase,rss_bytes,uss_bytes,hwm_bytes,locked_bytes,read_bytes,write_bytes,gpu_allocated_bytes,gpu_reserved_bytes"
PHASES = ["start", "load", "load", "initialize", "initialize", "forward", "backward", "backward", "step", "forward",
          "backward", "step", "save", "done"]


def _csv(path, scale: float, phases=PHASES):
    rows = [HEADER]
    for i, ph in enumerate(phases):
        rss = int(scale * (1 + i % 5) * 2**28)
        rows.append(f"{i * 0.5:.3f},{ph},{rss},{rss // 2 if i % 2 else ''},{rss},{rss // 4},0,0,,")
    path.write_text("\n".join(rows) + "\n")
    return path


def _spans(ax) -> list[str]:
    return [p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith("phase:")]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tl")
    fig = timeline_figure({"baseline": _csv(d / "b.csv", 3.0), "memascend": _csv(d / "m.csv", 1.0, PHASES[:9])},
                          title="pair")
    yield fig
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_each_run_of_a_comparison_has_its_phases_shaded(two_runs):
    base_ax, mine_ax = two_runs.axes
    # baseline: load, initialize, forward, backward, step, forward, backward, step, save
    assert _spans(base_ax) == ["phase:" + p for p in
                               ("load", "initialize", "forward", "backward", "step", "forward", "backward", "step",
                                "save")]
    assert _spans(mine_ax) == ["phase:" + p for p in ("load", "initialize", "forward", "backward", "step")]
    assert base_ax.get_shared_y_axes().joined(base_ax, mine_ax)


def test_legend_sits_outside_every_data_area(two_runs):
    two_runs.canvas.draw()
    renderer = two_runs.canvas.get_renderer()
    legends = [ax.get_legend() for ax in two_runs.axes if ax.get_legend()]
    assert len(legends) == 1
    box = legends[0].get_window_extent(renderer)
    for ax in two_runs.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers a curve's axes"
    labels = [t.get_text() for t in legends[0].get_texts()]
    assert labels[:3] == ["RSS", "USS", "locked (VmLck)"] and "save" in labels and "step" in labels


def test_single_run_png_is_written_with_phases(tmp_path):
    png = tmp_path / "one" / "t.png"
    plot_timelines({"memascend": _csv(tmp_path / "a.csv", 1.0)}, png, title="one run")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = timeline_figure({"memascend": tmp_path / "a.csv"})
    assert len(fig.axes) == 1 and "phase:backward" in _spans(fig.axes[0])
