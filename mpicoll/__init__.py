"""mpicoll: MPI collectives for distributed SGD, as a drop-in mpi4py communicator and an array API.

    from mpi4py import MPI
    import mpicoll

    comm = mpicoll.Communicator(MPI.COMM_WORLD)        # algorithm="auto" by default
    comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)     # same arguments as mpi4py

    mean = mpicoll.allreduce(grad) / comm.size         # or the array API
"""

from .base.ucx import apply_defaults as _apply_ucx_defaults

_apply_ucx_defaults()           # before anything imports mpi4py.MPI, which starts MPI (see mpicoll/base/ucx.py)

from .base import timeline
from .base.errors import (CollectiveTimeout, ConcurrentCall, Diverged, MismatchError, MpicollError, NonFiniteError,
                          PartFailed, PeerFailed, RanksLost, ReductionError, RootError, ServerFailed, ServerLost,
                          SetupError, Unsupported)
from .base.failure import end_job, fault_tolerant as _fault_tolerant
from .base.launcher import LaunchMismatch
from .channel.watchdog import guard_job, start as _start_watchdog
from .collectives import algorithms
from .collectives.api import (allgather, allreduce, broadcast, iallgather, iallreduce, ibroadcast, ireduce_scatter,
                              reduce_scatter)
from .collectives.communicator import Communicator
from .collectives.compression import Compression
from .collectives.nonblocking import Request
from .collectives.powersgd import PowerSGD

__version__ = "0.1.0"

# Under MPI's fault tolerance, Open MPI's heartbeat detector beats only while a process is inside MPI, and MPI
# started with mpi4py's import: a rank that loads data or builds a model for longer than the detector's timeout
# before its first call would be taken for dead (and aborted by Open MPI).  The watchdog thread's probes beat
# for it from here on (mpicoll.channel.watchdog).
if _fault_tolerant():
    _start_watchdog()

# The errors a program catches are mpicoll's own, wherever they are defined: tracebacks name them so.
for _error in (CollectiveTimeout, ConcurrentCall, Diverged, MismatchError, MpicollError, NonFiniteError, PartFailed,
               PeerFailed, RanksLost, ReductionError, RootError, ServerFailed, ServerLost, SetupError, LaunchMismatch,
               Unsupported):
    _error.__module__ = __name__
del _error

__all__ = [
    "Communicator",
    "allreduce", "reduce_scatter", "allgather", "broadcast",
    "iallreduce", "ireduce_scatter", "iallgather", "ibroadcast", "Request", "Compression", "PowerSGD",
    "MpicollError", "MismatchError", "CollectiveTimeout", "PeerFailed", "RanksLost", "ServerFailed", "ServerLost",
    "PartFailed", "NonFiniteError", "Diverged", "ReductionError", "RootError", "SetupError", "ConcurrentCall",
    "LaunchMismatch", "Unsupported", "end_job", "guard_job", "timeline", "algorithms", "__version__",
]
