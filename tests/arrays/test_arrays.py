"""mpicoll.arrays: every kind of array is recognised, viewed without a copy, and moved correctly.

Where real GPU libraries behave differently from Numba's CUDA simulator, the
tests use small fakes that behave like the real library: Numba device arrays
whose ``flags`` is a dict, and CuPy arrays whose ``set()`` from host memory is
asynchronous (the copy reads the host buffer when the stream is synchronised).
"""

from __future__ import annotations

import array
import sys
import types

import numpy as np
import pytest

import mpicoll
from mpicoll import arrays
from mpicoll.arrays import kinds
from tests.support.gpus import DLPackOnly, InterfaceOnly, numba_cuda_or_skip
from tests.support.mpi import P, RANK, WORLD, everywhere


@pytest.mark.parametrize("make", [np.asarray, lambda v: array.array("d", v), lambda v: memoryview(np.asarray(v)),
                                  lambda v: DLPackOnly(np.asarray(v)), lambda v: InterfaceOnly(np.asarray(v))],
                         ids=["numpy", "array.array", "memoryview", "dlpack", "cuda-array-interface"])
def test_host_memory_of_every_kind_is_viewed_without_a_copy(make):
    values = np.arange(6, dtype=np.float64)
    obj = make(values.copy())
    assert arrays.library(obj) is None and not arrays.is_device(obj)
    view = arrays.host_view(obj, writable=True)
    assert view.dtype == np.float64 and view.tolist() == values.tolist()
    view[0] = 42.0                                   # writes reach the caller's memory
    assert arrays.host_view(obj)[0] == 42.0


def test_shapes_survive_as_host_and_staging():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    for obj in (DLPackOnly(values), InterfaceOnly(values)):
        host = arrays.as_host(obj)
        assert host.shape == (2, 3) and np.array_equal(host, values)
        staged = arrays.Staging(6, np.float32, "the model has {size} {dtype} parameters").host(obj)
        assert np.array_equal(staged, values.ravel())
    with pytest.raises(ValueError, match="the model has 5 float32 parameters"):
        arrays.Staging(5, np.float32, "the model has {size} {dtype} parameters").host(DLPackOnly(values))


def test_refusals_name_the_problem():
    with pytest.raises(BufferError, match="not contiguous"):
        arrays.host_view(np.zeros(8)[::2])
    with pytest.raises(BufferError, match="read-only"):
        arrays.host_view(bytes(8), writable=True)
    with pytest.raises(BufferError, match="read-only"):
        arrays.host_view(DLPackOnly(np.frombuffer(bytes(32))), writable=True)
    with pytest.raises(TypeError, match="expecting buffer"):
        arrays.host_view(object())


def test_device_names_are_text_for_every_library_version():
    assert arrays.device_name(b"NVIDIA H100") == arrays.device_name("NVIDIA H100") == "NVIDIA H100"


def _numba_with_dict_flags(cuda):
    """A device array class whose ``flags`` is a dict, as real Numba's is (the simulator's is numpy's)."""
    simulated = type(cuda.device_array(1))
    if not hasattr(cuda.device_array(1), "_ary"):
        pytest.skip("a real GPU: its Numba arrays have dict flags themselves")

    class DictFlags(simulated):
        @property
        def flags(self):
            f = self._ary.flags
            return {"C_CONTIGUOUS": f.c_contiguous, "F_CONTIGUOUS": f.f_contiguous, "WRITEABLE": f.writeable}

    DictFlags.__module__ = simulated.__module__
    return lambda values: DictFlags(np.ascontiguousarray(values))


def test_numba_arrays_with_dict_flags_are_flat_viewed():
    cuda = numba_cuda_or_skip()
    device_array = _numba_with_dict_flags(cuda)(np.arange(6.0).reshape(2, 3))
    assert isinstance(device_array.flags, dict) and arrays.is_contiguous(device_array)
    assert arrays.flat(device_array).shape == (6,)


@pytest.mark.mpi
def test_collectives_take_numba_arrays_with_dict_flags():
    cuda = numba_cuda_or_skip()
    make = _numba_with_dict_flags(cuda)
    values = np.full((2, 3), RANK + 1.0)
    out = make(np.zeros((2, 3)))
    with mpicoll.Communicator(WORLD) as comm:
        comm.Allreduce(make(values), out)
    everywhere(np.array_equal(out.copy_to_host(), np.full((2, 3), P * (P + 1) / 2)), "wrong Allreduce")


def test_strided_device_arrays_are_refused_by_kernels_not_silently_copied():
    cuda = numba_cuda_or_skip()
    from mpicoll import compute
    w, g = cuda.to_device(np.ones(8)), cuda.to_device(np.ones(8))
    with pytest.raises(BufferError, match="not contiguous"):
        compute.sgd(w[::2], g[::2], 0.5)
    with pytest.raises(BufferError, match="not contiguous"):
        arrays.from_host(np.zeros(4), w[::2])


@pytest.mark.mpi
def test_array_api_reduces_strided_device_arrays():
    cuda = numba_cuda_or_skip()
    data = cuda.to_device(np.arange(8.0) * (RANK + 1))
    result = mpicoll.allreduce(data[::2])
    everywhere(np.array_equal(result.copy_to_host(), np.arange(0, 8.0, 2) * P * (P + 1) / 2), "wrong result")


class _AsyncCupy:
    """Enough of CuPy for the staged collectives, with its asynchrony: ``set()`` from host
    memory is queued on the stream and reads the host buffer only when the stream is synchronised."""

    queued: list = []

    def __init__(self, values):
        self._a = values

    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)

    def __getitem__(self, index):
        return _AsyncCupy(self._a[index])

    def __setitem__(self, index, value):
        self._a[index] = value._a if isinstance(value, _AsyncCupy) else value

    def view(self, dtype):
        return _AsyncCupy(self._a.view(dtype))

    def reshape(self, *shape, order="C"):
        return _AsyncCupy(self._a.reshape(*shape, order=order))

    def get(self, out):
        _AsyncCupy.synchronize()
        out[...] = self._a

    def set(self, host):
        _AsyncCupy.queued.append((self._a, host))

    @staticmethod
    def synchronize():
        for target, source in _AsyncCupy.queued:
            target[...] = source
        _AsyncCupy.queued.clear()


_AsyncCupy.__module__ = "cupy"


@pytest.fixture
def async_cupy(monkeypatch):
    stream = types.SimpleNamespace(synchronize=_AsyncCupy.synchronize)
    fake = types.SimpleNamespace(empty=lambda shape, dtype: _AsyncCupy(np.empty(shape, dtype)),
                                 cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=np.empty))
    kinds._module.cache_clear()
    yield _AsyncCupy
    kinds._module.cache_clear()


@pytest.mark.mpi
def test_staged_broadcasts_never_reuse_a_pinned_buffer_still_being_copied(async_cupy):
    """``for p in params: comm.Bcast(p)``: each array gets its own data, not a later one's."""
    params = [async_cupy(np.full(4, float(i) if RANK == 0 else -1.0)) for i in range(3)]
    with mpicoll.Communicator(WORLD) as comm:
        for p in params:
            comm.Bcast(p, root=0)
    async_cupy.synchronize()
    got = [p._a.tolist() for p in params]
    everywhere(got == [[float(i)] * 4 for i in range(3)], f"broadcast arrays hold {got}")
