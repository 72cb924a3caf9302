"""PyTorch tensors through mpicoll's collectives, the way Horovod and torch.distributed take them.

    import mpicoll.torch as mt
    mt.broadcast_parameters(model.state_dict(), root=0)     # every replica starts alike
    optimizer = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ...
    loss.backward()
    optimizer.step()                                        # gradients averaged over the ranks, then the step

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

from collections.abc import Mapping
from itertools import zip_longest

import numpy as np
import torch
from mpi4py import MPI

from . import api
from .checks import agree

__all__ = ["allreduce", "allgather", "broadcast", "broadcast_parameters", "DistributedOptimizer", "OPS"]

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
    if op not in OPS:
        raise ValueError(f"Unrecognized op: {op!r}; use one of {', '.join(OPS)}")
    if op == "average" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"averaging needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide")
    source = _array(tensor)
    if out is None:
        result = _tensor(api.allreduce(source, OPS[op], comm=comm, algorithm=algorithm), tensor)
    else:
        target = source if out is tensor else _array(out)
        api.allreduce(source, OPS[op], comm=comm, algorithm=algorithm, out=target)
        result = out
    if op == "average":
        with torch.no_grad():
            result.div_(_size(comm))
    return result


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


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new flat tensor holding ``tensors`` one after the other (one message for many)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors``, in place, in :func:`_flatten`'s order."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_parameters(params, root: int = 0, *, comm=None, algorithm: str = "auto") -> None:
    """Overwrite every rank's parameters with the root's, in place.

    ``params``: a ``state_dict()``, or ``named_parameters()`` (any iterable of
    (name, tensor) pairs).  Tensors of one dtype and device travel together in
    one broadcast.  Ranks whose names, shapes or dtypes differ from the root's
    get one :class:`~mpicoll.errors.SetupError` on every rank, before anything is
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
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, tensor in named:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for tensors in groups.values():
            flat = _flatten(tensors)
            broadcast(flat, root, comm=comm, algorithm=algorithm, out=flat)
            _unflatten(flat, tensors)


class DistributedOptimizer:
    """Wraps a torch optimizer: ``step()`` averages the gradients over the ranks, then steps.

    Gradients are packed into fused buckets (one per dtype and device, at most
    ``bucket_bytes`` each) and each bucket is summed with one allreduce, so
    every replica gets the same bits and stays identical to the others.  A
    parameter that has a gradient on some ranks only (unused on the others in
    this step) is averaged with zeros from those, and gets that gradient
    everywhere.  ``compression="fp16"`` sends float32/float64 buckets as
    float16 (half the bytes; the sum is rounded to float16).  Everything else
    (``zero_grad``, ``state_dict``, ``param_groups``, ...) is the wrapped optimizer's.

    This version communicates when ``step()`` is called, after the whole
    backward pass: nothing overlaps the computation yet.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, *, algorithm: str = "auto",
                 compression: str | None = None, bucket_bytes: int = 25 << 20, comm=None):
        if compression not in (None, "fp16"):
            raise ValueError(f"compression must be None or 'fp16', got {compression!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.optimizer, self.algorithm, self.compression = optimizer, algorithm, compression
        self.bucket_bytes, self.comm = bucket_bytes, MPI.COMM_WORLD if comm is None else comm
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if named_parameters is not None:
            known = {id(p) for _, p in named_parameters}
            missing = [i for i, p in enumerate(self.parameters) if id(p) not in known]
            if missing:
                raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's parameters "
                                 f"(the first at position {missing[0]}): pass model.named_parameters() of the model "
                                 "whose parameters the optimizer holds")

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def synchronize(self) -> None:
        """Average every parameter's gradient over the ranks, in place (``step()`` calls it)."""
        size = self.comm.Get_size()
        has = torch.tensor([p.grad is not None for p in self.parameters], dtype=torch.int32)
        allreduce(has, "max", comm=self.comm, algorithm=self.algorithm, out=has)
        with torch.no_grad():
            for p, anywhere in zip(self.parameters, has.tolist()):
                if anywhere and p.grad is None:
                    p.grad = torch.zeros_like(p)
            for bucket in self._buckets([p for p, anywhere in zip(self.parameters, has.tolist()) if anywhere]):
                grads = [p.grad for p in bucket]
                flat = _flatten(grads)
                wire = flat.half() if self.compression == "fp16" and flat.is_floating_point() else flat
                allreduce(wire, "sum", comm=self.comm, algorithm=self.algorithm, out=wire)
                if wire is not flat:
                    flat.copy_(wire)
                flat.div_(size)
                _unflatten(flat, grads)

    def _buckets(self, parameters: list) -> list[list]:
        """Parameters in the optimizer's order, cut into runs of one dtype and device up to bucket_bytes."""
        buckets, current, current_bytes = [], [], 0
        for p in parameters:
            nbytes = p.numel() * p.element_size()
            if current and (p.dtype, p.device) != (current[0].dtype, current[0].device) or \
                    current and current_bytes + nbytes > self.bucket_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        return buckets + ([current] if current else [])

    def step(self, closure=None):
        """Average the gradients over the ranks, then the wrapped optimizer's step."""
        if closure is not None:
            raise ValueError("a closure would recompute the gradients after they were averaged: call "
                             "loss.backward(), then step() without one")
        self.synchronize()
        return self.optimizer.step()
