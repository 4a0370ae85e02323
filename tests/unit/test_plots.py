"""The PNG plots on small fake runs: seeds named, distinct colours, paired ratios with their
intervals, plain log tick labels, one y scale across the timeline panels."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hybridserve.metrics import plots  # noqa: E402

close_all = plt.close  # write_plots' own close is stubbed out to keep its figures readable


def fake_run(seed: int, scale: float) -> Any:
    rows = [
        {
            "t_s": float(t),
            "prefill_tokens_per_step": scale * (100.0 + t),
            "decode_tokens_per_step": scale * 20.0,
            "kv_usage_max": 0.5,
        }
        for t in range(20)
    ]
    return SimpleNamespace(
        config=SimpleNamespace(warmup_s=5.0, seed=seed),
        summary={"job_goodput_per_hour": 100.0 * scale, "output_tokens_per_s": 800.0},
        recorder=SimpleNamespace(timeline=SimpleNamespace(rows=lambda: rows)),
        itl_samples_s=lambda: [0.004 * scale * (1 + i % 50) for i in range(400)],
        ttft_samples_s=lambda: [0.2 * scale * (1 + i % 30) for i in range(100)],
    )


RUNS = {"baseline": fake_run(0, 1.0), "hybridserve": fake_run(0, 3.0), "legacy": fake_run(0, 2.0)}
RATIOS = {
    "hybridserve": {"mean": 1.62, "ci95": [1.41, 1.86], "per_seed": [1.5, 1.6, 1.8], "n": 3},
    "legacy": {"mean": 1.0, "ci95": [1.0, 1.0], "per_seed": [1.0] * 3, "degenerate": True},
    "free-prefill": {"mean": 2.2, "ci95": [2.0, 2.4], "per_seed": [2.1, 2.2, 2.3], "n": 3},
}


def figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **kwargs: Any) -> dict[str, Any]:
    """write_plots' figures by file name, kept open to be read."""
    kept: dict[str, Any] = {}

    def savefig(self: Any, path: Any, **_: Any) -> None:
        kept[Path(path).name] = self

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    plots.write_plots(tmp_path, RUNS, **kwargs)
    return kept


def texts(fig: Any) -> str:
    parts = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        parts += [ax.get_title(), *(t.get_text() for t in ax.texts)]
    return "\n".join(parts)


def test_seeds_are_named_in_words() -> None:
    assert plots.seeds_caption([0]) == "seed 0"
    assert plots.seeds_caption([2, 0, 1]) == "mean of seeds 0-2"
    assert plots.seeds_caption([1, 4], mean="geometric mean") == "geometric mean of seeds 1, 4"


def test_every_plot_names_its_seeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    figs = figures(
        monkeypatch, tmp_path, goodput_ratios=RATIOS, ratio_seeds=[0, 1, 2], bounds=["free-prefill"]
    )
    assert set(figs) == {"itl_cdf.png", "ttft_cdf.png", "goodput.png", "timeline.png"}
    for name in ("itl_cdf.png", "ttft_cdf.png", "timeline.png"):
        assert "seed 0" in texts(figs[name]), name
    assert "geometric mean of seeds 0-2" in texts(figs["goodput.png"])
    close_all("all")


def test_tuned_vllm_legacy_and_baseline_have_distinct_colours() -> None:
    colours = {plots.COLORS[k] for k in ("baseline", "vllm-tuned", "legacy")}
    assert len(colours) == 3


def test_goodput_shows_paired_ratios_with_intervals_and_bound_lines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    figs = figures(
        monkeypatch, tmp_path, goodput_ratios=RATIOS, ratio_seeds=[0, 1, 2], bounds=["free-prefill"]
    )
    ax = figs["goodput.png"].axes[0]
    assert not ax.patches  # no bars from zero
    assert ax.get_yscale() == "log"
    caps = [c for c in ax.containers if c.has_yerr]
    assert len(caps) == 2  # hybridserve and legacy, each with its interval
    segments = caps[0].lines[2][0].get_segments()
    assert [tuple(p[1] for p in s) for s in segments] == [pytest.approx((1.41, 1.86))]
    lines = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines()}
    assert lines["free-prefill bound 2.20x"] == pytest.approx(2.2)
    assert lines["baseline (1x)"] == 1.0
    assert "degenerate: every seed equal" in texts(figs["goodput.png"])
    close_all("all")


def test_a_run_alone_shows_its_goodput_as_points(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ax = figures(monkeypatch, tmp_path)["goodput.png"].axes[0]
    assert not ax.patches
    assert "seed 0" in ax.get_title()
    close_all("all")


def test_log_axes_have_plain_tick_labels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    figs = figures(
        monkeypatch, tmp_path, goodput_ratios=RATIOS, ratio_seeds=[0, 1, 2], bounds=["free-prefill"]
    )
    checked = 0
    for name, axis in (
        ("itl_cdf.png", figs["itl_cdf.png"].axes[0].xaxis),
        ("ttft_cdf.png", figs["ttft_cdf.png"].axes[1].xaxis),
        ("goodput.png", figs["goodput.png"].axes[0].yaxis),
    ):
        figs[name].canvas.draw()
        labels = [t.get_text() for t in axis.get_ticklabels(which="both") if t.get_text()]
        assert labels, name
        for label in labels:
            float(label)  # a plain number: no 10^x, no mathtext
        checked += 1
    assert checked == 3
    close_all("all")


def test_timeline_panels_share_one_y_scale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fig = figures(monkeypatch, tmp_path)["timeline.png"]
    panels = [ax for ax in fig.axes if ax.get_ylabel().startswith("tokens per step")]
    assert len(panels) == 3
    shared = panels[0].get_shared_y_axes()
    assert all(shared.joined(panels[0], ax) for ax in panels[1:])
    assert len({ax.get_ylim() for ax in panels}) == 1
    close_all("all")


def test_the_fleet_sweep_plot_names_its_seed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kept: list[Any] = []
    figure = matplotlib.figure.Figure
    monkeypatch.setattr(figure, "savefig", lambda self, *a, **k: kept.append(self))
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    row = {
        "router": "prefix", "layout": "colocated", "preset": "hybridserve", "gpus": 2,
        "slo_requests_per_gpu_hour": 10.0, "hit_rate": 0.9, "global_ideal_hit_rate": 0.95,
    }  # fmt: skip
    plots.write_fleet_sweep_plot(tmp_path / "f.png", [row], seed=7)
    assert "seed 7" in kept[0]._suptitle.get_text()
    close_all("all")
