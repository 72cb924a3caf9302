"""The low-communication family: every rank a replica that trains on its own shard and meets the others every
``--sync-every`` steps (``localsgd``: their average; ``diloco``: DiLoCo's outer Nesterov step on their average
pseudo-gradient), through :class:`mpicoll.diloco.DiLoCo` (streaming fragments, overlap, 16-bit
pseudo-gradients).  The inner optimizer is SGD (``--inner-momentum``) or AdamW (``--inner-optimizer``)."""

from __future__ import annotations

import numpy as np

from ..base import checkpoint, timeline
from ..base.errors import RanksLost
from ..base.straggler import Straggler
from ..channel.checks import load_checkpoint_set
from ..collectives.communicator import Communicator
from ..diloco import DiLoCo, optimizers
from ..diloco.state import taken_from, under
from ..models.dense import Model, unpack
from . import elastic, schedule as schedules
from .common import Family, Options, batches, setup, stop_if_diverged
from .report import Reporter

__all__ = ["LocalUpdates"]


def _arrays_of(model: Model, params) -> list:
    """The model's arrays as views of its flat vector (its layers, where it says how they lie; else the whole
    vector, one array): what the fragments are made of."""
    try:
        return unpack(params, model.parameter_shapes())
    except (NotImplementedError, AttributeError):
        return [params]


def _shared_weights(outer: DiLoCo):
    """The replicas' shared weights as one flat vector (what the reporter evaluates): the anchor of their last
    meetings, the same on every rank."""
    return np.concatenate([a.ravel() for a in outer.anchor])


def _communication(outer: DiLoCo) -> dict:
    """What the summary says the replicas exchanged."""
    return {"meetings": outer.meetings, "bytes_summed_per_rank": int(outer.bytes_summed)}


