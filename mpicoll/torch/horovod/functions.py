"""Horovod's helpers around the ops: parameters, optimizer state and Python objects broadcast from a root,
objects gathered from every rank."""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping

import numpy as np
import torch

from ...base.errors import Unsupported
from ..functions import broadcast_optimizer_state as _broadcast_optimizer_state
from .basics import global_process_set
from .ops import _name, allgather, broadcast_, broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank, prefix="Parameter.", process_set=global_process_set) -> None:
    """Overwrite ``params`` (a ``state_dict()``, or ``named_parameters()``) with the root's, in place."""
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
        raise ValueError("invalid params of type: " + str(type(params)))
    handles = []
    for name, p in items:
        if p is None:
            continue
        tensor = p.data if isinstance(p, torch.nn.Parameter) else p
        if tensor.is_sparse:
            raise Unsupported(f"broadcast_parameters: {name} is sparse, which is not supported")
        handles.append(broadcast_async_(tensor, root_rank, name=prefix + str(name), process_set=process_set))
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set) -> None:
    """Overwrite ``optimizer``'s state and hyperparameters with the root's.  An optimizer with no state yet
    first takes one step on zero gradients (as Horovod does), so that every parameter that requires a gradient
    has one and its state exists everywhere."""
    if process_set is not global_process_set:
        raise Unsupported("broadcast_optimizer_state: only over the global process set in mpicoll's Horovod API")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        sparse = {id(p) for m in (model.modules() if model else []) if isinstance(m, torch.nn.Embedding) and m.sparse
                  for p in m.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or \
                            (isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                        p.grad = p.grad.to_sparse()
        skip = getattr(optimizer, "skip_synchronize", None)         # a DistributedOptimizer: no allreduce here
        if skip is None:
            optimizer.step()
        else:
            with skip():
                optimizer.step()
    _broadcast_optimizer_state(optimizer, root=root_rank, comm=process_set.comm)     # Horovod's world, not MPI's


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """The root's Python object (pickled) on every rank.  Unnamed, the op is named by its place in the set's
    sequence of unnamed object broadcasts (Horovod names it after the object's type, which differs where the
    other ranks pass None)."""
    name = name or _name("broadcast_object", None, process_set)
    if process_set.rank() == process_set.set_rank(root_rank):
        data = torch.from_numpy(np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8).copy())
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        data, length = None, torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name=name + ".sz", process_set=process_set)
    if data is None:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name=name + ".t", process_set=process_set)
    return pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's Python object (pickled), in rank order."""
    name = name or _name("allgather_object", None, process_set)
    buffer = io.BytesIO()
    pickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    data = torch.from_numpy(np.frombuffer(buffer.getvalue(), np.uint8).copy())
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), name=name + ".sz",
                      process_set=process_set).tolist()
    gathered = allgather(data, name=name + ".t", process_set=process_set).numpy()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(gathered[offsets[i]: offsets[i + 1]].tobytes()) for i in range(len(sizes))]
