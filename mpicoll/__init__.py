"""mpicoll: MPI collectives for distributed SGD, as a drop-in mpi4py communicator and an array API.

    from mpi4py import MPI
    import mpicoll

    comm = mpicoll.Communicator(MPI.COMM_WORLD)        # algorithm="auto" by default
    comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)     # same arguments as mpi4py

    mean = mpicoll.allreduce(grad) / comm.size         # or the array API
"""

from .ucx import apply_defaults as _apply_ucx_defaults

_apply_ucx_defaults()           # before anything imports mpi4py.MPI, which starts MPI (see mpicoll/ucx.py)

from .api import (allgather, allreduce, broadcast, iallgather, iallreduce, ibroadcast, ireduce_scatter,
                  reduce_scatter)
from .communicator import Communicator
from .errors import (CollectiveTimeout, ConcurrentCall, Diverged, MismatchError, MpicollError, NonFiniteError,
                     PartFailed, PeerFailed, ReductionError, RootError, ServerFailed, SetupError)
from .failure import end_job
from .nonblocking import Request

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "allreduce", "reduce_scatter", "allgather", "broadcast",
    "iallreduce", "ireduce_scatter", "iallgather", "ibroadcast", "Request",
    "MpicollError", "MismatchError", "CollectiveTimeout", "PeerFailed", "ServerFailed", "PartFailed",
    "NonFiniteError", "Diverged", "ReductionError", "RootError", "SetupError", "ConcurrentCall", "end_job",
    "__version__",
]
