"""Cross-rank validation: every rank learns what every other rank passed, and all fail together.

A collective called with different counts, datatypes, ops or roots on
different ranks is an error MPI does not report: it hangs or returns garbage.
:func:`check_call` gathers a small signature from every rank (one Allgather
of a few integers) and, if they differ, raises the same
:class:`mpicoll.MismatchError` on every rank, with what each rank
passed.  It also reports NaN or Inf in any rank's float contribution.  It
costs one small collective, so the communicator runs it on its first call and
on every call under ``MPICOLL_DEBUG=1``.  In between, large calls carry a
:class:`Fingerprint` in the tags of their own messages.
"""

from __future__ import annotations

import functools
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..base import checkpoint, failure
from ..base.collectives import COLLECTIVES
from ..base.errors import MismatchError, NonFiniteError, PeerFailed, SetupError
from ..base.abandoned import abandon_requests
from ..base.tags import Tag
from .watchdog import bounded

__all__ = ["Signature", "Fingerprint", "check_call", "agree", "load_checkpoint_set", "TAG_SPAN"]


class Signature:
    """What one rank passed to one collective, as integers that must agree across ranks."""

    def __init__(self, collective: str, count: int, dtype: np.dtype, op: str = "-", root: int = -1,
                 algorithm: str = "-"):
        self.collective, self.count, self.dtype, self.op, self.root = collective, count, np.dtype(dtype), op, root
        self.algorithm = algorithm          # the one that runs this call (set by the communicator)
        self.thread = "-"                   # the calling thread's name, on a communicator called from several

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def codes(self) -> list[int]:
        return [_code(self.collective), self.count, self.dtype.itemsize, _code(self.dtype.str),
                _code(self.op), self.root, _code(self.algorithm), _code(self.thread)]

    def __str__(self) -> str:
        text = f"{self.collective}(count={self.count}, dtype={self.dtype}"
        if self.op != "-":
            text += f", op={self.op}"
        if self.root >= 0:
            text += f", root={self.root}"
        if self.algorithm != "-":
            text += f", algorithm={self.algorithm}"
        if self.thread != "-":
            text += f", from thread {self.thread!r}"
        return text + ")"


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def all_finite(array) -> bool:
    """No NaN or Inf in ``array`` (numpy or CuPy): one read-only pass (a sum) and no temporary array, but for
    the rare finite array whose sum overflows, which a full check then clears."""
    return bool(np.isfinite(array.sum())) or bool(np.isfinite(array).all())


def check_call(context, signature: Signature, contribution: np.ndarray | None = None) -> None:
    """Raise on every rank if the ranks' signatures differ or a float contribution is not finite.

    ``context`` is the communicator's :class:`~mpicoll.channel.context.Context`: the
    exchange is nonblocking and waited on with its deadline, so a rank that
    never arrives is named instead of hanging the others.
    """
    comm = context.comm
    nonfinite = int(contribution is not None and contribution.dtype.kind in "fc" and not all_finite(contribution))
    mine = np.array(signature.codes() + [nonfinite], np.int64)
    everyone = np.zeros((comm.Get_size(), mine.size), np.int64)
    context.waitall([comm.Iallgather(mine, everyone)], context.others())
    if (everyone[:, :-1] != everyone[0, :-1]).any():
        described = comm.allgather(str(signature))
        # every rank met it here, before any data moved: a worker's later calls go on (MismatchError.settled)
        raise MismatchError(signature.collective, dict(enumerate(described)), settled=True)
    bad = np.flatnonzero(everyone[:, -1])
    if bad.size:
        raise NonFiniteError(signature.collective, bad.tolist())


# Tags below this are the algorithms' own (mpicoll.base.tags); a call's stamp is added to them as a multiple of it.
TAG_SPAN = 128

