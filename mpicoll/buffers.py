"""Read mpi4py buffer specifications as typed numpy views over the caller's memory.

mpicoll's algorithms work on flat numpy arrays; users hand over whatever mpi4py
accepts: a buffer, ``[buf, datatype]``, ``[buf, count, datatype]``,
``[buf, (count, displ), datatype]``, ``MPI.IN_PLACE`` or ``None``.  This module
turns each of those into a :class:`Message` that shares memory with the
caller's object, so results are written where the caller expects them and no
byte is copied on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

__all__ = ["Message", "read_message", "is_in_place", "numpy_dtype"]


@dataclass(frozen=True)
class Message:
    """A contiguous run of ``array.size`` elements of ``datatype``.

    ``array`` is a 1-D view of the caller's memory.  Its numpy dtype mirrors
    the MPI datatype when numpy has an equivalent; otherwise it is an opaque
    ``V<size>`` record, which is enough to copy and send elements while
    MPI itself reduces them.  ``native`` is False for datatypes whose elements
    are not laid out back to back (vectors, resized types): those are left to
    the MPI library.
    """

    array: np.ndarray
    datatype: MPI.Datatype
    native: bool = True

    @property
    def count(self) -> int:
        return self.array.size

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


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


def _as_datatype(datatype) -> MPI.Datatype:
    if isinstance(datatype, MPI.Datatype):
        return datatype
    if isinstance(datatype, (str, np.dtype, type)):
        return MPI.Datatype.fromcode(np.dtype(datatype).char)
    raise TypeError(f"expected an MPI.Datatype or a type code, got {datatype!r}")


def _split_spec(spec):
    """(buffer, count or None, displacement, datatype or None) from a specification."""
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            buf, datatype = spec
            return buf, None, 0, _as_datatype(datatype)
        if len(spec) == 3:
            buf, count, datatype = spec
            if isinstance(count, (list, tuple)):
                count, displ = count
            else:
                displ = 0
            return buf, int(count), int(displ), _as_datatype(datatype)
        raise ValueError(
            f"a message is buf, [buf, datatype] or [buf, count, datatype]; got a {len(spec)}-item {type(spec).__name__}"
        )
    return spec, None, 0, None


def _raw_bytes(buf, writable: bool) -> tuple[np.ndarray, str | None]:
    """All bytes of ``buf`` as a 1-D uint8 view, plus the element type code it advertises."""
    array = buf if isinstance(buf, np.ndarray) else np.asarray(memoryview(buf))
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise BufferError(
            f"buffer of shape {array.shape} is not contiguous; pass a contiguous array "
            "(np.ascontiguousarray) or use mpicoll.allreduce(), which accepts any array"
        )
    if writable and not array.flags.writeable:
        raise BufferError("receive buffer is read-only; pass a writable array")
    code = array.dtype.char if isinstance(buf, np.ndarray) else memoryview(buf).format
    flat = array.reshape(-1, order="A")
    return flat.view(np.uint8), code


_PLAIN: dict[str, MPI.Datatype] = {}


def _plain_array(array: np.ndarray, writable: bool) -> Message | None:
    """The common case, quickly: a C-contiguous numpy array of a type MPI names."""
    if not array.flags.c_contiguous or (writable and not array.flags.writeable):
        return None
    code = array.dtype.char
    datatype = _PLAIN.get(code)
    if datatype is None:
        if code in ("V", "O", "S", "U", "M", "m") or array.dtype.fields is not None:
            return None
        try:
            datatype = _PLAIN[code] = MPI.Datatype.fromcode(code)
        except (ValueError, KeyError):
            return None
    return Message(array.reshape(-1), datatype)


def read_message(spec, *, writable: bool = False, role: str = "buffer") -> Message:
    """Interpret one mpi4py buffer specification (not IN_PLACE) as a :class:`Message`."""
    if type(spec) is np.ndarray:
        message = _plain_array(spec, writable)
        if message is not None:
            return message
    buf, count, displ, datatype = _split_spec(spec)
    raw, code = _raw_bytes(buf, writable)
    if datatype is None:
        datatype = MPI.Datatype.fromcode(code) if code and code not in ("c", "V") else MPI.BYTE
    size, extent, lb = datatype.size, datatype.extent, datatype.lb
    if extent <= 0:
        raise ValueError(f"{role}: datatype of extent {extent} cannot describe a message")
    if count is None:
        if raw.size % extent:
            raise ValueError(
                f"{role}: buffer of {raw.size} bytes is not a whole number of {extent}-byte elements"
            )
        count = raw.size // extent
    start = displ * extent
    end = start + count * extent
    if count < 0 or displ < 0 or end > raw.size:
        raise ValueError(
            f"{role}: {count} elements at displacement {displ} need {end} bytes, buffer has {raw.size}"
        )
    contiguous = size == extent and lb == 0
    dtype = numpy_dtype(datatype) if contiguous else np.dtype((np.void, extent))
    return Message(raw[start:end].view(dtype), datatype, native=contiguous)
