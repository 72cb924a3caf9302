"""The Sandblaster coordinator: L-BFGS's vector operations as commands to the shards, and gradient
evaluations as portions handed to workers as they become free, with backup tasks.

:class:`RemoteVectors` is the :class:`~.lbfgs.Vectors` store the coordinator's
L-BFGS runs on.  Each operation is one command to every shard; a dot product
comes back as each shard's partial sums, added in shard order here: only
scalars ever reach the coordinator.

A gradient evaluation publishes the point to the workers (each shard sends
its slice) and cuts the batch into more portions than there are workers.  A
free worker gets the next portion; once none is left, a free worker gets a
**backup** copy of the portion that has been running longest (at most one
backup per portion, as MapReduce's backup tasks): whichever copy finishes
first counts, and the shards drop the other's gradient.  A worker that stays
silent for the timeout on one portion is counted lost: its portion goes to
another worker and it gets no more work, so a dead worker costs one timeout
without backups and nothing with them.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..base.chunks import balanced_bounds
from ..channel.context import Context
from ..base.errors import WorkersLost
from ..base.tags import Tag
from .protocol import COMMAND_WORDS, HEADER, Op, Roles, Task

__all__ = ["RemoteVectors", "Stats", "WorkersLost"]

_LOOK_AROUND_S = 0.01       # how often a wait for workers looks for silent ones
_DEATHS_EVERY = 0.05        # seconds between questions to MPI about dead workers (0.1 ms each)


@dataclass
class Stats:
    """What the coordinator saw, for logs and benchmarks."""

    evaluations: int = 0
    portions: int = 0                   # portions counted (the first copy of each)
    backups: int = 0                    # backup copies handed out
    discarded: int = 0                  # results that came second, or after their evaluation was over
    reissued: int = 0                   # portions taken from a silent worker and handed to another
    lost: list = field(default_factory=list)             # workers counted lost
    per_worker: dict = field(default_factory=dict)       # worker -> portions it finished first
    evaluation_s: list = field(default_factory=list)     # wall time of each gradient evaluation


class RemoteVectors:
    """L-BFGS's vectors held by the shards, and the workers that compute gradients; runs on rank 0."""

    def __init__(self, ctx: Context, roles: Roles, names: list[str], *, samples: int, batch: int, portions: int,
                 backup: bool = True, worker_timeout: float | None = None):
        self.ctx, self.roles = ctx, roles
        self.index = {name: i for i, name in enumerate(names)}
        self.rows = min(batch, samples)
        self.portions = max(1, min(portions, self.rows))
        self.backup = backup
        self.worker_timeout = ctx.timeout if worker_timeout is None else worker_timeout
        self.publication = 0
        self.stats = Stats(per_worker={w: 0 for w in roles.workers})
        self.live = list(roles.workers)
        self.busy: dict[int, tuple[int, int, float]] = {}     # worker -> (publication, portion, since)
        self._done = {w: np.empty(4) for w in roles.workers}
        self._requests = {w: ctx.irecv(self._done[w], w, Tag.SANDBLASTER_DONE) for w in roles.workers}
        self._sends: list = []

    # -- the Vectors operations ----------------------------------------------

    def dots(self, pairs):
        """As many DOTS commands as the pairs need, all sent before any answer is awaited: one round trip."""
        per_command = (COMMAND_WORDS - 2) // 2
        chunks = [pairs[i:i + per_command] for i in range(0, len(pairs), per_command)]
        for chunk in chunks:
            self._command([Op.DOTS, len(chunk)] + [self.index[name] for pair in chunk for name in pair])
        shards, values = list(self.roles.shards), []
        for chunk in chunks:                    # a shard's answers come in the order of the commands
            partial = {s: np.empty(len(chunk)) for s in shards}
            self.ctx.waitall([self.ctx.irecv(partial[s], s, Tag.SANDBLASTER_REPLY) for s in shards], shards)
            values += [float(v) for v in sum(partial[s] for s in shards)]
        return values

    def combination(self, out, terms):
        if any(name == out for _, name in terms):
            raise ValueError(f"combination into {out!r} reads {out!r}: the shards write it as they go")
        if 3 + 2 * len(terms) > COMMAND_WORDS:
            raise ValueError(f"a combination of {len(terms)} vectors does not fit one command "
                             f"(at most {(COMMAND_WORDS - 3) // 2}): use a shorter history")
        self._command([Op.COMBINATION, self.index[out], len(terms)] +
                      [word for c, name in terms for word in (self.index[name], c)])

    def swap(self, a, b):
        self._command([Op.SWAP, self.index[a], self.index[b]])

    def save(self, iteration: int) -> None:
        """Have every shard write its checkpoint, and wait until all have (the coordinator's own file,
        written after, is what says the set is whole)."""
        self._command([Op.SAVE, iteration])
        shards = list(self.roles.shards)
        done = {s: np.empty(1) for s in shards}
        self.ctx.waitall([self.ctx.irecv(done[s], s, Tag.SANDBLASTER_REPLY) for s in shards], shards)

    def evaluate(self, at, gradient, batch):
        """Publish ``at``, have the workers compute the batch's gradient portion by portion, collect it."""
        start = time.perf_counter()
        self._command([Op.PUBLISH, self.index[at]])
        self.publication += 1
        loss = self._portions(batch)
        self._command([Op.COLLECT, self.index[gradient], self.publication, self.portions, self.rows])
        self.stats.evaluations += 1
        self.stats.evaluation_s.append(time.perf_counter() - start)
        return loss

    # -- reporting and the end -------------------------------------------------

    def report(self, iteration: int, evaluations: int) -> None:
        """Ask the first worker to evaluate the current parameters (the last publication: the accepted point)."""
        reporter = self.roles.workers[0]
        if reporter in self.live:
            self._task(reporter, [Task.REPORT, self.publication, iteration, evaluations, 0, 0])

    def finish(self) -> list[int]:
        """Stop the workers (each says goodbye once its last task is done), then the shards; returns the
        workers lost.  A worker silent for the timeout here is counted lost too."""
        for worker in self.live:
            self._task(worker, [Task.STOP, self.publication, 0, 0, 0, 0])
        waiting, deadline = set(self.live), time.perf_counter() + self.worker_timeout
        dead: set[int] = set()
        while waiting and (not self.worker_timeout or time.perf_counter() < deadline):
            worker, task = self._next_done(sorted(waiting))
            if worker is not None and task is None:
                waiting.discard(worker)
            elif worker is not None:
                self.stats.discarded += 1                      # a backup's twin, finishing late
            else:                                              # the dead say no goodbye
                dead.update(waiting.difference(self.ctx.living(waiting, stale_after=_DEATHS_EVERY)))
                waiting.difference_update(dead)
        self._lose(sorted(waiting), f"said no goodbye in {self.worker_timeout:g} s")
        self._lose(sorted(dead), "died (the MPI library reports its process gone)")
        self._command([Op.FINISH])
        mask = np.zeros(self.roles.ranks, np.int8)
        mask[self.stats.lost] = 1
        shards = list(self.roles.shards)
        self.ctx.waitall([self.ctx.isend(mask, s, Tag.SANDBLASTER_FINAL) for s in shards], shards)
        live = [(r, w) for r, w in self._sends if w not in self.stats.lost]
        self.ctx.waitall([r for r, _ in live], [w for _, w in live])
        return self.stats.lost

    # -- inside ------------------------------------------------------------------

    def _command(self, words) -> None:
        command = np.zeros(COMMAND_WORDS)
        command[:len(words)] = words
        shards = list(self.roles.shards)
        self.ctx.waitall([self.ctx.isend(command, s, Tag.SANDBLASTER_COMMAND) for s in shards], shards)

    def _task(self, worker: int, words) -> None:
        self._sends = [(r, w) for r, w in self._sends if not self.ctx.done_or_dead(r)]
        task = np.array(words, HEADER)
        self._sends.append((self.ctx.isend(task, worker, Tag.SANDBLASTER_TASK), worker))

    def _portions(self, batch: int) -> float:
        """Hand out the batch's portions until each is done once; the mean loss over the batch."""
        bounds = balanced_bounds(self.rows, self.portions)
        todo, losses = deque(range(self.portions)), {}
        copies: dict[int, int] = {}                      # portion -> copies running
        while len(losses) < self.portions:
            for worker in [w for w in self.live if w not in self.busy]:
                portion = todo.popleft() if todo else self._backup_candidate(losses, copies)
                if portion is None:
                    break
                if copies.get(portion, 0):
                    self.stats.backups += 1
                copies[portion] = copies.get(portion, 0) + 1
                self.busy[worker] = (self.publication, portion, time.perf_counter())
                self._task(worker, [Task.GRADIENT, self.publication, batch, portion, bounds[portion],
                                    bounds[portion + 1]])
            worker, task = self._next_done([w for w in self.live if w in self.busy])
            if worker is None:
                for portion in self._take_from_silent():
                    copies[portion] -= 1
                    if portion not in losses and not copies[portion]:
                        todo.appendleft(portion)
                        self.stats.reissued += 1
                continue
            publication, portion, loss_sum, _ = self._done[worker]
            if publication == self.publication:
                copies[int(portion)] -= 1
            if publication == self.publication and int(portion) not in losses:
                losses[int(portion)] = loss_sum
                self.stats.per_worker[worker] += 1
                self.stats.portions += 1
            else:
                self.stats.discarded += 1
        return sum(losses[p] for p in range(self.portions)) / self.rows

    def _backup_candidate(self, losses: dict, copies: dict) -> int | None:
        """The portion of this publication running longest with one copy, if backups are on."""
        if not self.backup:
            return None
        running = [(since, portion) for publication, portion, since in self.busy.values()
                   if publication == self.publication and portion not in losses and copies.get(portion) == 1]
        return min(running)[1] if running else None

    def _next_done(self, workers: list[int]) -> tuple[int | None, tuple | None]:
        """(the worker whose message came in, the task it finished: it is free again; None for a goodbye),
        or (None, None) after a short wait."""
        if not workers:
            return None, None
        index = self.ctx.waitany([self._requests[w] for w in workers], workers, patience=_LOOK_AROUND_S,
                                 or_death=True)          # a death: the dead are lost next (_take_from_silent)
        if index is None:
            return None, None
        worker = workers[index]
        if self._done[worker][0] < 0:        # a goodbye: nothing more comes (a receive left posted would keep the
            self._requests[worker] = MPI.REQUEST_NULL     # communicator, and its context id, alive after its free)
            return worker, None
        self._requests[worker] = self.ctx.irecv(self._done[worker], worker, Tag.SANDBLASTER_DONE)
        return worker, self.busy.pop(worker, (-1, -1, time.perf_counter()))

    def _take_from_silent(self) -> list[int]:
        """Count workers silent on one portion for the timeout, or dead by MPI's account, as lost; the
        portions (of this publication) they held."""
        now = time.perf_counter()
        dead = set(self.live).difference(self.ctx.living(self.live, stale_after=_DEATHS_EVERY))
        silent = [w for w, (_, _, since) in self.busy.items()
                  if w in dead or self.worker_timeout and now - since > self.worker_timeout]
        held = [self.busy[w][1] for w in silent if self.busy[w][0] == self.publication]
        self._lose(sorted(dead), "died (the MPI library reports its process gone)")
        self._lose([w for w in silent if w not in dead], f"was silent on one portion for {self.worker_timeout:g} s")
        if not self.live:
            raise self.ctx.broken_by(WorkersLost(f"Sandblaster coordinator: every worker was lost "
                                                 f"({self.stats.lost}); no gradient can be computed"))
        return held

    def _lose(self, workers, why: str) -> None:
        """Go on without ``workers`` (their portions are handed out again), saying so."""
        for worker in workers:
            others = len(self.live) - 1
            print(f"[Sandblaster coordinator] worker rank {worker} {why}: lost; " +
                  (f"its portions go to the other {others}" if others else "no worker is left"),
                  file=sys.stderr, flush=True)
            self.live.remove(worker)
            self.busy.pop(worker, None)
            self.stats.lost.append(worker)
