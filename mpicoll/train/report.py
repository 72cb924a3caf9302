"""What one training run shows and leaves behind: a progress bar and a JSON-lines log.

One record per evaluation (``time_s``, ``epoch``, ``samples``, ``loss``,
``accuracy``, ``samples_per_s``) and a final summary (``final_accuracy``,
``final_loss``, ``wall_s``, ``samples_per_s``, ``method``, ``ranks`` and
the options).  The bar redraws in place on a terminal and prints one line per
evaluation elsewhere (a Slurm log, a pipe).

The log belongs to one run: an existing file is refused unless ``--overwrite`` (replace it) or ``--resume``
(continue it: the resumed run's records follow the first part's), and a lock held while it is open keeps
two runs from ever interleaving in one file (:func:`open_log`).

Times count from the reporter's creation, which every method does once its
set-up is over (communicators, windows, kernels loaded): ``wall_s`` compares
the methods' training, not their start-up.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from dataclasses import asdict, replace

import numpy as np

__all__ = ["Reporter", "open_log", "check_log", "interrupted"]


def open_log(path, replace: bool = False, resume: bool = False):
    """The run's log, open for writing and locked against every other run until closed: a new file, or
    (``replace``) an existing one emptied, or (``resume``) an existing one appended to.  ValueError, naming
    the option, where the file exists and neither is given or another run holds it."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if resume else 0) | (0 if replace or resume else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise ValueError(_exists(path)) from None
    log = os.fdopen(fd, "w")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.close()
        raise ValueError(f"--output {path} is being written by another run right now; name another file") from None
    if not resume:
        log.truncate(0)
    return log


def check_log(path, replace: bool = False, resume: bool = False) -> None:
    """Raise as :func:`open_log` would, leaving the file as it is (the checks before a job starts)."""
    if not os.path.lexists(path):
        return
    if not (replace or resume):
        raise ValueError(_exists(path))
    open_log(path, resume=True).close()      # another run's lock raises; appending nothing changes nothing


def _exists(path) -> str:
    return (f"--output {path} exists, an earlier run's log: pass --overwrite to replace it (or --resume to "
            "continue it), or name another file")


def interrupted(options) -> str:
    """The one line a run stopped by Ctrl-C ends with (on its reporting rank): where training stopped, and
    what holds its state."""
    where = f"after epoch {_running.last['epoch']} of {options.epochs}" if _running and _running.last else \
        "before its first epoch ended" if _running else "before training started"
    saved = (f"--checkpoint {options.checkpoint} holds the last state saved: the same command with --resume "
             "continues from there" if options.checkpoint else "nothing was saved (--checkpoint PREFIX saves "
             "the state every epoch)")
    return f"mpicoll train: interrupted {where}; {saved}"


_running: Reporter | None = None       # this process's reporter of the run under way, if it reports one