class LocalUpdates(Family):
    """Replicas that train apart and meet every ``--sync-every`` steps; ``outer``: "diloco" (the options'
    outer SGD) or "average" (local SGD)."""

    fixed_ranks = "each rank's replica, its inner optimizer and its shard of the data are its own between meetings"

    def __init__(self, name: str, outer: str):
        super().__init__(name)
        self.outer = outer

    def check(self, options: Options, model: Model, size: int) -> None:
        if options.model_parallel != 1:
            raise ValueError(f"--model-parallel: {self.name} trains whole replicas")
        if options.overlap >= options.sync_every:
            raise ValueError(f"--overlap {options.overlap}: fewer inner steps than --sync-every "
                             f"{options.sync_every} (a fragment's sum must land before its next meeting)")
        arrays = len(_arrays_of(model, np.zeros(model.size)))
        if options.fragments > arrays:
            raise ValueError(f"--fragments {options.fragments}: the model has {arrays} array(s) to cut into fragments "
                             "(numpy's mlp and softmax say how their vector is laid out; use --fragments 1 otherwise)")
        optimizers.make(options.inner_optimizer, options.lr, options.inner_momentum,
                        weight_decay=options.weight_decay)              # raises on a bad combination
        if self.outer == "diloco":
            optimizers.SGD(options.outer_lr, options.outer_momentum, options.nesterov and options.outer_momentum > 0)

    def check_elastic(self, options: Options, model: Model, size: int) -> None:
        if options.overlap:
            raise ValueError("--elastic: a meeting's sum must be whole before any replica uses it, and with "
                             "--overlap it is used steps after it began; drop --overlap (fragments still stream)")

    def check_compression(self, options: Options, model: Model) -> None:
        if options.compression == "powersgd":
            raise ValueError(f"--compression powersgd: {self.name} moves pseudo-gradients as fp16 or bf16 (with error "
                             "feedback, always)")
        if getattr(model, "xp", np) is not np:
            raise ValueError("--compression moves host (numpy) pseudo-gradients: drop --device cuda, or --compression")

    def checkpoint_file(self, options: Options, rank: int):
        """One file per rank: each replica's weights and inner optimizer are its own between meetings."""
        return checkpoint.path(options.checkpoint, "rank", rank)

    def _save(self, options: Options, rank: int, run: dict, epoch: int, params, inner, outer) -> None:
        """This rank's checkpoint after ``epoch`` epochs: its replica, its inner optimizer, its outer loop."""
        checkpoint.save(self.checkpoint_file(options, rank), run, epoch, params=params.copy(), epoch=np.array(epoch),
                        **under("inner.", inner.state_dict()), **under("outer.", outer.state_dict()))

    def _outer(self, options: Options, arrays: list, channel) -> DiLoCo:
        """The outer loop over ``arrays`` among ``channel``'s ranks, as the options say."""
        outer = dict(outer_lr=options.outer_lr, outer_momentum=options.outer_momentum, nesterov=options.nesterov) \
            if self.outer == "diloco" else dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        return DiLoCo(arrays, sync_every=options.sync_every, fragments=options.fragments, overlap=options.overlap,
                      mix=options.mix, compression=options.compression, comm=channel, **outer)

    def run(self, comm, options, model, data, xp, run):
        if xp is not np:
            raise ValueError(f"{self.name} keeps its anchor in host memory: --device cpu")
        if options.elastic:
            return self._run_elastic(comm, options, model, data, run)
        rank, size = comm.Get_rank(), comm.Get_size()
        _, steps, X, y, slow = setup(comm, options, data, xp, tuple(range(size)))
        params = np.asarray(model.init(options.seed))
        arrays = _arrays_of(model, params)
        inner = optimizers.make(options.inner_optimizer, options.lr, options.inner_momentum,
                                weight_decay=options.weight_decay)
        lr_at = schedules.per_step(options.lr_schedule, options.lr, options.epochs, steps)
        start = 0
        with Communicator(comm, algorithm="auto") as channel:
            outer = self._outer(options, arrays, channel)
            if options.resume:
                start = self._resume(comm, options, run, params, inner, outer)
            reporter = Reporter(options, model, data, xp, ranks=size) if rank == 0 else None
            for epoch in range(start, options.epochs):
                losses = []
                for step, batch in enumerate(batches(len(y), options.batch, steps, [options.seed, rank, epoch])):
                    with slow, timeline.span("gradient", "train"):
                        loss, grad = model.loss_and_gradient(params, X[batch], y[batch])
                    losses.append(loss)
                    with timeline.span("update", "train"):
                        inner.step(arrays, _arrays_of(model, grad), lr=lr_at(epoch, step))
                    outer.step()
                stop_if_diverged(comm, params, [(epoch, losses)], f"after epoch {epoch + 1}")
                if options.checkpoint:
                    self._save(options, rank, run, epoch + 1, params, inner, outer)
                if reporter:
                    reporter.evaluate(_shared_weights(outer), epoch + 1, (epoch + 1) * steps * options.batch * size)
            outer.finish()
        return reporter.finish(params, communication=_communication(outer)) if reporter else None

    def _resume(self, comm, options, run, params, inner, outer) -> int:
        """The epochs done; ``params``, ``inner`` and ``outer`` set to this rank's saved state (every rank's
        file of the same epoch, or none: :func:`load_checkpoint_set`)."""
        self.check_rank_count(comm, options, run)
        state = load_checkpoint_set(comm, [self.checkpoint_file(options, comm.Get_rank())], run, "epochs")[0]
        params[...] = state["params"]
        inner.load_state_dict(taken_from("inner.", state))
        outer.load_state_dict(taken_from("outer.", state))
        return int(state["epoch"])

    def _run_elastic(self, comm, options, model, data, run):
        """The same replicas going on without ranks that die (:mod:`mpicoll.train.elastic`): every step that
        meets is agreed on (one ``MPI_Comm_agree``: its sum is used only once every member says it is whole), with
        the replica's weights and the outer state saved just before it.  After a loss the survivors, all at the
        same meeting, restore what they saved, shrink, and hold that meeting again among themselves (the lost
        replica's inner steps since its last meeting are gone with it); the rows of this epoch that nobody had
        reached, the lost rank's too, are divided among them, and later epochs among them as a run of that many
        ranks would divide the data."""
        X, y = data.X, data.y
        slow = Straggler.for_rank(comm.Get_rank(), options.straggler, options.delay, options.seed)
        params = np.asarray(model.init(options.seed))
        arrays = _arrays_of(model, params)
        inner = optimizers.make(options.inner_optimizer, options.lr, options.inner_momentum,
                                weight_decay=options.weight_decay)
        channel = Communicator(comm.Dup(), algorithm="auto")      # revoked, not the job's, after a loss
        channel.on_death = "revoke"             # the survivors shrink it together (elastic.Survivors.recover)
        outer = self._outer(options, arrays, channel)
        epoch = samples = 0
        if options.resume:
            epoch = self._resume(comm, options, run, params, inner, outer)
            samples = elastic.samples_before(epoch, len(y), comm.Get_size(), options.batch)
        survivors = elastic.Survivors(comm, options, model, data, np)
        rate = schedules.parse(options.lr_schedule, options.lr)
        plan, done = elastic.Plan.epoch(len(y), comm.Get_size(), options.batch, options.seed, epoch), 0
        saved, again = None, None      # just before the meeting in hand: (weights, outer state, "step"|"finish")

        def meet(kind: str) -> None:
            """outer.step() or outer.finish(), a step that communicates: agreed on, from a saved point."""
            nonlocal saved
            saved = (params.copy(), {k: np.array(v, copy=True) for k, v in outer.state_dict().items()}, kind)
            with elastic.agreed(channel):
                getattr(outer, kind)()          # the outer loop of this moment (a new one after a loss)
            saved = None

        while True:
            try:
                if again is not None:           # the meeting a loss interrupted, held among the survivors
                    kind, again = again, None
                    meet(kind)
                while epoch < options.epochs:
                    me, count = channel.Get_rank(), channel.Get_size()
                    losses = []
                    while done < plan.steps:
                        batch = plan.batches[me][done]
                        with slow, timeline.span("gradient", "train"):
                            loss, grad = model.loss_and_gradient(params, X[batch], y[batch])
                        losses.append(loss)
                        with timeline.span("update", "train"):
                            inner.step(arrays, _arrays_of(model, grad),
                                       lr=rate(plan.progress(epoch, done, options.epochs)))
                        done, samples = done + 1, samples + count * len(batch)
                        if outer.meets_next():
                            meet("step")
                        else:
                            outer.step()
                    with elastic.agreed(channel):
                        stop_if_diverged(channel, params, [(epoch, losses)], f"after epoch {epoch + 1}")
                    if options.checkpoint:
                        self._save(options, me, {**run, "ranks": count}, epoch + 1, params, inner, outer)
                    if survivors.reporter:
                        survivors.reporter.evaluate(_shared_weights(outer), epoch + 1, samples)
                    epoch += 1
                    plan, done = elastic.Plan.epoch(len(y), channel.Get_size(), options.batch, options.seed,
                                                    epoch), 0
                meet("finish")
                break
            except RanksLost:           # on every survivor alike, at the same meeting or check
                if saved is not None:   # the meeting in hand: back to just before it, to hold it again
                    params[...], state, again = saved
                    saved = None
                else:                   # met at an epoch's check: no meeting was in hand
                    state = outer.state_dict()
                channel, (epoch, agreed), loss = survivors.recover(channel, (epoch, done))
                outer = self._outer(options, arrays, channel)      # the same state, among the survivors
                outer.load_state_dict(state)
                plan, done = plan.rest(agreed, loss.ranks, options.batch), 0
        summary = survivors.finish(params, samples, communication=_communication(outer))
        channel.close(abandon=bool(survivors.losses))
        return summary
