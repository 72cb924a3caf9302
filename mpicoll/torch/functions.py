"""What a torch program needs around its training loop: torch.distributed started from mpiexec's ranks,
parameters and optimizer state broadcast from one rank, a module's parameters as one flat vector."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from itertools import zip_longest

import torch
from mpi4py import MPI

from ..channel.checks import agree
from ..models.modules import point_at
from .backend import rendezvous_address
from .collectives import as_array, broadcast

__all__ = ["init_process_group", "FlatParameters", "broadcast_parameters", "broadcast_optimizer_state"]


def init_process_group(backend: str = "gloo", *, comm=None, master: str | None = None,
                       timeout: float = 300.0) -> None:
    """Start ``torch.distributed`` on the ranks mpiexec launched, for code that needs a process group
    (DDP, gloo's collectives): no MASTER_ADDR or port to set by hand.

    Rank 0 picks a free TCP port on its host and tells the others through
    MPI; ``master`` overrides the host name the others dial (all ranks on one
    host use 127.0.0.1).  Torch's rank and world size are the communicator's.
    (``dist.init_process_group`` with no ``MASTER_ADDR`` now does the same on
    its own after ``import mpicoll.torch``; this one also takes a communicator
    other than the world and a ``master`` host.)
    """
    import torch.distributed as dist

    comm = MPI.COMM_WORLD if comm is None else comm
    address, port = rendezvous_address(comm, master)
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
            raise TypeError("bfloat16 parameters are not supported here: the parameter servers and SGP update in "
                            "float32 or float64; call model.float()")
        self._weights = _flatten(self.parameters) if self.parameters else torch.zeros(0)
        self._grad = torch.zeros_like(self._weights)
        point_at(self.parameters, self._weights, self._grad)
        self.weights, self.grad = as_array(self._weights), as_array(self._grad)

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
