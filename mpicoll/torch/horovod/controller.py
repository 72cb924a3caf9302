"""The negotiation that gives Horovod's semantics: ops matched by name, in any order, checked across ranks.

A Horovod program may start the same op at different moments on different
ranks, in different orders, and wait for some and not others: rank 0 may
leave an ``allreduce_async(x, name="a")`` pending through an ``hvd.barrier()``
that the others reach before they ask for ``"a"``.  MPI's rule (every rank
makes the same calls in the same order) cannot serve that, so, as Horovod
does, a background thread on every rank negotiates.  Every cycle the ranks
allgather, over a private duplicate of the world, what each was asked since
the last cycle: new requests (name, process set, kind and what the call
passed), a join, a shutdown.  Every rank so holds the same table of who asked
for what.  A request is *ready* when every member of its process set has
asked for it (a rank that has joined counts for allreduces of the global set,
with zeros).  Ready requests run in the same order on every rank (the cycle
that made them ready, then process set, then name), on this thread: first
checked (what every rank passed must agree, or the request fails on every
rank with :class:`~mpicoll.HorovodInternalError` naming the ranks and values,
and nothing moves), then the data moves over the process set's communicator
(:mod:`.ops` says how each kind does).

A cycle waits for the last rank to reach it; between cycles the thread sleeps
``HOROVOD_CYCLE_TIME`` milliseconds (default 1), doubling while nothing comes
up to 5 ms, unless a request comes.  The
allgathers run over a channel :class:`~mpicoll.channel.context.Context` set for a
background thread: nonblocking, polled with naps (a waiting thread does not spin
on a core the training needs), and past ``MPICOLL_TIMEOUT`` a roll call names
the rank that never came to the cycle (a dead or hung process).
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import threading
import time

import numpy as np
from mpi4py import MPI

from ...base import config
from ...base.errors import HorovodInternalError
from ...channel.context import Context

__all__ = ["Request", "Controller"]

IDLE_MAX_S = 0.005        # the longest sleep between cycles once nothing has come for a while


class Request:
    """One op asked of this rank: ``meta`` is what must agree across ranks (kind-specific), ``run(table)``
    moves the data once it is ready and returns the result; ``handle`` is what the caller holds."""

    _handles = itertools.count(1)

    def __init__(self, kind: str, name: str, process_set, meta: dict, run):
        self.kind, self.name, self.process_set, self.meta, self.run = kind, name, process_set, meta, run
        self.handle = next(Request._handles)
        self.result = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    @property
    def key(self) -> tuple:
        return self.process_set.process_set_id, self.name

    def finish(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.run = None                        # let go of the tensors
        self.done.set()


class Controller:
    """The background negotiation of one Horovod job (see the module's docstring)."""

    def __init__(self, world: MPI.Intracomm, process_sets, joined_part):
        self.world = world
        self.joined_part = joined_part            # (kind, meta, process set, asked, joined): a joined rank's part
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.control = Context(world, "Horovod negotiation")     # a private duplicate of the world
        self.control.run_in_background()
        self.process_sets = process_sets          # id -> ProcessSet, kept by the caller, read here
        self.cycle_s = float(os.environ.get("HOROVOD_CYCLE_TIME", "1")) / 1000
        self._idle_s = self.cycle_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._new: list[Request] = []
        self._mine: dict[tuple, Request] = {}     # requests of this rank not yet ready
        self._asked: dict[tuple, dict[int, tuple]] = {}   # key -> rank -> (kind, meta), every rank's
        self._order: dict[tuple, int] = {}        # key -> the cycle it became known (for a stable order)
        self._first_seen: dict[tuple, float] = {}  # key -> when it became known (rank 0 judges stalls)
        self._joined: dict[int, int] = {}         # rank -> the cycle it joined
        self._join_request: Request | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self.failure: BaseException | None = None
        self.cycles = 0
        self._thread = threading.Thread(target=self._serve, name="mpicoll-horovod", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    # -- asked by the caller's threads ------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        """Queue ``request``; a name already in flight on this rank (in that process set) is a ValueError."""
        with self._lock:
            if self._stopping or self.failure is not None:
                raise HorovodInternalError(f"{request.kind} {request.name!r}: Horovod has been shut down"
                                           + (f" after an error: {self.failure}" if self.failure else ""))
            if request.key in self._mine:
                raise ValueError(f"{request.kind}: an op named {request.name!r} is already in flight on rank "
                                 f"{self.rank}: wait for it (hvd.synchronize) or use another name")
            self._mine[request.key] = request
            self._new.append(request)
        self._wake.set()
        return request.handle

    def join(self, request: Request) -> None:
        with self._lock:
            self._join_request = request
        self._wake.set()

    def stop(self) -> None:
        """Leave the negotiation once every rank has asked to (collective, as ``hvd.shutdown``)."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopping = True
        self._wake.set()
        limit = config.timeout()
        self._stopped.wait(limit + 10 if limit else None)

    # -- the cycles ---------------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._cycle():
                pass
        except BaseException as error:             # a lost peer, a dead control channel: fail what waits
            self.failure = error
            with self._lock:
                waiting = list(self._mine.values()) + ([self._join_request] if self._join_request else [])
                self._mine.clear()
            for request in waiting:
                request.finish(error=HorovodInternalError(f"{request.kind} {request.name!r}: {error}"))
        finally:
            self._stopped.set()
            self.control.free(abandon=self.failure is not None)

    def _cycle(self) -> bool:
        """One negotiation round; True once every rank has asked to stop."""
        if not self._new and not self._stopping:
            self._wake.wait(self._idle_s)           # up to IDLE_MAX_S between cycles while nothing comes
            self._idle_s = min(self._idle_s * 2, IDLE_MAX_S)
        if self._new or self._stopping:
            self._idle_s = self.cycle_s
        self._wake.clear()
        with self._lock:
            new, self._new = self._new, []
            joining = self._join_request is not None and self.rank not in self._joined
            stopping = self._stopping
        mine = [(r.key, r.kind, r.meta) for r in new]
        stalled = self._stalled() if self.rank == 0 else []
        everyone = self._allgather((mine, joining, stopping, stalled))
        self.cycles += 1
        for rank, (asked, joins, _, _) in enumerate(everyone):
            for key, kind, meta in asked:
                self._asked.setdefault(key, {})[rank] = (kind, meta)
                self._order.setdefault(key, self.cycles)
                self._first_seen.setdefault(key, time.monotonic())
            if joins and rank not in self._joined:
                self._joined[rank] = self.cycles
        for key in self._ready():
            self._run(key)
        for key in everyone[0][3]:                 # rank 0's judgement, so every rank drops the same ones
            self._give_up(key)
        if len(self._joined) == self.size:
            self._finish_join()
        return all(stop for _, _, stop, _ in everyone)

    def _stalled(self) -> list[tuple]:
        """(Rank 0) the ops some ranks have asked for and others not, for longer than ``MPICOLL_TIMEOUT``."""
        limit = config.timeout()
        now = time.monotonic()
        return [key for key in self._asked if limit and now - self._first_seen.get(key, now) > limit]

    def _give_up(self, key: tuple) -> None:
        """Fail a stalled op on the ranks that asked for it, naming who did not and what they wait for."""
        asked = self._asked.pop(key, None)
        self._order.pop(key, None)
        self._first_seen.pop(key, None)
        if asked is None:
            return
        with self._lock:
            request = self._mine.pop(key, None)
        if request is None:
            return
        process_set = self.process_sets.get(key[0])
        members = process_set.ranks if process_set is not None else range(self.size)
        missing = [rank for rank in members if rank not in asked]
        waiting = {rank: sorted(name for (set_id, name), who in self._asked.items() if rank in who)[:5]
                   for rank in missing}
        request.finish(error=HorovodInternalError(
            f"{request.kind} {key[1]!r}: asked for by rank(s) {', '.join(map(str, sorted(asked)))} but not by "
            f"rank(s) {', '.join(map(str, missing))} within MPICOLL_TIMEOUT ({config.timeout():g} s): the ranks "
            "made different calls (an op on some ranks only, or unnamed ops in another order). Pending there: "
            + _by_rank(waiting)))

    def _allgather(self, value) -> list:
        """Every rank's ``value`` (pickled), through two nonblocking allgathers waited for by the control
        context (within ``MPICOLL_TIMEOUT``; past it, the rank that never came is named)."""
        control, others = self.control, self.control.others()
        data = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        lengths = np.zeros(self.size, np.int64)
        control.waitall([control.comm.Iallgather(np.array([data.size], np.int64), lengths)], others)
        everything = np.empty(int(lengths.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        control.waitall([control.comm.Iallgatherv(data, [everything, (lengths, offsets)])], others)
        return [pickle.loads(everything[o: o + n].tobytes()) for o, n in zip(offsets, lengths)]

    def _ready(self) -> list[tuple]:
        """The keys every member has asked for (or, for the global set's allreduces, joined), in the order every
        rank agrees on."""
        ready = []
        for key, asked in self._asked.items():
            process_set = self.process_sets.get(key[0])
            members = range(self.size) if process_set is None else process_set.ranks
            global_set = key[0] == 0
            if all(rank in asked or (global_set and rank in self._joined) for rank in members):
                ready.append(key)
        return sorted(ready, key=lambda key: (self._order[key], key))

    def _run(self, key: tuple) -> None:
        asked = self._asked.pop(key)
        self._order.pop(key)
        self._first_seen.pop(key, None)
        with self._lock:
            request = self._mine.pop(key, None)
        process_set = self.process_sets.get(key[0])
        kinds = {kind for kind, _ in asked.values()}
        name = key[1]
        if process_set is None:
            error = HorovodInternalError(f"{name!r}: process set {key[0]} was removed while the op was in flight")
        elif len(kinds) > 1:
            error = HorovodInternalError(f"{name!r}: ranks asked for different ops under one name: "
                                         + _by_rank({rank: kind for rank, (kind, _) in asked.items()}))
        else:
            error = None
        joined = [rank for rank in (process_set.ranks if process_set else []) if rank not in asked]
        if request is None:                         # joined here, or not a member: take part if a member
            if error is None and process_set is not None and process_set.included() and joined:
                kind, meta = next(iter(asked.values()))
                try:
                    self.joined_part(kind, meta, process_set, asked, joined)
                except HorovodInternalError:
                    pass                             # the asking ranks raise it
            return
        if error is None:
            try:
                request.finish(request.run({rank: meta for rank, (_, meta) in asked.items()}, joined))
            except BaseException as failure:        # ranks that disagree, a lost peer: the caller raises it
                request.finish(error=failure if isinstance(failure, HorovodInternalError) else
                               HorovodInternalError(f"{request.kind} {name!r}: {failure}"))
        else:
            request.finish(error=error)

    def _finish_join(self) -> None:
        """Every rank has joined: the joins complete with the rank that joined last (the highest of those that
        joined in the last cycle), the same on every rank."""
        last_cycle = max(self._joined.values())
        last = max(rank for rank, cycle in self._joined.items() if cycle == last_cycle)
        self._joined.clear()
        with self._lock:
            request, self._join_request = self._join_request, None
        if request is not None:
            request.finish(last)


def _by_rank(values: dict) -> str:
    """'rank 0: x; rank 1: y', ranks with the same value grouped."""
    groups: dict = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(repr(value), []).append(rank)
    return "; ".join(f"rank(s) {', '.join(map(str, ranks))}: {value}" for value, ranks in groups.items())
