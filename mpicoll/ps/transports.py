"""How workers and servers reach each other: point-to-point messages, or one-sided MPI windows.

Each transport has two sides with mirrored duties, so the server loop
(:class:`~mpicoll.ps.server.Server`) and the worker's client
(:class:`~mpicoll.ps.client.Client`) never ask which one they run on:

==========================  =============================================  =============================================
duty                        ``p2p``                                        ``onesided`` (:mod:`mpicoll.ps.windows`)
==========================  =============================================  =============================================
worker: send a gradient     header, then the slice, to each server (or,    ``Put`` into its inbox slot, then the header
                            when the rule refuses late gradients, the
                            header, and the slice once the server says go)
server: read a gradient     receive the slice after the header (saying     read the inbox slot in place
                            go first when asked, or refusing a late one)
server: answer with         header, then a snapshot of the shard           ``Put`` shard and version into the worker's
weights                     (nonblocking: a slow worker holds up nobody)   window, then the header
worker: plain pull          request and answer, like an exchange           ``Get`` of the live shards, no server involved
server: end of the run      nothing                                        a final header to every worker
==========================  =============================================  =============================================

Headers are described in :mod:`mpicoll.ps.protocol`.
"""

from __future__ import annotations

import contextlib

import numpy as np
from mpi4py import MPI

from ..base import failure
from ..channel.context import Context
from ..base.tags import Tag
from .layout import Layout
from .protocol import Kind, final_note, lost_in
from .windows import Windows

__all__ = ["TRANSPORTS", "server_side", "client_side", "WorkerUnreachable"]

TRANSPORTS = ("p2p", "onesided")


# -- the server's side ----------------------------------------------------------------------

class WorkerUnreachable(Exception):
    """A transfer with one worker did not complete within the timeout (its node cut off, or it hung in the
    middle of a request), or MPI's fault tolerance reported the worker dead during it: the server drops that
    worker where its rule allows, instead of ending the job."""

    def __init__(self, worker: int, what: str, seconds: float, died: bool = False):
        self.worker, self.what, self.seconds = worker, what, seconds
        super().__init__(f"died in the middle of {what} (the MPI library reports its process gone)" if died
                         else f"stopped in the middle of {what}: it did not complete in {seconds:g} s (cut off or hung)")


class _ServerSide:
    """Answer headers, each sent once the previous one to the same worker has left."""

    def __init__(self, ctx: Context, workers: tuple[int, ...]):
        self.ctx = ctx
        self.answers: dict[int, list] = {w: [] for w in workers}

    def finish_transfer(self, requests: list, worker: int, what: str) -> None:
        """Wait for a transfer with ``worker``; past half the timeout, :class:`WorkerUnreachable` (the channel
        stays usable for the other workers; the requests are abandoned).  Half: the other workers wait for
        this server with the whole timeout, and must not time out while it waits for one of them.

        A transfer that did not complete is put down to a death where the MPI library knows of one by then: a
        receive from a process killed mid-send is not always failed by MPICH, though its death is known."""
        limit = self.ctx.timeout / 2
        try:
            if self.ctx.completes(requests, limit):
                return
        except MPI.Exception as error:
            if not failure.is_process_failure(error):
                raise
            raise WorkerUnreachable(worker, what, limit, died=True) from None
        raise WorkerUnreachable(worker, what, limit, died=not self.ctx.living([worker]))

    def note(self, worker: int, value: int) -> None:
        """The small answer header (a version, or the final note)."""
        self.finish_transfer(self.answers[worker], worker, "receiving its previous answer")
        self.answers[worker] = [self.ctx.isend(np.array([value], np.int64), worker, Tag.PS_ANSWER)]

    def settle(self, workers) -> None:
        """Wait until every answer to ``workers`` has left."""
        for worker in workers:
            self.finish_transfer(self.answers[worker], worker, "receiving its answer")


