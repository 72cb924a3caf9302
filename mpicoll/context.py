"""What an algorithm needs from its communicator: a private channel, scratch memory, bounded waits.

Algorithms talk over a duplicate of the user's communicator, so their
messages can never match the user's own point-to-point traffic.  Scratch
buffers are allocated on first use and only grow, so a training loop that
reduces the same gradient size every step allocates nothing after step one.
Every wait has a deadline: a dead or hung peer becomes a
:class:`~mpicoll.errors.CollectiveTimeout` naming that peer, not an eternal hang.
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from . import config
from .errors import CollectiveTimeout, MismatchError

__all__ = ["Context"]

_SPIN_SECONDS = 1e-3   # poll flat out this long before yielding the core
_MAX_NAP = 1e-4        # longest sleep between polls once yielding


def _ranks_per_core(comm: MPI.Intracomm) -> float:
    """Ranks of ``comm`` on this node per core this process may run on (> 1: oversubscribed)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ranks = local.Get_size()
    finally:
        local.Free()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return ranks / cores


class Context:
    """A private duplicate of a communicator plus the services algorithms share."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = MPI.Intracomm(MPI.Intracomm.Dup(comm))
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = config.timeout()
        self.debug = config.debug()
        self.segment_bytes = config.segment_bytes()
        self.collective = "collective"
        # Oversubscribed ranks yield the core while they wait: the peer they
        # wait for may need it to make progress.
        self.spin_seconds = 0.0 if _ranks_per_core(self.comm) > 1 else _SPIN_SECONDS
        self._scratch: dict[str, np.ndarray] = {}
        self._broken: str | None = None

    def free(self) -> None:
        """Release the private communicator and the scratch memory."""
        comm, self.comm = self.comm, MPI.COMM_NULL
        if comm != MPI.COMM_NULL:
            comm.Free()
        self._scratch.clear()

    def begin(self, collective: str) -> None:
        """Mark the start of one call (for error messages); refuse if a peer was lost before."""
        if self._broken:
            raise RuntimeError(f"{collective}: this communicator is unusable after: {self._broken}")
        if self.comm == MPI.COMM_NULL:
            raise RuntimeError(f"{collective}: communicator already freed")
        self.collective = collective

    # -- memory -------------------------------------------------------------

    def scratch(self, name: str, count: int, dtype) -> np.ndarray:
        """``count`` elements of grow-only scratch memory owned by ``name``."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._scratch.get(name)
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 64), np.uint8)
            self._scratch[name] = buf
        return buf[:nbytes].view(dtype)

    # -- messages -----------------------------------------------------------

    def isend(self, array: np.ndarray, dest: int, tag: int = 0) -> MPI.Request:
        return self.comm.Isend([array.view(np.uint8), MPI.BYTE], dest, tag)

    def irecv(self, array: np.ndarray, source: int, tag: int = 0) -> MPI.Request:
        return self.comm.Irecv([array.view(np.uint8), MPI.BYTE], source, tag)

    def wait(self, request: MPI.Request, peer: int) -> None:
        """Complete one request to or from ``peer``."""
        self.waitall([request], [peer])

    def waitall(self, requests: list, peers) -> None:
        """Complete all requests; ``peers`` names the rank behind each (or one rank for all)."""
        if not requests:
            return
        try:
            if self.timeout == 0:
                MPI.Request.Waitall(requests)
            elif not MPI.Request.Testall(requests):
                self._wait_with_deadline(requests, peers)
        except MPI.Exception as error:
            if error.Get_error_class() == MPI.ERR_TRUNCATE:
                raise MismatchError(self.collective, {
                    self.rank: "received a larger message than its own count implies; "
                               "the ranks passed different counts (MPICOLL_DEBUG=1 names them)"}) from None
            raise

    def _wait_with_deadline(self, requests: list, peers) -> None:
        start = time.perf_counter()
        deadline = start + self.timeout
        nap = 0.0
        while not MPI.Request.Testall(requests):
            now = time.perf_counter()
            if now > deadline:
                self._give_up(requests, peers)
            if now - start < self.spin_seconds:
                continue
            if now - start < 10 * self.spin_seconds + 1e-3:
                os.sched_yield()
            else:
                nap = min(_MAX_NAP, nap * 2 or 1e-6)
                time.sleep(nap)

    def _give_up(self, requests: list, peers) -> None:
        if isinstance(peers, int):
            peers = [peers] * len(requests)
        stuck = [peer for request, peer in zip(requests, peers) if not request.Test()]
        for request in requests:
            if request != MPI.REQUEST_NULL:
                request.Cancel()
        error = CollectiveTimeout(self.collective, self.rank, stuck, self.timeout)
        self._broken = str(error)
        raise error
