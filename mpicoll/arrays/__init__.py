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
``to_host``, ``from_host``, ``copy``, ``synchronize``, and flat views that
refuse non-contiguous arrays instead of silently copying them.

Three modules: :mod:`.kinds` (which memory, views), :mod:`.transfers`
(allocation and copies), :mod:`.gpus` (devices and CUDA-aware MPI).
"""

from .gpus import cuda_aware, device_name, gpu_count
from .kinds import HOST, device_view, flat, host_view, is_c_contiguous, is_contiguous, is_device, library, view
from .transfers import (Staging, as_host, contiguous, copy, copy_into, empty, empty_like, from_host, pinned,
                        synchronize, to_host)

__all__ = ["HOST", "library", "is_device", "host_view", "device_view", "view", "is_contiguous", "is_c_contiguous", "flat", "empty",
           "empty_like", "pinned", "to_host", "from_host", "copy", "contiguous", "synchronize", "as_host",
           "copy_into", "Staging", "gpu_count", "device_name", "cuda_aware"]
