"""The one place that knows kinds of arrays: where their memory is, how to view it, how to move it.

mpicoll takes every array mpi4py takes, and views it without copying:

=========================  =====================================================  ==========================
kind                       recognised by                                          viewed as
=========================  =====================================================  ==========================
numpy array                ``numpy.ndarray``                                      itself
buffer protocol            ``memoryview(obj)`` works (bytes, array.array, ...)    numpy, typed by its format
DLPack, host memory        ``__dlpack_device__()`` is CPU or CUDA-pinned host     numpy, through ``MPI.buffer``
CUDA array interface,      ``__cuda_array_interface__`` whose pointer the CUDA    numpy, through ``MPI.buffer``
host memory                driver does not know as device memory (always so
                           without a CUDA driver)
CuPy / Numba device array  the array's own library                                itself
DLPack / CAI on a GPU      a CUDA device type, or a device pointer                CuPy (or Numba for CAI)
=========================  =====================================================  ==========================

mpi4py's order decides for objects with several interfaces: the buffer
protocol first, then DLPack, then the CUDA array interface.  Host views come
from mpi4py's own ``MPI.buffer``, so what mpi4py refuses (non-contiguous,
read-only when written) is refused here with mpi4py's exception.

MPI reads device memory itself when the library is CUDA-aware
(:func:`cuda_aware`: ``MPICOLL_CUDA_AWARE=1`` or ``0`` forces the answer; Open
MPI's ``MPIX_Query_cuda_support()`` and MPICH's ``MPIX_GPU_query_support()``,
looked up in the MPI library the process loaded, where MPICH also needs
``MPIR_CVAR_ENABLE_GPU=1``); otherwise device data goes through pinned host buffers.

Device arrays (``library`` is ``"cupy"`` or ``"numba-cuda"``, the kernel
backend that serves them) get the uniform operations the collectives and the
training loops need: ``empty``, ``empty_like``, ``pinned`` host buffers,
``to_host``, ``from_host``, ``copy``, ``synchronize``, flat and byte views
that refuse non-contiguous arrays instead of silently copying them.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os

import numpy as np
from mpi4py import MPI

__all__ = ["HOST", "library", "is_device", "host_view", "device_view", "view", "is_contiguous", "flat",
           "byte_view", "empty", "empty_like", "pinned", "to_host", "from_host", "copy", "contiguous", "synchronize",
           "as_host", "copy_into", "Staging", "gpu_count", "device_name", "cuda_aware"]

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
        dtype = np.dtype(interface["typestr"]) if interface is not None and not hasattr(obj, "__dlpack__") \
            else _dlpack_layout(obj)[0]
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


def device_view(obj):
    """(library, array): a CUDA array as a CuPy or Numba array, without a copy."""
    name = library(obj)
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
    if library(obj) is HOST:
        return HOST, host_view(obj, writable=writable)
    name, array = device_view(obj)
    return name, flat(array, "buffer")


def is_contiguous(array) -> bool:
    """C- or Fortran-contiguous, for numpy, CuPy and Numba arrays (whose ``flags`` is a dict on a GPU)."""
    flags = array.flags
    if isinstance(flags, dict):
        return bool(flags.get("C_CONTIGUOUS") or flags.get("F_CONTIGUOUS"))
    return bool(flags.c_contiguous or flags.f_contiguous)


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
    order = "F" if (array.ndim > 1 and not _c_contiguous(array)) else "C"
    return array.reshape(array.size, order=order)


def _c_contiguous(array) -> bool:
    flags = array.flags
    return bool(flags["C_CONTIGUOUS"] if isinstance(flags, dict) else flags.c_contiguous)


def byte_view(array):
    """A flat uint8 view of a contiguous array of any library."""
    return flat(array).view(np.uint8)


# -- allocation and transfers ----------------------------------------------------------------

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


def contiguous(array):
    """``array`` itself when contiguous, else a contiguous copy of it on the same device (or host)."""
    if isinstance(array, np.ndarray):
        return array if array.flags.c_contiguous else np.ascontiguousarray(array)
    if is_contiguous(array):
        return array
    if library(array) == "cupy":
        return _module("cupy").ascontiguousarray(array)
    return _module("numba-cuda").to_device(np.ascontiguousarray(array.copy_to_host()))


def synchronize(library_name: str) -> None:
    """Wait for the work queued on the library's current stream (before MPI reads device memory)."""
    if library_name == "cupy":
        _module("cupy").cuda.get_current_stream().synchronize()
    elif library_name == "numba-cuda":
        _module("numba-cuda").synchronize()


def _shaped_host(obj) -> np.ndarray:
    """A host-memory object as a numpy array of its own shape, without a copy."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__array__") or hasattr(obj, "__array_interface__") or _has_buffer(obj):
        return np.asarray(obj)          # numpy's own protocols (torch CPU tensors have __array__)
    interface = getattr(obj, "__cuda_array_interface__", None)
    shape = interface["shape"] if interface is not None and not hasattr(obj, "__dlpack__") else _dlpack_layout(obj)[1]
    return host_view(obj).reshape(shape)


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


# -- the machine's GPUs, and whether MPI can read their memory -----------------------------

def _mpi_library() -> ctypes.CDLL | None:
    """The MPI shared library this process loaded (found in /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and line.split()[-1].startswith("/")}
    except OSError:
        return None
    for path in sorted(paths, key=len):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def cuda_aware() -> tuple[bool, str]:
    """(whether device buffers can go to MPI directly, why we think so)."""
    forced = os.environ.get("MPICOLL_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"forced by MPICOLL_CUDA_AWARE={forced}"
    library = _mpi_library()
    if library is not None and hasattr(library, "MPIX_Query_cuda_support"):
        supported = bool(library.MPIX_Query_cuda_support())
        return supported, f"MPIX_Query_cuda_support() returned {int(supported)}"
    if library is not None and hasattr(library, "MPIX_GPU_query_support"):
        answer = ctypes.c_int(0)
        library.MPIX_GPU_query_support(0, ctypes.byref(answer))   # 0: MPIX_GPU_SUPPORT_CUDA
        enabled = os.environ.get("MPIR_CVAR_ENABLE_GPU", "0") not in ("0", "")
        supported = bool(answer.value) and enabled
        return supported, (f"MPIX_GPU_query_support(CUDA) returned {answer.value}; "
                           f"MPIR_CVAR_ENABLE_GPU={'1' if enabled else 'unset or 0'}")
    return False, "the MPI library offers no CUDA query: assuming not CUDA-aware"



def gpu_count() -> tuple[int, str]:
    """(CUDA devices this process can use, the first one's name or why there is none)."""
    cupy = _module("cupy")
    if cupy is not None:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
            if count:
                return count, f"{device_name(cupy.cuda.runtime.getDeviceProperties(0)['name'])} (CuPy)"
        except Exception:  # noqa: BLE001 - CuPy without a driver: try Numba
            pass
    cuda = _module("numba-cuda")
    if cuda is not None:
        from numba import config
        if config.ENABLE_CUDASIM:
            return 0, "Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)"
        if cuda.is_available():
            return len(cuda.gpus), f"{device_name(cuda.get_current_device().name)} (Numba)"
    return 0, "no CUDA device found"


def device_name(name) -> str:
    """A device name as text: CuPy and older Numba give bytes, current numba-cuda gives str."""
    return name.decode() if isinstance(name, bytes) else str(name)
