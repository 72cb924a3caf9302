"""torch.distributed's ``"mpicoll"`` backend: every ``dist`` collective, and DDP, over MPI through mpicoll.

    import mpicoll.torch                         # registers the backend
    dist.init_process_group("mpicoll")           # under mpiexec, mpirun or srun: nothing else to set
    model = DistributedDataParallel(model)       # no gloo anywhere

Rank and size are MPI's.  torch insists on a rendezvous store before it
builds any process group; with no ``MASTER_ADDR`` set, its ``env://``
rendezvous is arranged from MPI: rank 0 opens a TCP store on a free port and
tells the others through MPI (:func:`mpi_rendezvous`).  With ``MASTER_ADDR``
set (torchrun), torch's own rendezvous runs, and the backend refuses a torch
world that is not MPI's world (separate one-rank MPI jobs would otherwise
each reduce alone).

Each process group is an MPI communicator of its ranks (``new_group`` makes
one with ``MPI_Comm_create_group``, among the members only) wrapped in a
:class:`mpicoll.Communicator`.  Every collective is a started call on that
communicator's nonblocking worker (:mod:`mpicoll.collectives.nonblocking`):
one thread runs them in the order they were issued, from whichever thread
issued them (DDP's autograd threads included), on the tensors' own memory
(CPU tensors through numpy without a copy).  ``allreduce``, ``broadcast``,
``all_gather(_into_tensor)`` and ``reduce_scatter(_tensor)`` run mpicoll's
algorithms (``auto`` chooses by size); ``reduce``, ``gather``, ``scatter``,
``all_to_all(_single)`` and ``barrier`` are MPI's own, run by the same
thread.  A call returns a ``Work`` whose future completes when the worker
has run it, so ``async_op=True`` overlaps and the blocking form waits.
Point-to-point ``send``/``recv``/``isend``/``irecv`` use a communicator of
their own, so a pending receive never holds up a collective.

Not supported, with an error saying so: ``recv`` without a source, reduce
ops other than SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR and PREMUL_SUM,
several tensors per call (torch's multi-device form), and sparse tensors.
bfloat16 tensors are reduced in float32 and rounded back (numpy has no
bfloat16 arithmetic of its own).
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..base import ops
from ..base.errors import LaunchMismatch, Unsupported
from ..channel import watchdog
from ..channel.context import Context
from ..collectives.communicator import Communicator
from ..collectives.nonblocking import Request
from .collectives import TensorBuffer, as_array

__all__ = ["BACKEND", "ProcessGroupMpicoll", "mpi_rendezvous", "rendezvous_address"]

BACKEND = "mpicoll"

_R = dist.ReduceOp.RedOpType
# torch's reduce ops -> MPI's, from the op table (mpicoll.base.ops); (AVG is a SUM divided by the group's size; PREMUL_SUM a SUM of tensors first
# multiplied by the op's factor)
_MPI_OPS = {**{getattr(_R, op.torch): op.mpi_op for op in ops.OPS if op.torch}, _R.AVG: MPI.SUM,
            _R.PREMUL_SUM: MPI.SUM}
# torch's ops on bool tensors, as MPI's logical ones (MPI defines no arithmetic on bool)
_ON_BOOL = {_R.SUM: MPI.LOR, _R.MAX: MPI.LOR, _R.BOR: MPI.LOR, _R.PRODUCT: MPI.LAND, _R.MIN: MPI.LAND,
            _R.BAND: MPI.LAND, _R.BXOR: MPI.LXOR}


# -- the rendezvous torch insists on, arranged from MPI ----------------------------------------------------

def rendezvous_address(comm: MPI.Intracomm, master: str | None = None) -> tuple[str, int]:
    """(host, port) of a free TCP port on ``comm``'s rank 0, the same on every rank (collective).

    ``master`` overrides the host name the others dial; when every rank runs on
    one host it is 127.0.0.1.
    """
    if comm.Get_rank() == 0:
        with socket.socket() as probe:             # a free port on rank 0's host
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        host = master or socket.gethostname()
    else:
        host = port = None
    host, port = comm.bcast((host, port))
    single_host = len(set(comm.allgather(socket.gethostname()))) == 1
    return ("127.0.0.1" if single_host and not master else host), port


def mpi_rendezvous(url: str, timeout: timedelta = timedelta(seconds=300), **kwargs):
    """torch's ``env://`` rendezvous, arranged from MPI when ``MASTER_ADDR`` is not set.

    Yields (store, rank, world size) as torch's rendezvous handlers do: a TCP
    store served by MPI rank 0 on a free port, MPI's rank and size.  A rank or
    world size torch was given (``RANK``, ``WORLD_SIZE``, arguments) must be
    MPI's.  With ``MASTER_ADDR`` set, torch's own ``env://`` handler runs.
    """
    if "MASTER_ADDR" in os.environ:
        yield from _TORCH_ENV_RENDEZVOUS(url, timeout=timeout, **kwargs)
        return
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    for name, asked, mine in (("rank", query.get("rank", os.environ.get("RANK")), rank),
                              ("world size", query.get("world_size", os.environ.get("WORLD_SIZE")), size)):
        if asked not in (None, "", "-1") and int(asked) != mine:
            raise LaunchMismatch(f"torch.distributed was given {name} {asked}, but MPI's is {mine} (MPI rank "
                                 f"{rank} of {size}): without MASTER_ADDR, mpicoll takes both from MPI; unset "
                                 "RANK and WORLD_SIZE, or set MASTER_ADDR and MASTER_PORT for torch's own "
                                 "rendezvous")
    host, port = rendezvous_address(world)
    if rank == 0:
        store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False)
    else:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    yield store, rank, size
    raise RuntimeError("mpicoll's rendezvous of torch.distributed ran twice: it does not re-rendezvous")


_RENDEZVOUS = sys.modules["torch.distributed.rendezvous"]
_TORCH_ENV_RENDEZVOUS = _RENDEZVOUS._rendezvous_handlers["env"]


# -- work: what a collective call returns ------------------------------------------------------------------

class _Started(dist._Work):
    """A collective queued on the group's worker: ``wait()`` blocks until it has run and raises its error, as
    gloo's Work does; its future completes with ``result`` (or fails with the error).

    (torch's own Work made from a future, ``_create_work_from_future``, waits without raising: an op MPI refused
    on the worker left the tensor as it was, no error anywhere, and every later call on the group, not run
    after the failure, did the same.)  The future completes on the worker's thread, which runs the callbacks
    chained on it (DDP's, a comm hook's ``then``); a collective such a callback starts runs there and then,
    before the worker's next call (:meth:`mpicoll.collectives.nonblocking.Worker.start`), so every rank runs
    them in the same order and a callback may wait for it (powerSGD does)."""

    def __init__(self, request: Request, result):
        super().__init__()
        self.request, self.result, self.future = request, result, torch.futures.Future()
        request.add_done_callback(self._settle)

    def _settle(self, done: Request) -> None:
        if done.error is not None:
            self.future.set_exception(done.error)
        else:
            self.future.set_result(self.result)

    def wait(self, timeout=None) -> bool:
        self.request.Wait()               # raises the call's error
        self.future.wait()                # completed by the worker right after the call
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()         # (done with an error too, which wait() raises, as gloo's)


class _PointToPoint(dist._Work):
    """A started send or receive: ``wait()`` completes the MPI request through the group's point-to-point
    channel, within ``MPICOLL_TIMEOUT`` (past it, a CollectiveTimeout naming the peer)."""

    def __init__(self, channel: Context, request: MPI.Request, peer: int, result, memory: torch.Tensor):
        super().__init__()
        self.channel, self.request, self.peer, self.result = channel, request, peer, result
        self.memory = memory             # the tensor MPI reads or writes, alive until the request completes
        self.future = torch.futures.Future()

    def wait(self, timeout=None) -> bool:
        if not self.future.done():
            try:
                self.channel.waitall([self.request], self.peer)
            except BaseException as error:
                self.future.set_exception(error)
                raise
            self.future.set_result(self.result)
        self.future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done() or bool(self.request.Test())


# -- the process group -------------------------------------------------------------------------------------

class ProcessGroupMpicoll(dist.ProcessGroup):
    """A torch process group over an MPI communicator of its ranks (see the module's docstring).

    ``comm`` becomes the group's own: it is freed with the group.  Building one
    is collective over ``comm`` (the worker's channel is set up at once, so
    later calls from any thread only queue).
    """

    def __init__(self, comm: MPI.Intracomm):
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._comm = Communicator(comm)
        self._comm.start(Request("set-up", lambda worker: None)).Wait()
        self._p2p = Context(comm, "point to point")   # apart from the collectives; waits with the deadline

    def getBackendName(self) -> str:
        return BACKEND

    # torch names each group it makes (``_set_group_name``) and reads the name back to forget the group
    # (``destroy_process_group(group)``); its C++ class keeps the name in its backends, which a group written in
    # Python has none of ("ProcessGroup name not set"): kept here instead.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def __repr__(self) -> str:
        return f"<mpicoll ProcessGroup rank {self._rank} of {self._size}>"

    # -- how a call runs ----------------------------------------------------------------------------------

    def _start(self, name: str, run, result) -> dist.Work:
        """Queue ``run(worker_communicator)`` on the group's worker; the Work completes with ``result``."""
        return _Started(self._comm.start(Request(name, run)), result)

    def _mpi(self, name: str, run, result) -> dist.Work:
        """Queue one of MPI's own blocking collectives, ``run(worker_communicator)``, bounded by the
        watchdog (a peer that never comes ends the job naming it, as for mpicoll's small calls)."""
        def bounded(worker):
            with watchdog.watch_of(worker, name):
                run(worker)
        return self._start(name, bounded, result)

    def _one(self, tensors, name: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise Unsupported(f"{name}: the mpicoll backend takes one tensor per call, got {len(tensors)} "
                              "(torch's several-devices-per-process form); call once per tensor")
        tensor = tensors[0]
        if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
            raise Unsupported(f"{name}: sparse tensors are not supported by the mpicoll backend; pass "
                               "tensor.to_dense()")
        return tensor

    def _op(self, opts, name: str, tensor: torch.Tensor):
        """(MPI's op, the premultiplying factor or None, whether to divide by the size) of ``opts``, checked
        against the tensor's kind here, in the caller's thread (an op MPI refuses on the worker would end the
        group: the calls after it are not run).  On bool tensors the ops are MPI's logical ones, what they mean
        there: SUM, MAX and BOR are "any" (LOR), PRODUCT, MIN and BAND "all" (LAND), BXOR LXOR."""
        reduce_op = opts.reduceOp
        kind = reduce_op.op
        if kind not in _MPI_OPS:
            raise Unsupported(f"{name}: reduce op {kind} is not supported by the mpicoll backend")
        if kind in (_R.AVG, _R.PREMUL_SUM) and not (tensor.is_floating_point() or tensor.is_complex()):
            raise Unsupported(f"{name}: {kind.name} needs a floating-point tensor, got {tensor.dtype}; "
                               "reduce with SUM and divide")
        if tensor.dtype == torch.bool:
            return _ON_BOOL[kind], None, False
        elements = "c" if tensor.is_complex() else "f" if tensor.is_floating_point() else \
            "u" if torch.iinfo(tensor.dtype).min == 0 else "i"
        takes = ops.not_defined_for(_MPI_OPS[kind], elements)
        if takes:
            raise Unsupported(f"{name}: {kind.name} is not defined for {tensor.dtype} tensors: MPI defines it on "
                              f"{takes} tensors only (gloo refuses it too)")
        return _MPI_OPS[kind], (reduce_op.factor if kind == _R.PREMUL_SUM else None), kind == _R.AVG

    # -- the collectives ----------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = dist.AllreduceOptions() if opts is None else opts
        tensor = self._one(tensors, "all_reduce")
        op, factor, average = self._op(opts, "all_reduce", tensor)
        buffer = TensorBuffer(tensor)

        def run(worker):
            if factor is not None:
                buffer.tensor.mul_(factor)
            worker.Allreduce(MPI.IN_PLACE, buffer.array, op)
            if average:
                buffer.tensor.div_(self._size)
            buffer.deliver()
        return self._start("all_reduce", run, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        for tensor in tensors:
            work = self.allreduce([tensor], opts)
        return work if tensors else self._start("all_reduce_coalesced", lambda worker: None, tensors)

    def broadcast(self, tensors, opts=None):
        opts = dist.BroadcastOptions() if opts is None else opts
        tensor = self._one(tensors, "broadcast")
        buffer = TensorBuffer(tensor)

        def run(worker):
            worker.Bcast(buffer.array, opts.rootRank)
            buffer.deliver()
        return self._start("broadcast", run, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        tensor = self._one(input_tensors, "all_gather")
        outputs = self._one(output_tensors, "all_gather")       # one list of outputs
        _check_list(outputs, self._size, tensor, "all_gather", "output tensors")
        source = TensorBuffer(tensor, read_only=True)

        def run(worker):
            whole = torch.empty((self._size, *tensor.shape), dtype=source.tensor.dtype, device=tensor.device)
            worker.Allgather(source.array, as_array(whole))
            for part, out in zip(whole, outputs):
                out.copy_(part)
        return self._start("all_gather", run, output_tensors)

    def all_gather_single(self, output, input, opts=None):
        _check_numel(output, input.numel() * self._size, "all_gather_into_tensor", "output")
        _check_dtypes(output, input, "all_gather_into_tensor")
        target, source = TensorBuffer(output), TensorBuffer(input, read_only=True)

        def run(worker):
            worker.Allgather(source.array, target.array)
            target.deliver()
        return self._start("all_gather_into_tensor", run, output)

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        output = self._one(output_tensors, "reduce_scatter")
        inputs = input_tensors[0] if len(input_tensors) == 1 else input_tensors
        _check_list(inputs, self._size, output, "reduce_scatter", "input tensors")
        return self._reduce_scatter(output, torch.stack([t.reshape(output.shape) for t in inputs]), opts,
                                    "reduce_scatter", output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        _check_numel(input, output.numel() * self._size, "reduce_scatter_tensor", "input")
        _check_dtypes(output, input, "reduce_scatter_tensor")
        return self._reduce_scatter(output, input, opts, "reduce_scatter_tensor", output)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, output, whole, opts, name, result):
        op, factor, average = self._op(opts, name, output)
        target, source = TensorBuffer(output), TensorBuffer(whole, read_only=True)

        def run(worker):
            send = source.array if factor is None else as_array(source.tensor * factor)   # the input stays
            worker.Reduce_scatter_block(send, target.array, op)
            if average:
                target.tensor.div_(self._size)
            target.deliver()
        return self._start(name, run, result)

    def reduce(self, tensors, opts=None):
        opts = dist.ReduceOptions() if opts is None else opts
        tensor = self._one(tensors, "reduce")
        op, factor, average = self._op(opts, "reduce", tensor)
        buffer, root = TensorBuffer(tensor), opts.rootRank

        def run(worker):
            if factor is not None:
                buffer.tensor.mul_(factor)
            if self._rank == root:
                MPI.Intracomm.Reduce(worker, MPI.IN_PLACE, buffer.array, op, root)
                if average:
                    buffer.tensor.div_(self._size)
                buffer.deliver()
            else:
                MPI.Intracomm.Reduce(worker, buffer.array, None, op, root)
        return self._mpi("reduce", run, tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = dist.GatherOptions() if opts is None else opts
        tensor, root = self._one(input_tensors, "gather"), opts.rootRank
        outputs = output_tensors[0] if self._rank == root else []
        if self._rank == root:
            _check_list(outputs, self._size, tensor, "gather", "output tensors")
        source = TensorBuffer(tensor, read_only=True)

        def run(worker):
            whole = (torch.empty((self._size, *tensor.shape), dtype=source.tensor.dtype, device=tensor.device)
                     if self._rank == root else None)
            MPI.Intracomm.Gather(worker, source.array, None if whole is None else as_array(whole), root)
            for part, out in zip(whole if whole is not None else [], outputs):
                out.copy_(part)
        return self._mpi("gather", run, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = dist.ScatterOptions() if opts is None else opts
        output, root = self._one(output_tensors, "scatter"), opts.rootRank
        inputs = input_tensors[0] if self._rank == root else []
        if self._rank == root:
            _check_list(inputs, self._size, output, "scatter", "input tensors")
        target = TensorBuffer(output)

        def run(worker):
            whole = torch.stack([t.to(target.tensor.dtype) for t in inputs]) if self._rank == root else None
            MPI.Intracomm.Scatter(worker, None if whole is None else as_array(whole), target.array, root)
            target.deliver()
        return self._mpi("scatter", run, output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        row_out = output.numel() // max(output.shape[0], 1) if output.dim() else 1
        row_in = input.numel() // max(input.shape[0], 1) if input.dim() else 1
        sends = _splits(input_split_sizes, input, self._size, "input") * row_in
        receives = _splits(output_split_sizes, output, self._size, "output") * row_out
        target, source = TensorBuffer(output), TensorBuffer(input, read_only=True)

        def run(worker):
            MPI.Intracomm.Alltoallv(worker, [source.array, (sends, _offsets(sends))],
                                    [target.array, (receives, _offsets(receives))])
            target.deliver()
        return self._mpi("all_to_all_single", run, output)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise Unsupported(f"all_to_all: {len(input_tensors)} input and {len(output_tensors)} output tensors "
                               f"for a group of {self._size}: pass one per rank")
        dtype = input_tensors[0].dtype
        sends = np.array([t.numel() for t in input_tensors], np.int64)
        receives = np.array([t.numel() for t in output_tensors], np.int64)

        def run(worker):
            send = torch.cat([t.reshape(-1) for t in input_tensors]) if sends.sum() else torch.empty(0, dtype=dtype)
            receive = torch.empty(int(receives.sum()), dtype=dtype)
            MPI.Intracomm.Alltoallv(worker, [as_array(send), (sends, _offsets(sends))],
                                    [as_array(receive), (receives, _offsets(receives))])
            for out, start, count in zip(output_tensors, _offsets(receives), receives):
                out.copy_(receive[start: start + count].view_as(out))
        return self._mpi("all_to_all", run, output_tensors)

    def barrier(self, opts=None):
        return self._mpi("barrier", lambda worker: MPI.Intracomm.Barrier(worker), [])

    # -- point to point -----------------------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        tensor = TensorBuffer(self._one(tensors, "send"), read_only=True).tensor      # kept alive by the work
        request = self._p2p.comm.Isend(as_array(tensor), dst, tag)
        return _PointToPoint(self._p2p, request, dst, tensors, tensor)

    def recv(self, tensors, src, tag):
        tensor = self._one(tensors, "recv")
        if not tensor.is_contiguous():
            raise Unsupported("recv: the mpicoll backend receives into contiguous tensors; pass "
                               "tensor.contiguous() and copy from it")
        request = self._p2p.comm.Irecv(as_array(tensor), src, tag)
        return _PointToPoint(self._p2p, request, src, tensors, tensor)

    def recv_anysource(self, tensors, tag):
        raise Unsupported("recv without src is not supported by the mpicoll backend: name the sending rank")

    # -- life ---------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Free the group's communicators (collective, as when it was made)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.Free()
            self._p2p.free()

    def abort(self) -> None:
        """Drop the group's communicators without waiting for the other ranks."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close(abandon=True)
            self._p2p.free(abandon=True)


def _check_list(tensors, size: int, like: torch.Tensor, name: str, what: str) -> None:
    if len(tensors) != size:
        raise Unsupported(f"{name}: {len(tensors)} {what} for a group of {size} ranks: pass one per rank")
    for tensor in tensors:
        if tensor.numel() != like.numel():
            raise Unsupported(f"{name}: {what} of {tensor.numel()} elements where this rank's tensor has "
                               f"{like.numel()}: every one must be of the same size")


def _check_numel(tensor: torch.Tensor, expected: int, name: str, what: str) -> None:
    if tensor.numel() != expected:
        raise Unsupported(f"{name}: the {what} tensor has {tensor.numel()} elements; the group's size times "
                           f"the other's is {expected}")


def _check_dtypes(output: torch.Tensor, input: torch.Tensor, name: str) -> None:
    """In the caller's thread: met on the worker, the error would end the group (its later calls not run)."""
    if output.dtype != input.dtype:
        raise Unsupported(f"{name}: the output tensor is {output.dtype} and the input {input.dtype}; pass tensors "
                          "of one dtype (gloo refuses them too)")


def _splits(sizes, tensor: torch.Tensor, ranks: int, what: str) -> np.ndarray:
    """Rows to each rank: the given split sizes, or the first dimension cut evenly."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if len(sizes) == 0:
        if rows % ranks:
            raise Unsupported(f"all_to_all_single: the {what} tensor's {rows} rows do not split evenly over "
                               f"{ranks} ranks: pass {what}_split_sizes")
        return np.full(ranks, rows // ranks, np.int64)
    sizes = np.asarray(sizes, np.int64)
    if len(sizes) != ranks or sizes.sum() != rows:
        raise Unsupported(f"all_to_all_single: {what}_split_sizes {sizes.tolist()} must give one count per rank "
                           f"({ranks}) adding up to the tensor's {rows} rows")
    return sizes


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


# -- making groups -----------------------------------------------------------------------------------------

def _create(options, backend_options=None) -> ProcessGroupMpicoll:
    """torch's creator (extended form): a group over MPI's world, or over the ranks ``new_group`` lists."""
    world = MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group)
    if not ranks:                                   # the default group: torch's world must be MPI's
        if options.group_size != world.Get_size():
            raise LaunchMismatch(
                f"torch.distributed has {options.group_size} ranks but MPI's world has {world.Get_size()}: the "
                "mpicoll backend needs the processes started by one MPI launcher (mpiexec, mpirun, srun "
                "--mpi=pmix or pmi2), not torchrun or separate MPI jobs")
        # A rank that fails tells the others why, and each says so (an uncaught error after init_process_group
        # names its rank on every rank, as gloo's ranks each print theirs)
        watchdog.guard_job(world)
        return ProcessGroupMpicoll(world.Dup())
    group = world.Get_group().Incl(ranks)
    try:
        comm = world.Create_group(group)
    finally:
        group.Free()
    return ProcessGroupMpicoll(comm)


def register() -> None:
    """Register the "mpicoll" backend with torch.distributed and MPI's rendezvous for ``env://``; called
    by ``import mpicoll.torch`` (a second call does nothing)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    _RENDEZVOUS._rendezvous_handlers["env"] = mpi_rendezvous
