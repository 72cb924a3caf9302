"""Which memory an array lives in, and views of it without copies (see :mod:`mpicoll.arrays`)."""

from __future__ import annotations

import ctypes
import functools
import importlib

import numpy as np
from mpi4py import MPI

__all__ = ["HOST", "library", "is_device", "host_view", "device_view", "view", "is_contiguous", "is_c_contiguous",
           "flat"]

HOST = None     # library() of host memory

# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DEVICE_LIBRARIES = ("cupy", "numba-cuda")


# -- which memory ---------------------------------------------------------------------------

def _has_buffer(obj) -> bool:
    try:
        memoryview(obj).release()
        return True
    except TypeError:
        return False


@functools.lru_cache(maxsize=1)
def _cuda_driver():
    """The CUDA driver library, initialised, or None where there is none (no GPU on this machine)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return driver if driver.cuInit(0) == 0 else None


def _is_device_pointer(address: int) -> bool:
    """True when the CUDA driver knows ``address`` as device (or managed) memory."""
    driver = _cuda_driver()
    if driver is None or not address:
        return False
    memory_type = ctypes.c_uint(0)
    # CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2; CU_MEMORYTYPE_DEVICE = 2, _ARRAY = 3, _UNIFIED = 4
    status = driver.cuPointerGetAttribute(ctypes.byref(memory_type), 2, ctypes.c_void_p(address))
    return status == 0 and memory_type.value in (2, 3, 4)


def _device_viewer() -> str:
    """The library that views foreign CUDA arrays: CuPy, or Numba's CUDA target without it."""
    for name in _DEVICE_LIBRARIES:
        if _module(name) is not None:
            return name
    raise TypeError("this is a CUDA array, but neither CuPy nor Numba's CUDA target is installed to "
                    "view it: pip install 'mpicoll[gpu]' (CUDA 12) or 'mpicoll[gpu-cuda13]'")


@functools.lru_cache(maxsize=None)
def _module(name: str):
    """cupy or numba.cuda, or None when it cannot be imported."""
    try:
        return importlib.import_module("cupy" if name == "cupy" else "numba.cuda")
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return None


def library(obj) -> str | None:
    """``"cupy"`` or ``"numba-cuda"`` for an array in GPU memory (the library that serves it), None for host memory."""
    if isinstance(obj, np.ndarray):
        return HOST
    module = type(obj).__module__
    if module.startswith("cupy"):
        return "cupy"
    if module.startswith("numba") and hasattr(obj, "copy_to_host"):
        return "numba-cuda"
    if _has_buffer(obj):
        return HOST
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        kind = obj.__dlpack_device__()[0]
        if kind in (_DL_CPU, _DL_CUDA_HOST):
            return HOST
        if kind in (_DL_CUDA, _DL_CUDA_MANAGED):
            return "cupy" if _module("cupy") is not None else _no_dlpack_viewer()
        raise BufferError(f"{type(obj).__name__} lives on DLPack device type {kind}; mpicoll takes host "
                          "memory and CUDA devices")
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None and _is_device_pointer(interface["data"][0]):
        return _device_viewer()
    return HOST


def _no_dlpack_viewer():
    raise TypeError("this is a CUDA DLPack array; viewing it needs CuPy: pip install cupy-cuda12x "
                    "(or the wheel for your CUDA)")


def is_device(obj) -> bool:
    """True for arrays in GPU memory (CuPy, Numba, or any DLPack / CUDA-array-interface object)."""
    return library(obj) is not HOST


# -- views without copies -------------------------------------------------------------------

class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):     # the head of DLTensor (dlpack.h)
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64))]


_DL_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}


def _dlpack_layout(obj) -> tuple[np.dtype, tuple]:
    """The element type and shape a DLPack object declares (its capsule is read, not consumed)."""
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    try:          # DLPack 1.x: the tensor follows version, manager context, deleter and flags (32 bytes)
        capsule = obj.__dlpack__(max_version=(1, 0))
        tensor = _DLTensor.from_address(get_pointer(capsule, b"dltensor_versioned") + 32)
    except (TypeError, ValueError):      # a producer of DLPack 0.x (no max_version, or an unversioned capsule)
        capsule = obj.__dlpack__()
        tensor = _DLTensor.from_address(get_pointer(capsule, b"dltensor"))
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    del capsule                    # its destructor frees the producer's tensor: we did not consume it
    kind = _DL_KINDS.get(code)
    if kind is None or lanes != 1 or bits % 8:
        return np.dtype(np.uint8), (-1,)   # as mpi4py: bytes, to be typed by an explicit datatype
    return np.dtype("?" if kind == "b" else f"{kind}{bits // 8}"), shape


