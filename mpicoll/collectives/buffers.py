"""Read mpi4py buffer specifications as typed views over the caller's memory.

mpicoll's algorithms work on flat arrays; users hand over whatever mpi4py
accepts, read by mpi4py's rules (``message_simple`` in its ``msgbuffer.pxi``):

- ``buf``: any array of :mod:`mpicoll.arrays` (buffer protocol, DLPack,
  CUDA array interface; host or device), typed by its own format;
- ``[buf, datatype]``, ``[buf, count]``, ``[buf, (count, displ)]``;
- ``[buf, count, datatype]``, ``[buf, (count, displ), datatype]``;
- ``[buf, count, displ, datatype]``;
- ``None`` (or ``MPI.BOTTOM``) as ``buf`` with a datatype: an empty message.

A datatype is an ``MPI.Datatype`` or a type code string (``"f"``, ``"i4"``).
Counts and displacements are in datatype elements.  Where a collective
splits a buffer into ``blocks`` (one per rank), an explicit count is the count
of *one* block and an implied count must divide evenly, as in mpi4py.  Each
specification becomes a :class:`Message` that shares memory with the caller's
object, so results land where the caller expects them; nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from .. import arrays

__all__ = ["Message", "read_message", "is_in_place", "numpy_dtype"]


@dataclass(frozen=True)
class Message:
    """A contiguous run of ``array.size`` elements of ``datatype``.

    ``array`` is a 1-D view of the caller's memory: numpy for host memory,
    CuPy or Numba for device memory (``library`` names which; None for host).
    Its dtype mirrors the MPI datatype when numpy has an equivalent; otherwise
    it is an opaque ``V<size>`` record, enough to copy and send elements while
    MPI itself reduces them.  ``native`` is False for datatypes whose elements
    are not laid out back to back (vectors, resized types): those are left to
    the MPI library.
    """

    array: object
    datatype: MPI.Datatype
    native: bool = True
    library: str | None = None

    @property
    def count(self) -> int:
        return self.array.size

    @property
    def nbytes(self) -> int:
        return self.array.size * self.array.dtype.itemsize

    @property
    def on_device(self) -> bool:
        return self.library is not None


def is_in_place(spec) -> bool:
    """True for the specifications mpi4py reads as "the data is in recvbuf"."""
    return spec is None or spec is MPI.IN_PLACE


def numpy_dtype(datatype: MPI.Datatype) -> np.dtype:
    """The numpy dtype of one element of ``datatype`` (opaque bytes if numpy has none)."""
    try:
        dtype = dtlib.to_numpy_dtype(datatype)
    except (ValueError, TypeError, KeyError):
        return np.dtype((np.void, datatype.size))
    if dtype.itemsize != datatype.size or dtype.subdtype is not None:
        return np.dtype((np.void, datatype.size))
    return dtype


def _lookup(code: str) -> MPI.Datatype:
    """mpi4py's datatype for a type code or format string.

    (mpi4py reads an untyped buffer's format "B" as MPI.BYTE, on which MPI
    defines no arithmetic; here it is MPI.UNSIGNED_CHAR, as for numpy's uint8,
    so byte buffers can be summed too.)
    """
    try:
        return MPI._typedict[code]          # as mpi4py: no byte-order prefix ("<f", ">f", "=f" are refused)
    except KeyError:
        raise KeyError(f"cannot map {code!r} to an MPI datatype; pass [buf, datatype] with an MPI.Datatype "
                       "such as MPI.FLOAT") from None


def _as_datatype(datatype) -> MPI.Datatype:
    if isinstance(datatype, MPI.Datatype):
        return datatype
    return _lookup(datatype)


def _is_datatype(item) -> bool:
    return isinstance(item, (MPI.Datatype, str))


def _split_spec(spec):
    """(buffer, count, displacement, datatype), each None where not given, by mpi4py's rules."""
    if isinstance(spec, (list, tuple)):
        count = displ = datatype = None
        if len(spec) == 2:
            buf, count = spec
            if _is_datatype(count):
                count, datatype = None, count
            elif isinstance(count, (list, tuple)):
                count, displ = count
        elif len(spec) == 3:
            buf, count, datatype = spec
            if isinstance(count, (list, tuple)):
                count, displ = count
        elif len(spec) == 4:
            buf, count, displ, datatype = spec
        else:
            raise ValueError(f"message: expecting 2 to 4 items, got {len(spec)}: pass buf, [buf, datatype], "
                             "[buf, count, datatype] or [buf, count, displ, datatype]")
        return buf, count, displ, datatype
    if spec is None or isinstance(spec, (int, float, str)):
        raise TypeError(f"message: expecting buffer or list/tuple, got {type(spec).__name__}")
    return spec, None, None, None


