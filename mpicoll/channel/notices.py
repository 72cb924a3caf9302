"""Failure notices: a rank that stops tells the ranks that depend on it why, and they stop at once.

A parameter server that fails tells its workers; a Sandblaster part that fails tells every other part.
The notice is a short message on a tag of the caller's (sent, never waited for): the sender's words, the
name of its error's class and the ranks that error said were lost, as data (a rank told of a lost server
names the checkpoint without reading the words).  The ranks that may receive one make every lasting wait
of their context look for it and raise it, instead of waiting out their timeout for a rank that will
never answer.
"""

from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI

from ..base.errors import ServerLost, Told

__all__ = ["tell", "listen", "what_failed"]

_REASON_BYTES = 1000


def tell(ctx, ranks, error: BaseException, tag: int) -> None:
    """A failing rank's last word to ``ranks`` (those still living): why it stops."""
    kind, lost = what_failed(error)
    reason = f"{type(error).__name__}: {error}"[:_REASON_BYTES]
    note = np.frombuffer(json.dumps({"kind": kind, "lost": lost, "reason": reason}).encode(), np.uint8).copy()
    for rank in ctx.living(ranks):
        ctx.isend(note, rank, tag)


def listen(ctx, senders, tag: int, error: type) -> None:
    """Make every lasting wait of ``ctx`` check for a notice from one of ``senders`` on ``tag``, and raise it
    as ``error(this rank, the sender, the reason)``."""
    status, senders = MPI.Status(), set(senders)

    def alarm() -> None:
        try:
            noticed = ctx.comm.Iprobe(MPI.ANY_SOURCE, tag, status)
        except MPI.Exception as death:     # ULFM: a probe of any source fails until a death is acknowledged
            if ctx.raise_if_ranks_lost(death):     # acknowledged (on_death "acknowledge"): look again at the
                return                             # next alarm
            raise
        if noticed and status.Get_source() in senders:
            note = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            ctx.comm.Recv([note, MPI.BYTE], status.Get_source(), tag)
            told = json.loads(bytes(note).decode(errors="replace"))
            raise ctx.broken_by(error(ctx.rank, status.Get_source(), told["reason"], told["kind"], told["lost"]))

    ctx.alarms.append(alarm)


def what_failed(error: BaseException) -> tuple[str, list[int]]:
    """(the name of the error's class, the ranks it says are lost) as a notice carries them; a failure told by
    another rank passes on what that rank said (a server stopped by a worker that lost another server tells
    the other workers of the lost server, not of the worker)."""
    if isinstance(error, Told):
        return error.kind, error.lost
    lost = getattr(error, "servers", None) if isinstance(error, ServerLost) else getattr(error, "peers", [])
    return type(error).__name__, [int(rank) for rank in lost]
