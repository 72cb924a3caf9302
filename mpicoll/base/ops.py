"""One table of reduction ops: every name mpicoll takes for an op, MPI's op, numpy's ufunc and the element kinds
MPI defines it for, and whether the kernel layer reduces it.

Op resolution (:func:`mpicoll.collectives.reduction.resolve_op`), :class:`~mpicoll.collectives.reduction.Reduction`,
the kernel backends (:mod:`mpicoll.compute`) and :mod:`mpicoll.torch` read it; nothing else spells an op.
"average" is not an MPI op: the array API and the torch module take it as a sum divided by the rank count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

__all__ = ["Op", "OPS", "KERNEL_OPS", "AVERAGE", "find", "of_mpi", "names", "not_defined_for", "keeping_nan", "as_numpy_has_it"]

_INTEGER = "iu"
_NUMERIC = "iufc"


@dataclass(frozen=True)
class Op:
    name: str                          # the array API's name, "sum"
    mpi: str                           # MPI's, "SUM" (MPI.SUM)
    ufunc: np.ufunc | None             # numpy's, for the kinds below; None: MPI applies it (MAXLOC, MINLOC)
    kinds: str = ""                    # numpy dtype kinds MPI defines the op for
    kernel: bool = False               # the kernel layer reduces it (host and GPU backends)
    spellings: tuple[str, ...] = ()    # other names for it (torch's and Horovod's "product")
    torch: str = ""                    # torch.distributed.ReduceOp's name for it ("" where torch has none)
    keywords: dict = field(default_factory=dict)    # extra ufunc keywords

    @property
    def mpi_op(self) -> MPI.Op:
        return getattr(MPI, self.mpi)


OPS = (
    Op("sum", "SUM", np.add, _NUMERIC, kernel=True, torch="SUM"),
    Op("prod", "PROD", np.multiply, _NUMERIC, kernel=True, spellings=("product",), torch="PRODUCT"),
    Op("min", "MIN", np.minimum, "iuf", kernel=True, torch="MIN"),
    Op("max", "MAX", np.maximum, "iuf", kernel=True, torch="MAX"),
    Op("land", "LAND", np.logical_and, _INTEGER + "b", keywords={"casting": "unsafe"}),
    Op("lor", "LOR", np.logical_or, _INTEGER + "b", keywords={"casting": "unsafe"}),
    Op("lxor", "LXOR", np.logical_xor, _INTEGER + "b", keywords={"casting": "unsafe"}),
    Op("band", "BAND", np.bitwise_and, _INTEGER + "b", torch="BAND"),
    Op("bor", "BOR", np.bitwise_or, _INTEGER + "b", torch="BOR"),
    Op("bxor", "BXOR", np.bitwise_xor, _INTEGER + "b", torch="BXOR"),
    Op("maxloc", "MAXLOC", None),
    Op("minloc", "MINLOC", None),
)
# The kernel layer's reductions, in the order its kernels number them (kernels/reduce.cu)
KERNEL_OPS = tuple(op.name for op in OPS if op.kernel)
# A sum divided by the rank count (mpicoll.torch's default, Horovod's Average)
AVERAGE = ("average", "avg", "mean")

_BY_NAME = {spelling: op for op in OPS for spelling in (op.name, op.mpi.lower(), *op.spellings)}


def find(name: str) -> Op | None:
    """The op a name means ("sum", "SUM", "product"), or None."""
    return _BY_NAME.get(str(name).lower())


def of_mpi(op: MPI.Op) -> Op | None:
    """The table's entry for a predefined ``MPI.Op``, or None (a user op from ``MPI.Op.Create``): a dictionary
    lookup by the op's handle (it runs on every call that reduces)."""
    if not _BY_HANDLE:
        _BY_HANDLE.update({entry.mpi_op.py2f(): entry for entry in OPS})
    return _BY_HANDLE.get(op.py2f())


_BY_HANDLE: dict[int, Op] = {}            # filled on first use, once MPI has started


_KIND_NAMES = {"i": "integer", "u": "unsigned integer", "f": "floating-point", "c": "complex", "b": "bool"}


def not_defined_for(op: MPI.Op, kind: str) -> str | None:
    """Where MPI does not define ``op`` for elements of numpy dtype kind ``kind`` ("b": bool): the kinds it is
    defined for, in words, for the caller's refusal ("integer, unsigned integer, bool"); else None (a user op,
    or MAXLOC and MINLOC, whose pair types MPI checks itself, included)."""
    entry = of_mpi(op) if op.is_predefined else None
    if entry is None or not entry.kinds or kind in entry.kinds:
        return None
    return ", ".join(_KIND_NAMES.get(k, k) for k in entry.kinds)


def names() -> str:
    """The op names, for messages."""
    return ", ".join(op.name for op in OPS)


def keeping_nan(op: MPI.Op) -> MPI.Op:
    """``op`` for MPI's own calls on floating-point elements: MIN and MAX as numpy has them, where a NaN in any
    contribution gives NaN (a user op, made once per op); any other op as it is.  MPI's predefined MIN and MAX
    compare with ``<`` and ``>``, so a NaN is kept or dropped by which rank holds it (MPICH 5.0.2, 3 ranks: a NaN
    on rank 0 or 1 of a MIN gave 1.0, on rank 2 nan), where mpicoll's own algorithms, following numpy, always
    give NaN (:mod:`mpicoll.collectives.reduction`)."""
    entry = of_mpi(op) if op.is_predefined else None
    if entry is None or entry.mpi not in ("MIN", "MAX"):
        return op
    made = _KEEPING_NAN.get(entry.mpi)
    if made is None:
        ufunc = entry.ufunc

        def combine(inbuf, inoutbuf, datatype):
            from mpi4py.util.dtlib import to_numpy_dtype
            dtype = to_numpy_dtype(datatype)
            ufunc(np.frombuffer(inbuf, dtype), np.frombuffer(inoutbuf, dtype), out=np.frombuffer(inoutbuf, dtype))

        made = _KEEPING_NAN[entry.mpi] = MPI.Op.Create(combine, commute=True)
    return made


_KEEPING_NAN: dict[str, MPI.Op] = {}


def as_numpy_has_it(op: MPI.Op, array) -> MPI.Op:
    """``op`` for MPI's own call on ``array``: :func:`keeping_nan` on host (numpy) floating-point arrays, where
    numpy's MIN and MAX keep a NaN; ``op`` on any other (a device array's reduction is the CUDA-aware MPI's)."""
    if isinstance(array, np.ndarray) and array.dtype.kind == "f":
        return keeping_nan(op)
    return op
