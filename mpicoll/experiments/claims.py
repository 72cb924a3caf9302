"""The seeds' claims, measured over several seeds: ``mpicoll reproduce`` (``scripts/reproduce-results``).

Four claims of the papers behind mpicoll's methods, each settled by real
``mpicoll train`` jobs (one per method, worker count and seed, each under its
own mpiexec), with one :class:`Setting` chosen before any run and written
into the report:

(a) **DC-ASGD** (Zheng et al. 2017) closes at least half of asynchronous
    SGD's test-error gap to sequential SGD, at M = 4 and M = 8 workers, with
    the same number of updates and the same learning-rate schedule; ps-sync
    (SSGD, M times fewer updates for the same samples) is shown beside them.
    One record for DC-ASGD-a (adaptive lambda) and one for DC-ASGD-c.
(b) **soft-sync and async** finish sooner than sync when one worker is
    three times slower, at equal final accuracy (no more than 1 point
    lower).  Each uses the rate that gives every sample the same weight
    (sync lr x M on its average of M gradients, soft-sync lr x K, async lr).
(c) **SGP** (Assran et al. 2019) reaches the target accuracy sooner than ring
    allreduce on a bandwidth-limited emulated cluster (``mpicoll cluster``).
(d) **Downpour** (Dean et al. 2012) survives a replica killed mid-run: the
    other workers finish and the model ends within reach of unharmed runs.

Writes ``claims.json`` (one record per claim: ``id``, ``claim``, ``setting``,
``reproduced`` (true, false, or null when skipped), ``figures`` with means
and standard deviations over the seeds, ``note``), ``report.md``, plots, and
every run's log and output under ``runs/``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..base.launcher import keep_survivors, launcher, mpiexec_command
from .compare import read_log, time_to

__all__ = ["Setting", "reproduce", "CLAIMS"]


@dataclass
class Setting:
    """What every run shares, fixed before the first run (never searched per seed)."""

    data: str = "mnist1d"
    classes: int = 10                      # of the data: a run that diverged counts as guessing
    model: list[str] = field(default_factory=lambda: ["--framework", "torch", "--model", "cnn"])
    epochs: int = 15
    batch: int = 32
    lr: float = 0.25                       # sequential SGD's best of 0.1-0.25 here; every method gets it
    lr_schedule: str = "step:0.5,0.75"     # /10 at half and three quarters of every method's own updates
    delay: str = "gamma:2,0.5"             # ms added to every step of every worker: staleness spreads
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    # (b) judges accuracy to 1 point on a 1,000-sample test set (one run's accuracy varies by about 1.6
    # points): 3 seeds could not decide it (softsync -1.1 +- 1.3 points), so (b) runs 10 (about 5 minutes)
    straggler_seeds: list[int] = field(default_factory=lambda: list(range(1, 11)))
    workers: list[int] = field(default_factory=lambda: [4, 8])
    lam: float = 0.04                      # DC-ASGD-c's lambda (Zheng et al.)
    lam0: float = 2.0                      # DC-ASGD-a's lambda_0 (Zheng et al.)
    straggler: float = 3.0                 # (b): the last worker this many times slower ...
    straggler_model: list[str] = field(default_factory=lambda: ["--model", "mlp", "--hidden", "1024,1024",
                                                                "--batch", "128"])   # ... at computing this
    straggler_lr: float = 0.1              # (b): async's rate; sync gets M times it, soft-sync K times
    downpour_lr: float = 0.02              # (d): Adagrad steps about lr per weight from its first update
    sgp_model: list[str] = field(default_factory=lambda: ["--model", "mlp", "--hidden", "1024,1024",
                                                          "--batch", "128"])
    sgp_link: str = "1gbit"
    sgp_nodes: int = 4
    within: float = 0.95                   # (c), (d): the target is this fraction of the reference's accuracy
    # (e) low communication across slow links: 4 nodes, 100 Mbit/s, 20 ms one way (10 ms a link end, where the
    # kernel has netem), MNIST-1D on an MLP 512x512, 20 epochs; each method at its own rate (the ring's best of
    # 0.1, 0.2, 0.4 measured here; DiLoCo's and local SGD's inner rate their default)
    low_link: str = "100mbit"
    low_delay: str = "10ms"
    low_model: list[str] = field(default_factory=lambda: ["--model", "mlp", "--hidden", "512,512", "--epochs", "20",
                                                          "--lr-schedule", "constant"])
    low_ring_lr: float = 0.4
    low_inner_lr: float = 0.1
    low_sync_every: int = 16
    max_train: int = 4000                  # larger data: a fixed random subset of this many training samples ...
    max_test: int = 1000                   # ... and of test samples, so the claims keep to about 14 minutes
    subset: str = ""                       # what was cut, for the report
    timeout: float = 600                   # seconds per run

    def args(self, seed: int, model: list[str] | None = None) -> list[str]:
        """The ``mpicoll train`` options every run of ``seed`` shares (a ``--batch`` in the model wins)."""
        return ["--data", self.data, "--epochs", str(self.epochs), "--batch", str(self.batch),
                *(self.model if model is None else model), "--lr-schedule", self.lr_schedule,
                "--delay", self.delay, "--seed", str(seed), "--quiet"]


def quick() -> Setting:
    """A setting for CI: the same pipeline in well under a minute (2 seeds, M = 2, a small numpy MLP, 6 epochs:
    3 processes a job; at M = 4 its 18 jobs started 92 processes, most of the run's time on 2 cores)."""
    small = ["--model", "mlp", "--hidden", "32"]
    return Setting(model=small, straggler_model=small, lr=0.1, epochs=6, seeds=[1, 2], straggler_seeds=[1, 2],
                   workers=[2], delay="gamma:2,1", timeout=90, low_model=small + ["--epochs", "4"], low_sync_every=4)


def prepare_data(setting: Setting, folder: Path) -> int:
    """Load ``setting.data`` (refusing bad data with its message), note its classes, and where it is larger
    than ``max_train``/``max_test``, write a fixed random subset to ``folder``/data.npz and train on that;
    returns the data's features."""
    from ..train.data import load
    data = load(setting.data)
    setting.classes = data.classes
    train, test = len(data.y), len(data.y_test)
    if train <= setting.max_train and test <= setting.max_test:
        return data.features
    rng = np.random.default_rng(0)
    keep = np.sort(rng.permutation(train)[:setting.max_train])
    keep_test = np.sort(rng.permutation(test)[:setting.max_test])
    if len(np.unique(data.y[keep])) < data.classes:      # every class needs a training sample
        keep = np.arange(train)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "data.npz"
    np.savez(path, X=data.X[keep], y=data.y[keep], X_test=data.X_test[keep_test], y_test=data.y_test[keep_test])
    setting.subset = (f"{setting.data} has {train} training and {test} test samples: the claims use a fixed random "
                      f"{len(keep)} and {len(keep_test)} of them ({path.name})")
    setting.data = str(path)
    return data.features


# ---------------------------------------------------------------------------------------------- running jobs

@dataclass
class Run:
    """One finished (or failed) ``mpicoll train`` job."""

    name: str
    log: Path
    records: list[dict] = field(default_factory=list)
    summary: dict | None = None
    returncode: int = 0
    outcome: object = None                 # what the ``during`` hook returned

    @property
    def ok(self) -> bool:
        return self.summary is not None

    @property
    def diverged(self) -> bool:
        """The job stopped because training diverged (every gradient NaN or Inf)."""
        output = self.log.with_suffix(".out")
        return not self.ok and output.is_file() and "training diverged" in output.read_text(errors="replace")


class Runner:
    """Launches the jobs one after the other, with one progress line each."""

    def __init__(self, folder: Path, setting: Setting):
        self.folder, self.setting = folder / "runs", setting
        self.folder.mkdir(parents=True, exist_ok=True)
        self.started, self.count = time.perf_counter(), 0

    def run(self, name: str, method: str, ranks: int, args: list[str], *, launch: list[str] | None = None,
            env: dict | None = None, during=None) -> Run:
        """Run ``mpicoll train --method METHOD ARGS`` on ``ranks`` ranks; ``during(job, log)`` runs while it does."""
        log = self.folder / f"{name}.jsonl"
        output = log.with_suffix(".out")
        for stale in (log, output):
            stale.unlink(missing_ok=True)
        command = [*(launch or mpiexec_command(ranks)), sys.executable, "-m", "mpicoll", "train",
                   "--method", method, "--output", str(log), *args]
        before = time.perf_counter()
        with open(output, "w") as sink:
            sink.write("+ " + " ".join(command) + "\n")
            sink.flush()
            job = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
            outcome = None
            try:
                if during:
                    outcome = during(job, log)
                job.wait(timeout=self.setting.timeout)
            except subprocess.TimeoutExpired:
                sink.write(f"\nmpicoll reproduce: stopped after {self.setting.timeout:g} s\n")
            finally:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
        run = Run(name, log, returncode=job.returncode, outcome=outcome)
        if log.is_file():
            try:
                run.records, run.summary = read_log(log)
            except ValueError:
                pass
        self.count += 1
        outcome = (f"test accuracy {run.summary['final_accuracy']:.1%}, training {run.summary['wall_s']:.1f} s"
                   if run.ok else f"FAILED (exit {job.returncode}): see {output}")
        print(f"[{self.count:>3} | {time.perf_counter() - self.started:6.0f} s] {name}: {outcome} "
              f"({time.perf_counter() - before:.0f} s with start-up)", file=sys.stderr, flush=True)
        return run


# ------------------------------------------------------------------------------------------------- figures

def _stats(values: list[float]) -> dict:
    """Mean and sample standard deviation (0 for one value) of ``values``, and the values."""
    values = [float(v) for v in values]
    if not values:
        return {"mean": None, "sd": None, "values": []}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def _paired_gap(runs: list[Run], reference: list[Run]) -> dict:
    """The accuracy of ``runs`` minus that of ``reference``, seed by seed (runs that both finished): mean,
    standard error of the mean, and the differences; how sure a "within 1 point" verdict is."""
    gaps = [a.summary["final_accuracy"] - b.summary["final_accuracy"] for a, b in zip(runs, reference) if a.ok and b.ok]
    stats = _stats(gaps)
    stats["se"] = stats["sd"] / math.sqrt(len(gaps)) if len(gaps) > 1 else None
    return stats


def _finished(runs: list[Run]) -> list[Run]:
    return [run for run in runs if run.ok]


def _errors(runs: list[Run], classes: int) -> dict:
    """Test errors over the seeds; a run that diverged counts as guessing (1 - 1/classes), one that failed
    otherwise is left out (and named in the note)."""
    return _stats([1.0 - run.summary["final_accuracy"] if run.ok else 1.0 - 1.0 / classes
                   for run in runs if run.ok or run.diverged])


def _percent(stats: dict) -> str:
    return "-" if stats["mean"] is None else f"{100 * stats['mean']:.1f} ± {100 * stats['sd']:.1f}"


# ---------------------------------------------------------------------------------------------- the claims

def delay_compensation(setting: Setting, runner: Runner) -> tuple[list[dict], dict]:
    """(a): sequential SGD, ASGD, DC-ASGD-c, DC-ASGD-a and SSGD, at each M; returns (a record per DC-ASGD
    variant, runs by label)."""
    lr = ["--lr", str(setting.lr)]
    variants = {"asgd": ("ps-async", ["--staleness", "none"]), "dcasgd-c": ("dcasgd", ["--lam", str(setting.lam)]),
                "dcasgd-a": ("dcasgd", ["--adaptive", "--lam", str(setting.lam0)]), "ssgd": ("ps-sync", [])}
    runs: dict[str, list[Run]] = {"sequential": []}
    for seed in setting.seeds:
        runs["sequential"].append(runner.run(f"a-sequential-seed{seed}", "sequential", 1, setting.args(seed) + lr))
        for m in setting.workers:
            for label, (method, extra) in variants.items():
                runs.setdefault(f"{label} M={m}", []).append(
                    runner.run(f"a-{label}-M{m}-seed{seed}", method, m + 1, setting.args(seed) + lr + extra))
    errors = {label: _errors(members, setting.classes) for label, members in runs.items()}
    diverged = sorted(run.name for members in runs.values() for run in members if run.diverged)
    failed = sorted(run.name for members in runs.values() for run in members if not run.ok and not run.diverged)
    records = []
    for variant, name in (("dcasgd-a", "DC-ASGD-a (adaptive lambda)"), ("dcasgd-c", "DC-ASGD-c (constant lambda)")):
        figures: dict = {"test error": {label: value for label, value in errors.items()
                                        if label.split(" ")[0] in ("sequential", "asgd", variant, "ssgd")},
                         "gap closed": {}}
        verdicts, notes = [], []
        for m in setting.workers:
            sequential, asgd, dc = errors["sequential"], errors[f"asgd M={m}"], errors[f"{variant} M={m}"]
            closed = None
            if None not in (asgd["mean"], dc["mean"], sequential["mean"]):
                gap = asgd["mean"] - sequential["mean"]
                if gap > 0:
                    closed = (asgd["mean"] - dc["mean"]) / gap
                    notes.append(f"M={m}: ASGD {100 * asgd['mean']:.1f}%, {variant} {100 * dc['mean']:.1f}%, "
                                 f"sequential {100 * sequential['mean']:.1f}% test error: {100 * closed:.0f}% of "
                                 "the gap closed")
                else:
                    notes.append(f"M={m}: ASGD is not behind sequential SGD ({100 * asgd['mean']:.1f}% against "
                                 f"{100 * sequential['mean']:.1f}% test error): no gap to close")
            figures["gap closed"][f"M={m}"] = closed
            verdicts.append(closed is not None and closed >= 0.5)
        if diverged:
            notes.append(f"diverged (counted as guessing, {100 * (1 - 1 / setting.classes):.0f}% error): "
                         f"{', '.join(diverged)}")
        if failed:
            notes.append(f"failed, left out: {', '.join(failed)}")
        records.append({
            "id": f"a-{variant}", "claim": f"(a) {name} closes >= 50% of ASGD's test-error gap to sequential SGD at "
                                           f"M = {' and '.join(map(str, setting.workers))} workers, same updates and "
                                           "learning-rate schedule",
            "setting": {"methods": "sequential (1 process), ps-async --staleness none (ASGD), " +
                                   (f"dcasgd --adaptive --lam {setting.lam0}" if variant == "dcasgd-a" else
                                    f"dcasgd --lam {setting.lam}") + ", ps-sync (SSGD)", "lr": setting.lr},
            "reproduced": all(verdicts), "figures": figures, "note": "; ".join(notes)})
    return records, runs


def stragglers(setting: Setting, runner: Runner) -> tuple[dict, dict]:
    """(b): sync, soft-sync (K = half the workers) and async with the last worker ``straggler`` times slower."""
    m = setting.workers[0]
    k = max(1, m // 2)
    slow = ["--straggler", f"{m}={setting.straggler:g}"]
    lr = setting.straggler_lr
    methods = {"sync": ("ps-sync", lr * m, []), "softsync": ("ps-softsync", lr * k, ["--softsync-k", str(k)]),
               "async": ("ps-async", lr, ["--staleness", "none"])}
    runs: dict[str, list[Run]] = {}
    for seed in setting.straggler_seeds:
        for label, (method, rate, extra) in methods.items():
            runs.setdefault(label, []).append(runner.run(
                f"b-{label}-seed{seed}", method, m + 1,
                setting.args(seed, setting.straggler_model) + ["--lr", str(rate), *extra, *slow]))
    figures = {label: _outcome(members) for label, members in runs.items()}
    sync, verdicts, notes = figures["sync"], [], []
    for label in ("softsync", "async"):
        mine = figures[label]
        if None in (mine["wall s"]["mean"], sync["wall s"]["mean"]):
            verdicts.append(False)
            continue
        faster = mine["wall s"]["mean"] < sync["wall s"]["mean"]
        as_good = mine["accuracy"]["mean"] >= sync["accuracy"]["mean"] - 0.01
        verdicts.append(faster and as_good)
        gap = mine["accuracy gap"] = _paired_gap(runs[label], runs["sync"])
        notes.append(f"{label}: {mine['wall s']['mean']:.2f} s against sync's {sync['wall s']['mean']:.2f} s "
                     f"({sync['wall s']['mean'] / mine['wall s']['mean']:.2f}x), accuracy "
                     f"{100 * mine['accuracy']['mean']:.1f}% against {100 * sync['accuracy']['mean']:.1f}%"
                     + ("" if gap["se"] is None else
                        f" (gap {100 * gap['mean']:+.1f} +- {100 * gap['se']:.1f} points, paired by seed)"))
    record = {"id": "b", "claim": "(b) soft-sync and async finish faster in wall time than sync under a straggler, "
                                  "at equal final accuracy (within 1 point)",
              "setting": {"workers": m, "straggler": f"worker rank {m} at {setting.straggler:g}x",
                          "model": " ".join(setting.straggler_model),
                          "learning rates": {label: rate for label, (_, rate, _) in methods.items()},
                          "softsync K": k, "seeds": setting.straggler_seeds},
              "reproduced": all(verdicts), "figures": figures, "note": "; ".join(notes)}
    return record, runs


def _cluster_unavailable() -> str | None:
    """Why ``mpicoll cluster`` cannot run here, or None."""
    if os.name != "posix" or os.geteuid() != 0:
        return "emulated nodes need root (network namespaces): run as root, or on a real cluster"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need {', '.join(missing)} (iproute2, util-linux)"
    return None


def sgp_on_a_slow_network(setting: Setting, runner: Runner, skip: str | None = None) -> tuple[dict, dict]:
    """(c): ring allreduce against SGP (tau 1) on ``sgp_nodes`` emulated nodes joined by ``sgp_link`` links."""
    record = {"id": "c", "claim": "(c) SGP reaches the target accuracy faster than allreduce on a bandwidth-limited "
                                  "emulated cluster",
              "setting": {"nodes": setting.sgp_nodes, "link": setting.sgp_link, "model": " ".join(setting.sgp_model),
                          "target": f"{setting.within:.0%} of allreduce-ring's mean final accuracy"},
              "reproduced": None, "figures": {}, "note": ""}
    skip = skip or _cluster_unavailable()
    if skip:
        record["note"] = f"skipped: {skip}"
        return record, {}
    from .. import cluster
    ours = cluster.state() is None
    if ours:
        cluster.up(setting.sgp_nodes, link=setting.sgp_link)
    launch = [sys.executable, "-m", "mpicoll", "cluster", "run", "-n", str(setting.sgp_nodes), "--"]
    runs: dict[str, list[Run]] = {"allreduce-ring": [], "sgp": []}
    try:
        for seed in setting.seeds:
            base = setting.args(seed, setting.sgp_model)
            at = base.index("--delay")
            del base[at:at + 2]                  # the link is what is slow here
            for label, extra in (("allreduce-ring", []), ("sgp", ["--tau", "1"])):
                runs[label].append(runner.run(f"c-{label}-seed{seed}", label, setting.sgp_nodes,
                                              base + ["--lr", str(setting.lr), *extra], launch=launch))
    finally:
        if ours:
            cluster.down()
    reference = _stats([r.summary["final_accuracy"] for r in _finished(runs["allreduce-ring"])])
    if reference["mean"] is None:
        record["reproduced"], record["note"] = False, "no allreduce run finished: see runs/c-*.out"
        return record, runs
    target = setting.within * reference["mean"]
    figures = {"target accuracy": target}
    for label, members in runs.items():
        times = [time_to(run.records, target) for run in _finished(members)]
        figures[label] = {"time to target s": _stats([t for t in times if t is not None]),
                          "reached": f"{sum(t is not None for t in times)} of {len(members)}",
                          "accuracy": _stats([r.summary["final_accuracy"] for r in _finished(members)])}
    ring, sgp = figures["allreduce-ring"]["time to target s"], figures["sgp"]["time to target s"]
    everyone = all(len(figures[label]["time to target s"]["values"]) == len(runs[label]) for label in runs)
    record["figures"] = figures
    record["reproduced"] = bool(everyone and sgp["mean"] < ring["mean"])
    record["note"] = (f"time to {100 * target:.1f}%: sgp {sgp['mean']:.2f} s, allreduce-ring {ring['mean']:.2f} s"
                      if everyone else "not every run reached the target")
    return record, runs


def low_communication(setting: Setting, runner: Runner, skip: str | None = None) -> tuple[list[dict], dict]:
    """(e): DiLoCo and local SGD against ring allreduce (and streaming DiLoCo, bf16 pseudo-gradients) on
    ``sgp_nodes`` emulated nodes joined by ``low_link`` links with ``low_delay`` at each end."""
    methods = {"allreduce-ring": ["--lr", str(setting.low_ring_lr)],
               "diloco": ["--lr", str(setting.low_inner_lr), "--sync-every", str(setting.low_sync_every)],
               "localsgd": ["--lr", str(setting.low_inner_lr), "--sync-every", str(setting.low_sync_every)],
               "diloco-streaming": ["--lr", str(setting.low_inner_lr), "--sync-every", str(setting.low_sync_every),
                                    "--fragments", "3", "--compression", "bf16"]}
    where = {"nodes": setting.sgp_nodes, "link": setting.low_link, "delay at each link end": setting.low_delay,
             "model": " ".join(setting.low_model), "sync every": setting.low_sync_every}
    records = [{"id": f"e-{name}", "claim": f"(e) {name} reaches allreduce-ring's accuracy within 1 point in at most "
                                           "0.2 of its wall time across slow links",
                "setting": where, "reproduced": None, "figures": {}, "note": ""} for name in ("diloco", "localsgd")]
    skip = skip or _cluster_unavailable()
    if skip:
        for record in records:
            record["note"] = f"skipped: {skip}"
        return records, {}
    from .. import cluster
    ours, unemulated = cluster.state() is None, ""
    if ours:
        try:
            cluster.up(setting.sgp_nodes, link=setting.low_link, delay=setting.low_delay)
        except cluster.ClusterError as error:   # no netem in this kernel: the links' rate alone
            cluster.down()
            cluster.up(setting.sgp_nodes, link=setting.low_link)
            unemulated = f"the delay was not emulated ({str(error).splitlines()[-1][:160]}); "
            where["delay at each link end"] = "none (not emulated here)"
    launch = [sys.executable, "-m", "mpicoll", "cluster", "run", "-n", str(setting.sgp_nodes), "--"]
    runs: dict[str, list[Run]] = {name: [] for name in methods}
    try:
        for seed in setting.seeds:
            base = setting.args(seed, setting.low_model)
            for flag in ("--delay", "--lr-schedule"):       # the links are what is slow; the model's schedule
                at = len(base) - 1 - base[::-1].index(flag)
                del base[at:at + 2]
            for name, extra in methods.items():
                method = "diloco" if name.startswith("diloco") else name
                runs[name].append(runner.run(f"e-{name}-seed{seed}", method, setting.sgp_nodes, base + extra,
                                             launch=launch))
    finally:
        if ours:
            cluster.down()
    figures = {}
    for name, members in runs.items():
        done = _finished(members)
        figures[name] = {**_outcome(members),
                         "MB a rank contributed": _stats([_bytes_contributed(r.summary) / 1e6 for r in done]),
                         "meetings or steps": _stats([_meetings(r.summary) for r in done])}
    ring = figures["allreduce-ring"]
    for record in records:
        name = record["id"][2:]
        mine = figures[name]
        whole = _all_finished(runs[name], runs["allreduce-ring"]) and ring["accuracy"]["mean"] is not None
        record["figures"] = {"allreduce-ring": ring, name: mine, **({"diloco-streaming": figures["diloco-streaming"]}
                                                                   if name == "diloco" else {})}
        if not whole:
            record["reproduced"], record["note"] = False, f"{unemulated}not every run finished: see runs/e-*.out"
            continue
        gap, share = _against(mine, ring)
        record["reproduced"] = bool(gap <= 0.01 and share <= 0.2)
        record["note"] = (f"{unemulated}accuracy {100 * mine['accuracy']['mean']:.1f}% against the ring's "
                          f"{100 * ring['accuracy']['mean']:.1f}% ({_points(gap)}), in {share:.3f} of "
                          f"its wall time, {mine['MB a rank contributed']['mean']:.1f} MB a rank against "
                          f"{ring['MB a rank contributed']['mean']:.1f}")
    return records, runs


def new_asynchronous_rules(setting: Setting, runner: Runner) -> tuple[list[dict], dict]:
    """(f): Ringmaster and Rescaled ASGD against ASGD and DC-ASGD, one server and M workers, the last ``straggler``
    times slower; SGP on M ranks beside them (the same straggler), every method at ASGD's rate."""
    m = setting.workers[0]
    slow = f"{m}={setting.straggler:g}"
    lr = ["--lr", str(setting.straggler_lr)]
    methods = {"ps-async": (m + 1, ["--staleness", "none", "--straggler", slow]),
               "dcasgd": (m + 1, ["--lam", str(setting.lam), "--straggler", slow]),
               "ringmaster": (m + 1, ["--straggler", slow]), "rescaled": (m + 1, ["--straggler", slow]),
               "sgp": (m, ["--tau", "1", "--straggler", f"{m - 1}={setting.straggler:g}"])}
    runs: dict[str, list[Run]] = {name: [] for name in methods}
    for seed in setting.seeds:
        for name, (ranks, extra) in methods.items():
            runs[name].append(runner.run(f"f-{name}-seed{seed}", name, ranks,
                                         setting.args(seed, setting.straggler_model) + lr + extra))
    figures = {name: _outcome(members) for name, members in runs.items()}
    plain, records = figures["ps-async"], []
    for name, paper in (("ringmaster", "Ringmaster ASGD (ICML 2025)"), ("rescaled", "Rescaled ASGD (2026)")):
        mine = figures[name]
        record = {"id": f"f-{name}", "claim": f"(f) {paper} is as accurate as ASGD (within 1 point) in no more wall "
                                             f"time (5% spread), one of {m} workers {setting.straggler:g}x slower",
                  "setting": {"workers": m, "straggler": slow, "model": " ".join(setting.straggler_model),
                              "lr": setting.straggler_lr, "beside": "ps-async, dcasgd, sgp"},
                  "figures": {"ps-async": plain, "dcasgd": figures["dcasgd"], name: mine, "sgp": figures["sgp"]},
                  "reproduced": False, "note": "not every run finished: see runs/f-*.out"}
        if _all_finished(runs[name], runs["ps-async"]):
            gap, share = _against(mine, plain)
            record["reproduced"] = bool(gap <= 0.01 and share <= 1.05)
            record["note"] = (f"accuracy {100 * mine['accuracy']['mean']:.1f}% against ASGD's "
                              f"{100 * plain['accuracy']['mean']:.1f}% ({_points(gap)}), wall time "
                              f"{share:.2f}x ASGD's; DC-ASGD {100 * figures['dcasgd']['accuracy']['mean']:.1f}%, SGP "
                              f"{100 * figures['sgp']['accuracy']['mean']:.1f}%")
        records.append(record)
    return records, runs


def _outcome(members: list[Run]) -> dict:
    """The finished runs' final accuracy and wall time, each as mean, deviation and values."""
    done = _finished(members)
    return {"accuracy": _stats([r.summary["final_accuracy"] for r in done]),
            "wall s": _stats([r.summary["wall_s"] for r in done])}


def _all_finished(*groups: list[Run]) -> bool:
    """Whether every run of every group finished (a verdict needs them all)."""
    return all(len(_finished(group)) == len(group) for group in groups)


def _against(mine: dict, reference: dict) -> tuple[float, float]:
    """(the reference's mean accuracy minus this one's, this one's mean wall time as a share of the reference's)."""
    return (reference["accuracy"]["mean"] - mine["accuracy"]["mean"],
            mine["wall s"]["mean"] / reference["wall s"]["mean"])


def _points(gap: float) -> str:
    """An accuracy gap (reference minus this method's) in words."""
    return f"{abs(100 * gap):.1f} points {'below' if gap > 0 else 'above'}"


def _meetings(summary: dict) -> int:
    """The replicas' meetings (low-communication methods), or the allreduce steps (one a step)."""
    if "communication" in summary:
        return summary["communication"]["meetings"]
    return round(summary["samples"] / (summary["ranks"] * summary["options"]["batch"]))


def _bytes_contributed(summary: dict) -> float:
    """The bytes each rank contributed to the sums: the summary's count, or a float32 gradient a step."""
    if "communication" in summary:
        return summary["communication"]["bytes_summed_per_rank"]
    return _meetings(summary) * summary["model_size"] * 4


def _kill_worker(rank: int, after_epoch: int, token: str):
    """A ``during`` hook: once the log shows ``after_epoch``, SIGKILL the process of MPI rank ``rank``;
    returns whether it did (not when the run ended first)."""
    def during(job: subprocess.Popen, log: Path) -> bool:
        deadline = time.monotonic() + 300
        while job.poll() is None and time.monotonic() < deadline:
            records = [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")] \
                if log.is_file() else []
            if any(record.get("summary") for record in records):
                return False                             # too late: training is over
            if records and max(record.get("epoch", 0) for record in records) >= after_epoch:
                ranks = _processes_with({"PMI_RANK": str(rank), "MPICOLL_REPRODUCE_RUN": token})
                wrappers = {_parent(pid) for pid in ranks}
                for pid in ranks:
                    if pid not in wrappers:              # the rank itself, not the shell that runs it
                        os.kill(pid, signal.SIGKILL)
                return True
            time.sleep(0.01)
        return False
    return during


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _processes_with(variables: dict[str, str]) -> list[int]:
    """The processes whose environment holds all of ``variables`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = dict(item.split("=", 1) for item in
                               (entry / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        except OSError:
            continue
        if all(environment.get(key) == value for key, value in variables.items()):
            found.append(int(entry.name))
    return found


def downpour_survives(setting: Setting, runner: Runner) -> tuple[dict, dict]:
    """(d): Downpour with M workers, intact and with the last worker killed a third of the way in."""
    m = setting.workers[0]
    after = max(1, setting.epochs // 3)
    record = {"id": "d", "claim": "(d) Downpour is robust to a failed replica: one worker killed mid-run, the "
                                  "others finish and the model reaches the target",
              "setting": {"workers": m, "killed": f"worker rank {m}, SIGKILL once epoch {after} is logged",
                          "dropped after": "5 s of silence (MPICOLL_TIMEOUT=5)", "lr": setting.downpour_lr,
                          "target": f"{setting.within:.0%} of the intact runs' mean accuracy"},
              "reproduced": None, "figures": {}, "note": ""}
    try:
        flags, wrapper = keep_survivors(launcher()[1], [])
    except RuntimeError as refusal:
        record["note"] = f"skipped: {refusal}"
        return record, {}
    survive = [*mpiexec_command(m + 1, flags), *wrapper]
    runs: dict[str, list[Run]] = {"intact": [], "one worker killed": []}
    for seed in setting.seeds:
        args = setting.args(seed) + ["--lr", str(setting.downpour_lr)]
        runs["intact"].append(runner.run(f"d-downpour-seed{seed}", "downpour", m + 1, args))
        token = uuid.uuid4().hex
        runs["one worker killed"].append(runner.run(
            f"d-downpour-killed-seed{seed}", "downpour", m + 1, args, launch=survive,
            env={"MPICOLL_REPRODUCE_RUN": token, "MPICOLL_TIMEOUT": "5"}, during=_kill_worker(m, after, token)))
    intact = _stats([r.summary["final_accuracy"] for r in _finished(runs["intact"])])
    harmed = _stats([r.summary["final_accuracy"] for r in _finished(runs["one worker killed"])])
    finished = len(_finished(runs["one worker killed"]))
    killed = sum(run.outcome is True for run in runs["one worker killed"])
    figures = {"accuracy intact": intact, "accuracy with a worker killed": harmed,
               "workers killed mid-run": f"{killed} of {len(setting.seeds)}",
               "killed runs that finished": f"{finished} of {len(setting.seeds)}"}
    reproduced = False
    note = f"{finished} of {len(setting.seeds)} runs with a killed worker finished"
    if killed < len(setting.seeds):
        note += f" (in {len(setting.seeds) - killed} the run ended before the kill: make it longer)"
    if intact["mean"] is not None and harmed["mean"] is not None:
        target = setting.within * intact["mean"]
        figures["target accuracy"] = target
        reproduced = finished == killed == len(setting.seeds) and min(harmed["values"]) >= target
        note += (f"; accuracy {100 * harmed['mean']:.1f}% (lowest {100 * min(harmed['values']):.1f}%) against "
                 f"{100 * intact['mean']:.1f}% intact, target {100 * target:.1f}%")
    record.update(reproduced=reproduced, figures=figures, note=note)
    return record, runs


CLAIMS = {"a": delay_compensation, "b": stragglers, "c": sgp_on_a_slow_network, "d": downpour_survives,
          "e": low_communication, "f": new_asynchronous_rules}


# ---------------------------------------------------------------------------------------------- the report

def reproduce(folder: str | Path, setting: Setting, claims: str = "abcdef", skip_cluster: str | None = None) -> dict:
    """Run ``claims`` (letters of :data:`CLAIMS`) and write claims.json, report.md and the plots to ``folder``."""
    folder = Path(folder)
    runner = Runner(folder, setting)
    records, runs = [], {}
    for letter in claims:
        if letter in "ce":                   # on emulated nodes
            made, claim_runs = CLAIMS[letter](setting, runner, skip_cluster)
        else:
            made, claim_runs = CLAIMS[letter](setting, runner)
        records += made if isinstance(made, list) else [made]
        runs[letter] = claim_runs
    result = {"setting": asdict(setting), "claims": records,
              "wall_s": round(time.perf_counter() - runner.started, 1)}
    (folder / "claims.json").write_text(json.dumps(result, indent=1) + "\n")
    from .plots import plot_claims
    plots = plot_claims(folder, setting, runs)
    (folder / "report.md").write_text(_markdown(result, plots))
    return result


def _markdown(result: dict, plots: list[str]) -> str:
    setting = result["setting"]
    lines = ["# The seeds' claims, reproduced", "",
             f"Data `{setting['data']}`, model `{' '.join(setting['model'])}`, {setting['epochs']} epochs, batch "
             f"{setting['batch']}, lr {setting['lr']} with schedule `{setting['lr_schedule']}`, per-step delay "
             f"`{setting['delay']}` ms on every worker, seeds {setting['seeds']}; means ± standard deviations over "
             f"the seeds. Written by `scripts/reproduce-results` in {result['wall_s']:.0f} s.", "",
             *([setting["subset"] + ".", ""] if setting["subset"] else [])]
    verdict = {True: "**reproduced**", False: "**not reproduced**", None: "**skipped**"}
    for record in result["claims"]:
        lines += [f"## {record['claim']}", "", f"{verdict[record['reproduced']]}: {record['note']}", "",
                  f"Setting: `{json.dumps(record['setting'])}`", ""]
        lines += _table(record["figures"])
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def _table(figures: dict) -> list[str]:
    """One row per figure that has a mean: name, mean ± sd (percent for errors and accuracies), values."""
    rows = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and "mean" in value:
            if value["mean"] is None:
                rows.append(f"| {prefix} | - | |")
                return
            ratio = "error" in prefix or "accuracy" in prefix
            shown = _percent(value) + " %" if ratio else f"{value['mean']:.2f} ± {value['sd']:.2f}"
            values = ", ".join(f"{100 * v:.1f}" if ratio else f"{v:.2f}" for v in value["values"])
            rows.append(f"| {prefix} | {shown} | {values} |")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix} {key}".strip(), item)
        elif isinstance(value, float):
            rows.append(f"| {prefix} | {value:.3f} | |")
        elif value is not None:
            rows.append(f"| {prefix} | {value} | |")
        else:
            rows.append(f"| {prefix} | - | |")

    walk("", figures)
    return ["| figure | mean ± sd | per seed |", "|---|---:|---|", *rows, ""] if rows else []
