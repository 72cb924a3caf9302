"""CUDA sources of mpicoll's device kernels, installed as package data ``mpicoll.kernels``.

:mod:`mpicoll.compute.sources` finds them (here in a checkout, in the installed
package otherwise) and :mod:`mpicoll.compute.cupy_kernels` compiles them.
"""
