"""The worker's side: pull weights, push gradients, or both in one exchange."""

from __future__ import annotations

import numpy as np

from .. import arrays
from ..channel import notices
from ..channel.context import Context
from ..base.errors import ServerFailed
from ..base.tags import Tag
from .layout import Layout
from .protocol import Kind
from .transports import client_side
from .windows import Windows

__all__ = ["Client", "Schedule"]


class Client:
    """A worker's connection to every server shard.

    ``weights`` is the worker's copy of the full parameter vector, refreshed by
    ``pull`` and ``exchange``; treat it as read-only (copy it to modify it).
    Gradients may be numpy or CUDA arrays (copied to the host on the way);
    ``out=`` (any array, a CUDA one included) also receives the weights.
    ``asks_first``: send a gradient's header and the gradient only if the
    server still wants it (the rule's ``refuses_late``; point to point).
    """

    def __init__(self, ctx: Context, layout: Layout, dtype, windows: Windows | None = None,
                 reads_live: bool = True, asks_first: bool = False):
        self.layout = layout
        notices.listen(ctx, layout.servers, Tag.PS_FAILED, ServerFailed)    # a server that fails says why: stop
        self.transport = client_side(ctx, layout, dtype, windows, reads_live, asks_first)
        self.weights = self.transport.weights
        self.versions = {server: 0 for server in layout.servers}
        self._staging = arrays.Staging(layout.size, dtype, "the servers hold {size} {dtype} parameters")
        self.closed = False

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
        versions = self.transport.request(kind, gradient, self.versions)
        if versions is not None:
            self.versions = versions
        if not kind.wants_weights:
            return None
        if out is not None:
            arrays.copy_into(out, self.weights)
            return out
        return self.weights

    @property
    def servers_lost(self) -> int:
        """Workers the servers dropped (known after ``close``, with windows)."""
        return self.transport.servers_lost


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