def _index(value, what: str) -> int:
    try:
        number = value.__index__()
    except AttributeError:
        raise TypeError(f"message: {what} must be an integer, got {type(value).__name__}") from None
    if number < 0:
        raise ValueError(f"message: negative {what} {number}")
    return number


_PLAIN: dict[str, MPI.Datatype] = {}


def _plain_array(array: np.ndarray, writable: bool) -> Message | None:
    """The common case, quickly: a C-contiguous numpy array of a type MPI names."""
    if not array.flags.c_contiguous or (writable and not array.flags.writeable) or not array.dtype.isnative:
        return None
    code = array.dtype.char
    datatype = _PLAIN.get(code)
    if datatype is None:
        if code not in MPI._typedict or array.dtype.fields is not None:
            return None
        datatype = _PLAIN[code] = _lookup(code)
    return Message(array.reshape(-1), datatype)


def read_message(spec, *, writable: bool = False, role: str = "buffer", blocks: int = 0) -> Message:
    """Interpret one mpi4py buffer specification (not IN_PLACE) as a :class:`Message`.

    ``blocks`` >= 2: the buffer holds that many blocks (one per rank), and an
    explicit count is the count of one block; the Message spans all of them.
    """
    if type(spec) is np.ndarray and (blocks < 2 or spec.size % blocks == 0):
        message = _plain_array(spec, writable)
        if message is not None:
            return message
    buf, count, displ, datatype = _split_spec(spec)
    if buf is None or buf is MPI.BOTTOM:
        if datatype is None:
            raise KeyError(f"{role}: a buffer of None needs a datatype, e.g. [None, MPI.INT]")
        if count is not None and _index(count, "count") > 0:
            raise ValueError(f"{role}: buffer is None but count is {count}")
        if buf is MPI.BOTTOM and count:
            raise NotImplementedError(f"{role}: MPI.BOTTOM with absolute addresses is not supported by mpicoll; "
                                      "call mpi4py's communicator for it")
        datatype = _as_datatype(datatype)
        return Message(np.empty(0, numpy_dtype(datatype)), datatype)
    try:
        library, array = arrays.view(buf, writable=writable)
    except BufferError as error:
        raise BufferError(f"{role}: {error}") from None
    if datatype is None and array.dtype.kind == "V":
        raise KeyError(f"{role}: cannot map {array.dtype} to an MPI datatype; pass [buf, datatype]")
    if datatype is None and not array.dtype.isnative:    # MPI's datatypes are the machine's byte order
        raise BufferError(f"{role}: format string '{array.dtype.byteorder}{array.dtype.char}' with non-native byte "
                          f"order, which MPI's datatypes do not describe (mpi4py refuses it too): convert it with "
                          f"array.astype(array.dtype.newbyteorder('='))")
    datatype = _lookup(array.dtype.char) if datatype is None else _as_datatype(datatype)
    raw = array.view(np.uint8)
    size, extent, lb = datatype.size, datatype.extent, datatype.lb
    start = 0
    if displ is not None and _index(displ, "displacement") > 0:
        if extent <= 0:
            raise ValueError(f"{role}: cannot handle displacement, datatype extent {extent}")
        start = displ * extent
        if start > raw.size:
            raise ValueError(f"{role}: displacement {displ} out of bounds, buffer has {raw.size // extent} elements")
    length = raw.size - start
    if count is not None:
        count = _index(count, "count")
    elif length == 0:
        count = 0
    else:
        if extent <= 0:
            raise ValueError(f"{role}: cannot infer count, datatype extent {extent}")
        if length % extent:
            raise ValueError(f"{role}: cannot infer count, buffer length {length} is not a multiple of "
                             f"datatype extent {extent}")
        count = length // extent
        if blocks >= 2:
            if count % blocks:
                raise ValueError(f"{role}: cannot infer count, number of entries {count} is not a multiple of "
                                 f"the required number of blocks {blocks} (one per rank)")
            count //= blocks
    elements = count * max(blocks, 1)
    end = start + elements * extent
    if end > raw.size:
        raise ValueError(f"{role}: {elements} elements at displacement {displ or 0} need {end} bytes, "
                         f"buffer has {raw.size}")
    contiguous = size == extent and lb == 0
    dtype = numpy_dtype(datatype) if contiguous else np.dtype((np.void, extent))
    if library is not None and dtype.kind == "V":
        raise TypeError(f"{role}: device arrays travel as numeric datatypes; {datatype.Get_name() or 'this datatype'} "
                        "has no numpy equivalent: pass a contiguous numeric datatype")
    return Message(raw[start:end].view(dtype), datatype, native=contiguous, library=library)
