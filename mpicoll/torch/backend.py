"""torch.distributed's ``"mpicoll"`` backend: every ``dist`` collective, and DDP, over MPI through mpicoll.

    import mpicoll.torch                         # registers the backend
    dist.init_process_group("mpicoll")           # under mpiexec, mpirun or srun: nothing else to set
    model = DistributedDataParallel(model)       # no gloo anywhere

Rank and size are MPI's wherever the launcher did not give both.  torch
insists on a rendezvous store before it builds any process group; its
``env://`` rendezvous is arranged from MPI (:func:`mpi_rendezvous`): rank 0
serves a TCP store at ``MASTER_ADDR`` where it is set, else on a free port it
tells the others through MPI.  A launcher that gave rank and size with
``MASTER_ADDR`` (torchrun) gets torch's own rendezvous; a torch world that is
not MPI's world (torchrun's workers) is joined into one communicator where the
MPI can, and asked to (:mod:`.joining`), else refused in one line (separate
MPI jobs would otherwise each reduce alone).

Each process group is an MPI communicator of its ranks (``new_group`` makes
one with ``MPI_Comm_create_group``, among the members only) wrapped in a
:class:`mpicoll.Communicator`, whose nonblocking worker
(:mod:`mpicoll.collectives.nonblocking`) runs the group's calls one at a time
in the order they were issued: a blocking one (torch's ``async_op=False``) in
the calling thread, after those queued before it; a started one on the
worker's thread, while its caller computes (DDP's autograd threads included).
Calls run on the tensors' own memory (CPU tensors through numpy without a
copy).  A small ``allreduce`` goes straight to MPI's own, as ``auto`` would
choose; larger ones, ``broadcast``, ``all_gather(_into_tensor)`` and
``reduce_scatter(_tensor)`` run mpicoll's algorithms; ``reduce``, ``gather``,
``scatter``, ``all_to_all(_single)`` and ``barrier`` are MPI's own, started
nonblocking; every wait is bounded by the group's timeout (or
``MPICOLL_TIMEOUT``) and raises on the waiting rank.  Point-to-point
``send``/``recv``/``isend``/``irecv`` use a communicator of their own, so a
pending receive never holds up a collective.

Not supported, with an error saying so: several tensors per call (torch's
multi-device form), sparse tensors but in ``all_reduce`` with SUM.  bfloat16
tensors are reduced in float32 and rounded back (numpy has no bfloat16
arithmetic of its own).
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
from torch.distributed.constants import default_pg_timeout

from ..base import config, ops
from ..base.collectives import ALLREDUCE
from ..base.errors import CollectiveTimeout, LaunchMismatch, MismatchError, RootError, Unsupported
from ..channel import watchdog
from ..channel.checks import Signature
from ..channel.context import Context
from ..collectives.algorithms import auto
from ..collectives.communicator import Communicator
from ..collectives.nonblocking import Request
from ..collectives.reduction import op_name
from . import joining
from .collectives import TensorBuffer, as_array

try:                    # the short way of small blocking all_reduces in C: optional (setup.py)
    from ._shortway import ShortWay
except ImportError:
    ShortWay = None

__all__ = ["BACKEND", "ProcessGroupMpicoll", "mpi_rendezvous", "rendezvous_address"]

BACKEND = "mpicoll"

_R = dist.ReduceOp.RedOpType
# torch's reduce ops -> MPI's, from the op table (mpicoll.base.ops); (AVG is a SUM divided by the group's size; PREMUL_SUM a SUM of tensors first
# multiplied by the op's factor)
_MPI_OPS = {**{getattr(_R, op.torch): op.mpi_op for op in ops.OPS if op.torch}, _R.AVG: MPI.SUM,
            _R.PREMUL_SUM: MPI.SUM}
_UNKNOWN = object()
_address = MPI.buffer.fromaddress
# the dtypes every MPI reduces as they are (16-bit floats and bool take mpicoll's paths)
_MPI_DTYPES = frozenset({torch.float64, torch.float32, torch.int64, torch.int32, torch.int16,
                         torch.int8, torch.uint8, torch.complex64, torch.complex128})
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
    """torch's ``env://`` rendezvous, with rank and size from MPI wherever the launcher did not give them.

    Yields (store, rank, world size) as torch's rendezvous handlers do.  A launcher that gave torch its rank
    and size with ``MASTER_ADDR`` (torchrun; ``RANK`` and ``WORLD_SIZE``, or the arguments) gets torch's own
    handler.  Otherwise rank and size are MPI's, as torch's MPI backend takes them, ``world_size=0`` (that
    backend's "ask MPI", which torch's tutorial passes) included, and the store is served by MPI rank 0: at
    ``MASTER_ADDR``:``MASTER_PORT`` where they are set (``accelerate launch``'s MPI path sets them, and
    ``RANK`` only later), else on a free port of its host, told to the others through MPI.  A rank or world
    size that was given must then be MPI's.
    """
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    asked = {"rank": query.get("rank", os.environ.get("RANK")),
             "world size": query.get("world_size", os.environ.get("WORLD_SIZE"))}
    ask_mpi = asked["world size"] in (None, "", "-1", "0") or asked["rank"] in (None, "", "-1")
    if "MASTER_ADDR" in os.environ and not ask_mpi:
        yield from _TORCH_ENV_RENDEZVOUS(url, timeout=timeout, **kwargs)
        return
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if asked["world size"] != "0":          # (with world size 0 torch's MPI backend ignores the rank given)
        for name, mine in (("rank", rank), ("world size", size)):
            if asked[name] not in (None, "", "-1") and int(asked[name]) != mine:
                raise LaunchMismatch(f"torch.distributed was given {name} {asked[name]}, but MPI's is {mine} (MPI "
                                     f"rank {rank} of {size}): where the launcher did not give both with "
                                     "MASTER_ADDR, mpicoll takes them from MPI; unset RANK and WORLD_SIZE, or set "
                                     "both with MASTER_ADDR and MASTER_PORT for torch's own rendezvous")
    if "MASTER_ADDR" in os.environ:
        host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    else:
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


class _Done(dist._Work):
    """What a blocking call returns once it has run in the caller's thread (torch waits for it and drops it:
    ``dist.all_reduce`` without ``async_op`` returns None).  One for all such calls: making a Work costs a
    call more than torch's whole dispatch to it; its future holds None."""

    def __init__(self):
        super().__init__()
        self.future = torch.futures.Future()
        self.future.set_result(None)

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