class PointToPointServer(_ServerSide):
    def __init__(self, ctx: Context, layout: Layout, weights: np.ndarray, asks_first: bool = False):
        super().__init__(ctx, layout.workers)
        self.weights = weights                               # the rule updates them in place
        self.asks_first = asks_first                         # workers wait for go before sending a gradient
        self._gradient = np.empty_like(weights)
        self._snapshots = {w: np.empty_like(weights) for w in layout.workers}

    def gradient(self, worker: int) -> np.ndarray:
        if self.asks_first:
            self._go(worker, True)
        try:
            self.finish_transfer([self.ctx.irecv(self._gradient, worker, Tag.PS_GRADIENT)], worker,
                                 "sending its gradient")
        except WorkerUnreachable:
            # the receive stays posted (abandoned) into this buffer, where the worker's late gradient can still
            # land: the next workers' gradients go elsewhere (one that came late overwrote the next one taken)
            self._gradient = np.empty_like(self._gradient)
            raise
        return self._gradient

    def refuse(self, worker: int) -> None:
        """Tell a worker that asked first that its gradient is too late: it never sends it."""
        self._go(worker, False)

    def _go(self, worker: int, go: bool) -> None:
        self.answers[worker].append(self.ctx.isend(np.array([int(go)], np.int64), worker, Tag.PS_GO))

    def answer(self, worker: int, version: int) -> None:
        self.note(worker, version)
        self._snapshots[worker][...] = self.weights
        self.answers[worker].append(self.ctx.isend(self._snapshots[worker], worker, Tag.PS_WEIGHTS))

    def pushed(self, worker: int, version: int) -> None:
        """A gradient that wants no answer was taken: nothing to say."""

    def publish(self, version: int):
        return contextlib.nullcontext()

    def finish(self, workers, finished, lost: int) -> None:
        self.settle(finished)


class OneSidedServer(_ServerSide):
    asks_first = False               # the gradient is in the window before its header arrives

    def __init__(self, ctx: Context, layout: Layout, weights: np.ndarray, windows: Windows):
        super().__init__(ctx, layout.workers)
        self.windows = windows
        self.weights = windows.weights                       # the rule updates the window's live weights
        self.weights[...] = weights

    def gradient(self, worker: int) -> np.ndarray:
        return self.windows.inbox(worker)

    def answer(self, worker: int, version: int) -> None:
        self.windows.put_weights(worker)                     # complete when this returns
        self.note(worker, version)

    def pushed(self, worker: int, version: int) -> None:
        self.note(worker, version)                           # its inbox slot is free again

    @contextlib.contextmanager
    def publish(self, version):
        """Change the live weights under the window's exclusive lock, then show ``version()`` to pulls."""
        with self.windows.updating():
            yield
            self.windows.version[0] = version()

    def finish(self, workers, finished, lost: int) -> None:
        """The last word, to every worker: how the run ended (lost workers may still read it, unless MPI
        knows them dead)."""
        for worker in self.ctx.living(workers):
            if worker in finished:
                self.note(worker, final_note(lost))
            else:
                self.ctx.isend(np.array([final_note(lost)], np.int64), worker, Tag.PS_ANSWER)
        self.settle(finished)


def server_side(ctx: Context, layout: Layout, weights: np.ndarray, windows: Windows | None,
                asks_first: bool = False):
    """The server's side of the transport the job uses (``windows``: one-sided).

    ``asks_first`` (point to point only): workers send a gradient's header and wait for go.
    """
    return (PointToPointServer(ctx, layout, weights, asks_first) if windows is None
            else OneSidedServer(ctx, layout, weights, windows))


# -- the worker's side ----------------------------------------------------------------------

class _ClientSide:
    def __init__(self, ctx: Context, layout: Layout):
        self.ctx, self.layout = ctx, layout
        self.answers = {server: np.zeros(1, np.int64) for server in layout.servers}
        self.servers_lost = 0            # workers the servers dropped (known after DONE, one-sided)

    def headers(self, kind: Kind, versions: dict, gradient, requests: list, peers: list) -> None:
        """The request header to every server (and, with ``gradient``, its slice after it)."""
        for server in self.layout.servers:
            requests.append(self.ctx.isend(np.array([int(kind), versions[server]], np.int64), server,
                                           Tag.PS_REQUEST))
            peers.append(server)
            if gradient is not None:
                requests.append(self.ctx.isend(gradient[self.layout.shard(server)], server, Tag.PS_GRADIENT))
                peers.append(server)


