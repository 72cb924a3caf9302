"""The allreduce family: every rank a worker, gradients averaged by an allreduce each step (``allreduce-ring``,
``allreduce-parallel``, ``allreduce-auto``), and ``sequential``, the same loop on one process, the reference."""

from __future__ import annotations

import zlib
from pathlib import Path

from .. import arrays
from ..base import checkpoint, timeline
from ..base.straggler import Straggler
from ..channel.checks import load_checkpoint_set
from ..collectives.communicator import Communicator
from ..models.dense import Model
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
        if options.model_parallel > 1:
            raise ValueError("--elastic with --model-parallel is not written yet: a lost stage leaves its "
                             "replica's pipeline without a part (docs/elastic.md)")

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

        start = 0
        if options.resume:                       # every replica holds the same parameters: one file per stage
            params, start = self._resume(comm, options, run, xp)
        average = xp.empty_like(params)
        lr_at = schedules.per_step(options.lr_schedule, options.lr, options.epochs, steps)
        with Communicator(replicas_comm, algorithm=self.algorithm) as channel:
            reporter = Reporter(options, model, data, xp, ranks=size) if rank == 0 else None
            for epoch in range(start, options.epochs):
                losses = []
                for step, batch in enumerate(batches(len(y), options.batch, steps, [options.seed, replica, epoch])):
                    with slow, timeline.span("gradient", "train"):
                        loss, grad = gradient_of(params, X[batch], y[batch])
                    losses.append(loss)
                    channel.Allreduce(grad, average)
                    with timeline.span("update", "train"):
                        params -= (lr_at(epoch, step) / replicas) * average
                stop_if_diverged(comm, params, [(epoch, losses)], f"after epoch {epoch + 1}")   # before saving it
                if options.checkpoint and replica == 0:     # the first replica: a file per stage (one stage: rank 0)
                    checkpoint.save(self.checkpoint_file(options, rank), run, epoch + 1,
                                    params=arrays.as_host(params), epoch=epoch + 1)
                score = test_score()
                if reporter:
                    reporter.evaluate(None, epoch + 1, (epoch + 1) * steps * options.batch * replicas, measured=score)
            final = test_score()
        if k > 1:
            pipe.close()
            pipe_comm.Free()
            replicas_comm.Free()
        return reporter.finish(None, measured=final) if reporter else None

    def _resume(self, comm, options, run, xp) -> tuple:
        """(the parameters, the epochs done) of the checkpoint, written at this rank count or any other (the
        files do not depend on it)."""
        earlier = self.check_rank_count(comm, options, run)
        state = load_checkpoint_set(comm, self.checkpoint_file(options, comm.Get_rank()),
                                    checkpoint.without_ranks(run), "epochs")
        self.say_resharded(comm, options, earlier)
        return xp.asarray(state["params"]), int(state["epoch"])

    def _run_elastic(self, comm, options, model, data, xp, run):
        """Allreduce SGD that goes on without ranks that die (:mod:`mpicoll.train.elastic`): the same steps as
        :meth:`run` while nobody is lost; after a loss the survivors step back to the last step all of them
        completed (the parameters before the last update are kept for it), take the rest of the epoch's rows
        between them, and train the later epochs as a run of that many ranks would."""
        X, y = xp.asarray(data.X), xp.asarray(data.y)
        slow = Straggler.for_rank(comm.Get_rank(), options.straggler, options.delay, options.seed)
        params, epoch = model.init(options.seed), 0
        if options.resume:
            params, epoch = self._resume(comm, options, run, xp)
        average, before = xp.empty_like(params), xp.empty_like(params)
        samples = elastic.samples_before(epoch, len(y), comm.Get_size(), options.batch)     # 0 unless resumed
        channel = Communicator(comm.Dup(), algorithm=self.algorithm)     # revoked, not the job's, after a loss
        survivors = elastic.Survivors(comm, options, model, data, xp)
        rate = schedules.parse(options.lr_schedule, options.lr)     # over the budget's progress (Plan.progress)
        plan, done = elastic.Plan.epoch(len(y), comm.Get_size(), options.batch, options.seed, epoch), 0
        while epoch < options.epochs:
            me, count = channel.Get_rank(), channel.Get_size()
            epoch_losses = []
            try:
                while done < plan.steps:
                    batch = plan.batches[me][done]
                    with slow, timeline.span("gradient", "train"):
                        loss, grad = model.loss_and_gradient(params, X[batch], y[batch])
                    epoch_losses.append(loss)
                    channel.Allreduce(grad, average)
                    before[...] = params
                    with timeline.span("update", "train"):
                        params -= (rate(plan.progress(epoch, done, options.epochs)) / count) * average
                    done, samples = done + 1, samples + count * len(batch)
                stop_if_diverged(channel, params, [(epoch, epoch_losses)], f"after epoch {epoch + 1}")
            except Exception as error:  # noqa: BLE001 - a loss is recovered from; anything else is raised
                if not elastic.is_loss(error):
                    raise
                channel, (epoch, agreed), loss = survivors.recover(channel, (epoch, done))
                if done > agreed:
                    params[...] = before                        # one step ahead of the slowest survivor
                    samples -= count * options.batch
                plan, done = plan.rest(agreed, loss.ranks, options.batch), 0
                continue
            if options.checkpoint and channel.Get_rank() == 0:     # written by the ranks left (a resume reshards)
                checkpoint.save(self.checkpoint_file(options, 0), {**run, "ranks": channel.Get_size()}, epoch + 1,
                                params=arrays.as_host(params), epoch=epoch + 1)
            if survivors.reporter:
                survivors.reporter.evaluate(params, epoch + 1, samples)
            epoch += 1
            plan, done = elastic.Plan.epoch(len(y), channel.Get_size(), options.batch, options.seed, epoch), 0
        same = len(set(channel.allgather(zlib.crc32(arrays.as_host(params).tobytes())))) == 1
        summary = survivors.finish(params, replicas_identical=same)
        channel.close(abandon=bool(survivors.losses))
        return summary
