"""Distributed SGD with any of mpicoll's training methods on one problem: ``mpicoll train``.

A *method* is a way of training (``allreduce-ring``, ``ps-async``, ``sgp``,
...): one row of :data:`METHODS`, an object of its family (:class:`~.common.Family`:
allreduce, parameter servers, SGP, Sandblaster L-BFGS) with its arguments (the
collective algorithm, the server rule), which answers for itself: its checks,
the ranks it needs, which rank reports, its checkpoint files, and the run.
Every method spends the same budget, ``epochs`` passes over the training
set counted over all workers, on the same model, data, batches and seed, so
runs compare: synchronous ones (allreduce, ps-sync, SGP) take equal steps on
every rank; asynchronous parameter servers let fast workers take more steps
than slow ones until the servers have seen the whole budget.  One rank (rank
0, or the first worker of a parameter-server job) evaluates on the test set
after each epoch, draws the progress bar and writes the log.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import compute
from ..base import checkpoint, config
from ..base.straggler import parse as parse_straggler, parse_delay
from ..channel.checks import agree
from ..channel.watchdog import bounded
from ..collectives.algorithms import auto
from ..models.dense import Model
from . import schedule as schedules
from .allreduce import Allreduce
from .common import Family, Options, check_writable
from .data import Dataset
from .elastic import check_fault_tolerance, short_timeout_warning
from .lbfgs import Lbfgs
from .local import LocalUpdates
from .parameter_servers import ParameterServers
from .report import check_log
from .sgp import Sgp

__all__ = ["Options", "Family", "METHODS", "train"]


def train(comm: MPI.Intracomm, options: Options, model: Model, data: Dataset, xp=np) -> dict | None:
    """Run one training job; returns the summary record on the reporting rank, None elsewhere.

    Before any rank starts, every rank checks what could stop it (options, the
    output folder, checkpoints); a problem on any rank raises the same
    :class:`mpicoll.SetupError` on all of them.
    """
    if options.method not in METHODS:
        raise ValueError(f"Unrecognized method: {options.method!r}; choose from {', '.join(METHODS)}")
    method = METHODS[options.method]
    run = _identity(comm, options, model, data) if options.checkpoint else {}
    agree(comm, lambda: _preflight(comm, options, model, data, method, run))
    if options.checkpoint and not options.resume:     # --overwrite: no file of the earlier run may remain
        if comm.Get_rank() == 0:
            checkpoint.discard(options.checkpoint)
        with bounded(comm, "removing the earlier run's checkpoint"):
            comm.barrier()
    if xp is np:
        compute.warm_up(model.dtype, model.size)     # kernels ready before any method's clock starts
    return method.run(comm, options, model, data, xp, run)


def _identity(comm, options: Options, model: Model, data: Dataset) -> dict:
    """What this run's checkpoints belong to: resuming needs the same method, model, data and ranks."""
    cut = {"model_parallel": options.model_parallel} if options.model_parallel > 1 else {}
    return {"method": options.method, "model": getattr(model, "name", type(model).__name__),
            "parameters": int(model.size), "data": data.fingerprint(), "ranks": comm.Get_size(), **cut}


def _finite(value) -> bool:
    return math.isfinite(value)


# Every numeric option's range: (field, test, what the test asks).  Checked on every rank before any starts.
_RANGES = [
    ("epochs", lambda v: v >= 1, "at least 1"),
    ("batch", lambda v: v >= 1, "at least 1"),
    ("lr", lambda v: _finite(v) and v > 0, "a positive finite number"),
    ("seed", lambda v: v >= 0, "at least 0"),
    ("servers", lambda v: v >= 1, "at least 1"),
    ("softsync_k", lambda v: _finite(v) and v > 0, "positive: a count of workers, or a fraction of them"),
    ("lam", lambda v: _finite(v) and v >= 0, "a finite number, at least 0"),
    ("n_fetch", lambda v: v >= 1, "at least 1"),
    ("n_push", lambda v: v >= 1, "at least 1"),
    ("warm_start", lambda v: v >= 0, "at least 0"),
    ("tau", lambda v: v >= 0, "at least 0"),
    ("model_parallel", lambda v: v >= 1, "at least 1"),
    ("max_rank_memory", lambda v: v >= 0, "at least 0 bytes"),
    ("history", lambda v: v >= 1, "at least 1"),
    ("lbfgs_batch", lambda v: v >= 0, "at least 0 (0: the whole training set)"),
    ("portions", lambda v: v >= 0, "at least 0 (0: 4 per worker)"),
    ("powersgd_rank", lambda v: v >= 1, "at least 1"),
    ("powersgd_start", lambda v: v >= 0, "at least 0"),
    ("min_ranks", lambda v: v >= 1, "at least 1"),
    ("ringmaster_r", lambda v: v >= 0, "at least 0 (0: the number of workers)"),
    ("sync_every", lambda v: v >= 1, "at least 1"),
    ("inner_momentum", lambda v: 0 <= v < 1, "from 0 to below 1"),
    ("weight_decay", lambda v: _finite(v) and v >= 0, "a finite number, at least 0"),
    ("outer_lr", lambda v: _finite(v) and v > 0, "a positive finite number"),
    ("outer_momentum", lambda v: 0 <= v < 1, "from 0 to below 1"),
    ("fragments", lambda v: v >= 1, "at least 1"),
    ("overlap", lambda v: v >= 0, "at least 0"),
    ("mix", lambda v: 0 <= v < 1, "from 0 to below 1"),
]


