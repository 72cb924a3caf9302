"""The server loop: one shard, any rule, either transport, never blocked by one slow worker.

Every worker always has a request receive posted; the loop takes whichever
arrives first, feeds gradients to the rule, and answers through the transport
(:mod:`mpicoll.ps.transports`): point to point, with nonblocking sends from
per-worker snapshots of the weights, so a worker slow to collect its answer
holds up nobody; one-sided, with the gradient already in the server's window
when the request arrives and the answer ``Put`` into the worker's window.
Between requests the server waits inside MPI, so workers' puts and reads
progress (MPICH's passive target progresses only while its target is in MPI).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..base import checkpoint, failure
from ..channel.context import Context
from ..channel.checks import all_finite
from ..base.errors import Diverged, ServerLost, WorkerLost
from ..base.tags import Tag
from .layout import Layout
from .protocol import Kind
from .rules import Rule
from .transports import WorkerUnreachable, server_side
from .windows import Windows

__all__ = ["Server", "ServerStats", "WorkerLost", "Diverged"]


@dataclass
class ServerStats:
    """What one server did, for logs and benchmarks."""

    updates: int = 0                       # updates applied to the weights (rounds, for sync and softsync)
    dropped: int = 0                       # stale gradients discarded
    refused: int = 0                       # of those, refused before their payload moved (workers asked first)
    gradients: dict = field(default_factory=dict)     # per worker
    staleness: dict = field(default_factory=dict)     # updates between a worker's weights and its gradient -> count
    lost: list = field(default_factory=list)          # workers dropped after going silent
    nonfinite: int = 0                     # gradients with NaN or Inf, skipped
    bytes_in: int = 0
    bytes_out: int = 0
    idle_s: float = 0.0
    update_s: float = 0.0                  # time inside the rule's updates
    wall_s: float = 0.0


# One non-finite gradient is skipped (a bad batch); once each active worker has sent this many in a row with
# no finite one between, no update can come and the loop would wait forever: the server raises Diverged.
NONFINITE_STREAK = 2
_NONFINITE_REPORTS = 5     # non-finite gradients named in the log; the rest are counted
_DEATHS_EVERY = 0.05       # seconds between the server's questions to MPI about dead workers (0.1 ms each)


def checkpoint_identity(layout: Layout, rule: Rule, run: dict | None = None) -> dict:
    """What a server's checkpoint belongs to: the rule, the shard layout, and the run's own identity."""
    return {"rule": rule.name, "servers": len(layout.servers), "workers": len(layout.workers),
            "parameters": layout.size, **(run or {})}


def save_checkpoint(prefix: str, layout: Layout, rule: Rule, run: dict | None = None) -> Path:
    """Write the rule's state atomically and durably (a crash mid-write leaves the previous checkpoint)."""
    return checkpoint.save(checkpoint_file(prefix, layout.rank), checkpoint_identity(layout, rule, run),
                           rule.version, **rule.state())


def checkpoint_file(prefix: str, rank: int) -> Path:
    """The checkpoint file of server rank ``rank`` under ``prefix``."""
    return checkpoint.path(prefix, "server", rank)


def load_checkpoint(prefix: str, layout: Layout, rule: Rule, run: dict | None = None, state: dict | None = None) -> int:
    """Load this server's checkpoint into ``rule`` (after setup); returns the update count it holds.

    ``state``: the arrays of a set of servers' files already chosen together (``checks.load_checkpoint_set``, as
    ``mpicoll train`` does); otherwise this server's newest whole file.  A checkpoint of another rule,
    layout or run is refused (``CheckpointMismatch``) before anything changes.
    """
    if state is None:
        state = checkpoint.load(checkpoint_file(prefix, layout.rank), checkpoint_identity(layout, rule, run))
    rule.load_state(state)
    return rule.version


