"""The machine's GPUs, and whether the MPI library can read their memory (see :mod:`mpicoll.arrays`)."""

from __future__ import annotations

import ctypes
import functools
import os

from ..base import config
from .kinds import _module

__all__ = ["gpu_count", "device_name", "cuda_aware"]


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
    forced = config.cuda_aware()
    if forced is not None:
        return forced, f"forced by MPICOLL_CUDA_AWARE={os.environ['MPICOLL_CUDA_AWARE'].strip()}"
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