class _PointToPoint(dist._Work):
    """A started send or receive: ``wait()`` completes the MPI request through the group's point-to-point
    channel, within ``MPICOLL_TIMEOUT`` (past it, a CollectiveTimeout naming the peer).  A receive from any
    source (``peer`` None) reads whom it came from once it has (``_source_rank()``, torch's name)."""

    def __init__(self, channel: Context, request: MPI.Request, peer: int | None, result, memory: torch.Tensor):
        super().__init__()
        self.channel, self.request, self.peer, self.result = channel, request, peer, result
        self.memory = memory             # the tensor MPI reads or writes, alive until the request completes
        self.future = torch.futures.Future()
        self.status = MPI.Status() if peer is None else None
        self.source = peer

    def wait(self, timeout=None) -> bool:
        if not self.future.done():
            try:
                if self.status is None:
                    self.channel.waitall([self.request], self.peer)
                else:       # (Get_status leaves the request, and so its status, to read)
                    self.channel.wait_until(lambda: self.request.Get_status(self.status), self.channel.others())
                    self.source = self.status.Get_source()
                    self.request.Wait()
            except CollectiveTimeout as error:
                self.future.set_exception(_in_torch_words(error))
                raise
            except BaseException as error:
                self.future.set_exception(error)
                raise
            self.future.set_result(self.result)
        self.future.wait()
        return True

    def _source_rank(self) -> int:
        if self.source is None:
            raise RuntimeError("the sending rank is known once the receive has completed: wait() first")
        return self.source

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done() or bool(self.request.Get_status())


# -- the process group -------------------------------------------------------------------------------------

