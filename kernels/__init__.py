"""CUDA sources of mpicoll's device kernels, installed as package data ``mpicoll.kernels``.

``reduce.cu``: reductions ``out = a (op) b`` for the collectives; ``optim.cu``: fused
optimizer updates (DC-ASGD, DC-ASGD-a, staleness-scaled SGD, Adagrad, push-sum mixing);
``common.cuh``: their shared helpers.  :mod:`mpicoll.compute.cupy_kernels` compiles them
once per process with CuPy.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["SOURCES", "directory", "source"]

SOURCES = ("reduce.cu", "optim.cu")


def directory() -> Path:
    """The folder holding the sources (the include path for ``common.cuh``)."""
    return Path(str(resources.files(__name__)))


def source(name: str) -> str:
    """The text of one source file."""
    return (directory() / name).read_text()
