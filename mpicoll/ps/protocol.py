"""The messages between workers and servers, point to point.

A worker's request is a small header ``[kind, version]`` (version: how many
updates its weights of that shard had seen), followed, for the kinds that carry
one, by the gradient slice for that server.  A server's answer is a header
``[version]`` followed by the shard's weights.  With windows (one-sided) the
data moves by RMA and only the headers travel here; every request but DONE is
answered, and every worker gets a last, negative answer once the server is done
(:func:`final_note`), which says how many workers it lost.  Messages between two ranks on
one tag arrive in order, so a header and its payload always pair up.  A server that
fails tells every worker why (:func:`tell_workers`); a worker hears it whenever one of
its waits lasts (:func:`listen_for_failures`) and stops with
:class:`~mpicoll.errors.ServerFailed` instead of waiting out its timeout.
"""

from __future__ import annotations

import enum

import numpy as np
from mpi4py import MPI

from ..errors import ServerFailed
from ..tags import Tag

__all__ = ["Kind", "final_note", "lost_in", "tell_workers", "listen_for_failures"]


class Kind(enum.IntEnum):
    EXCHANGE = 1    # a gradient; send me the weights after it
    PUSH = 2        # a gradient; no answer wanted
    PULL = 3        # no gradient; send me the current weights
    DONE = 4        # this worker has finished

    @property
    def carries_gradient(self) -> bool:
        return self in (Kind.EXCHANGE, Kind.PUSH)

    @property
    def wants_weights(self) -> bool:
        return self in (Kind.EXCHANGE, Kind.PULL)


def final_note(lost: int) -> int:
    """The server's last answer: negative, so it cannot pass for a version; it counts the lost workers."""
    return -1 - lost


def lost_in(answer: int) -> int | None:
    """The lost-worker count of a final note; None for an ordinary answer (a version)."""
    return -1 - answer if answer < 0 else None


_REASON_BYTES = 1000


def tell_workers(ctx, workers, error: BaseException, tag: int = Tag.PS_FAILED) -> None:
    """A failing server's last word to every worker: why it stops (sent, never waited for).  Other
    jobs with parts that depend on each other (:mod:`mpicoll.sandblaster`) say it on their own ``tag``."""
    text = f"{type(error).__name__}: {error}".encode()[:_REASON_BYTES]
    note = np.frombuffer(text, np.uint8).copy()
    for worker in ctx.living(workers):
        ctx.isend(note, worker, tag)


def listen_for_failures(ctx, servers, tag: int = Tag.PS_FAILED, error=ServerFailed) -> None:
    """Make every lasting wait of this worker's context check for a server's last word, and raise it
    (``error(this rank, the server, the reason)``)."""
    status, servers = MPI.Status(), set(servers)

    def alarm() -> None:
        if ctx.comm.Iprobe(MPI.ANY_SOURCE, tag, status) and status.Get_source() in servers:
            reason = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            ctx.comm.Recv([reason, MPI.BYTE], status.Get_source(), tag)
            raise ctx.broken_by(error(ctx.rank, status.Get_source(), bytes(reason).decode(errors="replace")))

    ctx.alarms.append(alarm)
