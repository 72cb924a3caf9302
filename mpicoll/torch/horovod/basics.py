"""Horovod's job-wide state: ``init``, ``shutdown``, who is where (rank, local rank, cross rank) and the
process sets (groups of ranks that run ops together, each an MPI communicator of its ranks)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from mpi4py import MPI

from ...base.errors import Unsupported
from ...collectives.communicator import Communicator
from .controller import Controller

__all__ = ["start", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "mpi_threads_supported", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", "controller", "mpi_enabled", "mpi_built", "gloo_enabled",
           "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
           "stop_timeline"]


class _Job:
    """What ``init`` set up: the world, the node layout, the process sets, the negotiation."""

    def __init__(self, world: MPI.Intracomm):
        self.world = world
        self.rank, self.size = world.Get_rank(), world.Get_size()
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        cross = world.Split(self.local_rank, self.rank)       # the same local rank on every node
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        self.homogeneous = len(set(world.allgather(self.local_size))) == 1
        local.Free()
        cross.Free()
        self.ids = itertools.count(1)
        self.process_sets: dict[int, ProcessSet] = {}
        self.controller: Controller | None = None


_job: _Job | None = None
_lock = threading.Lock()


def _need() -> _Job:
    if _job is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _job


class ProcessSet:
    """A set of ranks that run ops together: ``ProcessSet([0, 2])`` or ``ProcessSet(mpi_comm)``, then passed to
    ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``.  ``process_set_id`` is set once it is
    registered; ``rank()`` is this process's rank in the set (ops take global ranks, as Horovod's)."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
        elif isinstance(ranks_or_comm, Sequence) or hasattr(ranks_or_comm, "__iter__"):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                                 "object")
            self.ranks = ranks
        else:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.comm: MPI.Intracomm | None = None          # the set's communicator (members only)
        self.communicator: Communicator | None = None   # it, with mpicoll's collectives

    def size(self) -> int | None:
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        if self.process_set_id is None:
            return None
        return self.ranks.index(_need().rank) if _need().rank in self.ranks else -1

    def included(self) -> bool | None:
        return None if self.ranks is None else _need().rank in self.ranks

    def set_rank(self, global_rank: int) -> int:
        """The rank in this set of the process of ``global_rank``."""
        return self.ranks.index(global_rank)

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and (self.process_set_id, self.ranks) == (other.process_set_id,
                                                                                     other.ranks)

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__

    def _attach(self, job: _Job, process_set_id: int) -> None:
        """Build the set's communicator (collective over the world: every rank calls it, members or not)."""
        member = job.rank in self.ranks
        self.comm = job.world.Split(0 if member else MPI.UNDEFINED, job.rank)
        if self.comm == MPI.COMM_NULL:
            self.comm = None
        self.communicator = None if self.comm is None else Communicator(self.comm)
        self.process_set_id = process_set_id
        job.process_sets[process_set_id] = self

    def _detach(self) -> None:
        if self.communicator is not None:
            self.communicator.Free()          # frees self.comm too: it is the same handle
        self.comm = self.communicator = None
        self.process_set_id = None


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def start(comm, process_sets, joined_part) -> None:
    """``hvd.init``: Horovod on the ranks of ``comm`` (default ``MPI.COMM_WORLD``, or a list of its ranks), with
    ``process_sets`` registered (collective; a second call does nothing).  ``joined_part(kind, meta, process_set,
    asked, joined)``: what a rank that has joined does in an op the others run (:mod:`.ops`)."""
    global _job
    with _lock:
        if _job is not None:
            return
        world = MPI.COMM_WORLD
        if isinstance(comm, MPI.Comm):
            world = comm
        elif comm is not None:                         # a list of ranks of the world
            ranks = sorted(comm)
            world = MPI.COMM_WORLD.Split(0 if MPI.COMM_WORLD.Get_rank() in ranks else MPI.UNDEFINED,
                                         MPI.COMM_WORLD.Get_rank())
            if world == MPI.COMM_NULL:
                raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()} is not in hvd.init's comm {ranks}")
        job = _Job(world.Dup())
        global_process_set.ranks = list(range(job.size))
        global_process_set._attach(job, 0)
        for process_set in process_sets or []:
            _register(job, process_set)
        job.controller = Controller(job.world, job.process_sets, joined_part)
        _job = job


def _register(job: _Job, process_set: ProcessSet) -> ProcessSet:
    if process_set.mpi_comm is not None and process_set.ranks is None:
        group = process_set.mpi_comm.Get_group()
        process_set.ranks = sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                             job.world.Get_group()))
        group.Free()
    if any(not 0 <= r < job.size for r in process_set.ranks):
        raise ValueError(f"process set {process_set.ranks}: ranks must be 0 to {job.size - 1}")
    if any(known.ranks == process_set.ranks for known in job.process_sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set._attach(job, next(job.ids))
    return process_set


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (``ProcessSet`` or a list of ranks) on every rank (collective) and return it."""
    job = _need()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    job.world.Barrier()                          # every rank registers the same sets in the same order
    return _register(job, process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective); False for the global set or an unknown one."""
    job = _need()
    if process_set.process_set_id in (None, 0) or process_set.process_set_id not in job.process_sets:
        return False
    job.world.Barrier()
    job.process_sets.pop(process_set.process_set_id)
    process_set._detach()
    return True


def shutdown() -> None:
    """Leave Horovod (collective: the negotiation ends once every rank has asked)."""
    global _job
    with _lock:
        job, _job = _job, None
    if job is None:
        return
    job.controller.stop()
    for process_set in list(job.process_sets.values()):
        if process_set is not global_process_set:
            process_set._detach()
    global_process_set.communicator.close(abandon=job.controller.failure is not None)


def world() -> MPI.Intracomm:
    """The communicator of the job's ranks (a duplicate of ``hvd.init``'s): what an elastic reset shrinks."""
    return _need().world


def controller() -> Controller:
    return _need().controller


def is_initialized() -> bool:
    return _job is not None


def rank() -> int:
    return _need().rank


def size() -> int:
    return _need().size


def local_rank() -> int:
    return _need().local_rank


def local_size() -> int:
    return _need().local_size


def cross_rank() -> int:
    return _need().cross_rank


def cross_size() -> int:
    return _need().cross_size


def is_homogeneous() -> bool:
    return _need().homogeneous


def mpi_threads_supported() -> bool:
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def _no() -> bool:
    return False


gloo_enabled = gloo_built = nccl_built = ddl_built = ccl_built = cuda_built = rocm_built = _no


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise Unsupported("hvd.start_timeline: Horovod's timeline file is not supported by mpicoll; "
                      "MPICOLL_TIMELINE=trace.json writes mpicoll's own Chrome trace of every call")


def stop_timeline() -> None:
    raise Unsupported("hvd.stop_timeline: Horovod's timeline file is not supported by mpicoll; "
                      "MPICOLL_TIMELINE=trace.json writes mpicoll's own Chrome trace of every call")
