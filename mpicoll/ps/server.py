"""The server loop: one shard, any rule, never blocked by one slow worker.

Every worker always has a request receive posted; the loop takes whichever
arrives first, feeds gradients to the rule, and answers with nonblocking sends
from per-worker snapshots of the weights, so a worker that is slow to collect
its answer holds up nobody.  With the one-sided transport the gradients are
already in the server's window when the request arrives, and answers are
``Put`` into the window of the worker, which waits for them inside MPI.
Between requests the server waits inside MPI too, so workers' puts and reads
progress (MPICH's passive target progresses only while its target is in MPI).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import checkpoint
from ..context import Context
from ..tags import Tag
from .layout import Layout
from .protocol import Kind, final_note
from .rules import Rule
from .windows import Windows

__all__ = ["ServerStats", "WorkerLost", "serve"]


@dataclass
class ServerStats:
    """What one server did, for logs and benchmarks."""

    updates: int = 0                       # updates applied to the weights (rounds, for sync and softsync)
    dropped: int = 0                       # stale gradients discarded
    gradients: dict = field(default_factory=dict)     # per worker
    staleness: dict = field(default_factory=dict)     # updates between a worker's weights and its gradient -> count
    lost: list = field(default_factory=list)          # workers dropped after going silent
    nonfinite: int = 0                     # gradients with NaN or Inf, skipped
    bytes_in: int = 0
    bytes_out: int = 0
    idle_s: float = 0.0
    update_s: float = 0.0                  # time inside the rule's updates
    wall_s: float = 0.0


class WorkerLost(RuntimeError):
    """Synchronous training lost a worker: it cannot go on, and says which."""


def _finite(gradient: np.ndarray) -> bool:
    """No NaN or Inf, checked with one read-only pass (a sum) and no temporary array."""
    return bool(np.isfinite(gradient.sum())) or bool(np.isfinite(gradient).all())


def checkpoint_path(prefix: str, server: int) -> Path:
    return Path(f"{prefix}.server{server}.npz")


def save_checkpoint(prefix: str, server: int, rule: Rule) -> Path:
    """Write the rule's state atomically (a crash mid-write leaves the previous checkpoint)."""
    return checkpoint.save(checkpoint_path(prefix, server), rule=np.array(rule.name), **rule.state())


def load_checkpoint(prefix: str, server: int, rule: Rule) -> int:
    """Load this server's checkpoint into ``rule`` (after setup); returns the update count it holds."""
    path = checkpoint_path(prefix, server)
    state = checkpoint.load(path, f"server rank {server}")
    if str(state["rule"]) != rule.name:
        raise ValueError(f"{path} was written by a {state['rule']} run, this one uses {rule.name}")
    rule.load_state(state)
    return rule.version


