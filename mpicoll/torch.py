"""PyTorch tensors through mpicoll's collectives, the way Horovod and torch.distributed take them.

    import mpicoll.torch as mt
    mt.broadcast_parameters(model.state_dict(), root=0)     # every replica starts alike
    optimizer = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ...
    loss.backward()                                         # buckets of gradients start their allreduce here
    optimizer.step()                                        # waits for them, averages, steps

Needs ``pip install mpicoll[torch]``.  CPU tensors are read and written where
they are (numpy shares their memory); CUDA tensors go to the array layer as
device arrays (``__cuda_array_interface__``) and are reduced on their GPU.
Results are tensors of the input's kind; ``out=`` may be the input itself.
``comm`` is any mpi4py communicator (default ``MPI.COMM_WORLD``), wrapped once
in a :class:`~mpicoll.Communicator` of ``algorithm``; every rank must make the
same calls in the same order.  numpy has no bfloat16, so bfloat16 tensors are
refused with a message saying what to pass.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import timedelta
from itertools import zip_longest

import numpy as np
import torch
from mpi4py import MPI

from .base import timeline
from .channel import watchdog
from .channel.checks import agree
from .collectives import api
from .collectives.nonblocking import Request
from .models.modules import point_at

__all__ = ["allreduce", "allreduce_async", "allgather", "broadcast", "broadcast_parameters",
           "broadcast_optimizer_state", "DistributedOptimizer", "allreduce_hook", "init_process_group",
           "FlatParameters", "point_at", "OPS"]

# torch/Horovod names -> the array API's; "average" is a sum divided by the rank count
OPS = {"average": "sum", "sum": "sum", "min": "min", "max": "max", "product": "prod"}


def _array(tensor: torch.Tensor):
    """The tensor's memory as a numpy (CPU) or device array, without a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bfloat16:
        raise TypeError("bfloat16 tensors are not supported (numpy has no bfloat16): pass "
                        "tensor.float() and convert the result back")
    tensor = tensor.detach()
    return tensor if tensor.is_cuda else tensor.numpy()


def _tensor(array, like: torch.Tensor) -> torch.Tensor:
    """An array the array API returned, as a tensor of ``like``'s kind (no copy)."""
    return torch.from_numpy(array) if isinstance(array, np.ndarray) else torch.as_tensor(array, device=like.device)


def _size(comm) -> int:
    return (MPI.COMM_WORLD if comm is None else comm).Get_size()


