"""A Sandblaster worker: gradients over the portions of a batch the coordinator hands it.

A worker does one task at a time, in the order they come: for a portion it
takes the published parameters (receiving every shard's publications up to
the one the task names), computes the loss and gradient over the portion's
rows, sends each shard its slice of the gradient summed over the rows, and
tells the coordinator it is free.  It never knows whether its portion was a
backup: the first copy to arrive wins, the others are dropped where they land.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..channel.context import Context
from ..base.straggler import Straggler
from ..base.tags import Tag
from .protocol import HEADER, Roles, Task, batch_rows, coordinator_patience

__all__ = ["Worker"]


class Worker:
    """The loop of one worker rank.

    ``loss_and_gradient(w, rows) -> (loss, gradient)``: the mean loss over those
    rows of the training data and its gradient (float64 ``w``).  ``on_report(w,
    iteration, evaluations)`` is called with the parameters after an accepted
    L-BFGS iteration when the coordinator asks this worker to report.  ``slow``: a
    :class:`~mpicoll.base.straggler.Straggler` around each portion's computation (experiments).
    """

    def __init__(self, ctx: Context, roles: Roles, loss_and_gradient: Callable, samples: int, batch: int,
                 seed: int = 0, slow=None, on_report: Callable | None = None):
        self.ctx, self.roles = ctx, roles
        self.loss_and_gradient, self.samples, self.batch, self.seed = loss_and_gradient, samples, batch, seed
        self.slow, self.on_report = slow or Straggler(), on_report
        self.weights = np.zeros(roles.size)
        self.publication = 0                 # the publication ``weights`` holds
        self.portions = 0                    # portions computed, backups and late ones included
        self._rows: tuple[int, np.ndarray] | None = None
        self.lost: list[int] = []            # workers the coordinator lost (known after run)

    def run(self) -> np.ndarray:
        """Work until told to stop; returns the final parameters (from the shards)."""
        ctx, coordinator, task = self.ctx, self.roles.coordinator, np.empty(6, HEADER)
        while True:
            ctx.waitall([ctx.irecv(task, coordinator, Tag.SANDBLASTER_TASK)], coordinator,
                        limit=coordinator_patience(ctx))
            kind, publication, batch, portion, first, end = (int(t) for t in task)
            self._receive_weights(publication)
            if kind == Task.GRADIENT:
                self._gradient(publication, batch, portion, first, end)
            elif kind == Task.REPORT and self.on_report:
                self.on_report(self.weights, batch, portion)           # iteration, evaluations
            elif kind == Task.STOP:
                return self._stop()

    def _receive_weights(self, publication: int) -> None:
        """Take every shard's publications up to ``publication`` (the latest lands in ``weights``)."""
        while self.publication < publication:
            requests = [self.ctx.irecv(self.weights[self.roles.slice(s)], s, Tag.SANDBLASTER_WEIGHTS)
                        for s in self.roles.shards]
            self.ctx.waitall(requests, list(self.roles.shards))
            self.publication += 1

    def _gradient(self, publication: int, batch: int, portion: int, first: int, end: int) -> None:
        if self._rows is None or self._rows[0] != batch:
            self._rows = batch, batch_rows(self.samples, self.batch, batch, self.seed)
        rows = self._rows[1][first:end]
        with self.slow:
            loss, grad = self.loss_and_gradient(self.weights, rows)
        total = np.asarray(grad, np.float64) * len(rows)
        header = np.array([publication, portion], HEADER)
        sends, peers = [], []
        for shard in self.roles.shards:
            sends += [self.ctx.isend(header, shard, Tag.SANDBLASTER_GRADIENT),
                      self.ctx.isend(total[self.roles.slice(shard)], shard, Tag.SANDBLASTER_GRADIENT)]
            peers += [shard, shard]
        done = np.array([publication, portion, float(loss) * len(rows), len(rows)])
        sends.append(self.ctx.isend(done, self.roles.coordinator, Tag.SANDBLASTER_DONE))
        peers.append(self.roles.coordinator)
        self.ctx.waitall(sends, peers)
        self.portions += 1

    def _stop(self) -> np.ndarray:
        """Tell every shard and the coordinator this worker is done; receive the final parameters, and which
        workers were lost (:attr:`lost`)."""
        ctx, bye, shards = self.ctx, np.full(2, -1, HEADER), list(self.roles.shards)
        requests = [ctx.isend(bye, s, Tag.SANDBLASTER_GRADIENT) for s in shards]
        requests.append(ctx.isend(np.array([-1.0, -1, 0, 0]), self.roles.coordinator, Tag.SANDBLASTER_DONE))
        final, mask = np.empty(self.roles.size), np.empty(self.roles.ranks, np.int8)
        requests += [ctx.irecv(mask, shards[0], Tag.SANDBLASTER_FINAL)]        # sent before its slice
        requests += [ctx.irecv(final[self.roles.slice(s)], s, Tag.SANDBLASTER_FINAL) for s in shards]
        ctx.waitall(requests, [*shards, self.roles.coordinator, shards[0], *shards],
                    limit=coordinator_patience(ctx))      # the shards send once the coordinator says FINISH
        self.lost = [int(rank) for rank in np.flatnonzero(mask)]
        return final