def serve(ctx: Context, layout: Layout, rule: Rule, weights: np.ndarray,
          worker_timeout: float | None = None, checkpoint: str | None = None, every: int = 100,
          resume: bool = False, warm_start: int = 0, windows: Windows | None = None) -> ServerStats:
    """Serve ``weights`` (this server's shard, updated in place) until every worker is done.

    A worker that sends nothing for ``worker_timeout`` seconds (default: the
    communicator's MPICOLL_TIMEOUT) is dropped, and the log says so, when the
    rule can go on without it; under ``sync`` a :class:`WorkerLost` names it.
    With ``checkpoint`` (a path prefix) the state is saved every ``every``
    updates and at the end; ``resume`` continues from the saved state.
    ``warm_start=k``: only the first worker is answered until k updates are in
    (Downpour's warm start); the others' first pulls wait for that.
    ``windows``: the one-sided transport (:mod:`mpicoll.ps.windows`); the rule
    then works on the window's live weights, copied back at the end.
    """
    if warm_start and rule.waits_for_rounds:
        raise ValueError(f"a warm start lets one worker train alone; {rule.name} rounds need every worker: "
                         "use async, dcasgd or downpour")
    worker_timeout = ctx.timeout if worker_timeout is None else worker_timeout
    workers = list(layout.workers)
    live = weights
    if windows is not None:
        live = windows.weights
        live[...] = weights
    rule.setup(live, tuple(workers))
    if resume:
        load_checkpoint(checkpoint, layout.rank, rule)
    if windows is not None:
        windows.version[0] = rule.version
    saved_at = rule.version
    stats = ServerStats()
    headers = {w: np.zeros(2, np.int64) for w in workers}
    gradient = np.empty_like(weights) if windows is None else None
    snapshots = {w: np.empty_like(weights) for w in workers} if windows is None else {}
    answers: dict[int, list] = {w: [] for w in workers}
    waiting: dict[int, Kind] = {}       # workers owed weights, and what they asked with
    deferred: set[int] = set()          # first pulls held back by the warm start
    requests = [ctx.irecv(headers[w], w, Tag.PS_REQUEST) for w in workers]
    start = time.perf_counter()

    def note(worker: int, value: int) -> None:
        """The small answer header; with windows, all there is to send after a Put."""
        ctx.waitall(answers[worker], worker)                 # its previous answer has left
        answers[worker] = [ctx.isend(np.array([value], np.int64), worker, Tag.PS_ANSWER)]

    def answer(worker: int) -> None:
        if waiting.pop(worker) is Kind.PULL:
            rule.on_pull(worker)
        if windows is None:
            note(worker, rule.version)
            snapshots[worker][...] = live
            answers[worker].append(ctx.isend(snapshots[worker], worker, Tag.PS_WEIGHTS))
        else:
            windows.put_weights(worker)                      # complete when this returns
            note(worker, rule.version)
        stats.bytes_out += live.nbytes

    def update(worker: int, version: int, gradient: np.ndarray) -> list[int]:
        before = time.perf_counter()
        if windows is None:
            ready = rule.on_gradient(worker, version, gradient)
        else:
            with windows.updating():
                ready = rule.on_gradient(worker, version, gradient)
                windows.version[0] = rule.version
        stats.update_s += time.perf_counter() - before
        return ready

    active = set(workers)
    last_heard = {w: start for w in workers}

    def drop_silent_workers() -> None:
        now = time.perf_counter()
        for worker in sorted(active - set(waiting)):          # a worker waiting for us is not silent
            if worker_timeout and now - last_heard[worker] > worker_timeout:
                message = (f"[server rank {layout.rank}] worker rank {worker} sent nothing for "
                           f"{worker_timeout:g} s")
                if not rule.tolerates_lost_workers:
                    raise WorkerLost(f"{message}; {rule.name} training cannot go on without it "
                                     "(softsync, async, dcasgd and downpour drop lost workers)")
                print(f"{message}: dropped; training goes on with {len(active) - 1} worker(s)",
                      file=sys.stderr, flush=True)
                index = workers.index(worker)
                requests[index].Cancel()
                requests[index].Wait()
                active.discard(worker)
                stats.lost.append(worker)
                for target in rule.on_leave(worker):
                    if target in waiting:
                        answer(target)

    while active:
        before = time.perf_counter()
        index = ctx.waitany(requests, workers, patience=min(1.0, worker_timeout or 1.0))
        stats.idle_s += time.perf_counter() - before
        if index is None:
            drop_silent_workers()
            continue
        worker = workers[index]
        last_heard[worker] = time.perf_counter()
        kind, version = Kind(int(headers[worker][0])), int(headers[worker][1])
        ready: list[int] = []
        if kind.carries_gradient:
            if windows is None:
                ctx.wait(ctx.irecv(gradient, worker, Tag.PS_GRADIENT), worker)
            else:
                gradient = windows.inbox(worker)
            stats.bytes_in += gradient.nbytes
            stats.gradients[worker] = stats.gradients.get(worker, 0) + 1
            lag = rule.version - version
            stats.staleness[lag] = stats.staleness.get(lag, 0) + 1
            if kind.wants_weights:
                waiting[worker] = kind
            if _finite(gradient):
                ready = update(worker, version, gradient)
            else:                                              # never let NaN or Inf into the model
                stats.nonfinite += 1
                print(f"[server rank {layout.rank}] worker rank {worker} sent a gradient with NaN or Inf "
                      f"(update {rule.version}): skipped", file=sys.stderr, flush=True)
                ready = [worker]
            if windows is not None and not kind.wants_weights:
                note(worker, rule.version)                     # its inbox slot is free again
        elif kind is Kind.PULL:
            waiting[worker] = kind
            if rule.version < warm_start and worker != workers[0]:
                deferred.add(worker)
            else:
                ready = [worker]
        else:                                                  # DONE
            active.discard(worker)
            ready = rule.on_leave(worker)
        if deferred and rule.version >= warm_start:         # the warm start is over
            ready, deferred = [*ready, *sorted(deferred)], set()
        for target in ready:
            if target in waiting:
                answer(target)
        if kind is not Kind.DONE:
            requests[index] = ctx.irecv(headers[worker], worker, Tag.PS_REQUEST)
        if checkpoint and rule.version - saved_at >= every:
            save_checkpoint(checkpoint, layout.rank, rule)
            saved_at = rule.version
        drop_silent_workers()
    finished = [worker for worker in workers if worker not in stats.lost]
    if windows is not None:            # the last word, to every worker: how the run ended (lost ones may read it)
        for worker in workers:
            if worker in finished:
                note(worker, final_note(len(stats.lost)))
            else:
                ctx.isend(np.array([final_note(len(stats.lost))], np.int64), worker, Tag.PS_ANSWER)
    for worker in finished:
        ctx.waitall(answers[worker], worker)
    if checkpoint:
        save_checkpoint(checkpoint, layout.rank, rule)
    if live is not weights:
        weights[...] = live
    stats.updates, stats.dropped = rule.version, rule.dropped
    stats.wall_s = time.perf_counter() - start
    return stats