def _check_ranges(options: Options) -> None:
    """Raise naming the first option outside its range, as the command line spells it."""
    for name, test, wanted in _RANGES:
        value = getattr(options, name)
        if not test(value):
            raise ValueError(f"--{name.replace('_', '-')} must be {wanted}, got {value}")


def _preflight(comm, options: Options, model: Model, data: Dataset, method: Family, run: dict) -> None:
    """Raise (on this rank) what would stop this rank's part of the job, before anything is written."""
    rank, size = comm.Get_rank(), comm.Get_size()
    config.check_all()                      # every MPICOLL_ setting parses, or is named
    auto.check_settings()
    _check_ranges(options)
    slow = [r for r in parse_straggler(options.straggler) if not 0 <= r < size]
    if slow:
        raise ValueError(f"--straggler {options.straggler}: rank {slow[0]} is not among the {size} ranks")
    parse_delay(options.delay)
    schedules.parse(options.lr_schedule, options.lr)
    if options.model_parallel != 1:
        method.check_model_parallel(options, model, size)
    if options.max_rank_memory:
        method.check_memory(options, model, size)
    if options.distributed_optimizer:
        method.check_distributed_optimizer(options, model)
    if options.compression:
        method.check_compression(options, model)
    elif options.error_feedback:
        raise ValueError("--error-feedback carries the rounding of --compression: add --compression fp16 or bf16")
    method.check(options, model, size)
    if options.elastic:
        method.check_elastic(options, model, size)
        check_fault_tolerance()
        if rank == 0 and (warning := short_timeout_warning()):
            print(f"mpicoll train: warning: {warning}", file=sys.stderr, flush=True)
        if options.min_ranks > size:
            raise ValueError(f"--min-ranks {options.min_ranks} is more than the {size} ranks the job has")
    elif options.min_ranks != 1:
        raise ValueError("--min-ranks is the floor of an --elastic run: add --elastic, or drop it")
    workers = method.workers(options, size)
    if len(data.y) < workers:
        raise ValueError(f"{workers} workers but only {len(data.y)} training samples: every worker needs a shard; "
                         "use fewer ranks or more data")
    if options.output and rank == method.reporting_rank(options):
        check_writable("--output", Path(options.output))
        check_log(options.output, options.overwrite, options.resume)
    if not options.checkpoint:
        return
    check_writable("--checkpoint", Path(f"{options.checkpoint}.npz"), made=True)
    if not options.resume:
        found = checkpoint.existing(options.checkpoint) if rank == 0 else []
        if found and not options.overwrite:
            raise ValueError(f"--checkpoint {options.checkpoint}: {found[0]} is an earlier run's checkpoint; pass "
                             "--resume to continue it, --overwrite to replace it, or another prefix")
        return
    method.check_resume(comm, options, model, run)


METHODS: dict[str, Family] = {family.name: family for family in (
    Allreduce("allreduce-ring", "ring"),
    Allreduce("allreduce-parallel", "parallel"),
    Allreduce("allreduce-auto", "auto"),
    ParameterServers("ps-sync", "sync"),
    ParameterServers("ps-softsync", "softsync"),
    ParameterServers("ps-async", "async"),
    ParameterServers("dcasgd", "dcasgd"),
    ParameterServers("downpour", "downpour"),
    ParameterServers("ringmaster", "ringmaster"),
    ParameterServers("rescaled", "rescaled"),
    Sgp("sgp"),
    LocalUpdates("localsgd", "average"),
    LocalUpdates("diloco", "diloco"),
    Allreduce("sequential", "auto", one_rank=True),     # one process: plain SGD
    Lbfgs("sandblaster-lbfgs"),
)}
