"""The messages between workers and servers, point to point.

A worker's request is a small header ``[kind, version]`` (version: how many
updates its weights of that shard had seen), followed, for the kinds that carry
one, by the gradient slice for that server.  A server's answer is a header
``[version]`` followed by the shard's weights.  With windows (one-sided) the
data moves by RMA and only the headers travel here; every request but DONE is
answered, and every worker gets a last, negative answer once the server is done
(:func:`final_note`), which says how many workers it lost.  Messages between two ranks on
one tag arrive in order, so a header and its payload always pair up.  A server that
fails tells every worker why, and a worker hears it whenever one of its waits lasts
(:mod:`mpicoll.channel.notices`, on ``Tag.PS_FAILED``) and stops with
:class:`mpicoll.ServerFailed` instead of waiting out its timeout.
"""

from __future__ import annotations

import enum


__all__ = ["Kind", "final_note", "lost_in"]


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
