"""Combine two contributions of a reduction, in the order MPI defines.

Every algorithm reduces through :meth:`Reduction.combine`, ``out = left (op)
right`` with ``left`` the contribution of the lower ranks.  Predefined ops on
numpy types run as one numpy ufunc pass (three operands, no temporary);
everything else (user ops from ``MPI.Op.Create``, MAXLOC/MINLOC on pair
types, types numpy does not know) goes through ``MPI.Op.Reduce_local``, so
MPI's own definition of the op is the one applied.

Float MIN and MAX follow numpy: a NaN in any contribution gives NaN, so a
diverged replica is visible rather than silently ignored.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import compute
from ..base import ops
from ..base.errors import ReductionError

__all__ = ["Reduction", "ReductionError", "op_name", "resolve_op"]

_UNKNOWN = object()
_NOT_REDUCTIONS = ("REPLACE", "NO_OP")        # MPI's predefined ops that are not in the table (one-sided only)


def op_name(op: MPI.Op) -> str:
    """MPI's name for a predefined op ("SUM"), or "user op" for one from MPI.Op.Create."""
    entry = ops.of_mpi(op)
    if entry is not None:
        return entry.mpi
    return next((name for name in _NOT_REDUCTIONS if op == getattr(MPI, name, MPI.OP_NULL)), "user op")


def resolve_op(op) -> MPI.Op:
    """An ``MPI.Op`` from itself or from a name such as "sum" or "max" (:data:`mpicoll.base.ops.OPS`)."""
    if isinstance(op, MPI.Op):
        return op
    entry = ops.find(op)
    if entry is None:
        raise ValueError(f"Unrecognized op: {op!r}; use an MPI.Op or one of {ops.names()}")
    return entry.mpi_op


class Reduction:
    """``out = left (op) right`` for one op and one element type."""

    def __init__(self, op: MPI.Op, datatype: MPI.Datatype, dtype: np.dtype):
        if op == MPI.OP_NULL:
            raise ReductionError("MPI.OP_NULL is not a reduction")
        self.op = op
        self.datatype = datatype
        self.dtype = np.dtype(dtype)
        self.name = op_name(op)
        self.commutative = bool(op.Is_commutative())
        self._streaming = self._streaming_into_two = _UNKNOWN
        entry = ops.of_mpi(op) if op.is_predefined else None
        # device arrays are reduced by the kernel layer (the GPU), which has the table's kernel ops on its
        # types; others refuse them.  Host arrays: the op's ufunc, one pass, where MPI defines it for the kind
        self._kernel = entry.name if entry and entry.kernel and self.dtype in compute.REDUCIBLE else None
        if entry is not None and entry.ufunc is not None and self.dtype.kind in entry.kinds \
                and self.dtype.fields is None:
            self._ufunc, self._keywords = entry.ufunc, entry.keywords
        else:
            self._ufunc = None
            if op.is_predefined:
                self._check_mpi_defines_it()

    def _check_mpi_defines_it(self):
        """Ask MPI once, on one element, whether the predefined op applies to this datatype."""
        probe = np.zeros(1, self.dtype)
        try:
            self.op.Reduce_local([probe, 1, self.datatype], [probe.copy(), 1, self.datatype])
        except MPI.Exception as error:
            raise ReductionError(
                f"MPI.{self.name} is not defined for {self.dtype} elements: {error.Get_error_string()}"
            ) from None

    def _streaming_loop(self):
        """The kernel layer's streaming loop for this op and type (looked up once; None if none)."""
        if self._streaming is _UNKNOWN:
            self._streaming = (compute.streaming_reducer(self._kernel, self.dtype)
                               if self._kernel is not None else None)
        return self._streaming

    def _streaming_into_two_loop(self):
        """The kernel layer's streaming loop storing into two arrays (looked up once; None if none)."""
        if self._streaming_into_two is _UNKNOWN:
            self._streaming_into_two = (compute.streaming_reducer(self._kernel, self.dtype, into_two=True)
                                        if self._kernel is not None else None)
        return self._streaming_into_two

    def check_device(self) -> None:
        """Refuse, before any message, a reduction the GPU kernels do not have."""
        if self._kernel is None:
            raise TypeError(f"device arrays are reduced on the GPU with SUM, PROD, MIN or MAX on "
                            f"{', '.join(map(str, compute.REDUCIBLE))}, not {self.name} on {self.dtype}; "
                            "pass host (numpy) arrays for other ops")

    def combine(self, left: np.ndarray, right: np.ndarray, out: np.ndarray, *, streaming: bool = False,
                also: np.ndarray | None = None) -> None:
        """Store ``left (op) right`` in ``out``; ``out`` may be either operand.

        ``streaming``: the result will not be read again soon, so write it
        around the caches where the kernel layer can
        (:func:`mpicoll.compute.streaming_reducer`; same bits either way).
        ``also``: a second array (host, neither operand) that gets the result too, in the same pass
        where the kernel layer can (streaming, contiguous arrays 16-byte aligned alike), else copied.
        Device arrays are reduced on their GPU by :func:`mpicoll.compute.reduce`.
        """
        if also is not None:
            if streaming and self._streaming_into_two_loop() is not None and _contiguous(out, left, right, also) \
                    and type(out) is np.ndarray and (_address(also) - _address(out)) % 16 == 0:
                self._streaming_into_two(out, also, left, right)
                return
            self.combine(left, right, out, streaming=streaming)
            (compute.copy_around_caches if streaming else np.copyto)(also, out)
            return
        if type(out) is not np.ndarray:
            self.check_device()
            compute.reduce(left, right, out=out, op=self._kernel)
            return
        if streaming and self._streaming_loop() is not None and _contiguous(out, left, right):
            self._streaming(out, left, right)
            return
        if self._ufunc is np.add and self.dtype == np.float16 and _contiguous(out, left, right):
            # numpy adds float16 element by element in software; mpicoll.compute adds by the bits, the same bits
            if _same_memory(out, left):
                incoming = right
            elif _same_memory(out, right):
                incoming = left
            else:
                out[...], incoming = right, left
            compute.add_narrow(incoming.view(np.uint16), out.view(np.uint16), np.float16)
            return
        if self._ufunc is not None:
            self._ufunc(left, right, out=out, **self._keywords)
            return
        count = out.size
        if count == 0:
            return
        out_is_left = _same_memory(out, left)
        if out_is_left and not self.commutative:
            result = right.copy()
            self.op.Reduce_local([left, count, self.datatype], [result, count, self.datatype])
            out[...] = result
            return
        if out_is_left:  # commutative: right (op) left is the same value
            left, right = right, left
        elif not _same_memory(out, right):
            out[...] = right
        # Reduce_local(inbuf, inoutbuf) stores inbuf (op) inoutbuf in inoutbuf.
        self.op.Reduce_local([left, count, self.datatype], [out, count, self.datatype])


def _contiguous(*arrays: np.ndarray) -> bool:
    return all(a.flags.c_contiguous for a in arrays)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return _address(a) == _address(b)