def allreduce(tensor: torch.Tensor, op: str = "average", *, comm=None, algorithm: str = "auto",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The elementwise ``op`` of ``tensor`` over all ranks: average (default), sum, min, max or product.

    ``out=tensor`` reduces in place.  Averaging needs a floating-point tensor.
    """
    call, finish = _allreduce(tensor, op, comm, algorithm, out)
    return finish(call.run())


def allreduce_async(tensor: torch.Tensor, op: str = "average", *, comm=None, algorithm: str = "auto",
                    out: torch.Tensor | None = None) -> Request:
    """:func:`allreduce`, started: returns a :class:`~mpicoll.Request` whose ``wait()`` gives the result.

    The reduction runs while the caller goes on (:mod:`mpicoll.collectives.nonblocking`);
    leave ``tensor`` and ``out`` alone until it has completed.
    """
    call, finish = _allreduce(tensor, op, comm, algorithm, out)
    return call.start().then(finish)


def _allreduce(tensor, op, comm, algorithm, out):
    """(the prepared array call, what turns its result into the tensor to return)."""
    if op not in OPS:
        raise ValueError(f"Unrecognized op: {op!r}; use one of {', '.join(OPS)}")
    if op == "average" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"averaging needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide")
    source = _array(tensor)
    target = None if out is None else source if out is tensor else _array(out)
    size = _size(comm)

    def finish(array) -> torch.Tensor:
        result = _tensor(array, tensor) if out is None else out
        if op == "average":
            with torch.no_grad():
                result.div_(size)
        return result

    return api._allreduce(source, OPS[op], comm, algorithm, target), finish


def allgather(tensor: torch.Tensor, *, comm=None, algorithm: str = "auto",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (a scalar gives shape (p,))."""
    source = _array(tensor)
    if out is None:
        return _tensor(api.allgather(source, comm=comm, algorithm=algorithm), tensor)
    api.allgather(source, comm=comm, algorithm=algorithm, out=_array(out))
    return out


def broadcast(tensor: torch.Tensor, root: int = 0, *, comm=None, algorithm: str = "auto",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The root's ``tensor`` on every rank (the others pass one of the same shape and dtype).

    Returns a new tensor unless ``out`` is given; ``out=tensor`` overwrites it in place.
    """
    source = _array(tensor)
    if out is None:
        return _tensor(api.broadcast(source, root, comm=comm, algorithm=algorithm), tensor)
    target = source if out is tensor else _array(out)
    api.broadcast(source, root, comm=comm, algorithm=algorithm, out=target)
    return out


def init_process_group(backend: str = "gloo", *, comm=None, master: str | None = None,
                       timeout: float = 300.0) -> None:
    """Start ``torch.distributed`` on the ranks mpiexec launched, for code that needs a process group
    (DDP, gloo's collectives): no MASTER_ADDR or port to set by hand.

    Rank 0 picks a free TCP port on its host and tells the others through
    MPI; ``master`` overrides the host name the others dial (all ranks on one
    host use 127.0.0.1).  Torch's rank and world size are the communicator's.
    """
    import torch.distributed as dist

    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_rank() == 0:
        with socket.socket() as probe:             # a free port on rank 0's host
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        host = master or socket.gethostname()
    else:
        host = port = None
    host, port = comm.bcast((host, port))
    single_host = len(set(comm.allgather(socket.gethostname()))) == 1
    address = "127.0.0.1" if single_host and not master else host
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timedelta(seconds=timeout))


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new flat tensor holding ``tensors`` one after the other (one message for many)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors``, in place, in :func:`_flatten`'s order."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class FlatParameters:
    """A module's parameters and gradients as two flat vectors, the module computing on views of them.

    mpicoll's parameter servers and SGP move one flat array each step
    (:mod:`mpicoll.ps`, :mod:`mpicoll.gossip`).  After ``flat =
    FlatParameters(model)`` the model's parameters live in ``flat.weights``
    and backward writes their gradients into ``flat.grad``, so a torch model
    trains under any of them with no copy per step::

        flat = mt.FlatParameters(model)
        server = ps.ParameterServer(MPI.COMM_WORLD, flat.weights, ps.DCASGD(lr=0.1, lam=0.04))
        if server.is_server:
            server.serve()
        else:
            server.client.pull(out=flat.weights)
            for x, y in loader:
                flat.zero_grad()
                functional.cross_entropy(model(x), y).backward()
                server.client.exchange(flat.grad, out=flat.weights)
            server.client.close()

    ``weights`` and ``grad`` are numpy arrays for a CPU module (CUDA tensors for
    a CUDA one, which the array layer takes as device arrays).  Every parameter
    must have one dtype and device.  Zero the gradients with
    :meth:`zero_grad`: an optimizer's ``zero_grad()`` sets them to None,
    which would detach them from ``grad`` (this one puts the views back).
    """

    def __init__(self, module: torch.nn.Module):
        self.parameters = list(module.parameters())
        kinds = {(p.dtype, p.device) for p in self.parameters}
        if len(kinds) > 1:
            raise TypeError(f"the parameters have several dtypes or devices {sorted(map(str, kinds))}: one flat "
                            "vector holds one kind; convert the module (e.g. model.float()) first")
        if kinds and next(iter(kinds))[0] == torch.bfloat16:
            raise TypeError("bfloat16 parameters are not supported (numpy has no bfloat16): call model.float()")
        self._weights = _flatten(self.parameters) if self.parameters else torch.zeros(0)
        self._grad = torch.zeros_like(self._weights)
        point_at(self.parameters, self._weights, self._grad)
        self.weights, self.grad = _array(self._weights), _array(self._grad)

    def zero_grad(self) -> None:
        """Zero ``grad`` and make every parameter's ``.grad`` a view of it again."""
        self._grad.zero_()
        point_at(self.parameters, self._weights, self._grad)


def _broadcast_tensors(tensors: list[torch.Tensor], root: int, comm, algorithm: str) -> None:
    """Overwrite ``tensors`` with the root's, in place: those of one dtype and device in one broadcast."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for group in groups.values():
            flat = _flatten(group)
            broadcast(flat, root, comm=comm, algorithm=algorithm, out=flat)
            _unflatten(flat, group)


def broadcast_parameters(params, root: int = 0, *, comm=None, algorithm: str = "auto") -> None:
    """Overwrite every rank's parameters with the root's, in place.

    ``params``: a ``state_dict()``, or ``named_parameters()`` (any iterable of
    (name, tensor) pairs).  Tensors of one dtype and device travel together in
    one broadcast.  Ranks whose names, shapes or dtypes differ from the root's
    get one :class:`mpicoll.SetupError` on every rank, before anything is
    overwritten.
    """
    named = list(params.items() if isinstance(params, Mapping) else params)
    if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in named):
        raise TypeError("broadcast_parameters takes a state_dict() or named_parameters(): (name, tensor) pairs")
    comm = MPI.COMM_WORLD if comm is None else comm
    layout = [(name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in named]
    roots = comm.bcast(layout, root)

    def same_as_root() -> None:
        differ = next(((mine, theirs) for mine, theirs in zip_longest(layout, roots) if mine != theirs), None)
        if differ:
            raise ValueError(f"the parameters differ from rank {root}'s: this rank has {differ[0]}, "
                             f"rank {root} has {differ[1]} (build the same model on every rank)")

    agree(comm, same_as_root)
    _broadcast_tensors([tensor for _, tensor in named], root, comm, algorithm)


class _Slot:
    """Where a tensor stood in an optimizer's state_dict, as broadcast without its data."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0, *, comm=None,
                              algorithm: str = "auto") -> None:
    """Give every rank's optimizer the root's state: momentum buffers, step counts and hyperparameters.

    For runs resumed from a checkpoint that only the root loaded.  The
    state's structure travels pickled, its tensors in fused broadcasts; every
    rank then loads it with ``load_state_dict``, so ranks whose optimizer had
    no state yet (never stepped) get it too.  Optimizers whose parameter
    groups differ from the root's get one SetupError on every rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    sent: list[torch.Tensor] = []

    def strip(tensor: torch.Tensor) -> _Slot:
        sent.append(tensor.detach().to("cpu"))
        return _Slot(tensor)

    is_root = comm.Get_rank() == root
    skeleton = comm.bcast(_map_leaves(optimizer.state_dict(), torch.Tensor, strip) if is_root else None, root)
    groups = [len(group["params"]) for group in optimizer.param_groups]

    def same_as_root() -> None:
        theirs = [len(group["params"]) for group in skeleton["param_groups"]]
        if theirs != groups:
            raise ValueError(f"the optimizer's parameter groups differ from rank {root}'s: this rank has "
                             f"{groups} parameters per group, rank {root} has {theirs} (build the same "
                             "model and optimizer on every rank)")

    agree(comm, same_as_root)
    received: list[torch.Tensor] = []

    def allocate(slot: _Slot) -> torch.Tensor:
        received.append(torch.empty(slot.shape, dtype=slot.dtype))
        return received[-1]

    state = None if is_root else _map_leaves(skeleton, _Slot, allocate)
    _broadcast_tensors(sent if is_root else received, root, comm, algorithm)
    if not is_root:
        optimizer.load_state_dict(state)


def _map_leaves(value, leaf: type, convert):
    """``value`` (nested dicts, lists and tuples) with every ``leaf`` instance replaced by ``convert(it)``,
    visited in order."""
    if isinstance(value, leaf):
        return convert(value)
    if isinstance(value, Mapping):
        return {key: _map_leaves(item, leaf, convert) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(item, leaf, convert) for item in value)
    return value


def allreduce_hook(state, bucket):
    """A communication hook for ``DistributedDataParallel``: DDP's buckets averaged by mpicoll.

        model = DistributedDataParallel(model)
        model.register_comm_hook(None, mpicoll.torch.allreduce_hook)

    ``state``: None for ``MPI.COMM_WORLD``, or the mpi4py communicator to use.
    DDP still needs ``torch.distributed`` initialised (it broadcasts the
    parameters and checks the model with it); the gradients go through
    mpicoll's nonblocking allreduce, started as DDP hands over each bucket.
    """
    tensor = bucket.buffer()
    future: torch.futures.Future = torch.futures.Future()

    def settle(request: Request) -> None:
        if request.error is not None:
            future.set_exception(request.error)
        else:
            future.set_result(request.wait())

    allreduce_async(tensor, "average", comm=state, out=tensor).add_done_callback(settle)
    return future


# DDP checks the hook's return annotation as an object (this module's annotations are strings)
allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class _Bucket:
    """Parameters whose gradients travel together in one allreduce, through one flat buffer reused every step.

    The buffer holds the gradients one after the other in the wire dtype,
    then one element per parameter: 1 where this rank contributed a gradient
    for it.  Summed over the ranks, that says which parameters got a gradient
    anywhere, in the same message.
    """

    def __init__(self, index: int, params: list, wire: torch.dtype):
        self.index, self.params = index, params
        self.sizes = [p.numel() for p in params]
        self.elements = sum(self.sizes)
        self.flat = torch.zeros(self.elements + len(params), dtype=wire, device=params[0].device)
        self.waiting = len(params)          # parameters whose gradient is not ready yet this step
        self.request: Request | None = None

    def start(self, comm, algorithm: str) -> None:
        """Pack the gradients and start summing them over the ranks."""
        offset = 0
        with torch.no_grad(), timeline.span(f"bucket {self.index}: pack and start", "bucket",
                                            parameters=len(self.params), bytes=self.flat.nbytes):
            for index, (p, size) in enumerate(zip(self.params, self.sizes)):
                part = self.flat[offset:offset + size]
                if p.grad is None:
                    part.zero_()
                elif p.grad.is_sparse:
                    raise TypeError("sparse gradients are not supported by DistributedOptimizer: use a dense "
                                    "embedding (sparse=False)")
                else:
                    part.copy_(p.grad.reshape(-1))
                self.flat[self.elements + index] = p.grad is not None
                offset += size
        array = _array(self.flat)
        self.request = api.iallreduce(array, "sum", comm=comm, algorithm=algorithm, out=array)

    def finish(self, ranks: int) -> None:
        """Wait for the sum, and give each parameter that had a gradient anywhere the average."""
        self.request.Wait()
        self.request, self.waiting = None, len(self.params)
        with torch.no_grad(), timeline.span(f"bucket {self.index}: unpack", "bucket"):
            had = (self.flat[self.elements:] > 0).tolist()
            offset = 0
            for p, size, anywhere in zip(self.params, self.sizes, had):
                if anywhere:
                    average = self.flat[offset:offset + size].to(p.dtype).div_(ranks)
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(average.view_as(p.grad))
                offset += size


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: gradients are averaged over the ranks during the backward pass, then it steps.

    Like Horovod's: ``DistributedOptimizer(optimizer)`` returns an optimizer of
    the wrapped one's class (so LR schedulers and ``isinstance`` accept it)
    sharing its parameter groups and state.  As backward produces gradients,
    hooks pack them into fused buckets (one dtype and device each, closed once
    they hold ``bucket_bytes``, in reverse parameter order, which is roughly the order
    backward produces them) and start a nonblocking allreduce per full bucket
    (:mod:`mpicoll.collectives.nonblocking`), so communication overlaps the rest of the
    backward pass.  ``step()`` starts the buckets still waiting, waits for
    all, averages, and steps.  Buckets are started in the same order on
    every rank, and every rank gets the same bits, so replicas stay identical.

    - A parameter that has a gradient on some ranks only (unused there in this
      step) is averaged with zeros from those, and gets that gradient
      everywhere; one with no gradient anywhere keeps ``grad`` None.
    - ``backward_passes_per_step=N``: gradients accumulate locally over N
      backward passes (torch sums them into ``.grad``); the sum is averaged
      over the ranks after the N-th.  More passes than N before ``step()`` is
      an error, as in Horovod.
    - ``compression="fp16"`` sends float32/float64 buckets as float16 (half the
      bytes; the sum is rounded to float16).
    - ``synchronize()`` averages without stepping (e.g. to clip the averaged
      gradients), then ``with optimizer.skip_synchronize(): optimizer.step()``.

    Parameters that do not require gradients are left alone.  One whose
    ``requires_grad`` changes (gradual unfreezing) is followed: ``step()``
    notices the change, averages the newly trainable parameters' gradients of
    that step too, and plans the buckets afresh, after checking that every
    rank made the same change (a rank that differs is named, on every rank
    that made one, instead of reducing buckets of different layouts).  Sparse
    gradients are refused.  Wrap an optimizer once: each wrapper registers
    its own hooks on the parameters, and a second one would start its own
    buckets during every backward pass too.
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args, **kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is a DistributedOptimizer already: wrap the plain one once")
        kind = type(f"Distributed{type(optimizer).__name__}", (cls, type(optimizer)), {})
        self = object.__new__(kind)
        self.__dict__.update(optimizer.__dict__)      # the same parameter groups, state and hooks
        return self

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, *, algorithm: str = "auto",
                 compression: str | None = None, bucket_bytes: int = 4 << 20, backward_passes_per_step: int = 1,
                 comm=None):
        if compression not in (None, "fp16"):
            raise ValueError(f"compression must be None or 'fp16', got {compression!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        self.optimizer, self.algorithm, self.compression = optimizer, algorithm, compression
        self.bucket_bytes, self.backward_passes_per_step = bucket_bytes, backward_passes_per_step
        self.comm = MPI.COMM_WORLD if comm is None else comm
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if named_parameters is not None:
            known = {id(p) for _, p in named_parameters}
            missing = [i for i, p in enumerate(parameters) if id(p) not in known]
            if missing:
                raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's parameters "
                                 f"(the first at position {missing[0]}): pass model.named_parameters() of the model "
                                 "whose parameters the optimizer holds")
        self._passes: dict[int, int] = {}
        self._next = 0                       # the first bucket not started in this step
        self._lock = threading.Lock()
        self._skip = False
        self._hooks: list = []
        self._follow(self._trainable())

    def _trainable(self) -> list:
        """The optimizer's parameters that require gradients now, in reverse order (backward's)."""
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [p for p in reversed(parameters) if p.requires_grad]

    def _follow(self, trainable: list) -> None:
        """Plan the buckets of ``trainable`` and hook their parameters (dropping the hooks of a former plan)."""
        for hook in self._hooks:
            hook.remove()
        self._buckets = self._plan(trainable)
        self._bucket_of = {id(p): bucket for bucket in self._buckets for p in bucket.params}
        self._planned = [id(p) for p in trainable]
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in trainable]

    def _plan(self, parameters: list) -> list[_Bucket]:
        """Runs of one dtype and device in the given order, each closed once it holds bucket_bytes (as
        DDP's: a small bias joins the large weight after it rather than travelling alone)."""
        runs, current, current_bytes = [], [], 0
        for p in parameters:
            if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
                runs.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += p.numel() * p.element_size()
            if current_bytes >= self.bucket_bytes:
                runs.append(current)
                current, current_bytes = [], 0
        runs += [current] if current else []
        return [_Bucket(index, run, torch.float16 if self.compression == "fp16" and run[0].dtype in
                        (torch.float32, torch.float64) else run[0].dtype) for index, run in enumerate(runs)]

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """Backward has accumulated ``p``'s gradient: count the pass, start the buckets now complete."""
        with self._lock:
            passes = self._passes[id(p)] = self._passes.get(id(p), 0) + 1
            if passes > self.backward_passes_per_step:
                raise RuntimeError(f"a gradient was computed {passes} times before step(), but "
                                   f"backward_passes_per_step={self.backward_passes_per_step}: call step() (or "
                                   "synchronize()) after that many backward passes, or raise it")
            if passes == self.backward_passes_per_step:
                self._bucket_of[id(p)].waiting -= 1
                while self._next < len(self._buckets) and self._buckets[self._next].waiting == 0:
                    self._start_next()

    def _start_next(self) -> None:
        self._buckets[self._next].start(self.comm, self.algorithm)
        self._next += 1

    def synchronize(self) -> None:
        """Average every parameter's gradient over the ranks, in place (``step()`` calls it)."""
        with self._lock, timeline.span("synchronize", "train"):
            while self._next < len(self._buckets):
                self._start_next()
            try:
                ranks = self.comm.Get_size()
                for bucket in self._buckets:
                    bucket.finish(ranks)
            finally:
                self._next, self._passes = 0, {}
            trainable = self._trainable()
            if [id(p) for p in trainable] != self._planned:
                self._replan(trainable)

    def _replan(self, trainable: list) -> None:
        """``requires_grad`` changed since the buckets were planned: check that every rank changed alike,
        average this step's gradients of the newly trainable parameters, and plan afresh."""
        index = {id(p): i for i, p in enumerate(p for group in self.optimizer.param_groups for p in group["params"])}
        mine = sorted(index[id(p)] for p in trainable)
        with watchdog.bounded(self.comm, "DistributedOptimizer: comparing the parameters that require gradients"):
            everyone = self.comm.allgather(mine)
        if any(other != mine for other in everyone):
            differ = [rank for rank, other in enumerate(everyone) if other != everyone[0]]
            raise RuntimeError(f"DistributedOptimizer: the ranks changed requires_grad differently (rank(s) "
                               f"{', '.join(map(str, differ))} train other parameters than rank 0): change "
                               "it alike on every rank, at the same step")
        planned = set(self._planned)
        fresh = [p for p in trainable if id(p) not in planned]
        if fresh:                 # their gradients of this step were not in any bucket
            ranks = self.comm.Get_size()
            for bucket in self._plan(fresh):
                bucket.start(self.comm, self.algorithm)
                bucket.finish(ranks)
        self._follow(trainable)

    @contextmanager
    def skip_synchronize(self):
        """Within this block ``step()`` does not average (``synchronize()`` was called already)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        """Average the gradients over the ranks (unless inside ``skip_synchronize``), then step."""
        if closure is not None:
            raise ValueError("a closure would recompute the gradients after they were averaged: call "
                             "loss.backward(), then step() without one")
        if not self._skip:
            self.synchronize()
        with timeline.span("optimizer step", "train"):
            return super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; refused while gradients of this step are on their way."""
        if self._next or self._passes:
            raise RuntimeError("zero_grad() was called after backward() but before step() or synchronize(): "
                               "the gradients already started would be lost; call step() or synchronize() first")
        super().zero_grad(set_to_none)
