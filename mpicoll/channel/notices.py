"""Failure notices: a rank that stops tells the ranks that depend on it why, and they stop at once.

A parameter server that fails tells its workers; a Sandblaster part that fails tells every other part.
The notice is a short message on a tag of the caller's (sent, never waited for); the ranks that may
receive one make every lasting wait of their context look for it and raise it, instead of waiting
out their timeout for a rank that will never answer.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

__all__ = ["tell", "listen"]

_REASON_BYTES = 1000


def tell(ctx, ranks, error: BaseException, tag: int) -> None:
    """A failing rank's last word to ``ranks`` (those still living): why it stops."""
    text = f"{type(error).__name__}: {error}".encode()[:_REASON_BYTES]
    note = np.frombuffer(text, np.uint8).copy()
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
            reason = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            ctx.comm.Recv([reason, MPI.BYTE], status.Get_source(), tag)
            raise ctx.broken_by(error(ctx.rank, status.Get_source(), bytes(reason).decode(errors="replace")))

    ctx.alarms.append(alarm)
