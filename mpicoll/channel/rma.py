"""Passive-target access to an MPI window (``MPI_Win_lock`` ... ``MPI_Win_unlock``) that cannot hang without end.

MPI offers no way to interrupt such an access.  Under Open MPI's fault tolerance one aimed at a rank cut off
never returns (its one-sided modules are "not tested for post-failure operation", as it warns; a parameter
server stuck in ``MPI_Win_unlock``, seen across emulated nodes), and a lock on a rank's own window waits for
every lock other ranks hold on it, one held by a rank cut off in the middle of its access included.  So every
access is timed by the watchdog (``watch``, from :func:`mpicoll.channel.watchdog.watch_of`): past the
context's timeout the job ends naming the ranks that did not answer, instead of hanging.  A watch costs two
time stamps an access.
"""

from __future__ import annotations

from contextlib import contextmanager

from mpi4py import MPI

from .watchdog import watch_of, watching

__all__ = ["access_watch", "locked", "see_own"]


def access_watch(owner, what: str, remedy: str = "") -> watching:
    """The watch for ``owner``'s window accesses of one kind (``what``; made once per owner).  Past the timeout
    the job ends with a message that names the ranks that never answered and what keeps a rank from answering
    a one-sided access (not a collective's causes), then ``remedy``."""
    causes = "dead, hung, or cut off: an access to a rank cut off never returns"
    return watch_of(owner, what, causes=f"{causes}; {remedy}" if remedy else causes)


@contextmanager
def locked(win: MPI.Win, rank: int, watch: watching, exclusive: bool = False):
    """Hold a lock on ``rank``'s part of ``win`` (shared, or exclusive) for the block's accesses; the block's
    puts, gets and accumulates are complete at ``rank`` when it ends.  Released whatever the block raises, so
    that no other rank is locked out."""
    with watch:
        win.Lock(rank, MPI.LOCK_EXCLUSIVE if exclusive else MPI.LOCK_SHARED)
        try:
            yield
        finally:
            win.Unlock(rank)


def see_own(win: MPI.Win, rank: int, watch: watching) -> None:
    """Make what other ranks wrote into this rank's (``rank``'s) part of ``win`` visible to its own reads."""
    with locked(win, rank, watch):
        win.Sync()
