"""Cross-rank validation: every rank learns what every other rank passed, and all fail together.

A collective called with different counts, datatypes, ops or roots on
different ranks is an error MPI does not report: it hangs or returns garbage.
:func:`check_call` gathers a small signature from every rank (one Allgather
of a few integers) and, if they differ, raises the same
:class:`~mpicoll.errors.MismatchError` on every rank, with what each rank
passed.  It also reports NaN or Inf in any rank's float contribution.  It
costs one small collective, so the communicator runs it on its first call and
on every call under ``MPICOLL_DEBUG=1``.  In between, large calls carry a
:class:`Fingerprint`, compared across ranks while the data moves.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
from mpi4py import MPI

from .errors import MismatchError, NonFiniteError, SetupError

__all__ = ["Signature", "Fingerprint", "check_call", "agree"]


class Signature:
    """What one rank passed to one collective, as integers that must agree across ranks."""

    def __init__(self, collective: str, count: int, dtype: np.dtype, op: str = "-", root: int = -1,
                 algorithm: str = "-"):
        self.collective, self.count, self.dtype, self.op, self.root = collective, count, np.dtype(dtype), op, root
        self.algorithm = algorithm          # the one that runs this call (set by the communicator)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def codes(self) -> list[int]:
        return [_code(self.collective), self.count, self.dtype.itemsize, _code(self.dtype.str),
                _code(self.op), self.root, _code(self.algorithm)]

    def __str__(self) -> str:
        text = f"{self.collective}(count={self.count}, dtype={self.dtype}"
        if self.op != "-":
            text += f", op={self.op}"
        if self.root >= 0:
            text += f", root={self.root}"
        if self.algorithm != "-":
            text += f", algorithm={self.algorithm}"
        return text + ")"


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def check_call(context, signature: Signature, contribution: np.ndarray | None = None) -> None:
    """Raise on every rank if the ranks' signatures differ or a float contribution is not finite.

    ``context`` is the communicator's :class:`~mpicoll.context.Context`: the
    exchange is nonblocking and waited on with its deadline, so a rank that
    never arrives is named instead of hanging the others.
    """
    comm = context.comm
    nonfinite = int(contribution is not None and contribution.dtype.kind in "fc"
                    and not bool(np.isfinite(contribution).all()))
    mine = np.array(signature.codes() + [nonfinite], np.int64)
    everyone = np.zeros((comm.Get_size(), mine.size), np.int64)
    context.waitall([comm.Iallgather(mine, everyone)], context.others())
    if (everyone[:, :-1] != everyone[0, :-1]).any():
        described = comm.allgather(str(signature))
        raise MismatchError(signature.collective, dict(enumerate(described)))
    bad = np.flatnonzero(everyone[:, -1])
    if bad.size:
        raise NonFiniteError(signature.collective, bad.tolist())


class Fingerprint:
    """A cross-rank comparison of each call, carried alongside the call's own messages.

    One persistent 16-byte allreduce (MAX of the call's hash and of its
    negation: equal hashes everywhere exactly when max == -min) on a side
    channel of its own, set up once per communicator and started as each call
    starts (a persistent start costs well under a microsecond where starting
    a fresh nonblocking allreduce costs several).  It progresses while the
    algorithm moves the data.  The context looks at it whenever a wait lasts
    (:meth:`raise_if_mismatched`), so ranks whose calls disagree and wait for
    messages that never come learn it at once; :meth:`settle` waits for it as
    the call ends, so ranks whose calls disagree yet complete never return the
    result.  The hash covers the collective, count, dtype, op, root and
    algorithm.  Every rank must create it together.
    """

    def __init__(self, context):
        self.context = context
        self.channel = MPI.Intracomm(MPI.Intracomm.Dup(context.comm))
        self.values = np.zeros(2, np.int64)
        self.request = self.channel.Allreduce_init(MPI.IN_PLACE, self.values, MPI.MAX)
        self.signature: Signature | None = None          # the call in flight
        self.pending = False                             # its comparison not yet in
        context.alarms.append(self.raise_if_mismatched)

    def start(self, signature: Signature) -> None:
        self.values[:] = _fingerprint(signature.collective, signature.count, signature.dtype.str, signature.op,
                                      signature.root, signature.algorithm)
        self.signature, self.pending = signature, True
        self.request.Start()

    def raise_if_mismatched(self) -> None:
        """Raise the call's MismatchError (on every rank) if the comparison is in and the calls differ."""
        if self.pending and self.request.Test():
            self.pending = False
            if self.values[0] != -self.values[1]:
                self._raise()

    def settle(self) -> None:
        """Wait for the comparison in flight, if any (with the deadline); MismatchError if the calls differ."""
        if self.pending:
            if not self.request.Test():
                self.context.waitall([self.request], self.context.others())
            self.pending = False
        if self.signature is not None and self.values[0] != -self.values[1]:
            self._raise()
        self.signature = None

    def free(self, abandon: bool = False) -> None:
        """Release the request and the side channel (kept, as the context's own, when abandoned)."""
        if not abandon:
            self.request.Free()
            self.channel.Free()

    def _raise(self) -> None:
        """Every rank finds the same difference (the comparison is an allreduce): exchange what each
        passed (fixed-size, with the deadline), and raise."""
        signature, self.signature = self.signature, None      # no second look while describing
        width = 240
        mine = np.zeros(width, np.uint8)
        text = str(signature).encode()[:width]
        mine[:len(text)] = np.frombuffer(text, np.uint8)
        everyone = np.zeros((self.context.size, width), np.uint8)
        self.context.waitall([self.channel.Iallgather(mine, everyone)], self.context.others())
        described = {rank: bytes(row).rstrip(b"\0").decode(errors="replace") for rank, row in enumerate(everyone)}
        raise MismatchError(signature.collective, described)


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
    everyone = comm.allgather(mine)
    failed = {rank: reason for rank, reason in enumerate(everyone) if reason is not None}
    if failed:
        raise SetupError(failed, comm.Get_size())
