"""The array API: collectives that take an array and return one, like torch.distributed and Horovod.

Any array of :mod:`mpicoll.arrays` works, on the host or a GPU, in any shape
and memory layout: a non-contiguous input (or one in the other byte order) is packed once, such an
``out`` is filled from a packed result, and the result is of the input's kind
(numpy for host memory, CuPy or Numba for device memory).  Each has a
nonblocking form (``iallreduce``, ...) that returns a
:class:`~mpicoll.collectives.nonblocking.Request`.  ``comm`` defaults
to ``MPI.COMM_WORLD``; a plain mpi4py communicator is wrapped in a
:class:`~mpicoll.Communicator` once and the wrapper reused for as long as that
communicator lives (it is kept on the communicator as an MPI attribute, so freeing
the communicator releases it); pass the same communicator from every rank, in the
same order.

bfloat16 arrays (``ml_dtypes.bfloat16``, which gives numpy the type; MPI has none) work in every call: sums
and averages move the 16-bit words and add them in float32, rounding each partial sum once (the bound of
:mod:`mpicoll.collectives.compression`, the same bits on every rank), min, max and product reduce in float32
and round once, allgather and broadcast move the bits.  Host arrays only.
"""

from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI

from .. import arrays
from ..base import ops
from ..base.collectives import ALLGATHER, ALLREDUCE, BCAST, REDUCE_SCATTER_BLOCK, Collective
from .communicator import Communicator
from .compression import Compression, is_bfloat16
from .compression import resolve as resolve_compression
from .nonblocking import Request
from .reduction import ReductionError, op_name, resolve_op

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast",
           "iallreduce", "ireduce_scatter", "iallgather", "ibroadcast", "resolve_op"]

def _forget(comm, keyval, wrapped: dict) -> None:
    """MPI frees ``comm``: release the wrappers made for it (their private channels and threads)."""
    for communicator in wrapped.values():
        try:
            communicator.close()
        except Exception:  # noqa: BLE001 - an error inside MPI_Comm_free's callback would abort the job
            pass


# The wrappers made for a plain communicator live on the communicator itself, as an MPI attribute (a dict
# algorithm -> Communicator), which MPI deletes when the communicator is freed.  A cache by handle would hand
# a freed communicator's wrapper, and so its group, to the next communicator given the same handle.
_WRAPPERS = MPI.Comm.Create_keyval(delete_fn=_forget)
_FOR_WORLD: dict = {}          # algorithm -> the wrapper of MPI.COMM_WORLD (comm=None)


def _communicator(comm, algorithm: str) -> Communicator:
    if comm is None:                 # the default, looked up once per algorithm (MPI's attribute lookup: ~0.3 us)
        made = _FOR_WORLD.get(algorithm)
        if made is not None and made.__dict__.get("_world") is MPI.COMM_WORLD:
            return made
        made = _FOR_WORLD[algorithm] = _communicator(MPI.COMM_WORLD, algorithm)
        made.__dict__["_world"] = MPI.COMM_WORLD
        return made
    if isinstance(comm, Communicator) and comm.algorithm == algorithm:
        return comm
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        return Communicator(comm, algorithm=algorithm)      # its own error, naming what was passed
    wrapped = comm.Get_attr(_WRAPPERS)
    if wrapped is None:
        wrapped = {}
        comm.Set_attr(_WRAPPERS, wrapped)
    communicator = wrapped.get(algorithm)
    if communicator is None:
        communicator = wrapped[algorithm] = Communicator(comm, algorithm=algorithm)
    return communicator


def _as_array(x) -> tuple:
    """(library, array): ``x`` as a numpy array (host memory) or a CuPy/Numba array (device memory), without
    a copy.  A call reads its input's kind here, once, and hands it on."""
    kind = arrays.library(x)
    return kind, (np.asarray(x) if kind is arrays.HOST else arrays.device_view(x, kind)[1])