def _foreign_layout(obj) -> tuple[np.dtype, tuple]:
    """(dtype, shape) of an object known only by DLPack or the CUDA array interface (DLPack first, as mpi4py)."""
    if hasattr(obj, "__dlpack__"):
        return _dlpack_layout(obj)
    interface = obj.__cuda_array_interface__
    return np.dtype(interface["typestr"]), tuple(interface["shape"])


def host_view(obj, *, writable: bool = False) -> np.ndarray:
    """A 1-D numpy view of any host-memory array mpi4py takes, typed as the object declares itself.

    Raises mpi4py's BufferError for non-contiguous objects and for read-only
    ones when ``writable``, with what to pass instead.
    """
    if isinstance(obj, np.ndarray):
        array = obj
    elif _has_buffer(obj):
        view = memoryview(obj)
        try:
            array = np.asarray(view)
        except (ValueError, TypeError, NotImplementedError):   # a format numpy cannot read: its bytes
            array = np.frombuffer(view.cast("B"), np.uint8) if view.contiguous else np.asarray(view)
    else:
        interface = getattr(obj, "__cuda_array_interface__", None)
        if interface is None and not hasattr(obj, "__dlpack__"):
            raise TypeError(f"message: expecting buffer or list/tuple, got {type(obj).__name__}: pass an array "
                            "(numpy, anything with the buffer protocol, DLPack or __cuda_array_interface__)")
        dtype = _foreign_layout(obj)[0]
        try:
            raw = MPI.buffer(obj)
        except BufferError as error:
            raise BufferError(f"{type(obj).__name__}: {error}; pass a contiguous array") from None
        array = np.frombuffer(raw, np.uint8)
        if array.size % dtype.itemsize == 0:
            array = array.view(dtype)
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise BufferError(f"array of shape {array.shape} is not contiguous; pass a contiguous array "
                          "(numpy.ascontiguousarray) or use mpicoll.allreduce(), which accepts any layout")
    if writable and not array.flags.writeable:
        raise BufferError(f"{type(obj).__name__} is read-only; pass a writable buffer to receive into")
    return array.reshape(-1, order="A") if array.ndim != 1 else array


def device_view(obj, name: str | None = None):
    """(library, array): a CUDA array as a CuPy or Numba array, without a copy.  ``name``: its
    :func:`library`, where the caller has read it already."""
    name = library(obj) if name is None else name
    if name is HOST:
        raise TypeError(f"{type(obj).__name__} is in host memory, not a CUDA array")
    module = type(obj).__module__
    if module.startswith("cupy") or module.startswith("numba"):
        return name, obj
    if name == "cupy":
        cupy = _module("cupy")
        return name, (cupy.asarray(obj) if hasattr(obj, "__cuda_array_interface__") else cupy.from_dlpack(obj))
    return name, _module("numba-cuda").as_cuda_array(obj)


def view(obj, *, writable: bool = False):
    """(library, 1-D view) of any array mpi4py takes: numpy for host memory, CuPy/Numba for device memory."""
    name = library(obj)
    if name is HOST:
        return HOST, host_view(obj, writable=writable)
    return name, flat(device_view(obj, name)[1], "buffer")


def _flag(array, name: str) -> bool:
    """One of an array's flags ("C_CONTIGUOUS", ...): numpy and CuPy have attributes, real Numba a dict."""
    flags = array.flags
    return bool(flags.get(name) if isinstance(flags, dict) else flags[name])


def is_contiguous(array) -> bool:
    """C- or Fortran-contiguous, for numpy, CuPy and Numba arrays."""
    return _flag(array, "C_CONTIGUOUS") or _flag(array, "F_CONTIGUOUS")


def is_c_contiguous(array) -> bool:
    """C-contiguous: memory order is element order (what a result laid out like a packed input needs)."""
    return _flag(array, "C_CONTIGUOUS")


def flat(array, role: str = "array"):
    """A 1-D view of a contiguous array of any library; a non-contiguous one is refused, never copied.

    (Reshaping a strided device array would silently give a copy, or the same
    strided view, and a kernel writing through its pointer would miss the
    caller's elements or overwrite their neighbours.)
    """
    if array.ndim == 1 and (array.size <= 1 or array.strides[0] == array.dtype.itemsize):
        return array
    if not is_contiguous(array):
        raise BufferError(f"{role}: {type(array).__name__} of shape {array.shape} is not contiguous; pass a "
                          "contiguous array (ascontiguousarray) or use mpicoll.allreduce(), which accepts any layout")
    order = "F" if (array.ndim > 1 and not _flag(array, "C_CONTIGUOUS")) else "C"
    return array.reshape(array.size, order=order)


def _shaped_host(obj) -> np.ndarray:
    """A host-memory object as a numpy array of its own shape, without a copy."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__array__") or hasattr(obj, "__array_interface__") or _has_buffer(obj):
        return np.asarray(obj)          # numpy's own protocols (torch CPU tensors have __array__)
    return host_view(obj).reshape(_foreign_layout(obj)[1])
