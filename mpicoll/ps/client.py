"""The worker's side: pull weights, push gradients, or both in one exchange."""

from __future__ import annotations

import numpy as np

from .. import arrays
from ..context import Context
from ..tags import Tag
from .layout import Layout
from .protocol import Kind, lost_in
from .windows import Windows

__all__ = ["Client", "Schedule"]


class Client:
    """A worker's connection to every server shard.

    ``weights`` is the worker's copy of the full parameter vector, refreshed by
    ``pull`` and ``exchange``; treat it as read-only (copy it to modify it).
    Gradients may be numpy or CUDA arrays (copied to the host on the way);
    ``out=`` (any array, a CUDA one included) also receives the weights.
    """

    def __init__(self, ctx: Context, layout: Layout, dtype, windows: Windows | None = None,
                 reads_live: bool = True):
        self.ctx, self.layout, self.windows = ctx, layout, windows
        self.reads_live = reads_live
        self.weights = np.zeros(layout.size, dtype) if windows is None else windows.weights
        self.versions = {server: 0 for server in layout.servers}
        self._answers = {server: np.zeros(1, np.int64) for server in layout.servers}
        self._unsettled: tuple = ([], [])  # one-sided: our last push's messages, and their peers
        self._staging = arrays.Staging(layout.size, dtype, "the servers hold {size} {dtype} parameters")
        self.closed = False
        self._joined = False               # the first pull goes through the servers (a warm start may hold it)
        self.servers_lost = 0              # workers the servers dropped (known after close)

    def pull(self, out=None):
        """Fetch the current weights from every server."""
        return self._request(Kind.PULL, out=out)

    def push(self, gradient) -> None:
        """Send a gradient without waiting for weights (Downpour's push)."""
        self._request(Kind.PUSH, gradient)

    def exchange(self, gradient, out=None):
        """Send a gradient and return the weights the servers answer with."""
        return self._request(Kind.EXCHANGE, gradient, out)

    def close(self) -> None:
        """Tell every server this worker is done (servers return once all workers are).

        With windows, waits for the servers' last word (they answer once every
        worker is done or dropped), since freeing windows needs every rank.
        """
        if self.closed:
            return
        self._request(Kind.DONE)
        self.closed = True

    def _request(self, kind: Kind, gradient=None, out=None):
        if self.closed:
            raise RuntimeError("this parameter-server client is closed")
        if gradient is not None:
            gradient = self._staging.host(gradient)
        if self.windows is None:
            self._point_to_point(kind, gradient)
        else:
            self._one_sided(kind, gradient)
        if not kind.wants_weights:
            return None
        if out is not None:
            arrays.copy_into(out, self.weights)
            return out
        return self.weights

    def _point_to_point(self, kind: Kind, gradient) -> None:
        servers = list(self.layout.servers)
        requests, peers = [], []
        if kind.wants_weights:       # posted first, so answers land straight in place
            for server in servers:
                requests += [self.ctx.irecv(self._answers[server], server, Tag.PS_ANSWER),
                             self.ctx.irecv(self.weights[self.layout.shard(server)], server, Tag.PS_WEIGHTS)]
                peers += [server, server]
        self._send_headers(kind, gradient, requests, peers)
        self.ctx.waitall(requests, peers)
        if kind.wants_weights:
            self.versions = {server: int(self._answers[server][0]) for server in servers}

    def _one_sided(self, kind: Kind, gradient) -> None:
        servers = list(self.layout.servers)
        self.ctx.waitall(*self._unsettled)                  # our inbox slots are free again
        self._unsettled = ([], [])
        if kind is Kind.PULL and self.reads_live and self._joined:
            self.windows.get_live()
            self.versions = dict(zip(servers, map(int, self.windows.versions)))
            return
        if kind.carries_gradient:
            self.windows.put_gradient(gradient)
        requests = [self.ctx.irecv(self._answers[server], server, Tag.PS_ANSWER) for server in servers]
        peers = list(servers)
        self._send_headers(kind, None, requests, peers)
        if kind is Kind.PUSH:
            self._unsettled = (requests, peers)
            return
        # the servers answer DONE only once every worker is done or dropped
        self.ctx.waitall(requests, peers, limit=2 * self.ctx.timeout if kind is Kind.DONE else None)
        lost = {server: lost_in(int(self._answers[server][0])) for server in servers}
        ended = [server for server, count in lost.items() if count is not None]
        if kind is Kind.DONE:
            self.servers_lost = max(count or 0 for count in lost.values())
        elif ended:
            raise RuntimeError(f"worker rank {self.layout.rank}: server rank(s) {ended} finished without it "
                               "(it was silent for longer than their worker_timeout and was dropped)")
        else:
            self.windows.see_puts()
            self.versions = dict(zip(servers, map(int, self.windows.versions)))
            self._joined = True

    def _send_headers(self, kind: Kind, gradient, requests: list, peers: list) -> None:
        """The request header to every server (and, point to point, the gradient slice after it)."""
        for server in self.layout.servers:
            requests.append(self.ctx.isend(np.array([int(kind), self.versions[server]], np.int64), server,
                                           Tag.PS_REQUEST))
            peers.append(server)
            if gradient is not None:
                requests.append(self.ctx.isend(gradient[self.layout.shard(server)], server, Tag.PS_GRADIENT))
                peers.append(server)


class Schedule:
    """Downpour's worker cadence: push the summed gradients every ``n_push`` steps, fetch every ``n_fetch``.

    ``step(gradient)`` returns the weights to compute the next gradient on: the
    last fetched ones (the worker does not update its copy between fetches).
    With ``n_fetch = n_push = 1`` it is a plain exchange each step.
    """

    def __init__(self, client: Client, n_fetch: int = 1, n_push: int = 1):
        if n_fetch < 1 or n_push < 1:
            raise ValueError(f"n_fetch and n_push must be >= 1, got {n_fetch} and {n_push}")
        self.client, self.n_fetch, self.n_push = client, n_fetch, n_push
        self.steps = 0
        self.pending = np.zeros_like(client.weights)

    def step(self, gradient: np.ndarray) -> np.ndarray:
        self.pending += np.asarray(gradient).reshape(-1)
        self.steps += 1
        push, fetch = self.steps % self.n_push == 0, self.steps % self.n_fetch == 0
        if push and fetch:
            self.client.exchange(self.pending)
        elif push:
            self.client.push(self.pending)
        elif fetch:
            self.client.pull()
        if push:
            self.pending[...] = 0
        return self.client.weights