class Reporter:
    def __init__(self, options, model, data, xp, ranks: int):
        global _running
        _running = self
        self.options, self.model, self.data, self.ranks = options, model, data, ranks
        self.X_test, self.y_test = xp.asarray(data.X_test), xp.asarray(data.y_test)
        self.start = time.perf_counter()
        self.samples = 0
        self.log = open_log(options.output, options.overwrite, options.resume) if options.output else None
        self.stream = sys.stderr
        self.live = options.progress and self.stream.isatty()
        self.last: dict = {}

    @classmethod
    def take_over(cls, options, model, data, xp, ranks: int, start: float) -> "Reporter":
        """The reporter of a rank that goes on with the log of a reporting rank that was lost: the log appended
        to, the run timed from ``start`` (a ``time.perf_counter()`` of this rank's)."""
        reporter = cls(replace(options, resume=True, overwrite=False), model, data, xp, ranks=ranks)
        reporter.start = start
        return reporter

    def evaluate(self, params, epoch: int, samples: int, measured: tuple[float, float] | None = None) -> dict:
        """Record the test loss and accuracy of ``params`` (or ``measured``: (loss, accuracy) found elsewhere,
        e.g. through a model-parallel pipeline, with ``params`` None)."""
        loss, accuracy = measured or self.model.evaluate(params, self.X_test, self.y_test)
        elapsed = time.perf_counter() - self.start
        self.samples = samples
        record = {"time_s": round(elapsed, 4), "epoch": epoch, "samples": int(samples), "loss": loss,
                  "accuracy": accuracy, "samples_per_s": samples / max(elapsed, 1e-9)}
        self._write(record)
        self._draw(record)
        self.last = record
        return record

    def ranks_lost(self, loss) -> None:
        """Record a loss an elastic run went on from (:class:`mpicoll.train.elastic.Loss`): a line of the log,
        and a line on the terminal whatever ``--quiet`` says."""
        self.ranks = loss.ranks
        self._write(loss.record())
        if self.live:
            self.stream.write("\n")
        self.stream.write(loss.line(self.options.epochs) + "\n")
        self.stream.flush()

    def finish(self, params, staleness: dict[int, int] | None = None,
               measured: tuple[float, float] | None = None, losses=(), replicas_identical: bool | None = None,
               workers_lost=(), samples: int | None = None, communication: dict | None = None) -> dict:
        """The summary record (logged and returned); ``staleness``: a parameter server's histogram of the
        updates between the weights a gradient was computed on and the update that used it; ``measured``:
        as for :meth:`evaluate`; ``losses``: the ranks an elastic run lost (:class:`mpicoll.train.elastic.Loss`);
        ``replicas_identical``: whether every rank ended with the same parameters, where it was checked;
        ``workers_lost``: the workers the parameter servers dropped; ``samples``: the samples trained on, where
        not the last :meth:`evaluate`'s (a reporter that took the log over after the run's last epoch saw none);
        ``communication``: what the replicas exchanged (the low-communication methods' meetings and bytes)."""
        if samples is not None:
            self.samples = samples
        loss, accuracy = measured or self.model.evaluate(params, self.X_test, self.y_test)
        wall = time.perf_counter() - self.start
        options = {k: v for k, v in asdict(self.options).items() if k not in ("output", "progress", "resume")}
        summary = {"summary": True, "method": self.options.method, "ranks": self.ranks,
                   "final_accuracy": accuracy, "final_loss": loss, "wall_s": round(wall, 4),
                   "samples": int(self.samples), "samples_per_s": self.samples / max(wall, 1e-9),
                   "data": self.data.name, "model_size": self.model.size, "options": options}
        if staleness:
            summary["staleness"] = {str(lag): count for lag, count in sorted(staleness.items())}
        if replicas_identical is not None:
            summary["replicas_identical"] = replicas_identical
        if workers_lost:
            summary["workers_lost"] = list(workers_lost)
        if communication:
            summary["communication"] = communication
        if losses:
            summary["ranks_at_start"] = self.ranks + sum(len(loss.lost) + len(loss.stopped) for loss in losses)
            summary["ranks_lost"] = [loss.record() for loss in losses]
        self._write(summary)
        if self.options.progress:
            if self.live:
                self.stream.write("\n")
            ranks = f"{self.ranks} rank{'s' if self.ranks != 1 else ''}"
            self.stream.write(f"{self.options.method}: test accuracy {accuracy:.1%}, loss {loss:.4f}, "
                              f"{wall:.1f} s, {summary['samples_per_s']:,.0f} samples/s on {ranks}"
                              f"{_describe(staleness)}{_lost(losses)}{_dropped(workers_lost)}\n")
            self.stream.flush()
        if self.log:
            self.log.close()
        global _running
        _running = None
        return summary

    def close(self) -> None:
        """Release the log (and its lock) without a summary: another rank goes on writing it."""
        if self.log:
            self.log.close()
            self.log = None

    def _write(self, record: dict) -> None:
        if self.log:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def _draw(self, record: dict) -> None:
        if not self.options.progress:
            return
        total = self.options.epochs
        filled = int(20 * min(record["epoch"], total) / total)
        line = (f"{self.options.method:>18} epoch {record['epoch']:>3}/{total} [{'#' * filled:<20}] "
                f"loss {record['loss']:.4f}  accuracy {record['accuracy']:6.1%}  "
                f"{record['samples_per_s']:>9,.0f} samples/s")
        self.stream.write(("\r" + line) if self.live else line + "\n")
        self.stream.flush()


def _lost(losses) -> str:
    """' (lost rank 2 in epoch 3)' for the progress line ('' when nothing was lost)."""
    if not losses:
        return ""
    return " (" + "; ".join(f"lost rank{'s' if len(loss.lost) > 1 else ''} {', '.join(map(str, loss.lost))} in "
                            f"epoch {loss.epoch}" for loss in losses) + ")"


def _dropped(workers) -> str:
    """' (worker rank 3 lost, dropped)' for the progress line ('' when none was)."""
    return f" (worker rank{'s' if len(workers) > 1 else ''} {', '.join(map(str, workers))} lost, dropped)" \
        if workers else ""


def _describe(staleness: dict[int, int] | None) -> str:
    """', staleness mean 6.8, median 7, 95th percentile 11' for the progress line ('' without one)."""
    if not staleness:
        return ""
    lags = np.repeat(np.array(list(staleness), float), list(staleness.values()))
    return (f"; staleness mean {lags.mean():.1f}, median {np.median(lags):g}, "
            f"95th percentile {np.percentile(lags, 95):g} updates")
