"""Cross-rank validation: every rank learns what every other rank passed, and all fail together.

A collective called with different counts, datatypes, ops or roots on
different ranks is an error MPI does not report: it hangs or returns garbage.
:func:`check_call` gathers a small signature from every rank (one Allgather
of a few integers) and, if they differ, raises the same
:class:`~mpicoll.errors.MismatchError` on every rank, with what each rank
passed.  It also reports NaN or Inf in any rank's float contribution.  It
costs one small collective, so the communicator runs it on its first call and
on every call under ``MPICOLL_DEBUG=1``.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
from mpi4py import MPI

from .errors import MismatchError, NonFiniteError, SetupError

__all__ = ["Signature", "check_call", "check_fingerprint", "agree"]


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


def check_fingerprint(context, signature: Signature) -> None:
    """Raise the same :class:`MismatchError` on every rank if the ranks' calls differ.

    One 16-byte nonblocking allreduce (MAX of the call's hash and of its
    negation: equal hashes everywhere exactly when max == -min) on the
    context's side channel ``watch``, waited on with the deadline.  The hash
    covers the collective, count, dtype, op, root and algorithm, so ranks that
    chose different algorithms are caught too.
    """
    code = _fingerprint((signature.collective, signature.count, signature.dtype.str, signature.op, signature.root,
                         signature.algorithm))
    both = np.array([code, -code], np.int64)
    context.waitall([context.watch.Iallreduce(MPI.IN_PLACE, both, MPI.MAX)], context.others())
    if both[0] != -both[1]:
        described = context.watch.allgather(str(signature))
        raise MismatchError(signature.collective, dict(enumerate(described)))


@functools.lru_cache(maxsize=256)
def _fingerprint(key: tuple) -> int:
    """The same integer on every rank for the same call (Python's own hash is salted per process)."""
    return zlib.crc32(repr(key).encode())


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
