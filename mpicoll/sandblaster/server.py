"""A Sandblaster server shard: one slice of every L-BFGS vector, and the commands that act on it.

The shard never sees a whole vector.  It runs the coordinator's commands in
the order they come (:class:`~.protocol.Op`), and meanwhile takes every
gradient slice a worker sends: one copy of each portion of the current
publication is kept (the first to arrive: a backup task's duplicate is
dropped, as is anything for an older publication), and ``COLLECT`` sums the
portions in portion order, so the result does not depend on which worker was
fastest.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..base import checkpoint
from ..channel.context import Context
from ..base.errors import PeerFailed
from ..base.tags import Tag
from .protocol import COMMAND_WORDS, HEADER, Op, Roles, coordinator_patience

__all__ = ["Shard"]


def kept(names: list[str]) -> list[str]:
    """The vectors a checkpoint keeps: those an iteration reads before writing them (x, g, the history)."""
    return [name for name in names if name not in ("d", "x_trial", "g_trial")]


class Shard:
    """The loop of one server shard (rank ``comm`` rank in ``roles.shards``).

    ``saving``: (checkpoint file, identity) that a SAVE command writes; ``state``: a checkpoint's vectors
    to continue from, instead of ``init``.
    """

    def __init__(self, ctx: Context, roles: Roles, names: list[str], init: np.ndarray,
                 saving: tuple | None = None, state: dict | None = None):
        self.ctx, self.roles, self.names, self.saving = ctx, roles, names, saving
        mine = roles.slice(ctx.rank)
        self.vectors = {name: np.zeros(mine.stop - mine.start) for name in names}
        if state is None:
            self.vectors["x"][:] = init[mine]
        else:
            for name in kept(names):
                self.vectors[name][:] = state[name]
        self.publication = 0
        self.portions: dict[int, np.ndarray] = {}      # portion -> gradient slice, of the current publication
        self.sends: list = []                          # (request, worker, buffer) of published slices in flight
        workers = list(roles.workers)
        self._headers = {w: np.empty(2, HEADER) for w in workers}
        self._header_requests = {w: ctx.irecv(self._headers[w], w, Tag.SANDBLASTER_GRADIENT) for w in workers}
        self._command = np.empty(COMMAND_WORDS)
        self._command_request = ctx.irecv(self._command, roles.coordinator, Tag.SANDBLASTER_COMMAND)
        self._spare = np.empty_like(self.vectors["x"])

    def run(self) -> np.ndarray:
        """Serve until FINISH; returns this shard's slice of the final parameters."""
        while True:
            command = self._next_command()
            op = Op(int(command[0]))
            if op is Op.DOTS:
                pairs = command[2:2 + 2 * int(command[1])].astype(int).reshape(-1, 2)
                v = self.vectors
                partial = np.array([v[self.names[a]] @ v[self.names[b]] for a, b in pairs])
                self.ctx.wait(self.ctx.isend(partial, self.roles.coordinator, Tag.SANDBLASTER_REPLY),
                              self.roles.coordinator)
            elif op is Op.COMBINATION:
                terms = command[3:3 + 2 * int(command[2])].reshape(-1, 2)
                self._combination(self.names[int(command[1])], [(c, self.names[int(n)]) for n, c in terms])
            elif op is Op.SAVE:
                path, identity = self.saving
                checkpoint.save(path, identity, int(command[1]), iteration=np.array(int(command[1])),
                                **{name: self.vectors[name] for name in kept(self.names)})
                self.ctx.wait(self.ctx.isend(np.ones(1), self.roles.coordinator, Tag.SANDBLASTER_REPLY),
                              self.roles.coordinator)
            elif op is Op.SWAP:
                a, b = (self.names[int(i)] for i in command[1:3])
                self.vectors[a], self.vectors[b] = self.vectors[b], self.vectors[a]
            elif op is Op.PUBLISH:
                self._publish(self.vectors[self.names[int(command[1])]])
            elif op is Op.COLLECT:
                into, publication, portions, rows = (int(c) for c in command[1:5])
                self._collect(self.vectors[self.names[into]], publication, portions, rows)
            elif op is Op.FINISH:
                mask = np.empty(self.roles.ranks, np.int8)          # 1: a worker the coordinator lost
                coordinator = self.roles.coordinator
                self.ctx.wait(self.ctx.irecv(mask, coordinator, Tag.SANDBLASTER_FINAL), coordinator)
                self._finish({int(r) for r in np.flatnonzero(mask)})
                return self.vectors["x"]

    def _next_command(self) -> np.ndarray:
        """Wait for the coordinator's next command, taking workers' gradients meanwhile."""
        coordinator = self.roles.coordinator
        while True:
            requests = [self._command_request, *self._header_requests.values()]
            peers = [coordinator, *self._header_requests]
            index = self._waitany(requests, peers, limit=coordinator_patience(self.ctx))
            if index is None:
                continue
            if index == 0:
                command = self._command.copy()
                # none after the last: a receive left posted keeps the communicator, and its context id, after
                # its free (MPICH runs out of them after about 2000 runs in one process)
                self._command_request = (MPI.REQUEST_NULL if Op(int(command[0])) is Op.FINISH else
                                         self.ctx.irecv(self._command, coordinator, Tag.SANDBLASTER_COMMAND))
                return command
            self._take_gradient(peers[index])

    def _waitany(self, requests: list, peers: list[int], limit: float | None = None) -> int | None:
        """``ctx.waitany``, going on without workers MPI's fault tolerance reports dead (their headers are no
        longer awaited; the coordinator counts them lost): None after one such report."""
        index = self.ctx.waitany(requests, peers, limit=limit, or_death=True)
        if index is not None:
            return index
        dead = set(self._header_requests).difference(self.ctx.living(list(self._header_requests)))
        if not dead:                                   # the coordinator: no going on
            raise self.ctx.broken_by(PeerFailed(self.ctx.collective, self.ctx.rank,
                                                set(peers).difference(self.ctx.living(peers)),
                                                "the process died (MPI's fault tolerance)"))
        for worker in dead:
            self._header_requests[worker] = MPI.REQUEST_NULL
        return None

    def _take_gradient(self, worker: int) -> None:
        """Receive the slice announced by ``worker``'s header; keep it if it is a new portion of this publication."""
        publication, portion = (int(h) for h in self._headers[worker])
        if publication < 0:                       # this worker sends no more
            self._header_requests[worker] = MPI.REQUEST_NULL
            return
        fresh = publication == self.publication and portion not in self.portions
        into = np.empty_like(self._spare) if fresh else self._spare
        self.ctx.wait(self.ctx.irecv(into, worker, Tag.SANDBLASTER_GRADIENT), worker)
        self._header_requests[worker] = self.ctx.irecv(self._headers[worker], worker, Tag.SANDBLASTER_GRADIENT)
        if fresh:
            self.portions[portion] = into

    def _combination(self, out: str, terms: list[tuple[float, str]]) -> None:
        """``out = c1 v1 + c2 v2 + ...`` summed in order into ``out`` (none of the terms), as numpy's
        ``c1*v1 + c2*v2 + ...``."""
        v = self.vectors
        np.multiply(v[terms[0][1]], terms[0][0], out=v[out])
        for c, name in terms[1:]:
            v[out] += c * v[name]

    def _publish(self, vector: np.ndarray) -> None:
        """Send a snapshot of ``vector``'s slice to every worker (never waited for here: a slow worker
        takes it when it needs it); start a new publication, dropping the old one's portions."""
        self.sends = [(r, w, buf) for r, w, buf in self.sends if not self.ctx.done_or_dead(r)]
        snapshot = vector.copy()
        for worker in self.ctx.living(self.roles.workers):
            self.sends.append((self.ctx.isend(snapshot, worker, Tag.SANDBLASTER_WEIGHTS), worker, snapshot))
        self.publication += 1
        self.portions = {}

    def _collect(self, into: np.ndarray, publication: int, portions: int, rows: int) -> None:
        """``into`` = the sum of every portion's gradient slice, in portion order, divided by ``rows``."""
        if publication != self.publication:
            raise RuntimeError(f"server rank {self.ctx.rank}: asked to collect publication {publication} while "
                               f"at {self.publication}; the coordinator and this shard disagree")
        while len(self.portions) < portions:
            waiting = [w for w, r in self._header_requests.items() if r != MPI.REQUEST_NULL]
            requests = [self._header_requests[w] for w in waiting]
            if not requests:
                raise RuntimeError(f"server rank {self.ctx.rank}: every worker has stopped with "
                                   f"{portions - len(self.portions)} portion(s) missing")
            index = self._waitany(requests, waiting)
            if index is not None:
                self._take_gradient(waiting[index])
        into[:] = 0.0
        for portion in range(portions):
            into += self.portions[portion]
        into /= rows

    def _finish(self, lost: set[int]) -> None:
        """Take every live worker's last gradients and goodbye, finish the publications to them, and send
        them the final parameters; lost workers are neither waited for nor sent anything more."""
        for worker in lost:
            self._header_requests[worker] = MPI.REQUEST_NULL
        while any(r != MPI.REQUEST_NULL for r in self._header_requests.values()):
            waiting = [w for w, r in self._header_requests.items() if r != MPI.REQUEST_NULL]
            index = self._waitany([self._header_requests[w] for w in waiting], waiting)
            if index is not None:
                self._take_gradient(waiting[index])
        live = [(r, w) for r, w, _ in self.sends if w not in lost]
        self.ctx.waitall([r for r, _ in live], [w for _, w in live])
        mask = np.zeros(self.roles.ranks, np.int8)                 # the first shard tells the workers who was lost
        mask[sorted(lost)] = 1
        news = [mask] if self.ctx.rank == self.roles.shards[0] else []
        final = [(self.ctx.isend(array, w, Tag.SANDBLASTER_FINAL), w)
                 for w in self.roles.workers if w not in lost for array in [*news, self.vectors["x"]]]
        self.ctx.waitall([r for r, _ in final], [w for _, w in final])
