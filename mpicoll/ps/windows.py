"""The one-sided transport: MPI windows that workers and servers write into directly.

Every data movement is an RMA ``Put`` or ``Get`` aimed at a rank that is
inside MPI at that moment, followed by a small point-to-point note saying it is
there (the same request/answer headers as the point-to-point transport).
Measured with MPICH (docs/parameter-server.md): every passive-target operation
aimed at a rank busy outside MPI, even the lock, waits until it next enters
MPI.  So:

- a worker puts its gradient slice into its own inbox slot on each
  server, then sends the request note; the server reads the slot in place;
- a server answers by putting its shard and version into the worker's
  window, then sending the answer note; the worker is waiting for it inside
  MPI, and its weights *are* that window;
- a plain pull gets a server's live shard and version under a shared
  lock without the server doing anything; the server updates under an
  exclusive lock on its own window, so a pull always sees one whole version.
  Between updates the server waits for requests inside MPI (polling), so puts
  and pulls progress; one waits at most for the update in progress.  DC-ASGD
  pulls go through the server instead: its backup must be exactly what the
  worker got.

All windows come from ``Win.Allocate`` (5-20x faster to use than ``Win.Create``).

Under Open MPI's fault tolerance an access aimed at a rank whose node was cut off never returns (a server
stuck in ``MPI_Win_unlock`` towards a cut-off worker, seen across emulated nodes): every access, a lock on
the rank's own window too, is watched (:mod:`mpicoll.channel.rma`), so that the job ends after the
context's timeout naming the rank that did not answer, instead of hanging.  A worker killed on a reachable
node is dropped as with the point-to-point transport (``tests/train/test_elastic.py``, dcasgd over this
transport).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..channel.rma import access_watch, locked, see_own
from .layout import Layout

__all__ = ["Windows"]

_VERSION = np.dtype(np.int64).itemsize


class Windows:
    """The three windows of one parameter-server job (collective to create and free).

    On a server: ``live`` is ``[version | shard]``, ``inbox`` one shard-sized
    slot per worker.  On a worker: ``mine`` is ``[one version per server | full
    vector]``.  Each rank allocates nothing in the windows of the other role.
    """

    def __init__(self, context, layout: Layout, dtype):
        comm = context.comm
        self.comm, self.layout, self.dtype = comm, layout, np.dtype(dtype)
        self._access = access_watch(context, "a parameter server's one-sided transfer (MPI_Win_lock/unlock)",
                                    remedy="--transport p2p drops such a rank and goes on")
        item = self.dtype.itemsize
        shard = layout.shard(layout.rank).stop - layout.shard(layout.rank).start if layout.is_server else 0
        workers = len(layout.workers)
        self.live_win = MPI.Win.Allocate(_VERSION + shard * item if layout.is_server else 0, 1, comm=comm)
        self.inbox_win = MPI.Win.Allocate(workers * shard * item, item, comm=comm)
        self.mine_win = MPI.Win.Allocate(0 if layout.is_server else len(layout.servers) * _VERSION
                                         + layout.size * item, 1, comm=comm)
        if layout.is_server:
            live = np.frombuffer(self.live_win.tomemory(), np.uint8)
            self.version = live[:_VERSION].view(np.int64)
            self.weights = live[_VERSION:].view(self.dtype)
            self.inboxes = np.frombuffer(self.inbox_win.tomemory(), self.dtype).reshape(workers, shard)
        else:
            mine = np.frombuffer(self.mine_win.tomemory(), np.uint8)
            self.versions = mine[:len(layout.servers) * _VERSION].view(np.int64)
            self.weights = mine[len(layout.servers) * _VERSION:].view(self.dtype)

    # -- the worker's side --------------------------------------------------

    def put_gradient(self, gradient: np.ndarray) -> None:
        """Write each server's slice of ``gradient`` into this worker's inbox slot there."""
        slot = self.layout.workers.index(self.layout.rank)
        for server in self.layout.servers:
            part = gradient[self.layout.shard(server)]
            with locked(self.inbox_win, server, self._access):
                self.inbox_win.Put(part, server, slot * part.size)

    def get_live(self) -> None:
        """Read every server's current shard and version (no server involvement)."""
        item = self.dtype.itemsize
        for index, server in enumerate(self.layout.servers):
            part = self.weights[self.layout.shard(server)]
            with locked(self.live_win, server, self._access):
                self.live_win.Get(self.versions[index:index + 1].view(np.uint8), server, 0)
                self.live_win.Get([part.view(np.uint8), part.size * item, MPI.BYTE], server, _VERSION)

    def see_puts(self) -> None:
        """Make what the servers put into this rank's window visible to its own reads."""
        see_own(self.mine_win, self.layout.rank, self._access)

    # -- the server's side --------------------------------------------------

    def inbox(self, worker: int) -> np.ndarray:
        """This server's slot for ``worker``, holding the gradient it announced."""
        see_own(self.inbox_win, self.layout.rank, self._access)
        return self.inboxes[self.layout.workers.index(worker)]

    def updating(self):
        """Hold this while changing the live weights: pulls see before or after, never half."""
        return locked(self.live_win, self.layout.rank, self._access, exclusive=True)

    def put_weights(self, worker: int) -> None:
        """Write this server's shard and version into ``worker``'s window."""
        index = self.layout.servers.index(self.layout.rank)
        start = self.layout.shard(self.layout.rank).start
        base = len(self.layout.servers) * _VERSION + start * self.dtype.itemsize
        with locked(self.mine_win, worker, self._access):
            self.mine_win.Put(self.version.view(np.uint8), worker, index * _VERSION)
            self.mine_win.Put([self.weights.view(np.uint8), MPI.BYTE], worker, base)

    # -- both ---------------------------------------------------------------

    def free(self) -> None:
        """Free the windows (collective: every rank must call it).  As mpi4py frees its own objects: the handles
        are swapped for ``MPI.WIN_NULL`` and the views into window memory dropped first, so a second call does
        nothing and a use after it is refused (MPI refuses a null window) instead of reading freed memory."""
        windows = (self.live_win, self.inbox_win, self.mine_win)
        self.live_win = self.inbox_win = self.mine_win = MPI.WIN_NULL
        self.weights = self.version = self.versions = self.inboxes = None
        for win in windows:
            if win != MPI.WIN_NULL:
                win.Free()

