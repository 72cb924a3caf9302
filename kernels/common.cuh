// Shared definitions for mpicoll's CUDA kernels: element types and a grid-stride loop.
#pragma once
#include <cuda_fp16.h>

// Every kernel walks the array with a grid-stride loop, so any launch size covers any n.
#define MPICOLL_FOR_EACH(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// Arithmetic is done in a wider "compute" type: float for __half, the type itself otherwise.
template <typename T> struct compute { typedef T type; };
template <> struct compute<__half> { typedef float type; };

template <typename T> __device__ __forceinline__ typename compute<T>::type load(T v) { return v; }
template <> __device__ __forceinline__ float load<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T store(typename compute<T>::type v) { return v; }
template <> __device__ __forceinline__ __half store<__half>(float v) { return __float2half(v); }
