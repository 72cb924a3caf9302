"""What a process does when its job cannot go on: end the whole job, saying why, instead of hanging.

After a peer is lost, MPI offers no way to finish cleanly: ``MPI_Finalize``
waits for every rank, the lost one included, so survivors that merely return
hang at exit.  :func:`end_job` prints the reason once and calls ``MPI_Abort``,
which ends every rank of the job.  A communicator that breaks (a
:class:`~mpicoll.errors.CollectiveTimeout` or a lost peer) arranges for this to
happen at exit (``MPICOLL_END_BROKEN_JOBS=0`` turns that off, e.g. for test
harnesses that let ranks fail on purpose), so a program that catches the error
and returns still ends; one that can do better calls :func:`end_job` itself.
"""

from __future__ import annotations

import atexit
import sys
import time

from mpi4py import MPI

from . import config, timeline

__all__ = ["end_job", "end_at_exit"]

EXIT_CODE = 70          # EX_SOFTWARE: what mpiexec returns for a job ended this way
_SETTLE_S = 2.0
_FORWARD_S = 0.3
_reasons: list[str] = []


def end_job(reason: str, code: int = EXIT_CODE) -> None:
    """Print ``reason`` (naming this rank) and end every rank of the job with ``MPI_Abort``."""
    sys.stdout.flush()
    print(f"mpicoll: rank {MPI.COMM_WORLD.Get_rank()} ends the job: {reason}", file=sys.stderr, flush=True)
    timeline.write_own()            # MPI_Abort skips the exit hooks that would write the whole trace
    # The launcher tears its output forwarding down as it ends the job: give the line time to get through
    # (once in a CI run of test_faults.py, a job ended by MPI_Abort had printed nothing on stderr).
    time.sleep(_FORWARD_S)
    MPI.COMM_WORLD.Abort(code)


def end_at_exit(reason: str) -> None:
    """End the job when this process exits, unless turned off by ``MPICOLL_END_BROKEN_JOBS=0``."""
    if not config.end_broken_jobs():
        return
    if not _reasons:
        atexit.register(_at_exit)          # after mpi4py's own hook: runs before MPI_Finalize
    _reasons.append(reason)


def _at_exit() -> None:
    if _reasons and MPI.Is_initialized() and not MPI.Is_finalized():
        time.sleep(_SETTLE_S)          # the other survivors time out about now: let them report first
        end_job(_reasons[0])
