"""Requests given up on while in flight, kept with their buffers for the life of the process.

A wait that gives up (a timeout, a lost peer, ranks that disagreed on a call) cannot take back the receives it
posted: a late peer's message still lands in their buffers, and a late receive still reads a posted send's.
mpi4py frees a request that Python drops, and with it its hold on the buffer, whose memory goes to new arrays or
back to the system: a survivor that went on after a :class:`~mpicoll.CollectiveTimeout` had its new arrays
overwritten, or died of a segmentation fault when the message came (tests/channel/test_lost_peers.py).  Whatever
gives up on a request hands it here instead (:class:`mpicoll.channel.context.Context` does for every message of
its channel).
"""

from __future__ import annotations

__all__ = ["abandon_requests"]

_ABANDONED: list = []


def abandon_requests(requests) -> None:
    """Keep ``requests`` that are still in flight (completed ones are null and dropped), and their buffers."""
    _ABANDONED.extend(request for request in requests if request)
