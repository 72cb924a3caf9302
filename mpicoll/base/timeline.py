"""``MPICOLL_TIMELINE=trace.json``: a Chrome trace of what every rank's threads did, and when.

Open the file in https://ui.perfetto.dev or chrome://tracing: one process
per rank, one track per thread (the caller's, the nonblocking worker's, ...),
with mpicoll's collectives (name, size, algorithm), nonblocking calls being
started and waited for, DistributedOptimizer's buckets, and training phases.
A wait on the caller's track is communication that was not overlapped with
computation.  Programs add their own phases with :func:`span`:

    with mpicoll.base.timeline.span("forward"):
        loss = model(X)

Events are kept in memory (at most ``MAX_EVENTS`` per rank) and written at
exit: every rank sends its events to rank 0, which writes the one file (ranks
whose events do not arrive within 30 s are missing from it, and write their
own ``trace.json.rank-N`` instead).  A job that ends with ``MPI_Abort``
(a lost peer) writes ``trace.json.rank-N`` on every rank that ends it.
Timestamps are the wall clock, so ranks on one host line up exactly and
ranks on several hosts as well as their clocks agree.  Recording costs about
a microsecond per event; with the variable unset, nothing is recorded.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import socket
import threading
import time
from contextlib import nullcontext

from mpi4py import MPI

from .abandoned import abandon_requests
from .tags import Tag

__all__ = ["enabled", "span", "instant", "write_own", "MAX_EVENTS"]

MAX_EVENTS = 1_000_000
_GATHER_S = 30.0
_NOTHING = nullcontext()


class _Timeline:
    """One rank's events, and writing them out."""

    def __init__(self, path: str):
        self.path = path
        self.events: list[dict] = []
        self.threads: dict[int, str] = {}
        self.full = False

    def add(self, event: dict) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.full = True
            return
        thread = threading.current_thread()
        event["tid"] = thread.ident
        self.threads.setdefault(thread.ident, thread.name)
        self.events.append(event)

    def rank_events(self, rank: int) -> list[dict]:
        """This rank's events, with its process and thread names, as trace events of process ``rank``."""
        names = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                  "args": {"name": f"rank {rank} ({socket.gethostname()})"}},
                 {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
        names += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
                  for tid, name in self.threads.items()]
        if self.full:
            names.append({"ph": "i", "s": "p", "name": f"timeline full: only the first {MAX_EVENTS} events kept",
                          "pid": rank, "tid": 0, "ts": self.events[-1]["ts"]})
        return names + [{**event, "pid": rank} for event in self.events]

    def write(self, path: str, events: list[dict]) -> None:
        temporary = f"{path}.tmp-{os.getpid()}"
        with open(temporary, "w") as handle:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)
        os.replace(temporary, path)

    def write_all(self) -> None:
        """At exit: rank 0 gathers every rank's events and writes the trace (see the module's text)."""
        if not MPI.Is_initialized() or MPI.Is_finalized():
            self.write(self.path, self.rank_events(0))
            return
        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        if size == 1:
            self.write(self.path, self.rank_events(0))
            return
        deadline = time.monotonic() + _GATHER_S
        if rank != 0:
            payload = pickle.dumps(self.rank_events(rank), protocol=pickle.HIGHEST_PROTOCOL)
            header = world.isend(len(payload), 0, Tag.TIMELINE)
            body = world.Isend([payload, MPI.BYTE], 0, Tag.TIMELINE)
            if _poll(lambda: True if header.Test() and body.Test() else None, deadline) is None:
                abandon_requests([header, body])
                self.write_own(rank)          # rank 0 is not listening: keep this rank's events anyway
            return
        events, missing = self.rank_events(0), []
        for peer in range(1, size):
            length = world.irecv(source=peer, tag=Tag.TIMELINE)
            nbytes = _poll(lambda: (lambda done, value: value if done else None)(*length.test()), deadline)
            if nbytes is None:
                abandon_requests([length])
                missing.append(peer)
                continue
            buffer = bytearray(nbytes)
            body = world.Irecv([buffer, MPI.BYTE], peer, Tag.TIMELINE)
            if _poll(lambda: True if body.Test() else None, deadline) is None:
                abandon_requests([body])       # its events may still come, into this buffer
                missing.append(peer)
                continue
            events += pickle.loads(buffer)
        if missing:
            events.append({"ph": "i", "s": "g", "name": f"no events from rank(s) {missing}", "pid": 0, "tid": 0,
                           "ts": _now()})
        self.write(self.path, events)

    def write_own(self, rank: int) -> None:
        self.write(f"{self.path}.rank-{rank}", self.rank_events(rank))


def _now() -> float:
    return time.time_ns() / 1000.0


def _poll(check, deadline: float):
    """``check()``'s first value other than None, or None once the monotonic clock passes ``deadline``."""
    while (value := check()) is None and time.monotonic() < deadline:
        time.sleep(1e-3)
    return value


class _Span:
    __slots__ = ("name", "category", "args", "start")

    def __init__(self, name: str, category: str, args: dict):
        self.name, self.category, self.args = name, category, args

    def __enter__(self):
        self.start = _now()
        return self

    def __exit__(self, *exc) -> None:
        end = _now()
        event = {"ph": "X", "name": self.name, "cat": self.category, "ts": self.start, "dur": end - self.start}
        if self.args:
            event["args"] = self.args
        _timeline.add(event)


_path = os.environ.get("MPICOLL_TIMELINE", "").strip()
_timeline = _Timeline(os.path.abspath(_path)) if _path else None
enabled = _timeline is not None
if enabled:
    atexit.register(_timeline.write_all)        # after mpi4py's own exit hook: runs before MPI_Finalize


def span(name: str, category: str = "user", **args):
    """A context manager that records its block as one event (nothing when the timeline is off)."""
    return _Span(name, category, args) if enabled else _NOTHING


def instant(name: str, category: str = "user", **args) -> None:
    """Record one moment (a marker on this thread's track)."""
    if enabled:
        _timeline.add({"ph": "i", "s": "t", "name": name, "cat": category, "ts": _now(), **({"args": args} if args else {})})


def write_own() -> None:
    """Write this rank's events to ``PATH.rank-N`` now (before a job is ended with ``MPI_Abort``)."""
    if enabled:
        _timeline.write_own(MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else 0)