def _output(out, shape, like, kind):
    """(contiguous array to write the result into, the caller's ``out`` to copy it into afterwards or None);
    ``kind``: the library of ``like``, the call's input."""
    shape, dtype = tuple(shape), np.dtype(like.dtype).newbyteorder("=")    # results in the machine's byte order
    if out is None:
        return arrays.empty(kind, shape, dtype), None
    out_kind, out = (kind, out) if out is like else _as_array(out)
    if tuple(out.shape) != shape or np.dtype(out.dtype).newbyteorder("=") != dtype:
        raise ValueError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected {shape} and {like.dtype}")
    if out_kind != kind:
        raise TypeError("out must be in the same kind of memory as x (both host, or both one device library)")
    if arrays.is_c_contiguous(out) and (not isinstance(out, np.ndarray) or out.flags.writeable and out.dtype.isnative):
        return out, None
    return arrays.empty(kind, shape, dtype), out


class _Call:
    """One prepared collective call: the collective, its arguments, and where the result ends up.

    ``run()`` makes it blocking (the communicator's method); ``start()``
    nonblocking (its nonblocking method), returning a Request whose ``wait()``
    gives the result.
    """

    def __init__(self, communicator: Communicator, collective: Collective, args: tuple, result, copy_into=None,
                 divide_by: int = 1):
        self.communicator, self.collective, self.args = communicator, collective, args
        self.result, self.copy_into, self.divide_by = result, copy_into, divide_by

    def run(self):
        getattr(self.communicator, self.collective.method)(*self.args)
        return self._finish()

    def start(self) -> Request:
        started = getattr(self.communicator, self.collective.nonblocking)(*self.args)
        return started.then(lambda _: self._finish())

    def _finish(self):
        if self.divide_by != 1:                       # "average": the sum, divided by the rank count
            self.result /= self.divide_by
        return self._deliver()

    def _deliver(self):
        """The result, copied into the caller's ``out`` where it could not be written in place."""
        if self.copy_into is None:
            return self.result
        arrays.copy(self.result, self.copy_into)
        return self.copy_into


def _average(op, x, communicator: Communicator) -> tuple:
    """(the op to reduce with, what to divide its result by): "average" (also "avg", "mean", torch's and
    Horovod's name) is a sum divided by the rank count, for floating-point and complex arrays."""
    dtype = np.dtype(x.dtype)
    reduce, divides, _ = _plan(op, dtype) if isinstance(op, str) else _plan.__wrapped__(op, dtype)
    return reduce, communicator.Get_size() if divides else 1


@functools.lru_cache(maxsize=256)
def _plan(op, dtype: np.dtype) -> tuple:
    """(the MPI op, whether the result is divided by the rank count, whether the array goes to MPI as it is) of
    ``op`` on ``dtype`` elements: by name, looked up once per name and type (the checks cost a few microseconds,
    a small allreduce's price)."""
    as_it_is = dtype.isnative and not is_bfloat16(dtype)
    if not (isinstance(op, str) and op.lower() in ops.AVERAGE):
        op = resolve_op(op)
        takes = None if is_bfloat16(dtype) else ops.not_defined_for(op, dtype.kind)
        if takes:      # before any message, on every path (auto hands small calls to MPI, whose refusal says less)
            raise ReductionError(f"MPI.{op_name(op)} is not defined for {dtype} elements (MPI defines it on "
                                 f"{takes} ones): pass another op ('lor', 'land' on bool)")
        return op, False, as_it_is
    if dtype.kind not in "fc" and not is_bfloat16(dtype):
        raise ValueError(f"op {op!r} needs floating-point or complex arrays, got {dtype}: reduce with 'sum' and "
                         "divide as you need")
    return MPI.SUM, True, as_it_is


