"""torch's world made of separate MPI jobs (as ``torchrun`` starts them) joined into one MPI communicator.

``torchrun`` starts every worker itself, so no MPI launcher made them one ``MPI_COMM_WORLD``.  Where each
worker is an MPI job of its own (``torchrun --nproc-per-node N --no-python mpiexec -n 1 python script.py``),
:func:`join` makes them one communicator through torch's store: the job holding torch's rank 0 opens an MPI
port (``MPI_Open_port``) and posts its name in the store; each other job connects (``MPI_Comm_connect``),
is accepted by every rank joined so far (``MPI_Comm_accept``) and merged in, until torch's world is whole;
the ranks are then ordered as torch's.

What was measured here (MPICH 5.0.2 and Open MPI 5.0 wheels, torch 2.13, one node, December 2026):

- MPICH joins separate jobs, but not reliably once torch's store is open in the process: 3 jobs of one rank
  joined 14 of 14 times over the OFI netmod (4 of 6 over UCX) where the port name went through a file, yet
  with torch's TCP store connected in each process ``MPI_Comm_accept`` died inside libmpi (bus error or
  segmentation fault) in 2 of 8 runs over OFI and 7 of 8 over UCX.  Joining is therefore opt-in (``MPICOLL_JOIN_JOBS=1``; OFI is chosen for
  processes torchrun started, :mod:`mpicoll.base.ucx`); trained through it, DDP's weights equal gloo's.
- Processes that call ``MPI_Init`` without any launcher (MPI singletons: a plain ``torchrun script.py``)
  cannot be joined: MPICH 5.0 gives every singleton the same process identity ("Local and remote groups in
  MPI_Intercomm_create must not overlap", pmodels/mpich#7805).
- Open MPI 5 connects jobs only through a shared PMIx server: singletons fail with MPI_ERR_INTERN, and
  separate ``mpirun`` jobs wait forever in connect/accept.

Each case that cannot join is refused at once, in one line saying how to launch instead (:func:`refusal`).
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta

from mpi4py import MPI

from ..base import config
from ..base.errors import LaunchMismatch
from ..base.launcher import announced

__all__ = ["join", "refusal"]

_PORT_KEY = "mpicoll/join/port"


def refusal(torch_size: int) -> str | None:
    """Why this process's MPI job is not joined with the others of torch's world of ``torch_size``, or None
    where :func:`join` goes ahead."""
    world = MPI.COMM_WORLD.Get_size()
    launch = "launch with one MPI launcher instead: `mpiexec -n N python script.py` (or mpirun, or srun --mpi=pmix)"
    start = f"torch.distributed has {torch_size} ranks but this MPI job has {world} (as torchrun starts them)"
    if "Open MPI" in MPI.Get_library_version():
        return f"{start}, and Open MPI joins separate jobs only through a shared PMIx server: {launch}"
    if announced() is None and world == 1:
        return (f"{start}, each process started without an MPI launcher, and MPICH cannot connect such processes "
                "(pmodels/mpich#7805): " + launch + "; or make each torchrun worker an MPI job, `torchrun "
                "--nproc-per-node N --no-python mpiexec -n 1 python script.py`, with MPICOLL_JOIN_JOBS=1 (MPICH's "
                "connect/accept crashed in some runs here: see docs/torch.md)")
    if not config.join_jobs():
        return (f"{start}: " + launch + "; or set MPICOLL_JOIN_JOBS=1 to join the jobs with MPI's connect/accept "
                "(MPICH's crashed in some runs here: see docs/torch.md)")
    return None


def join(store, rank: int, size: int, timeout: timedelta) -> MPI.Intracomm:
    """One communicator of torch's ``size`` ranks, this process at torch's ``rank``, out of the MPI jobs they
    belong to (collective over all of them).  ``store`` is torch's; a job that does not come within
    ``timeout`` ends the waiting ones with a message saying how many had joined."""
    reason = refusal(size)
    if reason:
        raise LaunchMismatch(reason)
    job = MPI.COMM_WORLD
    holds_rank_0 = job.allreduce(rank == 0, op=MPI.LOR)
    deadline = _Deadline(timeout, rank, size)
    try:
        if holds_rank_0:
            port = MPI.Open_port() if job.Get_rank() == 0 else None
            if port is not None:
                store.set(_PORT_KEY, port)
            joined = job
        else:
            store.wait([_PORT_KEY], timeout)
            port = store.get(_PORT_KEY).decode()
            joined = _merged(job.Connect(port, root=0), high=True)
        while joined.Get_size() < size:
            deadline.joined = joined.Get_size()
            joined = _merged(joined.Accept(port or "", root=0), high=False,
                             free=joined if joined is not job else None)
        if joined.Get_size() != size:
            raise LaunchMismatch(f"joining torch's world of {size} ranks made one of {joined.Get_size()}: more "
                                 "MPI jobs connected than torch has ranks")
        ordered = joined.Split(0, rank)
        if joined is not job:
            joined.Free()
        if holds_rank_0 and job.Get_rank() == 0:
            MPI.Close_port(port)
        return ordered
    finally:
        deadline.cancel()


def _merged(inter: MPI.Intercomm, high: bool, free: MPI.Intracomm | None = None) -> MPI.Intracomm:
    """The intracommunicator of both sides of ``inter`` (freed, with ``free``, the joined part it replaces)."""
    merged = inter.Merge(high=high)
    inter.Free()
    if free is not None:
        free.Free()
    return merged


class _Deadline:
    """Ends this process, saying why, if joining takes longer than ``timeout`` (MPI's accept and connect
    wait forever for a job that never comes)."""

    def __init__(self, timeout: timedelta, rank: int, size: int):
        self.joined = 0
        self._timer = threading.Timer(timeout.total_seconds(), self._end, args=(timeout, rank, size))
        self._timer.daemon = True
        self._timer.start()

    def _end(self, timeout: timedelta, rank: int, size: int) -> None:
        sys.stderr.write(f"mpicoll: torch rank {rank} ends: joining torch's {size} ranks into one MPI world "
                         f"did not finish within {timeout.total_seconds():g} s ({self.joined} had joined; the "
                         "others never connected: is every worker an MPI job of this same MPI?)\n")
        sys.stderr.flush()
        os._exit(1)

    def cancel(self) -> None:
        self._timer.cancel()