# Collectives whose every rank's result needs every rank's messages: a rank that completes one received,
# through a chain of messages carrying the call's stamp, from every rank, so all ranks made the same call.
# (By mpi4py's name, which a Signature carries: one set lookup per call.)
_EVERYONE_HEARS_EVERYONE = frozenset(c.method for c in COLLECTIVES.values() if c.hears_everyone)


class Fingerprint:
    """A cross-rank comparison of each call, carried in the tags of the call's own messages.

    Every message of a fingerprinted call is sent and received with its tag
    raised by a *stamp*: a hash of the call (collective, count, dtype, op,
    root, algorithm) and the parity of the call's number.  Messages of calls
    that differ never match, so ranks that disagree can never combine each
    other's data into a wrong answer; they stop instead, and no message or
    synchronisation is added to a call that agrees.

    For an allreduce, reduce-scatter or allgather no rank can finish a call
    the others disagree on (its result needs every rank's messages), so every
    rank of a disagreeing call is waiting.  A wait that lasts looks (every
    ``LOOK_EVERY`` seconds of the call: :meth:`raise_if_mismatched` is one of
    the context's alarms) for a
    message of this call's parity with another stamp: proof that its sender
    made a different call.  The rank that finds one sends what it passed to
    every other rank on a side channel; a rank that sees that there does the
    same, and each raises :class:`mpicoll.MismatchError` with what
    every rank passed.  A message of the other parity is a faster peer's next
    call (a peer can be at most one call ahead).  The stamps take the bits
    above the algorithms' tags: MPICH's tag bound leaves 2 million distinct
    hashes (MPI's guaranteed minimum, 126), the odds that two different calls
    share one.

    A broadcast's root finishes without hearing from anyone, so broadcasts
    also start a persistent 16-byte allreduce on the side channel (MAX of
    the hash and of its negation: the same everywhere exactly when max ==
    -min) and settle it as the call ends.  So does :meth:`compare_now`, for
    an algorithm about to hand the call to MPI's own blocking collective.
    Every rank must create this together.
    """

    LOOK_EVERY = 0.02          # seconds of waiting before a call's first look at the queues, and between looks

    def __init__(self, context):
        self.context = context
        self.side = MPI.Intracomm(MPI.Intracomm.Dup(context.comm))
        self.values = np.zeros(2, np.int64)
        self.request = self.side.Allreduce_init(MPI.IN_PLACE, self.values, MPI.MAX)
        # distinct hashes that fit the tags: stamp index 1 + parity + 2 * hash, times TAG_SPAN
        tag_ub = context.comm.Get_attr(MPI.TAG_UB) or 32767
        self.hashes = (tag_ub // TAG_SPAN - 2) // 2
        self.signature: Signature | None = None          # the call in flight
        self.stamp = 0
        self.calls = 0                                   # fingerprinted calls so far (for the parity)
        self.started = self.pending = False              # the side-channel comparison: this call, not yet in
        self.next_look = 0.0
        self._stamps: dict[tuple, int] = {}              # per call signature, before the parity
        context.alarms.append(self.raise_if_mismatched)

    def start(self, signature: Signature) -> None:
        """Stamp this call's messages; start the side-channel comparison for a broadcast.  Runs on every
        large call, so kept to one dictionary lookup: its Python time is most of what it costs."""
        key = (signature.collective, signature.count, signature.dtype, signature.op, signature.root,
               signature.algorithm)
        stamp = self._stamps.get(key)
        if stamp is None:
            code = _hash(signature)[0]
            stamp = self._stamps[key] = (1 + 2 * (int(code) % self.hashes)) * TAG_SPAN
        self.calls += 1
        self.stamp = stamp = stamp + (self.calls & 1) * TAG_SPAN
        self.signature, self.next_look = signature, 0.0
        self.context.stamp_messages(stamp)
        if key[0] not in _EVERYONE_HEARS_EVERYONE:
            self.started = self.pending = False
            self.compare_now(wait=False)

    def compare_now(self, wait: bool = True) -> None:
        """Start the side-channel comparison of the call in flight (once) and, with ``wait``, settle it."""
        if self.signature is not None and not self.started:
            self.values[:] = _hash(self.signature)
            self.started = self.pending = True
            self.request.Start()
        if wait and self.pending:
            if not self.request.Test():
                self.context.waitall([self.request], self.context.others())
            self._compared()

    def leave_to_the_algorithm(self) -> None:
        """The call in flight is compared by the algorithm that carries it (the on-node collectives compare every
        rank's call in shared memory at their first step, and all raise the same settled MismatchError): this
        call's lasting waits look no more here.  Else a rank that found the side channel's comparison failed
        would wait for MISMATCH messages from ranks that had met the algorithm's error and gone on (a 60 s
        timeout, seen at 4 ranks).  A comparison already started is still completed as the call ends."""
        self.signature = None

    def raise_if_mismatched(self) -> None:
        """While a wait lasts: raise the call's MismatchError (on every rank) if a rank found the calls differ."""
        if self.signature is None:
            return
        if self.pending and self.request.Test():
            self._compared()
        now = time.perf_counter()
        if not self.next_look:             # the call's first lasting wait: probing costs microseconds on
            self.next_look = now + self.LOOK_EVERY      # ranks that share cores, so not at once
        if now < self.next_look:
            return
        self.next_look = now + self.LOOK_EVERY
        if self.side.Iprobe(MPI.ANY_SOURCE, Tag.MISMATCH) or self._foreign_message():
            self._raise()

    def settle(self) -> None:
        """As the call ends: wait for its side-channel comparison, if one started (MismatchError if the
        calls differ), and stop stamping messages."""
        if self.pending:
            self.compare_now(wait=True)
        self.signature, self.started, self.stamp = None, False, 0
        self.context.stamp_messages(0)

    def free(self, abandon: bool = False) -> None:
        """Release the request and the side channel (kept, as the context's own, when abandoned: the
        comparison in flight may still be completed by a late rank, into this rank's buffer)."""
        if abandon:
            abandon_requests([self.request])
        else:
            self.request.Free()
            self.side.Free()

    def _compared(self) -> None:
        self.pending = False
        if self.values[0] != -self.values[1]:
            self._raise()

    def _foreign_message(self) -> bool:
        """Whether a message of this call's parity but another stamp waits, from any rank, on any of the
        call's channels: its sender made another call."""
        status = MPI.Status()
        parity = self.stamp // TAG_SPAN % 2
        for context in (self.context, *self.context.children):
            for peer in context.others():
                if context.comm.Iprobe(peer, MPI.ANY_TAG, status):
                    stamp = status.Get_tag() // TAG_SPAN * TAG_SPAN
                    if stamp and stamp != self.stamp and stamp // TAG_SPAN % 2 == parity:
                        return True
        return False

    def _raise(self) -> None:
        """Tell every rank what this one passed (which makes those still waiting look here too), hear what
        each passed (with the deadline), and raise.  Point-to-point, so a comparison one rank started and
        another did not cannot cross it."""
        signature, self.signature, self.pending = self.signature, None, False      # no second look
        width, others = 240, self.context.others()
        everyone = np.zeros((self.context.size, width), np.uint8)
        text = str(signature).encode()[:width]
        everyone[self.context.rank, :len(text)] = np.frombuffer(text, np.uint8)
        mine = everyone[self.context.rank]
        requests = [self.context.track(self.side.Isend([mine, MPI.BYTE], peer, Tag.MISMATCH)) for peer in others]
        requests += [self.context.track(self.side.Irecv([everyone[peer], MPI.BYTE], peer, Tag.MISMATCH))
                     for peer in others]
        self.context.waitall(requests, others + others)
        described = {rank: bytes(row).rstrip(b"\0").decode(errors="replace") for rank, row in enumerate(everyone)}
        raise MismatchError(signature.collective, described)


def _hash(signature: Signature) -> np.ndarray:
    return _fingerprint(signature.collective, signature.count, signature.dtype.str, signature.op,
                        signature.root, signature.algorithm)


@functools.lru_cache(maxsize=256)
def _fingerprint(*key) -> np.ndarray:
    """(code, -code), the code the same integer on every rank for the same call (Python's own hash is
    salted per process)."""
    code = zlib.crc32(repr(key).encode())
    return np.array([code, -code], np.int64)


def agree(comm, check) -> None:
    """Run ``check()`` on every rank of ``comm``; if it raises on any, raise one :class:`SetupError` on all.

    For the checks before a job starts (input files, options, checkpoints): one
    rank's bad input must not leave the others waiting in the first collective.
    Every rank must call it, at the same point.
    """
    try:
        check()
        mine = None
    except Exception as error:  # noqa: BLE001 - whatever stops one rank must stop them all
        mine = str(error) if isinstance(error, (ValueError, OSError, KeyError)) else f"{type(error).__name__}: {error}"
    with bounded(comm, "the checks before the job starts"):
        try:
            everyone = comm.allgather(mine)
        except MPI.Exception as error:        # a rank died before the job began (MPI's fault tolerance says so)
            if not failure.is_process_failure(error):
                raise
            dead = failure.failed_ranks(comm)
            lost = PeerFailed("the checks before the job starts", comm.Get_rank(), dead,
                              "the process died (MPI's fault tolerance); nothing was done yet: start the job again")
            failure.end_after_losing(str(lost), dead)     # MPI_Finalize would wait for the dead
            raise lost from None
    failed = {rank: reason for rank, reason in enumerate(everyone) if reason is not None}
    if failed:
        raise SetupError(failed, comm.Get_size())


def load_checkpoint_set(comm, path: str | Path | list | None, identity: dict, unit: str):
    """This rank's arrays of the newest point that every rank's files hold (``path`` None: this rank keeps no
    file, and gets None).  A missing, damaged or foreign file, or no point common to all, is one
    :class:`mpicoll.SetupError` on every rank.  ``unit`` names the points ("epochs", "updates").

    ``path`` a list: this rank's share of the files of an earlier run at another rank count (a run resumed on
    fewer or more ranks reads them all between its ranks, :attr:`mpicoll.train.common.Family.reshards`); the
    arrays of each, at the point common to every file of every rank, in a list.  Collective over ``comm``."""
    paths = [] if path is None else list(path) if isinstance(path, list) else [path]
    found: list[dict[int, Path]] = []
    agree(comm, lambda: found.extend(checkpoint.versions(p, identity) for p in paths))
    with bounded(comm, "comparing the checkpoint files"):
        held = comm.allgather([sorted(points) for points in found] if path is not None else None)
    owners = {(rank, i): set(points) for rank, files in enumerate(held) if files is not None
              for i, points in enumerate(files)}
    common = set.intersection(*owners.values()) if owners else set()
    if owners and not common:
        listing = "; ".join(f"rank {rank}{f' file {i + 1}' if len(held[rank]) > 1 else ''}: "
                            f"{', '.join(map(str, sorted(points)))}" for (rank, i), points in owners.items())
        raise SetupError(dict.fromkeys(range(comm.Get_size()), (
            f"--resume: the checkpoint files hold no {unit[:-1] if unit.endswith('s') else unit} in common "
            f"({listing}): no set of files from one point of training is whole; restore one from a copy, or start "
            "afresh")),
            comm.Get_size())
    point = max(common, default=None)
    newest = max((max(points) for points in owners.values()), default=None)
    if comm.Get_rank() == 0 and newest is not None and newest > point:
        print(f"mpicoll: resuming from the checkpoint set after {point} {unit}: not every file of the set after "
              f"{newest} {unit} was written (the earlier run stopped while writing them)", file=sys.stderr, flush=True)
    if path is None:
        return None
    states = [checkpoint.load(p, identity, point) for p in paths]
    return states if isinstance(path, list) else states[0]
