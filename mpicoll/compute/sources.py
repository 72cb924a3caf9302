"""Where the CUDA sources are: the top-level ``kernels/`` folder of a checkout, or the
``mpicoll/kernels`` package data of an installed mpicoll.

``reduce.cu``: reductions ``out = a (op) b`` for the collectives; ``optim.cu``: the
fused optimizer updates; ``common.cuh``: their shared helpers.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["SOURCES", "directory", "source"]

SOURCES = ("reduce.cu", "optim.cu")


@functools.lru_cache(maxsize=1)
def directory() -> Path:
    """The folder holding the sources (also the include path for ``common.cuh``)."""
    package = Path(__file__).resolve().parent.parent          # .../mpicoll
    for candidate in (package / "kernels", package.parent / "kernels"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"mpicoll's CUDA sources are missing: looked in {package / 'kernels'} and "
                            f"{package.parent / 'kernels'}; reinstall mpicoll")


_INCLUDE = '#include "common.cuh"'


def source(name: str) -> str:
    """The text of one source file, with ``common.cuh`` written in where it is included.

    Compilers that cache by source text (CuPy's NVRTC cache) then see a change
    of the header too; an ``#include`` would hide it and serve a stale kernel.
    """
    text = (directory() / name).read_text()
    return text.replace(_INCLUDE, (directory() / "common.cuh").read_text()) if _INCLUDE in text else text
