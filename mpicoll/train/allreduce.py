"""The allreduce family: every rank a worker, gradients averaged by an allreduce each step (``allreduce-ring``,
``allreduce-parallel``, ``allreduce-auto``), and ``sequential``, the same loop on one process, the reference."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import arrays
from ..base import checkpoint, failure, timeline
from ..base.errors import RanksLost
from ..base.straggler import Straggler
from ..channel.checks import load_checkpoint_set
from ..channel.watchdog import bounded
from ..collectives.api import allreduce
from ..collectives.communicator import Communicator
from ..collectives.compression import Compression
from ..collectives.powersgd import PowerSGD
from ..models.dense import Model, unpack
from . import elastic, schedule as schedules
from .common import Family, Options, batches, check_whole_replicas, setup, stop_if_diverged
from .report import Reporter

__all__ = ["Allreduce"]


class Allreduce(Family):
    """Allreduce SGD with the collective ``algorithm``; ``one_rank``: plain SGD on one process."""

    reshards = ("every replica holds the same parameters, so the data is divided among the new ranks and the "
                "run goes on as a run of that many ranks would")

    def __init__(self, name: str, algorithm: str, one_rank: bool = False):
        super().__init__(name)
        self.algorithm, self.one_rank = algorithm, one_rank

    def check(self, options: Options, model: Model, size: int) -> None:
        if self.one_rank and size > 1:
            raise ValueError(f"{options.method} is plain SGD on one process, the reference the distributed methods' "
                             f"updates are compared with: run it with mpiexec -n 1, not {size} ranks")

    def check_model_parallel(self, options: Options, model: Model, size: int) -> None:
        if self.one_rank:
            super().check_model_parallel(options, model, size)
        check_whole_replicas(options, model, size)

    def checkpoint_file(self, options: Options, rank: int) -> Path:
        """One file (every rank holds the same), or one per stage with ``--model-parallel`` (the replicas of a
        stage hold the same)."""
        if options.model_parallel > 1:
            return checkpoint.path(options.checkpoint, "stage", rank % options.model_parallel)
        return checkpoint.path(options.checkpoint, None, rank)

    def check_elastic(self, options: Options, model: Model, size: int) -> None:
        if self.one_rank:
            raise ValueError(f"--elastic: {options.method} runs on one process, which has no rank to lose")

    def check_distributed_optimizer(self, options: Options, model: Model) -> None:
        if self.one_rank or options.model_parallel > 1 or options.elastic or not hasattr(model, "module"):
            raise ValueError("--distributed-optimizer trains torch modules (--framework torch) with an allreduce "
                             "method, whole (no --model-parallel) and not --elastic")

    def check_compression(self, options: Options, model: Model) -> None:
        if self.one_rank:
            raise ValueError(f"--compression: {options.method} runs on one process and moves no gradient")
        if options.compression == "int8":
            raise ValueError("--compression int8 moves localsgd's and diloco's pseudo-gradients (rare meetings, "
                             "error feedback carrying the rounding); a gradient every step: fp16, bf16 or powersgd")
        if getattr(model, "xp", np) is not np:
            raise ValueError("--compression moves host (numpy) gradients so far: drop --device cuda, or --compression")
        if options.compression == "powersgd" and options.model_parallel > 1:
            raise ValueError("--compression powersgd needs whole models (a stage holds parts of the matrices): drop "
                             "--model-parallel, or use fp16 or bf16")

    def check_memory(self, options: Options, model: Model, size: int) -> None:
        """Refuse a run whose ranks would hold more training state than ``--max-rank-memory``, saying which
        ``--model-parallel K`` would fit (the stage with the most state decides)."""
        if not hasattr(model, "state_bytes"):
            raise ValueError("--max-rank-memory is enforced for the allreduce methods on numpy dense models (mlp, "
                             "softmax): drop it, or use one of those")
        from ..modelparallel import layer_sizes, split
        layers = layer_sizes(model)

        def need(k: int) -> int:
            return max(model.state_bytes(options.batch, first, end) for first, end in split(layers, k))

        k, budget = options.model_parallel, options.max_rank_memory
        if need(k) <= budget:
            return
        fits = [j for j in range(k + 1, len(layers) + 1) if need(j) <= budget]
        advice = (f"--model-parallel {fits[0]} would fit (mpiexec -n a multiple of {fits[0]})" if fits else
                  f"no cut of its {len(layers)} layers fits: each layer is one stage at most; use a smaller model or "
                  f"batch, or more memory")
        raise ValueError(f"--max-rank-memory {budget:,} bytes: the model ({model.size:,} parameters) needs "
                         f"{need(k):,} bytes of training state per rank with --model-parallel {k} (parameters, "
                         f"gradient and allreduce result, and a batch of {options.batch} rows' activations); {advice}")

    def run(self, comm, options, model, data, xp, run):
        """Allreduce SGD; with ``--model-parallel K``, of N/K replicas of a model cut into K pipelined stages
        (rank = replica x K + stage): each replica trains on its own shard through its pipeline, and the
        replicas of each stage average that stage's gradient, so every replica takes the step plain
        allreduce training over N/K ranks takes."""
        if options.elastic:
            return self._run_elastic(comm, options, model, data, xp, run)
        rank, size, k = comm.Get_rank(), comm.Get_size(), options.model_parallel
        replica, replicas = rank // k, size // k
        _, steps, X, y, slow = setup(comm, options, data, xp, tuple(range(0, size, k)), me=replica)
        if k > 1:
            from ..modelparallel import stage
            pipe_comm, replicas_comm = comm.Split(replica, rank), comm.Split(rank % k, rank)
            pipe = stage(pipe_comm, model, micro_batches=min(k, options.batch))
            params, gradient_of = xp.asarray(pipe.init(options.seed)), pipe.loss_and_gradient
        else:
            replicas_comm, params, gradient_of = comm, model.init(options.seed), model.loss_and_gradient

        def test_score():       # (loss, accuracy) on the test set, on rank 0; through replica 0's pipeline
            if k == 1:
                return model.evaluate(params, reporter.X_test, reporter.y_test) if reporter else None
            if replica == 0:    # every stage of it takes part; none holds the whole model
                return pipe.evaluate(params, data.X_test, data.y_test)
            return None

        start, compressor = 0, _compressor(options)
        kept = _CompressionState(options, compressor, rank)
        if options.resume:                       # every replica holds the same parameters: one file per stage
            params, start = self._resume(comm, options, run, xp, kept)
        average = xp.empty_like(params)
        summed = _summer(model, self.algorithm, compressor)
        lr_at = schedules.per_step(options.lr_schedule, options.lr, options.epochs, steps)
        with Communicator(replicas_comm, algorithm=self.algorithm) as channel:
            # made before the reporter starts the clock: importing mpicoll.torch (torch.distributed) takes ~0.8 s
            torch_step = _torch_optimizer(options, model, channel, self.algorithm, compressor) \
                if options.distributed_optimizer else None
            reporter = Reporter(options, model, data, xp, ranks=size) if rank == 0 else None
            for epoch in range(start, options.epochs):
                losses = []
                for step, batch in enumerate(batches(len(y), options.batch, steps, [options.seed, replica, epoch])):
                    with slow, timeline.span("gradient", "train"):
                        loss, grad = gradient_of(params, X[batch], y[batch])
                    losses.append(loss)
                    if torch_step is not None:         # averaged during backward; the module's weights are params
                        torch_step(lr_at(epoch, step))
                        continue
                    summed(channel, grad, average)
                    with timeline.span("update", "train"):
                        params -= (lr_at(epoch, step) / replicas) * average
                stop_if_diverged(comm, params, [(epoch, losses)], f"after epoch {epoch + 1}")   # before saving it
                if options.checkpoint and replica == 0:     # the first replica: a file per stage (one stage: rank 0)
                    checkpoint.save(self.checkpoint_file(options, rank), run, epoch + 1,
                                    params=arrays.as_host(params), epoch=epoch + 1, **kept.saved_with)
                kept.save(run, epoch + 1)                   # every rank: its own residuals
                score = test_score()
                if reporter:
                    reporter.evaluate(None, epoch + 1, (epoch + 1) * steps * options.batch * replicas, measured=score)
            final = test_score()
        if options.checkpoint:
            # every rank resumes from the first replica's files: none returns before they are whole (a train() that
            # follows in the same program resumed from a file still being written; seen in the 2-rank tests)
            with bounded(comm, "waiting for the last checkpoint to be written"):
                comm.barrier()
        if k > 1:
            pipe.close()
            pipe_comm.Free()
            replicas_comm.Free()
        return reporter.finish(None, measured=final) if reporter else None

    def _resume(self, comm, options, run, xp, kept: _CompressionState | None = None) -> tuple:
        """(the parameters, the epochs done) of the checkpoint, written at this rank count or any other (the
        files do not depend on it); with ``kept``, the compression's state of the same point, where the
        parameters were saved with one this run can take."""
        earlier = self.check_rank_count(comm, options, run)
        identity, files = checkpoint.without_ranks(run), [self.checkpoint_file(options, comm.Get_rank())]
        carried = kept is not None and kept.resumable(comm, earlier, checkpoint.load(files[0], identity))
        states = load_checkpoint_set(comm, files + [kept.file] if carried else files, identity, "epochs")
        if carried:
            kept.compressor.load_state_dict(states[1])
        self.say_resharded(comm, options, earlier)
        return xp.asarray(states[0]["params"]), int(states[0]["epoch"])

    def _run_elastic(self, comm, options, model, data, xp, run):
        """Allreduce SGD that goes on without ranks that die (:mod:`mpicoll.train.elastic`): the same steps as
        :meth:`run` while nobody is lost, each step's sum used only once every member has agreed it is whole
        (:func:`~mpicoll.train.elastic.agreed`, one ``MPI_Comm_agree`` a step); after a loss the survivors, all at
        the step none of them took, take the rest of the epoch's rows between them, and train the later epochs
        as a run of that many ranks would.  With ``--model-parallel K`` the members are replicas of K stages: a
        replica that lost a stage stops, and the whole ones go on."""
        X, y = xp.asarray(data.X), xp.asarray(data.y)
        slow = Straggler.for_rank(comm.Get_rank(), options.straggler, options.delay, options.seed)
        k, epoch, params = options.model_parallel, 0, None
        compressor = _compressor(options)
        if options.resume:       # the compression's state is not kept: ranks are renumbered after a loss
            params, epoch = self._resume(comm, options, run, xp, _CompressionState(options, compressor, None))
        channel = Communicator(comm.Dup(), algorithm=self.algorithm)     # revoked, not the job's, after a loss
        channel.on_death = "revoke"             # the survivors shrink it together, after a step's agreement
        replicas = _Replicas(channel, k, model, options, self.algorithm)
        if params is None:
            params = xp.asarray(replicas.init(options.seed))
        average = xp.empty_like(params)
        summed = _summer(model, self.algorithm, compressor)
        samples = elastic.samples_before(epoch, len(y), replicas.count, options.batch)     # 0 unless resumed
        survivors = elastic.Survivors(comm, options, model, data, xp)
        rate = schedules.parse(options.lr_schedule, options.lr)     # over the budget's progress (Plan.progress)
        plan, done = elastic.Plan.epoch(len(y), replicas.count, options.batch, options.seed, epoch), 0
        while True:
            try:
                while epoch < options.epochs:
                    me, count = replicas.index, replicas.count
                    epoch_losses = []
                    while done < plan.steps:
                        batch = plan.batches[me][done]
                        with elastic.agreed(channel, revoke=replicas.revoke):  # no sum is used before all say whole
                            with slow, timeline.span("gradient", "train"):
                                loss, grad = replicas.loss_and_gradient(params, X[batch], y[batch])
                            summed(replicas.stage, grad, average)
                        epoch_losses.append(loss)
                        with timeline.span("update", "train"):
                            params -= (rate(plan.progress(epoch, done, options.epochs)) / count) * average
                        done, samples = done + 1, samples + count * len(batch)
                    with elastic.agreed(channel, revoke=replicas.revoke):
                        stop_if_diverged(channel, params, [(epoch, epoch_losses)], f"after epoch {epoch + 1}")
                        score = replicas.test_score(params, data)
                    if options.checkpoint and replicas.index == 0:     # written by the ranks left (a resume reshards)
                        checkpoint.save(self.checkpoint_file(options, channel.Get_rank()),
                                        {**run, "ranks": channel.Get_size()}, epoch + 1,
                                        params=arrays.as_host(params), epoch=epoch + 1)
                    if survivors.reporter:
                        survivors.reporter.evaluate(params if k == 1 else None, epoch + 1, samples, measured=score)
                    epoch += 1
                    plan, done = elastic.Plan.epoch(len(y), replicas.count, options.batch, options.seed, epoch), 0
                with elastic.agreed(channel):   # the survivors compare their replicas
                    crcs = channel.allgather((channel.Get_rank() % k, zlib.crc32(arrays.as_host(params).tobytes())))
                break
            except RanksLost:           # on every survivor alike, at the same step (the agreement's)
                channel, (epoch, agreed), _ = survivors.recover(channel, (epoch, done), stages=k)
                if channel is None:
                    return None                                 # this rank's replica lost a stage
                replicas = _Replicas(channel, k, model, options, self.algorithm)
                plan, done = plan.rest(agreed, replicas.count, options.batch), 0
        same = len(set(crcs)) == k              # one value per stage: every replica holds the same
        summary = survivors.finish(params if k == 1 else None, samples, replicas_identical=same,
                                   measured=replicas.test_score(params, data))
        replicas.close(abandon=bool(survivors.losses))
        channel.close(abandon=bool(survivors.losses))
        return summary


def _torch_optimizer(options: Options, model, channel, algorithm: str, compression):
    """``--distributed-optimizer``: ``step(lr)`` waits for :class:`mpicoll.torch.DistributedOptimizer`'s buckets
    (started by the torch module's backward, compressed as ``--compression`` says) and takes torch's SGD step
    on the module's weights, which are views of the flat parameters (:func:`mpicoll.models.modules.point_at`):
    the same update as the loop's own, through the optimizer a torch program would use."""
    import torch
    from ..torch import DistributedOptimizer
    sgd = torch.optim.SGD(model.parameters, lr=options.lr)
    optimizer = DistributedOptimizer(sgd, compression=compression, comm=channel, algorithm=algorithm)

    def step(lr: float) -> None:
        for group in sgd.param_groups:
            group["lr"] = lr
        with timeline.span("update", "train"):
            optimizer.step()
    return step


def _compressor(options: Options) -> Compression | PowerSGD | None:
    """The run's ``--compression``, made once: it keeps its state (the error feedback's residuals, PowerSGD's
    factors) across the steps, and in the checkpoint (:class:`_CompressionState`)."""
    if options.compression == "powersgd":
        return PowerSGD(rank=options.powersgd_rank, start_step=options.powersgd_start)
    if options.compression:
        return Compression(options.compression, error_feedback=options.error_feedback)
    return None


def _summer(model: Model, algorithm: str, compressor):
    """``summed(channel, gradient, out)``: out <- the sum of the ranks' gradients over ``channel``, by its
    allreduce, or through ``compressor``: as 16-bit floats (the error feedback's residual kept across steps), or
    PowerSGD's low-rank approximation of each weight matrix (its state kept across steps)."""
    if compressor is None:
        return lambda channel, gradient, out: channel.Allreduce(gradient, out)
    if isinstance(compressor, PowerSGD):
        shapes = model.parameter_shapes()

        def summed(channel, gradient, out):
            out[...] = gradient
            compressor.allreduce(unpack(out, shapes), comm=channel, algorithm=algorithm, key="gradient")
            out *= channel.Get_size()            # the average, as the sum the update divides
        return summed
    return lambda channel, gradient, out: allreduce(gradient, comm=channel, algorithm=algorithm, out=out,
                                                    compression=compressor, key="gradient")


class _CompressionState:
    """A compression's state in the checkpoint: each rank's own file (``PREFIX.rank<r>.npz``: residuals differ
    by rank) beside the parameters' file, written at the same epochs and resumed with it as one set, so a
    resumed run continues as the uninterrupted one would, to the bit.  The parameters' file names the
    compression whose state was saved with it (:attr:`saved_with`).  Where there is none to take (a compression
    without state, the parameters were saved with none or another, the earlier run ran on another rank count,
    or an elastic run renumbered its ranks) the state starts afresh, and rank 0 says so once."""

    def __init__(self, options: Options, compressor, rank: int | None):
        """``rank`` None: this run keeps no state (elastic: its ranks are renumbered after a loss)."""
        keeps = isinstance(compressor, PowerSGD) or getattr(compressor, "error_feedback", False)
        self.compressor = compressor if keeps and options.checkpoint else None
        self.file = checkpoint.path(options.checkpoint, "rank", rank) if self.compressor and rank is not None \
            else None

    @property
    def saved_with(self) -> dict[str, np.ndarray]:
        """What the parameters' file records of the state saved beside it (nothing: an empty name)."""
        return {"compression": np.array(repr(self.compressor) if self.file is not None else "")}

    def save(self, run: dict, epoch: int) -> None:
        if self.file is not None:
            checkpoint.save(self.file, run, epoch, **self.compressor.state_dict())

    def resumable(self, comm, earlier: int, parameters: dict) -> bool:
        """Whether this run takes the state saved with the newest ``parameters`` (collective: every rank has
        the same answer, and rank 0 says why not where there is a state to miss)."""
        saved = str(parameters.get("compression", ""))
        why = ("an elastic run keeps none" if self.compressor is not None and self.file is None else
               "the earlier run ran on another rank count" if earlier != comm.Get_size() else
               "the earlier run kept none" if not saved else
               f"it was saved by {saved}" if saved != repr(self.compressor) else "")
        with bounded(comm, "comparing the compression's checkpoint"):
            every = comm.allreduce(int(self.compressor is not None and not why), MPI.MIN) == 1
        if self.compressor is not None and not every and comm.Get_rank() == 0:
            print(f"mpicoll train: {self.compressor!r} starts afresh: its state is not in the checkpoint "
                  f"({why or 'not on every rank'})", file=sys.stderr, flush=True)
        return every


class _Replicas:
    """The replicas of an elastic run over ``channel``'s ranks, made anew after each loss: with ``k`` = 1 every
    rank is one, and ``stage`` is ``channel``; with ``k`` > 1, rank = replica x k + stage, each replica a pipeline
    of k stages (``pipe``) and ``stage`` the communicator of one stage's replicas, whose gradients it averages."""

    def __init__(self, channel, k: int, model, options, algorithm: str):
        rank, size = channel.Get_rank(), channel.Get_size()
        self.k, self.index, self.count, self.model = k, rank // k, size // k, model
        self.pipe = None
        if k == 1:
            self.stage, self.loss_and_gradient = channel, model.loss_and_gradient
            return
        from ..modelparallel import stage
        self.comms = [channel.Split(self.index, rank), channel.Split(rank % k, rank)]
        self.pipe = stage(self.comms[0], model, micro_batches=min(k, options.batch))
        self.stage = Communicator(self.comms[1], algorithm=algorithm)
        self.pipe.ctx.on_death = self.stage.on_death = "revoke"     # the survivors recover on the channel
        self.loss_and_gradient = self.pipe.loss_and_gradient

    def init(self, seed: int):
        """This rank's starting parameters: the whole model's, or its stage's."""
        return self.model.init(seed) if self.pipe is None else self.pipe.init(seed)

    def test_score(self, params, data):
        """(loss, accuracy) on the test set through the first replica's pipeline, known on its every stage (the
        first reports it); None with k = 1, where the reporter evaluates the parameters itself."""
        if self.pipe is None or self.index != 0:
            return None
        return self.pipe.evaluate(params, data.X_test, data.y_test)

    def revoke(self) -> None:
        """After a loss: revoke the pipeline's and the stage's communicators, so that every rank still waiting on
        them (in another replica's pipeline, or this stage's allreduce) hears of it and joins the recovery."""
        if self.pipe is not None:
            context = self.stage.context()
            for comm in [*self.comms, self.pipe.ctx.comm, *([context.comm] if context is not None else [])]:
                failure.revoke(comm)

    def close(self, abandon: bool = False) -> None:
        if self.pipe is not None:
            self.stage.close(abandon=abandon)
            if not abandon:
                self.pipe.close()
                for comm in self.comms:
                    comm.Free()
