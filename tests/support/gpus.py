"""Device libraries where they can run here, or a skip saying why; host memory in foreign clothes."""

from __future__ import annotations

import pytest

__all__ = ["numba_cuda_or_skip", "cupy_or_skip", "DLPackOnly", "InterfaceOnly"]


def numba_cuda_or_skip():
    """numba.cuda when it can run kernels here (a GPU, or the simulator), else skip the test."""
    pytest.importorskip("numba", reason="the numba extra is not installed")
    try:
        from numba import cuda
    except ImportError as error:
        pytest.skip(f"numba's CUDA target is not installed: {error}")
    if not cuda.is_available():
        pytest.skip("no CUDA device and NUMBA_ENABLE_CUDASIM is unset")
    return cuda


def cupy_or_skip():
    """cupy when it has a CUDA device here, else skip the test (with the reason)."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the gpu extra)")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("CuPy found no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as error:
        pytest.skip(f"CuPy found no CUDA device: {error}")
    return cupy


class DLPackOnly:
    """Host memory seen only through DLPack (torch CPU tensors, mpi4py's tests' dlpack backends)."""

    def __init__(self, values):
        self.values = values

    def __dlpack__(self, **kwargs):
        return self.values.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.values.__dlpack_device__()


class InterfaceOnly:
    """Host memory seen only through ``__cuda_array_interface__`` (mpi4py's tests' fake GPU arrays)."""

    def __init__(self, values):
        self.values = values
        self.__cuda_array_interface__ = {"shape": values.shape, "typestr": values.dtype.str, "strides": None,
                                         "data": (values.ctypes.data, not values.flags.writeable), "version": 3}
