"""The claims report's plots (:mod:`.claims`): test error against updates and wall time, staleness.

Each curve is the mean over the seeds of one method's evaluations (one per
epoch), with a band of ± one standard deviation; the x value of a point is
the mean over the seeds too.  Updates are gradients applied to the model:
samples / batch for sequential SGD and the asynchronous servers, divided
again by M for ps-sync, whose every update averages M gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

__all__ = ["plot_claims", "pyplot", "finish"]


def pyplot(who: str):
    """matplotlib's pyplot drawing to files, or None (saying so, for ``who``) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"{who}: matplotlib is not installed (pip install -e '.[plot]'): no plots", file=sys.stderr)
        return None


def finish(plt, figure, axes, path: Path, x_label: str, y_label: str) -> None:
    """Label, grid and legend the last panel, save the figure to ``path`` and close it."""
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _updates(label: str, summary: dict) -> float:
    """Samples per update of a run: the batch, times the gradients an update averages."""
    batch = summary["options"]["batch"]
    if label.startswith("ssgd") or label == "sync":
        return batch * (summary["ranks"] - summary["options"]["servers"])
    if label == "softsync":
        return batch * summary["options"]["softsync_k"]
    return batch


def _mean_curve(runs, x_of) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Mean x, mean test error and its sd over the finished runs, point by point (the shortest run's length)."""
    finished = [run for run in runs if run.ok and run.records]
    if not finished:
        return None
    length = min(len(run.records) for run in finished)
    x = np.array([[x_of(run, r) for r in run.records[:length]] for run in finished])
    error = np.array([[1 - r["accuracy"] for r in run.records[:length]] for run in finished])
    return x.mean(axis=0), error.mean(axis=0), error.std(axis=0, ddof=1) if len(finished) > 1 else 0 * error[0]


def _curves(plt, folder: Path, name: str, groups: dict, x_of, x_label: str, title: str) -> str | None:
    """One panel per group (e.g. per M) of mean test-error curves; returns the file name."""
    groups = {key: members for key, members in groups.items() if members}
    if not groups:
        return None
    figure, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
    for axis, (key, members) in zip(axes[0], groups.items()):
        for label, runs in members.items():
            curve = _mean_curve(runs, lambda run, record: x_of(label, run, record))
            if curve is None:
                continue
            x, error, sd = curve
            line, = axis.plot(x, 100 * error, marker="o", markersize=3, label=label)
            axis.fill_between(x, 100 * (error - sd), 100 * (error + sd), color=line.get_color(), alpha=0.15)
        axis.set_title(f"{title} {key}".strip())
        if axis is not axes[0][-1]:
            axis.set_xlabel(x_label)
            axis.set_ylabel("test error (%)")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    finish(plt, figure, axes[0][-1], folder / name, x_label, "test error (%)")
    return name


def _staleness(plt, folder: Path, runs: dict) -> str | None:
    """Histograms of the staleness ASGD's gradients had, per M, summed over the seeds."""
    counts: dict[str, dict[int, int]] = {}
    for label, members in runs.items():
        if label.startswith("asgd"):
            for run in members:
                for lag, count in (run.summary or {}).get("staleness", {}).items():
                    counts.setdefault(label, {})[int(lag)] = counts.get(label, {}).get(int(lag), 0) + count
    if not counts:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for label, histogram in counts.items():
        lags = np.arange(max(histogram) + 1)
        total = sum(histogram.values())
        axis.step(lags, [100 * histogram.get(int(lag), 0) / total for lag in lags], where="mid", label=label)
    finish(plt, figure, axis, folder / "a-staleness.png",
           "staleness (updates between a gradient's weights and its use; the last bin: 64 or more)", "gradients (%)")
    return "a-staleness.png"


def plot_claims(folder: Path, setting, runs: dict) -> list[str]:
    """Write the plots of the claims that ran; returns their file names."""
    plt = pyplot("mpicoll reproduce")
    if plt is None:
        return []
    written = []
    a = runs.get("a", {})
    if a:
        panels = {f"M = {m}": {"sequential": a["sequential"],
                               **{label.split(" ")[0]: members for label, members in a.items()
                                  if label.endswith(f" M={m}")}} for m in setting.workers}
        written.append(_curves(plt, folder, "a-error-vs-updates.png", panels,
                               lambda label, run, r: r["samples"] / _updates(label, run.summary),
                               "updates", "(a) DC-ASGD against ASGD, sequential SGD and SSGD,"))
        written.append(_curves(plt, folder, "a-error-vs-time.png", panels, lambda label, run, r: r["time_s"],
                               "wall time (s)", "(a) the same against wall time,"))
        written.append(_staleness(plt, folder, a))
    for letter, title in (("b", "(b) under a straggler"), ("c", "(c) on an emulated cluster"),
                          ("d", "(d) Downpour, one worker killed"), ("e", "(e) DiLoCo across slow links"),
                          ("f", "(f) Ringmaster and Rescaled ASGD under a straggler")):
        if runs.get(letter):
            written.append(_curves(plt, folder, f"{letter}-error-vs-time.png", {"": runs[letter]},
                                   lambda label, run, r: r["time_s"], "wall time (s)", title))
    return [name for name in written if name]