class PointToPointClient(_ClientSide):
    def __init__(self, ctx: Context, layout: Layout, dtype, asks_first: bool = False):
        super().__init__(ctx, layout)
        self.weights = np.zeros(layout.size, dtype)
        self.asks_first = asks_first         # send a gradient only once its server says it is not too late
        self._go = {server: np.zeros(1, np.int64) for server in layout.servers}

    def request(self, kind: Kind, gradient, versions: dict) -> dict | None:
        """Send one request; returns the servers' versions when weights came back."""
        servers = list(self.layout.servers)
        requests, peers = [], []
        if kind.wants_weights:       # posted first, so answers land straight in place
            for server in servers:
                requests += [self.ctx.irecv(self.answers[server], server, Tag.PS_ANSWER),
                             self.ctx.irecv(self.weights[self.layout.shard(server)], server, Tag.PS_WEIGHTS)]
                peers += [server, server]
        ask = self.asks_first and gradient is not None
        self.headers(kind, versions, None if ask else gradient, requests, peers)
        if ask:
            self.ctx.waitall([self.ctx.irecv(self._go[server], server, Tag.PS_GO) for server in servers], servers)
            for server in servers:
                if self._go[server][0]:
                    requests.append(self.ctx.isend(gradient[self.layout.shard(server)], server, Tag.PS_GRADIENT))
                    peers.append(server)
        self.ctx.waitall(requests, peers)
        return {server: int(self.answers[server][0]) for server in servers} if kind.wants_weights else None


class OneSidedClient(_ClientSide):
    def __init__(self, ctx: Context, layout: Layout, windows: Windows, reads_live: bool):
        super().__init__(ctx, layout)
        self.windows, self.reads_live = windows, reads_live
        self.weights = windows.weights                      # the servers put their answers here
        self._unsettled: tuple = ([], [])                   # our last push's messages, and their peers
        self._joined = False        # the first pull goes through the servers (a warm start may hold it)

    def request(self, kind: Kind, gradient, versions: dict) -> dict | None:
        servers = list(self.layout.servers)
        self.ctx.waitall(*self._unsettled)                  # our inbox slots are free again
        self._unsettled = ([], [])
        if kind is Kind.PULL and self.reads_live and self._joined:
            self.windows.get_live()
            return dict(zip(servers, map(int, self.windows.versions)))
        if kind.carries_gradient:
            self.windows.put_gradient(gradient)
        requests = [self.ctx.irecv(self.answers[server], server, Tag.PS_ANSWER) for server in servers]
        peers = list(servers)
        self.headers(kind, versions, None, requests, peers)
        if kind is Kind.PUSH:
            self._unsettled = (requests, peers)
            return None
        # the servers answer DONE only once every worker is done or dropped
        self.ctx.waitall(requests, peers, limit=2 * self.ctx.timeout if kind is Kind.DONE else None)
        lost = {server: lost_in(int(self.answers[server][0])) for server in servers}
        ended = [server for server, count in lost.items() if count is not None]
        if kind is Kind.DONE:
            self.servers_lost = max(count or 0 for count in lost.values())
            return None
        if ended:
            raise RuntimeError(f"worker rank {self.layout.rank}: server rank(s) {ended} finished without it "
                               "(it was silent for longer than their worker_timeout and was dropped)")
        self.windows.see_puts()
        self._joined = True
        return dict(zip(servers, map(int, self.windows.versions)))


def client_side(ctx: Context, layout: Layout, dtype, windows: Windows | None, reads_live: bool,
                asks_first: bool = False):
    """The worker's side of the transport the job uses (``windows``: one-sided; ``asks_first``: see server_side)."""
    return (PointToPointClient(ctx, layout, dtype, asks_first) if windows is None
            else OneSidedClient(ctx, layout, windows, reads_live))