class ProcessGroupMpicoll(dist.ProcessGroup):
    """A torch process group over an MPI communicator of its ranks (see the module's docstring).

    ``comm`` becomes the group's own: it is freed with the group.  Building one
    is collective over ``comm`` (the worker's channel is set up at once, so
    later calls from any thread only queue).
    """

    def __init__(self, comm: MPI.Intracomm, timeout: timedelta | None = None):
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._comm = Communicator(comm)
        # the group's timeout (init_process_group's or new_group's), where one was given: every call, mpicoll's
        # algorithms and MPI's own alike, waits that long for its peers, then raises on the waiting rank
        if timeout is not None and timeout != default_pg_timeout:
            self._comm.timeout = timeout.total_seconds()
        self._worker = self._comm.worker()          # made here, so that later calls from any thread only queue
        # bytes: below them auto chooses MPI's own allreduce, which small calls then get straight (allreduce);
        # known once the group's first call, checked across ranks on mpicoll's path, has told the layout
        self._straight_below = 0
        self._straight: dict = {}       # (op, dtype) -> what _straight_op answers
        self._compiled = _compiled_short_way(self._straight, self._worker)      # None: none built, or not asked
        self._short_way = self._compiled or self._short_way_in_python
        self._ops: dict = {}            # (op, dtype, call) -> what _op answers, checked once
        # point to point apart from the collectives, waiting with the same deadline
        self._p2p = Context(comm, "point to point", timeout=self._comm.timeout)
        self._others = self._p2p.others()     # (every rank but this one: what a small allreduce waits for)

    def _get_backend(self, device) -> "ProcessGroupMpicoll":
        """torch asks a group for its backend of a device (2.14's ``batch_isend_irecv`` asks whether it
        coalesces, on any ProcessGroup): a group written in Python is its own backend, on every device; it does
        not coalesce, so torch sends the batch's operations one by one."""
        return self

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

    def _start(self, name: str, run, result, opts=None) -> dist.Work:
        """Queue ``run(worker_communicator)`` on the group's worker; the Work completes with ``result``.  A
        blocking call (torch's ``opts.asyncOp`` False: the caller waits for it at once) runs in the caller's
        thread, after the calls queued before it: no hand-off to the worker's thread and back."""
        def worded(worker):
            try:
                run(worker)
            except CollectiveTimeout as error:
                raise _in_torch_words(error)
        if opts is not None and not opts.asyncOp:
            self._worker.run_now(name, worded)
            return _DONE
        return _Started(self._worker.start(Request(name, worded)), result)

    def _root(self, opts, name: str) -> int:
        """The call's root, checked here, in the caller's thread: a root outside the group, met on the worker,
        would fail the call there and every call of the group after it."""
        root = opts.rootRank
        if not 0 <= root < self._size:
            raise RootError(f"{name}: root {root} is not a rank of this group of {self._size} (ranks 0 to "
                            f"{self._size - 1}, the group's own numbering)")
        return root

    def _one(self, tensors, name: str, sparse: bool = False) -> torch.Tensor:
        if len(tensors) != 1:
            raise Unsupported(f"{name}: the mpicoll backend takes one tensor per call, got {len(tensors)} "
                              "(torch's several-devices-per-process form); call once per tensor")
        tensor = tensors[0]
        if isinstance(tensor, torch.Tensor) and tensor.is_sparse and not sparse:
            raise Unsupported(f"{name}: sparse tensors are not supported by the mpicoll backend's {name} (all_reduce "
                              "takes them, SUM); pass tensor.to_dense()")
        return tensor

    def _op(self, opts, name: str, tensor: torch.Tensor):
        """(MPI's op, the premultiplying factor or None, whether to divide by the size) of ``opts``, checked
        against the tensor's kind here, in the caller's thread (an op MPI refuses on the worker would end the
        group: the calls after it are not run).  On bool tensors the ops are MPI's logical ones, what they mean
        there: SUM, MAX and BOR are "any" (LOR), PRODUCT, MIN and BAND "all" (LAND), BXOR LXOR."""
        reduce_op = opts.reduceOp
        kind = reduce_op.op
        if kind == _R.PREMUL_SUM:             # (its factor may be a tensor: checked every time)
            return self._checked_op(kind, reduce_op, name, tensor)
        key = (kind, tensor.dtype, tensor.is_cpu, name)
        known = self._ops.get(key)
        if known is None:
            known = self._ops[key] = self._checked_op(kind, reduce_op, name, tensor)
        return known

    def _straight_op(self, opts, tensor: torch.Tensor):
        """(MPI's op, MPI's datatype) where MPI's own allreduce gives torch's answer on ``tensor``'s dtype as it
        is (no factor, no division), else None; errors as :meth:`_op`'s."""
        op, factor, average = self._op(opts, "all_reduce", tensor)
        if factor is not None or average or tensor.dtype not in _MPI_DTYPES:
            return None
        return op, MPI._typedict[np.dtype(str(tensor.dtype).removeprefix("torch.")).char]

    def _checked_op(self, kind, reduce_op, name: str, tensor: torch.Tensor):
        if kind not in _MPI_OPS:
            raise Unsupported(f"{name}: reduce op {kind} is not supported by the mpicoll backend")
        if kind == _R.PREMUL_SUM and not (tensor.is_floating_point() or tensor.is_complex()):
            raise Unsupported(f"{name}: {kind.name} needs a floating-point tensor, got {tensor.dtype}; "
                              "reduce with SUM and multiply")
        if tensor.dtype == torch.bool:
            if kind == _R.AVG:
                raise Unsupported(f"{name}: AVG of bool tensors has no meaning; reduce with SUM of an integer "
                                  "tensor and divide")
            return _ON_BOOL[kind], None, False
        elements = "c" if tensor.is_complex() else "f" if tensor.is_floating_point() else \
            "u" if torch.iinfo(tensor.dtype).min == 0 else "i"
        takes = ops.not_defined_for(_MPI_OPS[kind], elements)
        if takes:
            raise Unsupported(f"{name}: {kind.name} is not defined for {tensor.dtype} tensors: MPI defines it on "
                              f"{takes} tensors only (gloo refuses it too)")
        op = _MPI_OPS[kind]
        if elements == "f" and tensor.device.type == "cpu":
            op = ops.keeping_nan(op)            # MPI's own MIN and MAX lose a NaN by where it is
        return op, (reduce_op.factor if kind == _R.PREMUL_SUM else None), kind == _R.AVG

    def _divide(self, tensor: torch.Tensor) -> None:
        """AVG's division of a sum by the group's size, in place: integer tensors rounded toward zero, as NCCL's
        integer AVG (a sum, then C's integer division), which Lightning sends its counters to."""
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(self._size)
        else:
            tensor.div_(self._size, rounding_mode="trunc")

    def _short_way_in_python(self, tensors, opts) -> bool:
        """The short way of a small blocking all_reduce (torch's ``dist.all_reduce`` without ``async_op``:
        metrics, barriers' sums, DDP's small buckets, FSDP2's norms): MPI's own, as ``auto`` chooses under the
        group's limit, on a contiguous host tensor's memory, run here at once where nothing stands before it
        (:meth:`mpicoll.collectives.nonblocking.Worker.reduce_now`); whether it ran (False: :meth:`allreduce`'s
        own path runs the call).  Every read counts: the op is taken by its hash, its number (``reduceOp.op.value``
        costs a microsecond more), and (op, dtype) gives MPI's op and datatype where MPI's own allreduce answers
        as torch (filled by :meth:`allreduce`); a sparse tensor is not contiguous.  Where a compiler built it,
        ``mpicoll.torch._shortway`` does the same in C (``MPICOLL_FAST_PATH=python`` keeps this one)."""
        if opts is None or len(tensors) != 1 or self._straight_below <= 0:
            return False
        tensor = tensors[0]
        straight = self._straight.get((hash(opts.reduceOp), tensor.dtype))
        if (straight is None or not tensor.is_contiguous() or not tensor.is_cpu
                or tensor.nbytes >= self._straight_below or opts.asyncOp):
            return False
        try:
            return self._worker.reduce_now([_address(tensor.data_ptr(), tensor.nbytes), straight[1]], straight[0])
        except CollectiveTimeout as error:
            raise _in_torch_words(error)

    def _limit_small_calls(self, below: int) -> None:
        """Bytes below which an allreduce is MPI's own (auto's rule; -1: none is), known from the first call."""
        self._straight_below = below
        if self._compiled is not None:
            self._compiled.limit = max(below, 0)

    # -- the collectives ----------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        if self._short_way(tensors, opts):
            return _DONE
        opts = dist.AllreduceOptions() if opts is None else opts
        if len(tensors) != 1 or tensors[0].is_sparse:
            return self._sparse_allreduce(self._one(tensors, "all_reduce", sparse=True), opts)
        tensor = tensors[0]
        reduce_op = opts.reduceOp
        key = (hash(reduce_op), tensor.dtype)
        straight = self._straight.get(key, _UNKNOWN)
        if straight is _UNKNOWN:
            straight = self._straight_op(opts, tensor)
            if key[0] == reduce_op.op.value:            # (kept only where the hash is the op's number)
                self._straight[key] = straight
        if (straight is not None and tensor.is_contiguous() and tensor.is_cpu
                and tensor.nbytes < self._straight_below):
            # a small call the short way did not take (started, or behind other calls): MPI's own all the same
            memory, op = [_address(tensor.data_ptr(), tensor.nbytes), straight[1]], straight[0]

            def run(worker):
                context = worker.context()
                if context is None:             # a fresh channel (after an error): its first call is checked
                    worker.Allreduce(MPI.IN_PLACE, memory, op)
                else:
                    context.begin(ALLREDUCE.method)
                    context.waitall([MPI.Intracomm.Iallreduce(worker, MPI.IN_PLACE, memory, op)], self._others)
            return self._start("all_reduce", run, tensors, opts)
        op, factor, average = self._op(opts, "all_reduce", tensor)
        buffer = TensorBuffer(tensor)

        def run(worker):
            if factor is not None:
                buffer.tensor.mul_(factor)
            worker.Allreduce(MPI.IN_PLACE, buffer.array, op)
            if average:
                self._divide(buffer.tensor)
            buffer.deliver()
            if not self._straight_below:
                self._limit_small_calls(auto.straight_to_mpi_below(ALLREDUCE.name, worker.across_nodes))
        return self._start("all_reduce", run, tensors, opts)

    def _sparse_allreduce(self, tensor: torch.Tensor, opts) -> dist.Work:
        """The SUM of sparse COO tensors, as gloo's: every rank's indices and values gathered (MPI's Allgatherv,
        the counts first), summed by torch (``coalesce``) into the tensor, in place."""
        if opts.reduceOp.op != _R.SUM:
            raise Unsupported(f"all_reduce: {opts.reduceOp.op.name} of sparse tensors is not supported by the mpicoll "
                              "backend (SUM is, as gloo's); pass tensor.to_dense()")
        signature = Signature("Allgatherv", tensor.sparse_dim(), np.dtype(np.int64))

        def gather(worker, part: torch.Tensor, counts: np.ndarray, rows: int, dtype) -> torch.Tensor:
            """Every rank's ``part`` (``counts[r]`` rows each of ``rows`` elements) in rank order, as bytes."""
            whole = torch.empty((int(counts.sum()), *part.shape[1:]), dtype=dtype)
            sizes = counts * rows * part.element_size()
            send = as_array(part.contiguous().view(-1).view(torch.uint8))
            worker.run_started(signature, lambda: MPI.Intracomm.Iallgatherv(
                worker, send, [as_array(whole.view(-1).view(torch.uint8)), (sizes, _offsets(sizes))]))
            return whole

        def run(worker):
            local = tensor.detach().coalesce()
            indices, values = local.indices().t().contiguous(), local.values().contiguous()
            counts = np.empty(self._size, np.int64)
            worker.run_started(signature, lambda: MPI.Intracomm.Iallgather(
                worker, np.array([indices.shape[0]], np.int64), counts))
            dense_elements = int(np.prod(values.shape[1:], dtype=np.int64))
            summed = torch.sparse_coo_tensor(gather(worker, indices, counts, indices.shape[1], indices.dtype).t(),
                                             gather(worker, values, counts, dense_elements, values.dtype),
                                             tensor.shape).coalesce()
            with torch.no_grad():
                tensor.copy_(summed)
        return self._start("all_reduce", run, [tensor], opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        for tensor in tensors:
            work = self.allreduce([tensor], opts)
        return work if tensors else self._start("all_reduce_coalesced", lambda worker: None, tensors, opts)

    def broadcast(self, tensors, opts=None):
        opts = dist.BroadcastOptions() if opts is None else opts
        tensor, root = self._one(tensors, "broadcast"), self._root(opts, "broadcast")
        buffer = TensorBuffer(tensor)

        def run(worker):
            worker.Bcast(buffer.array, root)
            buffer.deliver()
        return self._start("broadcast", run, tensors, opts)

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
        return self._start("all_gather", run, output_tensors, opts)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """One all_gather per input tensor, in order (torch's all_gather_coalesced): ``output_lists[r][i]`` gets
        rank r's ``input_tensors[i]``."""
        if len(output_lists) != self._size or any(len(outputs) != len(input_tensors) for outputs in output_lists):
            raise Unsupported(f"all_gather_coalesced: pass one output list per rank of the group ({self._size}), each "
                              f"with one tensor per input ({len(input_tensors)})")
        by_input = [[outputs[i] for outputs in output_lists] for i in range(len(input_tensors))]
        return self._each(lambda outputs, tensor, opts: self.allgather([outputs], [tensor], opts), by_input,
                          input_tensors, opts, "all_gather_coalesced")

    def all_gather_single(self, output, input, opts=None):
        _check_numel(output, input.numel() * self._size, "all_gather_into_tensor", "output")
        _check_dtypes(output, input, "all_gather_into_tensor")
        target = TensorBuffer(output)
        in_place = _is_block(input, output, self._rank) and not target.copied
        # an input that shares memory with the output otherwise is copied first (MPI may not read and write one
        # buffer); this rank's own block in place is MPI's IN_PLACE (FSDP2's all-gather of its parameters)
        source = None if in_place else TensorBuffer(input.clone() if _overlap(input, output) else input,
                                                    read_only=True)

        def run(worker):
            worker.Allgather(MPI.IN_PLACE if source is None else source.array, target.array)
            target.deliver()
        return self._start("all_gather_into_tensor", run, output, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """One all_gather_into_tensor per pair, in order: what torch's functional collectives (DTensor's
        ``full_tensor``, FSDP2's state dicts) call, from C++, on a group written in Python."""
        return self._each(self.all_gather_single, outputs, inputs, opts, "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """One reduce_scatter_tensor per pair, in order (torch's functional reduce-scatter, as above)."""
        return self._each(self.reduce_scatter_single, outputs, inputs, opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _each(self, call, outputs, inputs, opts, name: str) -> dist.Work:
        """``call(output, input, opts)`` for each pair; the last one's Work (the worker runs them in order, and a
        failure fails the calls after it, so it completes, or fails, last)."""
        if len(outputs) != len(inputs):
            raise Unsupported(f"{name}: {len(outputs)} outputs for {len(inputs)} inputs: pass one output per input")
        work = None
        for output, input in zip(outputs, inputs):
            work = call(output, input, opts)
        return work if work is not None else self._start(name, lambda worker: None, [], opts)

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
        # an output inside the input (FSDP2 reduces its gradients so: output = input's block of this rank) is
        # written from a copy of the input, which is left as it was
        target, source = TensorBuffer(output), TensorBuffer(whole, read_only=True)
        copy = factor is None and _overlap(whole, output)

        def run(worker):
            send = source.array if factor is None and not copy else \
                as_array(source.tensor * factor if factor is not None else source.tensor.clone())
            worker.Reduce_scatter_block(send, target.array, op)
            if average:
                self._divide(target.tensor)
            target.deliver()
        return self._start(name, run, result, opts)

    def reduce(self, tensors, opts=None):
        opts = dist.ReduceOptions() if opts is None else opts
        tensor, root = self._one(tensors, "reduce"), self._root(opts, "reduce")
        op, factor, average = self._op(opts, "reduce", tensor)
        buffer = TensorBuffer(tensor, read_only=self._rank != root)
        signature = Signature("Reduce", tensor.numel(), np.dtype(buffer.array.dtype), op_name(op), root)

        def run(worker):
            if self._rank == root:
                if factor is not None:
                    buffer.tensor.mul_(factor)
                worker.run_started(signature, lambda: MPI.Intracomm.Ireduce(
                    worker, MPI.IN_PLACE, buffer.array, op, root))
                if average:
                    self._divide(buffer.tensor)
                buffer.deliver()
            else:           # (a non-root's input is left as it was: PREMUL_SUM scales a copy)
                send = buffer.array if factor is None else as_array(buffer.tensor * factor)
                worker.run_started(signature, lambda: MPI.Intracomm.Ireduce(worker, send, None, op, root))
        return self._start("reduce", run, tensors, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = dist.GatherOptions() if opts is None else opts
        tensor, root = self._one(input_tensors, "gather"), self._root(opts, "gather")
        outputs = output_tensors[0] if self._rank == root else []
        if self._rank == root:
            _check_list(outputs, self._size, tensor, "gather", "output tensors")
        source = TensorBuffer(tensor, read_only=True)
        signature = Signature("Gather", tensor.numel(), np.dtype(source.array.dtype), root=root)

        def run(worker):
            whole = (torch.empty((self._size, *tensor.shape), dtype=source.tensor.dtype, device=tensor.device)
                     if self._rank == root else None)
            worker.run_started(signature, lambda: MPI.Intracomm.Igather(
                worker, source.array, None if whole is None else as_array(whole), root))
            for part, out in zip(whole if whole is not None else [], outputs):
                out.copy_(part)
        return self._start("gather", run, output_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = dist.ScatterOptions() if opts is None else opts
        output, root = self._one(output_tensors, "scatter"), self._root(opts, "scatter")
        inputs = input_tensors[0] if self._rank == root else []
        if self._rank == root:
            _check_list(inputs, self._size, output, "scatter", "input tensors")
        target = TensorBuffer(output)
        signature = Signature("Scatter", output.numel(), np.dtype(target.array.dtype), root=root)

        def run(worker):
            whole = torch.stack([t.to(target.tensor.dtype) for t in inputs]) if self._rank == root else None
            worker.run_started(signature, lambda: MPI.Intracomm.Iscatter(
                worker, None if whole is None else as_array(whole), target.array, root))
            target.deliver()
        return self._start("scatter", run, output_tensors, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        row_out = output.numel() // max(output.shape[0], 1) if output.dim() else 1
        row_in = input.numel() // max(input.shape[0], 1) if input.dim() else 1
        sends = _splits(input_split_sizes, input, self._size, "input") * row_in
        receives = _splits(output_split_sizes, output, self._size, "output") * row_out
        target = TensorBuffer(output)
        source = TensorBuffer(input.clone() if _overlap(input, output) else input, read_only=True)
        _check_dtypes(output, input, "all_to_all_single")

        def run(worker):
            self._alltoallv(worker, "all_to_all_single", source.array, sends, target.array, receives)
            target.deliver()
        return self._start("all_to_all_single", run, output, opts)

    def _alltoallv(self, worker, name: str, send: np.ndarray, sends: np.ndarray, receive: np.ndarray,
                   receives: np.ndarray) -> None:
        """MPI's own Alltoallv, once every rank has seen that what each sends the other receives: the counts go
        round first (an Alltoall of them, and an Allreduce of whether all agree), so ranks whose split sizes
        disagree all get a MismatchError naming each rank's sizes, never a part of the output left stale."""
        signature = Signature("Alltoallv", 0, np.dtype(send.dtype))
        told = np.empty(self._size, np.int64)
        worker.run_started(signature, lambda: MPI.Intracomm.Ialltoall(worker, sends, told))
        agree = np.array([int(np.array_equal(told, receives))], np.int32)
        worker.run_started(signature, lambda: MPI.Intracomm.Iallreduce(worker, MPI.IN_PLACE, agree, MPI.LAND))
        if not agree[0]:
            mine = np.concatenate([sends, receives])
            everyone = np.empty((self._size, 2 * self._size), np.int64)
            worker.run_started(signature, lambda: MPI.Intracomm.Iallgather(worker, mine, everyone))
            raise MismatchError(name, {rank: f"sends {row[:self._size].tolist()} elements, receives "
                                             f"{row[self._size:].tolist()}" for rank, row in enumerate(everyone)},
                                settled=True)
        worker.run_started(signature, lambda: MPI.Intracomm.Ialltoallv(
            worker, [send, (sends, _offsets(sends))], [receive, (receives, _offsets(receives))]))

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
            self._alltoallv(worker, "all_to_all", as_array(send), sends, as_array(receive), receives)
            for out, start, count in zip(output_tensors, _offsets(receives), receives):
                out.copy_(receive[start: start + count].view_as(out))
        return self._start("all_to_all", run, output_tensors, opts)

    def barrier(self, opts=None):
        signature = Signature("Barrier", 0, np.dtype(np.uint8))
        return self._start("barrier", lambda worker: worker.run_started(
            signature, lambda: MPI.Intracomm.Ibarrier(worker)), [], opts)

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
        return _PointToPoint(self._p2p, request, None if src == MPI.ANY_SOURCE else src, tensors, tensor)

    def recv_anysource(self, tensors, tag):
        """A receive from whichever rank sends first (torch's ``recv`` without ``src``): its Work's
        ``_source_rank()`` names it, as torch's MPI and gloo backends' do."""
        return self.recv(tensors, MPI.ANY_SOURCE, tag)

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


def _compiled_short_way(straight: dict, worker):
    """The short way of small blocking all_reduces in C (``_shortway.c``), or None where no compiler built it
    or ``MPICOLL_FAST_PATH=python`` asks for the Python one (:meth:`ProcessGroupMpicoll._short_way_in_python`)."""
    if ShortWay is None or config.fast_path() != "c":
        return None
    return ShortWay(straight=straight, **worker.reduce_now_parts(), address=_address,
                    iallreduce=MPI.Intracomm.Iallreduce, in_place=MPI.IN_PLACE, mpi_error=MPI.Exception,
                    timeout_error=CollectiveTimeout, worded=_in_torch_words, collective=ALLREDUCE.method)


def _in_torch_words(error: CollectiveTimeout) -> CollectiveTimeout:
    """``error``, its message opened with torch's words for it (" Timed out ", as gloo's and NCCL's say, which
    programs and torch's own tests look for), once."""
    text = str(error)
    if " Timed out after " not in text:
        error.args = (f"{error.collective}: Timed out after {error.seconds:g} s (the group's timeout). {text}",
                      *error.args[1:])
    return error


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two host tensors' memory ranges overlap (their spans, from first to last element)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + _span(a) * a.element_size()
    b_end = b_start + _span(b) * b.element_size()
    return a_start < b_end and b_start < a_end


def _span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to just past its last (its strides' reach)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)


def _is_block(part: torch.Tensor, whole: torch.Tensor, rank: int) -> bool:
    """Whether ``part`` is exactly block ``rank`` of the contiguous ``whole`` cut into equal blocks."""
    return (part.is_contiguous() and whole.is_contiguous() and part.dtype == whole.dtype and part.numel() > 0
            and part.data_ptr() == whole.data_ptr() + rank * part.numel() * part.element_size())


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

# torch's world as an MPI communicator: MPI's world, or the MPI jobs torchrun started joined into one
_WORLD: MPI.Intracomm = MPI.COMM_WORLD


def _create(options, backend_options=None) -> ProcessGroupMpicoll:
    """torch's creator (extended form): a group over MPI's world, or over the ranks ``new_group`` lists."""
    global _WORLD
    ranks = list(options.global_ranks_in_group)
    if not ranks:                                   # the default group: torch's world, MPI's or joined
        _WORLD = MPI.COMM_WORLD
        if options.group_size != _WORLD.Get_size():      # (torchrun's workers, each an MPI job)
            _WORLD = joining.join(options.store, options.group_rank, options.group_size, options.timeout)
        world = _WORLD
        # A rank that fails tells the others why, and each says so (an uncaught error after init_process_group
        # names its rank on every rank, as gloo's ranks each print theirs)
        watchdog.guard_job(world)
        return ProcessGroupMpicoll(world.Dup(), options.timeout)
    world = _WORLD
    group = world.Get_group().Incl(ranks)
    try:
        comm = world.Create_group(group)
    finally:
        group.Free()
    return ProcessGroupMpicoll(comm, options.timeout)


def register() -> None:
    """Register the "mpicoll" backend with torch.distributed and MPI's rendezvous for ``env://``; called
    by ``import mpicoll.torch`` (a second call does nothing)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    _RENDEZVOUS._rendezvous_handlers["env"] = mpi_rendezvous