class Server:
    """One server's loop over its shard, with any rule, on either transport.

    ``weights`` (this server's shard) is updated in place and holds the result
    when :meth:`run` returns.  A worker that sends nothing for ``worker_timeout``
    seconds (default: the communicator's MPICOLL_TIMEOUT) is dropped, and the
    log says so, when the rule can go on without it; under ``sync`` a
    :class:`WorkerLost` names it.  ``windows``: the one-sided transport
    (:mod:`mpicoll.ps.windows`); the rule then works on the window's live
    weights, copied back at the end.
    """

    def __init__(self, ctx: Context, layout: Layout, rule: Rule, weights: np.ndarray,
                 windows: Windows | None = None, worker_timeout: float | None = None, lr_at=None):
        self.ctx, self.layout, self.rule, self.weights = ctx, layout, rule, weights
        self.lr_at = lr_at                 # update count -> the rule's learning rate (a schedule); None: fixed
        self.windows = windows
        self.worker_timeout = ctx.timeout if worker_timeout is None else worker_timeout
        self.workers = list(layout.workers)
        self.stats = ServerStats()
        self.nonfinite_streak = 0          # non-finite gradients in a row, from any workers

    def run(self, *, checkpoint: str | None = None, every: int = 100, resume: bool = False,
            warm_start: int = 0, identity: dict | None = None, state: dict | None = None) -> ServerStats:
        """Serve until every worker is done or dropped; returns the statistics.

        With ``checkpoint`` (a path prefix) the state is saved every ``every``
        updates and at the end; ``resume`` continues from the saved state.  ``identity``:
        what else the checkpoint belongs to (the training run's method, data, ...), checked on resume.
        ``warm_start=k``: only the first worker is answered until k updates are
        in (Downpour's warm start); the others' first pulls wait for that.
        """
        rule, workers, stats, ctx = self.rule, self.workers, self.stats, self.ctx
        if warm_start and rule.waits_for_rounds:
            raise ValueError(f"a warm start lets one worker train alone; {rule.name} rounds need every worker: "
                             "use async, dcasgd or downpour")
        self.transport = transport = server_side(ctx, self.layout, self.weights, self.windows, rule.refuses_late)
        rule.setup(transport.weights, tuple(workers))
        if resume:
            load_checkpoint(checkpoint, self.layout, rule, identity, state)
        with transport.publish(lambda: rule.version):
            pass
        saved_at = rule.version
        headers = {w: np.zeros(2, np.int64) for w in workers}
        self.waiting: dict[int, Kind] = {}        # workers owed weights, and what they asked with
        deferred: set[int] = set()                # first pulls held back by the warm start
        self.requests = [ctx.irecv(headers[w], w, Tag.PS_REQUEST) for w in workers]
        start = time.perf_counter()
        self.active = set(workers)
        self.last_heard = {w: start for w in workers}
        while self.active:
            before = time.perf_counter()
            index = ctx.waitany(self.requests, workers, patience=min(1.0, self.worker_timeout or 1.0), or_death=True)
            stats.idle_s += time.perf_counter() - before
            if index is None:
                self._drop_lost_workers()
                continue
            worker = workers[index]
            self.last_heard[worker] = time.perf_counter()
            kind, version = Kind(int(headers[worker][0])), int(headers[worker][1])
            ready: list[int] = []
            if kind.carries_gradient:
                try:
                    ready = self._take_gradient(worker, kind, version)
                except WorkerUnreachable as gone:         # cut off in the middle: go on without it
                    self._drop(worker, str(gone))
                    continue
            elif kind is Kind.PULL:
                self.waiting[worker] = kind
                if rule.version < warm_start and worker != workers[0]:
                    deferred.add(worker)
                else:
                    ready = [worker]
            else:                                                  # DONE
                self.active.discard(worker)
                ready = rule.on_leave(worker)
            if deferred and rule.version >= warm_start:         # the warm start is over
                ready, deferred = [*ready, *sorted(deferred)], set()
            if kind is not Kind.DONE:
                self.requests[index] = ctx.irecv(headers[worker], worker, Tag.PS_REQUEST)
            self._drop_lost_workers(fresh=ctx.spans_nodes)   # before answering: never send to the dead
            for target in ready:
                if target in self.waiting:
                    self._answer(target)
            if checkpoint and rule.version - saved_at >= every:
                save_checkpoint(checkpoint, self.layout, rule, identity)
                saved_at = rule.version
        finished = [worker for worker in workers if worker not in stats.lost]
        try:
            transport.finish(workers, finished, len(stats.lost))
        except WorkerUnreachable as gone:         # it finished, but its last answer did not get through
            print(f"[server rank {self.layout.rank}] worker rank {gone.worker} {gone}", file=sys.stderr, flush=True)
        if checkpoint:
            save_checkpoint(checkpoint, self.layout, rule, identity)
        if transport.weights is not self.weights:
            self.weights[...] = transport.weights
        stats.updates, stats.dropped = rule.version, rule.dropped
        stats.wall_s = time.perf_counter() - start
        return stats

    def _take_gradient(self, worker: int, kind: Kind, version: int) -> list[int]:
        """Take a worker's gradient (see :meth:`_apply`); returns who may be answered."""
        if kind.wants_weights:
            self.waiting[worker] = kind
        ready = self._apply(worker, version)
        if not kind.wants_weights:
            self.transport.pushed(worker, self.rule.version)
        return ready

    def _apply(self, worker: int, version: int) -> list[int]:
        """Read a worker's gradient and apply it, unless it is not finite, or is refused unread for
        being late when the worker asked first; returns who may be answered."""
        rule, stats = self.rule, self.stats
        if self.transport.asks_first and rule.too_late(version):
            self.transport.refuse(worker)
            stats.refused += 1
            return rule.refuse(worker)
        gradient = self.transport.gradient(worker)
        stats.bytes_in += gradient.nbytes
        stats.gradients[worker] = stats.gradients.get(worker, 0) + 1
        lag = rule.version - version
        stats.staleness[lag] = stats.staleness.get(lag, 0) + 1
        if not all_finite(gradient):                               # never let NaN or Inf into the model
            self._skip_nonfinite(worker)
            return [worker]
        self.nonfinite_streak = 0
        before = time.perf_counter()
        if self.lr_at is not None:
            rule.lr = self.lr_at(rule.version)
        with self.transport.publish(lambda: rule.version):
            ready = rule.on_gradient(worker, version, gradient)
        stats.update_s += time.perf_counter() - before
        return ready

    def _skip_nonfinite(self, worker: int) -> None:
        """Count a gradient with NaN or Inf, say so in the log, and stop training once every worker sends them."""
        stats, rank = self.stats, self.layout.rank
        stats.nonfinite += 1
        self.nonfinite_streak += 1
        if stats.nonfinite <= _NONFINITE_REPORTS:
            more = " (further ones are counted, not named)" if stats.nonfinite == _NONFINITE_REPORTS else ""
            print(f"[server rank {rank}] worker rank {worker} sent a gradient with NaN or Inf "
                  f"(update {self.rule.version}): skipped{more}", file=sys.stderr, flush=True)
        if self.nonfinite_streak >= NONFINITE_STREAK * max(len(self.active), 1):
            raise Diverged(f"server rank {rank}: training diverged at update {self.rule.version}: the last "
                           f"{self.nonfinite_streak} gradients from the {len(self.active)} worker(s) all had NaN "
                           "or Inf, so the weights no longer give finite gradients; lower the learning rate "
                           "(--lr) or, for dcasgd, the compensation (--lam)")

    def _answer(self, worker: int) -> None:
        if self.waiting.pop(worker) is Kind.PULL:
            self.rule.on_pull(worker)
        try:
            self.transport.answer(worker, self.rule.version)
        except WorkerUnreachable as gone:             # its previous answer is still stuck: cut off
            self._drop(worker, str(gone))
            return
        self.stats.bytes_out += self.transport.weights.nbytes

    def _drop_lost_workers(self, fresh: bool = False) -> None:
        """Drop the workers that are gone: dead by the MPI library's account (asked at most every
        ``_DEATHS_EVERY`` s, or now when ``fresh``), or silent for ``worker_timeout`` s while not waiting for us.
        Another server dead ends the run (:class:`ServerLost`): no rule goes on without a shard.

        An answer sent to a worker that died on another node crashes this server inside MPICH's UCX transport,
        so across nodes the server asks afresh before every round of answers (0.1 ms): with the answer of up to
        50 ms before, 3 of 8 runs of the killed-worker test across emulated nodes crashed; asking afresh, 0 of 18.
        That narrows the window and cannot close it: MPI learns of a death 4-8 ms after the transport does, and
        an answer posted in between still crashes (docs/failures.md)."""
        now, timeout = time.perf_counter(), self.worker_timeout
        others = [server for server in self.layout.servers if server != self.layout.rank]
        asked = [*others, *sorted(self.active)]                   # one question for the servers and the workers
        dead = set(asked).difference(self.ctx.living(asked, stale_after=0.0 if fresh else _DEATHS_EVERY))
        if gone := sorted(dead.intersection(others)):
            raise ServerLost(f"server rank {self.layout.rank}: server rank(s) {', '.join(map(str, gone))} died (the "
                             "MPI library reports the process gone): its shard of the weights is gone with it", gone)
        dead &= self.active
        for worker in dead:                       # owed nothing: dropping one must not answer another
            self.waiting.pop(worker, None)
        for worker in sorted(self.active):
            if worker in dead:
                self._drop(worker, "died (the MPI library reports its process gone)")
            elif worker not in self.waiting and timeout and now - self.last_heard[worker] > timeout:
                self._drop(worker, f"sent nothing for {timeout:g} s")

    def _drop(self, worker: int, what: str) -> None:
        """Go on without ``worker`` where the rule can (the log says so), else raise :class:`WorkerLost`."""
        message = f"[server rank {self.layout.rank}] worker rank {worker} {what}"
        if not self.rule.tolerates_lost_workers:
            raise WorkerLost(f"{message}; {self.rule.name} training cannot go on without it "
                             "(softsync, async, dcasgd and downpour drop lost workers)")
        others = len(self.active) - 1
        print(f"{message}: dropped; " + (f"training goes on with {others} worker(s)" if others
                                         else "every other worker has finished"), file=sys.stderr, flush=True)
        index = self.workers.index(worker)
        if self.requests[index] != MPI.REQUEST_NULL:       # its next header's receive, if posted
            try:
                self.requests[index].Cancel()
                self.requests[index].Wait()
            except MPI.Exception as error:                # a dead worker's (ULFM): nothing will come
                if not failure.is_process_failure(error):
                    raise
                self.requests[index] = MPI.REQUEST_NULL
        self.active.discard(worker)
        self.waiting.pop(worker, None)
        self.stats.lost.append(worker)
        for target in self.rule.on_leave(worker):
            if target in self.waiting:
                self._answer(target)
