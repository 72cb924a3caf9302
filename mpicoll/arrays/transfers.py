"""Allocating device and pinned memory, and moving data between host and GPU (see :mod:`mpicoll.arrays`).

Every copy here has completed when its call returns, so a caller may reuse
(or free) the buffer it copied from at once.
"""

from __future__ import annotations

import importlib

import numpy as np

from .kinds import HOST, _module, _shaped_host, device_view, flat, is_c_contiguous, is_contiguous, is_device, library

__all__ = ["empty", "empty_like", "pinned", "to_host", "from_host", "copy", "contiguous", "synchronize", "as_host",
           "copy_into", "Staging"]


def empty(library_name: str | None, shape, dtype):
    """An uninitialised array of ``library_name`` (None: numpy)."""
    if library_name is HOST:
        return np.empty(shape, dtype)
    if library_name == "cupy":
        return _module("cupy").empty(shape, dtype)
    return _module("numba-cuda").device_array(shape, np.dtype(dtype))


def empty_like(array, shape=None):
    """An uninitialised array of ``array``'s library and dtype (and shape, unless given)."""
    name = library(array)
    if name is not HOST:
        array = device_view(array)[1]
    return empty(name, array.shape if shape is None else shape, array.dtype)


def pinned(library_name: str, count: int, dtype) -> np.ndarray:
    """A page-locked host array (fast, asynchronous copies to and from the GPU)."""
    if library_name == "cupy":
        return importlib.import_module("cupyx").empty_pinned(count, dtype)
    return _module("numba-cuda").pinned_array(count, dtype)


def to_host(device_array, host: np.ndarray) -> None:
    """Copy a contiguous CUDA array into the host array ``host`` (same size); returns when done."""
    name, array = device_view(device_array)
    array, host = flat(array, "device array"), host.reshape(-1)
    if array.size:
        array.get(out=host) if name == "cupy" else array.copy_to_host(host)


def from_host(host: np.ndarray, device_array) -> None:
    """Copy host values into a contiguous CUDA array of the same size; returns when the copy is done."""
    name, array = device_view(device_array)
    array, host = flat(array, "device array"), np.ascontiguousarray(host).reshape(-1)
    if array.size:
        if name == "cupy":
            array.set(host)
            synchronize(name)        # set() may be asynchronous from pinned memory: the caller reuses host
        else:
            array.copy_to_device(host)


def copy(source, target) -> None:
    """``target[...] = source`` for two arrays of one kind: numpy, CuPy (any layout) or contiguous Numba."""
    if isinstance(target, np.ndarray) or library(target) == "cupy":
        target[...] = source
    elif target.size:
        if not (is_contiguous(target) and is_contiguous(source)):
            raise BufferError(f"Numba device arrays copy only when contiguous (shapes {source.shape} to "
                              f"{target.shape}); pass contiguous arrays")
        target.copy_to_device(source)


def contiguous(array, name: str | None = None):
    """``array`` itself when C-contiguous (and, on the host, in the machine's byte order), else such a copy of it
    on the same device (or host).  ``name``: its library, where the caller has read it already.

    C order, not any contiguity: a Fortran-ordered array's memory holds its
    elements in another order than a packed result's (measured: an in-place
    allreduce of a transposed array came back transposed).  The byte order, since MPI's datatypes are the
    machine's: a big-endian float32 read as a float32 sums to garbage.
    """
    if isinstance(array, np.ndarray):
        if array.flags.c_contiguous and array.dtype.isnative:
            return array
        return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    if is_c_contiguous(array):
        return array
    if (library(array) if name is None else name) == "cupy":
        return _module("cupy").ascontiguousarray(array)
    return _module("numba-cuda").to_device(np.ascontiguousarray(array.copy_to_host()))


def synchronize(library_name: str) -> None:
    """Wait for the work queued on the library's current stream (before MPI reads device memory)."""
    if library_name == "cupy":
        _module("cupy").cuda.get_current_stream().synchronize()
    elif library_name == "numba-cuda":
        _module("numba-cuda").synchronize()


def as_host(array) -> np.ndarray:
    """``array`` as a host array: host memory as it is (no copy), a CUDA array copied over."""
    if not is_device(array):
        return _shaped_host(array)
    array = device_view(array)[1]
    host = np.empty(array.shape, array.dtype)
    to_host(array, host)
    return host


def copy_into(out, host: np.ndarray) -> None:
    """Copy host values into ``out``: a host array (any layout) or a contiguous CUDA array."""
    if is_device(out):
        from_host(host, out)
    else:
        np.copyto(out, host.reshape(out.shape))


class Staging:
    """Gradients as flat host arrays of one size and dtype: host ones as they are, CUDA ones
    copied into one reused buffer (nothing allocated per step).  ``refusal`` completes the
    error for a gradient that does not fit, e.g. "the servers hold {size} {dtype} parameters"."""

    def __init__(self, size: int, dtype, refusal: str):
        self.size, self.dtype, self.refusal = size, np.dtype(dtype), refusal
        self._buffer: np.ndarray | None = None

    def host(self, gradient) -> np.ndarray:
        device = is_device(gradient)
        gradient = device_view(gradient)[1] if device else _shaped_host(gradient)
        if gradient.size != self.size or np.dtype(gradient.dtype) != self.dtype:
            raise ValueError(f"gradient of {gradient.size} {np.dtype(gradient.dtype)} values; "
                             + self.refusal.format(size=self.size, dtype=self.dtype))
        if not device:
            return np.ascontiguousarray(gradient).reshape(-1)
        if self._buffer is None:
            self._buffer = np.empty(self.size, self.dtype)
        to_host(gradient, self._buffer)
        return self._buffer
