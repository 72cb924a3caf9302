"""Torch's intra-op threads: this rank's share of the node's cores.

Under an MPI launcher, PyTorch's CPU build (2.13, its OpenMP and MKL) starts with one intra-op thread per process
whatever the node holds: the launcher's ``MPI_LOCALNRANKS`` (MPICH's Hydra) or ``OMPI_COMM_WORLD_LOCAL_SIZE``
(Open MPI) alone is enough (``MPI_LOCALNRANKS=1 python -c "import torch; print(torch.get_num_threads())"`` prints
1 on 2 cores, 2 without it), so one rank per node computes on one core.  Without a launcher's variable torch takes
every core in every process, which ranks sharing a node fight over.  ``import mpicoll.torch`` gives each rank the
node's cores over the ranks the launcher put there (:func:`mpicoll.compute.share_of_cores`, as ``mpicoll train``
does for numpy's BLAS and torch), unless ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` is set; a later
``torch.set_num_threads`` wins.
"""

from __future__ import annotations

import torch

from .. import compute

__all__ = ["share_the_node"]


def share_the_node() -> None:
    """Give torch this rank's share of the node's cores, unless the environment chose.

    Sets, never asks: a ``torch.get_num_threads()`` here, before Numba's pool starts, let that start change torch's
    count (1 thread became 2 a rank; the 2-rank test tier 97 s against 34 s); :func:`mpicoll.compute`'s
    ``_start_numba_threads`` now puts the count back whoever asked (docs/torch.md)."""
    compute.share_torch_threads(torch)
