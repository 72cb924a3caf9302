"""Memory that every rank of one node can read and write: an MPI shared-memory window.

When all ranks of a communicator share a node, a rank can read its
neighbour's data in place instead of receiving a copy of it: no kernel copy
(CMA), no page pinning, no landing buffer.  :class:`SharedRegions` owns one
``MPI.Win.Allocate_shared`` window, gives each rank a numpy view of every
rank's region, and grows (collectively) when a larger message comes.

Memory ordering follows MPI's unified model: the writer calls :meth:`sync`
before it tells a reader (by a message) that data is ready, and the reader
calls :meth:`sync` after it is told and before it reads.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

__all__ = ["SharedRegions"]


class SharedRegions:
    """One shared region per rank of ``comm`` (which must span one node)."""

    def __init__(self, comm: MPI.Intracomm, before_growing=lambda: None):
        self.comm = comm
        self._before_growing = before_growing
        self._window = MPI.WIN_NULL
        self._nbytes = 0
        self._views: list[np.ndarray] = []

    def regions(self, count: int, dtype) -> list[np.ndarray]:
        """``count`` elements of every rank's region, indexed by rank.

        Collective when it has to grow: all ranks must ask for the same size.
        """
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if nbytes > self._nbytes or not self._views:
            self._allocate(max(nbytes, 2 * self._nbytes, 4096))
        return [view[:nbytes].view(dtype) for view in self._views]

    def _allocate(self, nbytes: int) -> None:
        self._before_growing()   # allocation blocks until all ranks join: check they are here
        self.free()
        window = MPI.Win.Allocate_shared(nbytes, 1, comm=self.comm)
        window.Lock_all(MPI.MODE_NOCHECK)
        self._window, self._nbytes = window, nbytes
        self._views = []
        for rank in range(self.comm.Get_size()):
            buffer, _ = window.Shared_query(rank)
            self._views.append(np.frombuffer(buffer, np.uint8, count=nbytes))

    def sync(self) -> None:
        """Order this rank's loads and stores against the other ranks' (MPI_Win_sync)."""
        self._window.Sync()

    def free(self) -> None:
        window, self._window = self._window, MPI.WIN_NULL
        self._views, self._nbytes = [], 0
        if window != MPI.WIN_NULL:
            window.Unlock_all()
            window.Free()
