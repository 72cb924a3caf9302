"""Keep MPI's progress engine turning while a rank computes, for one-sided traffic aimed at it.

Measured with the MPICH wheel (5.0.2, shared memory): every passive-target
operation aimed at a rank busy outside MPI, even acquiring the lock, waits
until that rank next calls MPI: a Put, an Accumulate or a Get to a rank
computing for 0.5 s took 0.45 s.  Push-sum gossip has peers write into a
rank's window while it computes its gradient, so each such rank runs a
background thread that enters MPI every millisecond (an ``Iprobe``).  The
same operations then took 4-17 ms for 8 MiB, with the main thread in a
Python loop or in BLAS.  numpy releases the GIL in its kernels and Python
hands it over every few milliseconds, so the thread gets to run.
"""

from __future__ import annotations

import threading
import warnings

from mpi4py import MPI

from ..base import failure

__all__ = ["Progress"]


class Progress:
    """A daemon thread that pokes MPI's progress engine every ``interval`` seconds.

    Needs MPI initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py's default); with
    less it warns once and does nothing, and one-sided operations aimed at this
    rank wait for it to enter MPI.
    """

    _warned = False

    def __init__(self, comm: MPI.Comm, interval: float = 1e-3):
        self.comm, self.interval = comm, interval
        self._stop = threading.Event()
        self._awake = threading.Event()
        self._awake.set()
        self._thread: threading.Thread | None = None

    def start(self) -> "Progress":
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            if not Progress._warned:
                warnings.warn("MPI was initialised without MPI_THREAD_MULTIPLE: one-sided messages to a rank "
                              "that is computing wait until it next calls MPI", RuntimeWarning, stacklevel=2)
                Progress._warned = True
            return self
        self._thread = threading.Thread(target=self._run, name="mpicoll-progress", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._awake.is_set():
                try:
                    self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                except MPI.Exception as error:
                    # under MPI's fault tolerance a peer's death (or the revoke that follows) fails every probe
                    # until the main thread, which meets it in its own calls, recovers and stops this thread:
                    # the probe still turned the engine; anything else is this thread's end, said once
                    if not failure.is_process_failure(error):
                        raise

    def paused(self) -> "_Paused":
        """Hold the thread while this rank is inside MPI anyway (its polls then compete for MPI's lock)."""
        return _Paused(self._awake)

    def stop(self) -> None:
        """Stop and join the thread (before freeing the communicator it pokes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "Progress":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Paused:
    def __init__(self, awake: threading.Event):
        self.awake = awake

    def __enter__(self):
        self.awake.clear()

    def __exit__(self, *exc):
        self.awake.set()