def reduced_in_place(x, op: str, comm=None, algorithm: str = "auto"):
    """``allreduce(x, op, out=x)`` of a C-contiguous, writable numpy array of a type MPI has (or a bfloat16 sum or
    average), with an op by name (a training step's calls), in a straight line: ``x``; None, having done nothing,
    for any other array or op.
    The general path's steps (kinds, packing, outputs) cost ~4 us a call, 8x the on-node allreduce of a few
    bytes at 2 ranks (measured); this one ~1 us."""
    if type(x) is not np.ndarray or not isinstance(op, str):
        return None
    flags = x.flags
    if not (flags.c_contiguous and flags.writeable):
        return None
    reduce, divides, as_it_is = _plan(op, x.dtype)
    words = x
    if not as_it_is:
        if reduce != MPI.SUM or not is_bfloat16(x.dtype):
            return None
        # bfloat16 sums and averages: the words, added in float32 (the node does that in C) as the general path
        words, reduce = x.view(np.uint16), _bfloat16_sum()
    communicator = _communicator(comm, algorithm)
    communicator.Allreduce(MPI.IN_PLACE, words, reduce)
    if divides:
        x /= communicator.Get_size()
    return x


def _allreduce(x, op, comm, algorithm, out) -> _Call:
    communicator = _communicator(comm, algorithm)
    in_place = out is x
    kind, x = _as_array(x)
    if is_bfloat16(x.dtype):
        return _bfloat16_reduction(ALLREDUCE, x, op, comm, algorithm, x if in_place else out, communicator, kind)
    op, divide_by = _average(op, x, communicator)
    source = arrays.contiguous(x, kind)
    if in_place and source is x and (not isinstance(x, np.ndarray) or x.flags.writeable):
        return _Call(communicator, ALLREDUCE, (MPI.IN_PLACE, x, op), x, divide_by=divide_by)
    result, copy_into = _output(x if in_place else out, x.shape, x, kind)
    return _Call(communicator, ALLREDUCE, (source, result, op), result, copy_into, divide_by)


