"""``mpicoll compare`` and ``mpicoll plot``: several training runs side by side.

``compare`` launches ``mpicoll train`` once per training method under mpiexec
(or ``mpicoll cluster run``, across emulated nodes), on the same data, model,
seed and budget (training options are passed through; ``sequential`` always
on one rank), then writes a report folder; ``plot`` writes the same report from existing JSON-lines logs.  With
``--repeats R`` every method runs R times, in alternating order, so a drift of
the machine does not favour one method.  The report: ``report.md`` (final
accuracy, time to the target accuracy, samples per second, wall time: means,
and standard deviations over the repeats, and each method's wall time as a
ratio to the first method's) and two plots, loss against wall time and
accuracy against epochs, one line per run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from ..base.launcher import mpiexec_command
from .plots import finish, pyplot
from ..train.run import METHODS

__all__ = ["compare", "report", "read_log", "time_to"]


def read_log(path: str | Path) -> tuple[list[dict], dict]:
    """(evaluation records, summary) of one ``mpicoll train --output`` log, with a clear error if malformed."""
    records, summary = [], None
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number}: not JSON ({error.msg})") from None
        if record.get("summary"):
            summary = record
        else:
            missing = {"time_s", "epoch", "samples", "loss", "accuracy"} - set(record)
            if missing:
                raise ValueError(f"{path} line {number}: an evaluation record without {', '.join(sorted(missing))}")
            records.append(record)
    if summary is None:
        raise ValueError(f"{path}: no summary record; the run did not finish")
    return records, summary


def label(summary: dict) -> str:
    """A method's name in tables and legends, with the options that distinguish SGP runs and compressed ones
    ("allreduce-auto+fp16+ef", "allreduce-auto+powersgd-r2")."""
    options = summary.get("options", {})
    tau = options.get("tau", 0)
    method = summary.get("method", summary.get("algorithm"))      # logs before the rename say "algorithm"
    name = f"{method} (tau={tau})" if method == "sgp" and tau else method
    compression = options.get("compression")
    if compression == "powersgd":
        return f"{name}+powersgd-r{options.get('powersgd_rank', 2)}"
    if compression:
        return f"{name}+{compression}{'+ef' if options.get('error_feedback') else ''}"
    return name


# compare's --compressions: the mpicoll train options of each
COMPRESSIONS = {"none": [], "fp16": ["--compression", "fp16"], "bf16": ["--compression", "bf16"],
                "fp16+ef": ["--compression", "fp16", "--error-feedback"],
                "bf16+ef": ["--compression", "bf16", "--error-feedback"], "powersgd": ["--compression", "powersgd"]}


def time_to(records: list[dict], target: float) -> float | None:
    """Seconds until the first evaluation at ``target`` accuracy or above; None if never."""
    return next((r["time_s"] for r in records if r["accuracy"] >= target), None)


def _spread(values: list[float], form: str) -> str:
    """The mean, and ± the sample standard deviation when there are several values."""
    if not values:
        return "-"
    mean = format(statistics.fmean(values), form)
    return mean if len(values) < 2 else f"{mean} ± {format(statistics.stdev(values), form)}"


def report(logs: list[str | Path], folder: str | Path, target: float | str | None = None) -> Path:
    """Write ``report.md`` and the plots for ``logs`` into ``folder``; returns the markdown's path.

    Runs of the same method (and SGP tau, and compression) make one row: means, ± the standard deviation
    over runs, and the mean wall time as a ratio to the first row's.  ``target``: the accuracy whose time
    the table gives; None: 90% of the best run's final accuracy (a target any data set's runs reach);
    "first": each run's target is the final accuracy of the first row's run of the same seed (what a
    compressed run must reach to match the uncompressed one; the first row's mean where no run has its seed).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    runs = [(Path(path), *read_log(path)) for path in logs]
    best = max((summary["final_accuracy"] for _, _, summary in runs), default=0.0)
    groups: dict[str, list] = {}
    for run in runs:
        groups.setdefault(label(run[2]), []).append(run)
    if target == "first":
        first_name, first_runs = next(iter(groups.items()))
        by_seed = {summary.get("options", {}).get("seed"): summary["final_accuracy"] for _, _, summary in first_runs}
        mean = statistics.fmean(by_seed.values())

        def target_of(summary):
            return by_seed.get(summary.get("options", {}).get("seed"), mean)
        column, target_note = (f"time to {first_name}'s final accuracy (s)",
                               f"each run's: the final accuracy of the {first_name} run of its seed (mean {mean:.1%})")
    else:
        fixed = target if target is not None else 0.9 * best

        def target_of(summary):
            return fixed
        column = f"time to {fixed:.1%} (s)"
        target_note = f"{fixed:.1%}" if target is not None else f"{fixed:.1%}, 90% of the best final accuracy"
    lines = [f"| method | ranks | runs | final accuracy (%) | {column} | samples/s | wall (s) | wall / first | logs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    first_wall = None
    reached = {}
    for name, members in groups.items():
        summaries = [summary for _, _, summary in members]
        walls = [summary["wall_s"] for summary in summaries]
        reached[name] = [t for t in (time_to(records, target_of(summary)) for _, records, summary in members)
                         if t is not None]
        times = _spread(reached[name], '.2f') + ("" if len(reached[name]) == len(members) else
                                                 f" ({len(reached[name])} of {len(members)} runs)")
        first_wall = first_wall or statistics.fmean(walls)
        lines.append(f"| {name} | {summaries[0]['ranks']} | {len(members)} | "
                     f"{_spread([100 * s['final_accuracy'] for s in summaries], '.1f')} | "
                     f"{times if reached[name] else 'never'} | "
                     f"{_spread([s['samples_per_s'] for s in summaries], ',.0f')} | {_spread(walls, '.2f')} | "
                     f"{statistics.fmean(walls) / first_wall:.2f} | {', '.join(path.name for path, _, _ in members)} |")
    options = runs[0][2].get("options", {}) if runs else {}
    text = "\n".join([f"# mpicoll compare: {runs[0][2].get('data', '?') if runs else ''}", "",
                      f"Options of the first run: `{json.dumps(options)}`", "",
                      f"Target accuracy: {target_note}.", "", *lines, "",
                      "![loss against wall time](loss_vs_time.png)", "",
                      "![accuracy against epochs](accuracy_vs_epoch.png)", "",
                      "![time to the target and final accuracy](time_to_target.png)", ""])
    markdown = folder / "report.md"
    markdown.write_text(text)
    _plots(runs, folder)
    _time_to_target_plot(groups, reached, column, folder)
    return markdown


def _time_to_target_plot(groups: dict, reached: dict, column: str, folder: Path) -> None:
    """Bars of each method's mean time to its target (``reached``: the times of the runs that got there) with
    ± one standard deviation over its runs (hatched and marked where some run never got there), and its mean
    final accuracy beside them."""
    plt = pyplot("mpicoll compare")
    if plt is None or not groups:
        return
    figure, (times, accuracies) = plt.subplots(1, 2, figsize=(11, 0.5 * len(groups) + 2))
    names = list(groups)
    for row, name in enumerate(names):
        members, got = groups[name], reached[name]
        finals = [100 * summary["final_accuracy"] for _, _, summary in members]
        if got:
            times.barh(row, statistics.fmean(got), xerr=statistics.stdev(got) if len(got) > 1 else 0.0, capsize=4,
                       color="#1f77b4", hatch=None if len(got) == len(members) else "//")
            if len(got) < len(members):
                times.text(statistics.fmean(got), row, f"  {len(got)} of {len(members)} runs", va="center")
        else:
            times.text(0, row, "  never reached", va="center")
        accuracies.barh(row, statistics.fmean(finals), xerr=statistics.stdev(finals) if len(finals) > 1 else 0.0,
                        capsize=4, color="#2ca02c")
    for axes in (times, accuracies):
        axes.set_yticks(range(len(names)))
        axes.set_yticklabels(names if axes is times else [""] * len(names))
        axes.invert_yaxis()
        axes.grid(True, axis="x", alpha=0.3)
    times.set_xlabel(column.replace(" (s)", ": wall time (s), mean ± sd"))
    accuracies.set_xlabel("final test accuracy (%), mean ± sd")
    low = min(100 * s["final_accuracy"] for members in groups.values() for _, _, s in members)
    accuracies.set_xlim(max(0.0, low - 5), None)
    figure.tight_layout()
    figure.savefig(folder / "time_to_target.png", dpi=110)
    plt.close(figure)


def _plots(runs, folder: Path) -> None:
    plt = pyplot("mpicoll compare")
    if plt is None:
        return
    for file, x_key, y_key, x_label, y_label in [
            ("loss_vs_time.png", "time_s", "loss", "wall time (s)", "test loss"),
            ("accuracy_vs_epoch.png", "epoch", "accuracy", "epoch", "test accuracy")]:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        looks = _looks([label(summary) for _, _, summary in runs])
        drawn: set[str] = set()
        for _, records, summary in runs:          # repeats of a method share a look and a legend entry
            method = label(summary)
            axes.plot([r[x_key] for r in records], [r[y_key] for r in records], markersize=3, **looks[method],
                      label=None if method in drawn else method)
            drawn.add(method)
        if y_key == "loss":
            axes.set_yscale("log")
        finish(plt, figure, axes, folder / file, x_label, y_label)


# Ten colours that stay apart (matplotlib's tab10), four dash patterns and five markers: every method (up to 20
# with no repeat of both colour and dashes) has a look of its own, told apart in print and by colour-blind readers.
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")
_DASHES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v")


def _looks(methods: list[str]) -> dict[str, dict]:
    """Each method's colour, line style and marker, in the order the methods first appear."""
    order = list(dict.fromkeys(methods))
    return {method: {"color": _COLOURS[i % len(_COLOURS)], "marker": _MARKERS[i % len(_MARKERS)],
                     "linestyle": _DASHES[(i // len(_COLOURS) + i) % len(_DASHES)]} for i, method in enumerate(order)}


def compare(methods: list[str], ranks: int, folder: str | Path, train_args: list[str], target=None,
            timeout: float = 600, repeats: int = 1, cluster: bool = False, compressions: list[str] = ("none",),
            seeds: list[int] | None = None) -> Path:
    """Run ``mpicoll train`` for each method (and, for the allreduce methods, each of ``compressions``)
    ``repeats`` times (one job each) and write the report.

    ``cluster``: launch through ``mpicoll cluster run`` (an emulated cluster must be up).  ``seeds``: one
    repeat per seed (``--seed``: weights, data order and split), so the spreads are over seeds, not only
    over the machine's timing.
    """
    if seeds:
        repeats = len(seeds)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"mpicoll compare: unknown method(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(METHODS)}")
    wrong = [c for c in compressions if c not in COMPRESSIONS]
    if wrong or not compressions:
        raise SystemExit(f"mpicoll compare: --compressions takes {', '.join(COMPRESSIONS)}, not "
                         f"{', '.join(wrong) or 'nothing'}")
    runs = [(method, compression) for method in methods for compression in compressions
            if compression == "none" or (method.startswith("allreduce") and not METHODS[method].one_rank)]
    if repeats < 1:
        raise SystemExit(f"mpicoll compare: --repeats must be at least 1, got {repeats}")
    short = [m for m in methods if not METHODS[m].fits(ranks)]
    if short:
        raise SystemExit(f"mpicoll compare: {', '.join(short)} need(s) at least "
                         f"{max(METHODS[m].min_ranks for m in short)} ranks, not {ranks}: raise -n or leave "
                         "them out of --methods")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    logs = []

    def launch(ranks: int) -> list[str]:
        if cluster:
            return [sys.executable, "-m", "mpicoll", "cluster", "run", "-n", str(ranks), "--"]
        try:
            return mpiexec_command(ranks)
        except FileNotFoundError as error:
            raise SystemExit(f"mpicoll compare: {error}") from None

    names = [method if compression == "none" else f"{method}+{compression}" for method, compression in runs]
    for repeat in range(repeats):
        for (method, compression), name in zip(*((runs, names) if repeat % 2 == 0 else (runs[::-1], names[::-1]))):
            log = folder / (f"{name}.jsonl" if repeats == 1 else f"{name}.{repeat + 1}.jsonl")
            log.unlink(missing_ok=True)           # this report's own log of an earlier compare
            command = [*launch(1 if METHODS[method].one_rank else ranks), sys.executable, "-m", "mpicoll", "train",
                       "--method", method, "--output", str(log), *train_args, *COMPRESSIONS[compression],
                       *(["--seed", str(seeds[repeat])] if seeds else [])]
            print(f"+ {' '.join(command)}", file=sys.stderr, flush=True)
            result = subprocess.run(command, timeout=timeout)
            if result.returncode != 0:
                raise SystemExit(f"mpicoll compare: {name} failed (exit {result.returncode}); see its output above")
            logs.append(log)
    logs.sort(key=lambda log: names.index(log.name[: -len(".jsonl")].rsplit(".", 1)[0] if repeats > 1
                                          else log.name[: -len(".jsonl")]))
    markdown = report(logs, folder, target)
    print(f"mpicoll compare: wrote {markdown} and the plots beside it", file=sys.stderr)
    return markdown
