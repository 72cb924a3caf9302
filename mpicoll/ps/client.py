"""The worker's side: pull weights, push gradients, or both in one exchange."""

from __future__ import annotations

import numpy as np

from ..context import Context
from .layout import Layout
from .protocol import TAG_ANSWER, TAG_GRADIENT, TAG_REQUEST, TAG_WEIGHTS, Kind

__all__ = ["Client", "Schedule"]


class Client:
    """A worker's connection to every server shard.

    ``weights`` is the worker's copy of the full parameter vector, refreshed by
    ``pull`` and ``exchange``; treat it as read-only (copy it to modify it).
    """

    def __init__(self, ctx: Context, layout: Layout, dtype):
        self.ctx, self.layout = ctx, layout
        self.weights = np.zeros(layout.size, dtype)
        self.versions = {server: 0 for server in layout.servers}
        self._answers = {server: np.zeros(1, np.int64) for server in layout.servers}
        self.closed = False

    def pull(self) -> np.ndarray:
        """Fetch the current weights from every server."""
        return self._request(Kind.PULL)

    def push(self, gradient: np.ndarray) -> None:
        """Send a gradient without waiting for weights (Downpour's push)."""
        self._request(Kind.PUSH, gradient)

    def exchange(self, gradient: np.ndarray) -> np.ndarray:
        """Send a gradient and return the weights the servers answer with."""
        return self._request(Kind.EXCHANGE, gradient)

    def close(self) -> None:
        """Tell every server this worker is done (servers return once all workers are)."""
        if not self.closed:
            self._request(Kind.DONE)
            self.closed = True

    def _request(self, kind: Kind, gradient: np.ndarray | None = None):
        if self.closed:
            raise RuntimeError("this parameter-server client is closed")
        if gradient is not None:
            gradient = np.ascontiguousarray(gradient).reshape(-1)
            if gradient.size != self.layout.size or gradient.dtype != self.weights.dtype:
                raise ValueError(f"gradient of {gradient.size} {gradient.dtype} values; the servers hold "
                                 f"{self.layout.size} {self.weights.dtype} parameters")
        servers = list(self.layout.servers)
        requests, peers = [], []
        if kind.wants_weights:       # posted first, so answers land straight in place
            for server in servers:
                requests += [self.ctx.irecv(self._answers[server], server, TAG_ANSWER),
                             self.ctx.irecv(self.weights[self.layout.shard(server)], server, TAG_WEIGHTS)]
                peers += [server, server]
        for server in servers:
            requests.append(self.ctx.isend(np.array([int(kind), self.versions[server]], np.int64), server,
                                           TAG_REQUEST))
            peers.append(server)
            if kind.carries_gradient:
                requests.append(self.ctx.isend(gradient[self.layout.shard(server)], server, TAG_GRADIENT))
                peers.append(server)
        self.ctx.waitall(requests, peers)
        if kind.wants_weights:
            self.versions = {server: int(self._answers[server][0]) for server in servers}
            return self.weights
        return None


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