def _reduce_scatter(x, op, comm, algorithm, out) -> _Call:
    communicator = _communicator(comm, algorithm)
    kind, x = _as_array(x)
    x = arrays.contiguous(x, kind)
    size = communicator.Get_size()
    if x.ndim == 0 or x.shape[0] % size:
        raise ValueError(f"reduce_scatter: x has shape {x.shape}; its first axis must be a multiple of {size} ranks")
    if is_bfloat16(x.dtype):
        return _bfloat16_reduction(REDUCE_SCATTER_BLOCK, x, op, comm, algorithm, out, communicator, kind)
    result, copy_into = _output(out, (x.shape[0] // size, *x.shape[1:]), x, kind)
    op, divide_by = _average(op, x, communicator)
    return _Call(communicator, REDUCE_SCATTER_BLOCK, (x, result, op), result, copy_into, divide_by)


def _allgather(x, comm, algorithm, out) -> _Call:
    communicator = _communicator(comm, algorithm)
    kind, x = _as_array(x)
    if is_bfloat16(x.dtype):          # bits moved as they are
        target, convert = _bfloat16_out(out)
        return _Converted(_allgather(_bits(x), comm, algorithm, target), convert)
    x = arrays.contiguous(x, kind)
    size = communicator.Get_size()
    shape = (size,) if x.ndim == 0 else (size * x.shape[0], *x.shape[1:])
    result, copy_into = _output(out, shape, x, kind)
    return _Call(communicator, ALLGATHER, (x, result), result, copy_into)


def _broadcast(x, root, comm, algorithm, out) -> _Call:
    communicator = _communicator(comm, algorithm)
    kind, x = _as_array(x)
    if is_bfloat16(x.dtype):          # bits moved as they are
        target, convert = _bfloat16_out(out)
        return _Converted(_broadcast(_bits(x), root, comm, algorithm, target), convert)
    result, copy_into = _output(out, x.shape, x, kind)
    if communicator.Get_rank() == root and result is not x:
        arrays.copy(x, result)
    return _Call(communicator, BCAST, (result, root), result, copy_into)


class _Converted:
    """A prepared call whose result ``convert`` turns into the caller's (``run()`` and ``start()`` as
    :class:`_Call`'s)."""

    def __init__(self, call, convert):
        self.call, self.convert = call, convert

    def run(self):
        return self.convert(self.call.run())

    def start(self) -> Request:
        return self.call.start().then(self.convert)


def _bits(x) -> np.ndarray:
    """A host array of 16-bit floats as its bits (uint16), without a copy (a contiguous copy if need be)."""
    kind, x = _as_array(x)
    if kind is not arrays.HOST:
        raise NotImplementedError("bfloat16: host (numpy) arrays only; copy a device array to the host")
    return np.ascontiguousarray(x).view(np.uint16)


def _bfloat16_out(out):
    """(where a call moving bfloat16 bits writes: ``out``'s bits when they can be written in place, else None
    (a new array), what turns the call's uint16 result into the caller's: ``out``, or a bfloat16 array)."""
    aliased = isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable

    def convert(bits):
        if out is None:
            return bits.view(_bfloat16_op().dtype)
        if not aliased:
            out[...] = bits.view(_bfloat16_op().dtype)
        return out
    return (_bits(out) if aliased else None), convert


@functools.cache
def _bfloat16_op() -> Compression:
    """The op that adds bfloat16 words in float32, rounding each sum once (made at first use: ml_dtypes takes
    about 1 s to import, which every process of every job would pay at ``import mpicoll``)."""
    return Compression("bf16")


@functools.cache
def _bfloat16_sum() -> MPI.Op:
    """:func:`_bfloat16_op`'s op, made once (a Compression made a call cost a microsecond)."""
    return _bfloat16_op().op


def _bfloat16_reduction(collective: Collective, x, op, comm, algorithm, out, communicator: Communicator, kind):
    """A reduction of bfloat16 arrays (ml_dtypes'; MPI has no such type).  Sums and averages move the 16-bit
    words, each addition made in float32 and rounded once (:mod:`mpicoll.collectives.compression`: the same
    bound, the same bits on every rank); other ops run in float32 (exact for min and max) and round at the
    end."""
    if kind is not arrays.HOST:
        raise NotImplementedError("bfloat16: host (numpy) arrays only; copy a device array to the host")
    shape = x.shape if collective is ALLREDUCE else (x.shape[0] // communicator.Get_size(), *x.shape[1:])
    reduce, divide_by = _average(op, x, communicator)
    if reduce != MPI.SUM:
        wide = x.astype(np.float32)
        call = (_allreduce(wide, op, comm, algorithm, wide) if collective is ALLREDUCE else
                _reduce_scatter(wide, op, comm, algorithm, None))
        result, copy_into = _output(out, shape, x, kind)

        def narrow(values):
            result[...] = values
            if copy_into is None:
                return result
            arrays.copy(result, copy_into)
            return copy_into
        return _Converted(call, narrow)
    result, copy_into = _output(out, shape, x, kind)
    if collective is ALLREDUCE:
        if result is not x:
            result[...] = x
        args = (MPI.IN_PLACE, result.view(np.uint16), _bfloat16_sum())
    else:
        args = (_bits(x), result.view(np.uint16), _bfloat16_sum())
    return _Call(communicator, collective, args, result, copy_into, divide_by)


def allreduce(x, op="sum", *, comm=None, algorithm: str = "auto", out=None, compression=None, key=None):
    """The elementwise reduction of ``x`` over all ranks (same shape and dtype as ``x``).

    ``op``: "sum" (default), "prod", "min", "max", the logical and bitwise ops, any ``MPI.Op``, or
    "average" (the sum divided by the rank count, as in ``mpicoll.torch`` and Horovod; floating-point
    arrays).  ``out`` may be ``x`` itself to reduce in place.  Device arrays are reduced
    on their GPU and give device arrays.

    ``compression``: "fp16" or "bf16" moves a floating-point sum or average as 16-bit floats, half the bytes
    of float32, within a documented error of the exact sum, the same on every rank; a
    :class:`~mpicoll.collectives.compression.Compression` with ``error_feedback=True`` carries each buffer's
    rounding error (per ``key``) into its next call (:mod:`mpicoll.collectives.compression`).  A compressed
    device array is rounded and summed on the host, and its result copied back to the device.
    """
    if compression is not None:
        return _compressed_allreduce(x, op, comm, algorithm, out, compression, key).run()
    if out is x and (done := reduced_in_place(x, op, comm, algorithm)) is not None:
        return done
    return _allreduce(x, op, comm, algorithm, out).run()


class _CompressedCall(_Call):
    """A sum or average moved as 16-bit floats by the communicator's algorithm
    (:meth:`~mpicoll.collectives.algorithms.base.Algorithm.allreduce_compressed`).  ``staged``: for a device
    array, (the device array the host result is copied into, the caller's ``out`` to copy that into or None).

    A result with NaN or inf elements (the same bits, so the same elements, on every rank) is settled together
    (:meth:`_settle_non_finite`): where some rank's input was NaN or inf already, the uncompressed sum is NaN or
    inf too and the result stands; where none was, the 16-bit sum overflowed, and every rank raises the same
    OverflowError.  ``non_finite``: the flat indices of this rank's own NaN or inf inputs."""

    def __init__(self, communicator: Communicator, compression, key, source, result, copy_into, divide_by: int,
                 non_finite: np.ndarray, staged: tuple | None = None):
        super().__init__(communicator, ALLREDUCE, (), result, copy_into, divide_by)
        self.compression, self.key, self.source, self.non_finite = compression, key, source, non_finite
        self.staged = staged
        self.ran_on = communicator          # the communicator the call ran on (a started one: its worker's)

    def _reduce(self, communicator: Communicator) -> None:
        """The call; with error feedback, a call that fails (a lost rank, a timeout, ranks that disagree) leaves
        the residual as it found it: its rounding, done before anything moved, was never delivered, and a
        survivor that redoes the step carries the same residual as one that never began it."""
        self.ran_on = communicator
        residual = self.compression.residuals.get(self.key) if self.compression.error_feedback else None
        kept = None if residual is None else residual.copy()
        try:
            communicator._allreduce_compressed(self.source, self.result, self.compression, self.key)
        except BaseException:
            if kept is not None:
                residual[...] = kept
            raise

    def _settle_non_finite(self) -> None:
        """Decide a result with NaN or inf elements on every rank alike, by one small allreduce of which of them
        some rank's input held (every rank meets the same elements, so all make it); with error feedback the
        residual is dropped there (what could not be sent is not carried into the next call)."""
        finite = np.isfinite(self.result)
        if finite.all():
            return
        where = np.flatnonzero(~finite)
        if self.compression.error_feedback and self.key in self.compression.residuals:
            self.compression.residuals[self.key].flat[where] = 0
        held = np.isin(where, self.non_finite).astype(np.uint8)
        self.ran_on.Allreduce(MPI.IN_PLACE, held, MPI.MAX)
        overflowed = where[held == 0]
        if overflowed.size:
            inputs = where.size - overflowed.size
            raise OverflowError(
                f"compression {self.compression.kind}: the sum overflowed the 16-bit type at {overflowed.size} "
                f"element(s) (the first at index {overflowed[0]}), on every rank"
                + (f"; {inputs} other element(s) are NaN or inf because an input was" if inputs else "")
                + ("; float16 ends at 65504: use bf16, which has float32's range, or scale the values down"
                   if self.compression.kind == "fp16" else "; scale the values down")
                + ("; the error feedback's residual was dropped at those elements"
                   if self.compression.error_feedback else ""))

    def run(self):
        self._reduce(self.communicator)
        return self._finish()

    def start(self) -> Request:
        if self.source is not None:        # x is the caller's again at once: the call reduces its own copy
            self.result[...], self.source = self.source, None
        return self.communicator.start(Request(ALLREDUCE.nonblocking, self._reduce)).then(lambda _: self._finish())

    def _finish(self):
        self._settle_non_finite()
        result = super()._finish()
        if self.staged is None:
            return result
        device, copy_into = self.staged
        arrays.copy_into(device, result)
        if copy_into is None:
            return device
        arrays.copy(device, copy_into)
        return copy_into


def _compressed_allreduce(x, op, comm, algorithm, out, compression, key) -> _CompressedCall:
    compression = resolve_compression(compression)
    communicator = _communicator(comm, algorithm)
    kind, x = _as_array(x)
    if np.dtype(x.dtype).newbyteorder("=") not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"compression moves float32 or float64 arrays as 16-bit floats, got {x.dtype}")
    op, divide_by = _average(op, x, communicator)
    if op != MPI.SUM:
        raise ValueError("compression: only sums and averages compress (op 'sum' or 'average')")
    staged = None
    if kind is not arrays.HOST:
        # a device array is staged: copied to the host, rounded and summed there (the wire moves the 16-bit
        # words; the copy over the GPU's bus moves x's own type), the result copied back
        staged = _output(x if out is x else out, x.shape, x, kind)
        x, kind = arrays.as_host(x), arrays.HOST
        out = x                                  # the host copy is the call's own: reduced in place
    source = arrays.contiguous(x, kind)
    compression.residual(key, source)            # a buffer of another shape under this key: refused here
    result, copy_into = _output(x if out is x else out, x.shape, x, kind)
    finite = np.isfinite(source)
    non_finite = _NO_INDICES if finite.all() else np.flatnonzero(~finite)
    return _CompressedCall(communicator, compression, key, None if result is source else source, result, copy_into,
                           divide_by, non_finite, staged=staged)


_NO_INDICES = np.empty(0, np.intp)


def reduce_scatter(x, op="sum", *, comm=None, algorithm: str = "auto", out=None):
    """Reduce ``x`` over all ranks and keep this rank's share of axis 0.

    ``x.shape[0]`` must be a multiple of the rank count p; the result has
    shape ``(x.shape[0] // p, *x.shape[1:])``: rows ``rank * k`` to ``(rank+1) * k``.
    """
    return _reduce_scatter(x, op, comm, algorithm, out).run()


def allgather(x, *, comm=None, algorithm: str = "auto", out=None):
    """Every rank's ``x`` concatenated along axis 0, in rank order (a scalar gives shape (p,))."""
    return _allgather(x, comm, algorithm, out).run()


def broadcast(x, root: int = 0, *, comm=None, algorithm: str = "auto", out=None):
    """The root's ``x`` on every rank; other ranks pass an array of the same shape and dtype.

    Returns a new array unless ``out`` is given (``out=x`` overwrites ``x`` in place).
    """
    return _broadcast(x, root, comm, algorithm, out).run()


def iallreduce(x, op="sum", *, comm=None, algorithm: str = "auto", out=None, compression=None, key=None) -> Request:
    """:func:`allreduce`, started: returns a Request whose ``wait()`` gives the result.

    Leave ``x`` and ``out`` alone until then (:mod:`mpicoll.collectives.nonblocking`).  A compressed call
    copies ``x`` into its result before it returns (unless ``out`` is ``x``): ``x`` may change as soon as it
    has.
    """
    if compression is not None:
        return _compressed_allreduce(x, op, comm, algorithm, out, compression, key).start()
    return _allreduce(x, op, comm, algorithm, out).start()


def ireduce_scatter(x, op="sum", *, comm=None, algorithm: str = "auto", out=None) -> Request:
    """:func:`reduce_scatter`, started: returns a Request whose ``wait()`` gives the result."""
    return _reduce_scatter(x, op, comm, algorithm, out).start()


def iallgather(x, *, comm=None, algorithm: str = "auto", out=None) -> Request:
    """:func:`allgather`, started: returns a Request whose ``wait()`` gives the result."""
    return _allgather(x, comm, algorithm, out).start()


def ibroadcast(x, root: int = 0, *, comm=None, algorithm: str = "auto", out=None) -> Request:
    """:func:`broadcast`, started: returns a Request whose ``wait()`` gives the result."""
    return _broadcast(x, root, comm, algorithm, out).start()
