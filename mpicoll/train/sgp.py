"""The gossip family: ``sgp``, Stochastic Gradient Push (:mod:`mpicoll.gossip`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import gossip
from ..base import checkpoint, timeline
from ..base.errors import RanksLost
from ..base.straggler import Straggler
from ..channel.checks import load_checkpoint_set
from ..collectives.communicator import Communicator
from . import elastic, schedule as schedules
from .common import Family, Options, batches, setup, stop_if_diverged
from .report import Reporter

__all__ = ["Sgp"]


class Sgp(Family):
    """Every rank a worker; each step a local SGD step, then one push-sum gossip round."""

    reshards = ("every rank starts from the average of the earlier ranks' de-biased parameters (push-sum weight "
                "1), and the data is divided among the new ranks")

    def checkpoint_file(self, options: Options, rank: int) -> Path:
        """One file per rank: each holds its own numerator and push-sum weight."""
        return checkpoint.path(options.checkpoint, "rank", rank)

    def check_elastic(self, options: Options, model, size: int) -> None:
        """SGP goes on without lost ranks; its checkpoint is then the survivors' files (a resume reads as
        many files as the ranks that wrote the newest set, :meth:`_resume`)."""

    def run(self, comm, options, model, data, xp, run):
        if options.elastic:
            return self._run_elastic(comm, options, model, data, xp, run)
        rank, size = comm.Get_rank(), comm.Get_size()
        _, steps, X, y, slow = setup(comm, options, data, xp, tuple(range(size)))
        pushsum = gossip.PushSum(comm, model.init(options.seed), graph=options.graph, tau=options.tau,
                                 mailbox=options.transport)
        sgp = gossip.SGP(pushsum, options.lr)
        start, mine = 0, self.checkpoint_file(options, rank)
        if options.resume:
            start = self._resume(comm, options, run, pushsum)
        reporter = Reporter(options, model, data, xp, ranks=size) if rank == 0 else None
        z = xp.asarray(sgp.parameters)
        lr_at = schedules.per_step(options.lr_schedule, options.lr, options.epochs, steps)
        losses = []                              # (epoch, its losses): where the parameters went bad, if they do
        for epoch in range(start, options.epochs):
            losses.append((epoch, []))
            for step, batch in enumerate(batches(len(y), options.batch, steps, [options.seed, rank, epoch])):
                sgp.lr = lr_at(epoch, step)
                with slow, timeline.span("gradient", "train"):
                    loss, grad = model.loss_and_gradient(z, X[batch], y[batch])
                losses[-1][1].append(loss)
                with timeline.span("push-sum step", "train"):
                    z = xp.asarray(sgp.step(grad))
            if options.checkpoint:               # every rank is at the same round: nothing left in flight
                pushsum.drain()
                checkpoint.save(mine, run, epoch + 1, epoch=epoch + 1, **pushsum.state())
            if reporter:
                reporter.evaluate(z, epoch + 1, (epoch + 1) * steps * options.batch * size)
        pushsum.drain()
        consensus = np.empty_like(pushsum.x)                             # the model one would deploy: the average
        with Communicator(comm, algorithm="auto") as everyone:
            everyone.Allreduce(pushsum.debiased(), consensus)
        consensus /= size
        pushsum.close()
        # checked once, at the end: ranks hold different parameters, and asking after every epoch would make
        # every rank wait for the slowest there (the consensus is the same everywhere)
        stop_if_diverged(comm, consensus, losses, "at the end (the average of the ranks' parameters)")
        return reporter.finish(xp.asarray(consensus)) if reporter else None

    def check_resume(self, comm, options, model, run) -> None:
        """This rank's share of the earlier run's files must be whole and this run's."""
        for file in self._share(comm, options, self.check_rank_count(comm, options, run)):
            checkpoint.check(file, checkpoint.without_ranks(run))

    def _share(self, comm, options, earlier: int) -> list[Path]:
        """The files of an ``earlier`` run this rank reads: its own at the same count, else every size-th."""
        rank, size = comm.Get_rank(), comm.Get_size()
        return [self.checkpoint_file(options, r) for r in range(rank, earlier, size)]

    def _resume(self, comm, options, run, pushsum) -> int:
        """Load the checkpoint into ``pushsum``; the epochs done.  At the rank count that wrote it, each rank
        continues from its own numerator and weight, exactly; at another, every rank starts from the average
        of the earlier ranks' de-biased parameters with weight 1 (the consensus the run was heading to)."""
        earlier = self.check_rank_count(comm, options, run)
        share = self._share(comm, options, earlier)
        states = load_checkpoint_set(comm, share, checkpoint.without_ranks(run), "epochs")
        if earlier == comm.Get_size():
            pushsum.load_state(states[0])
            return int(states[0]["epoch"])
        debiased = np.zeros_like(pushsum.x)
        for state in states:
            debiased += state["x"] / state["x"].dtype.type(state["weight"])
        with Communicator(comm, algorithm="auto") as everyone:
            everyone.Allreduce(MPI.IN_PLACE, debiased)
            # the files are of one point (one epoch, one gossip round): any rank's first says which
            epoch, round_ = next(found for found in everyone.allgather(
                [(int(s["epoch"]), int(s["round"])) for s in states]) if found)[0]
        pushsum.load_state({"x": debiased / debiased.dtype.type(earlier), "weight": np.array(1.0),
                            "round": np.array(round_)})
        self.say_resharded(comm, options, earlier)
        return epoch

    def _run_elastic(self, comm, options, model, data, xp, run):
        """SGP that goes on without ranks that die (:mod:`mpicoll.train.elastic`): the same steps as :meth:`run`
        while nobody is lost; after a loss the survivors restart push-sum from their de-biased parameters (the
        mass in flight to and from the dead is gone, so the old sums mean nothing), take the rest of the
        epoch's rows between them from the last step all of them completed, and train later epochs as a run
        of that many ranks would.  No step is taken back: each rank's parameters are its own anyway."""
        X, y = xp.asarray(data.X), xp.asarray(data.y)
        slow = Straggler.for_rank(comm.Get_rank(), options.straggler, options.delay, options.seed)
        epoch, samples = 0, 0
        channel = Communicator(comm.Dup(), algorithm="auto")    # revoked, not the job's, after a loss
        channel.on_death = "revoke"             # the survivors shrink it together (elastic.Survivors.recover)

        def gossip_from(z) -> tuple:
            pushsum = gossip.PushSum(channel, z, graph=options.graph, tau=options.tau, mailbox=options.transport)
            return pushsum, gossip.SGP(pushsum, options.lr)

        pushsum, sgp = gossip_from(model.init(options.seed))
        if options.resume:
            epoch = self._resume(comm, options, run, pushsum)
            samples = elastic.samples_before(epoch, len(y), comm.Get_size(), options.batch)
        z = xp.asarray(sgp.parameters)
        survivors = elastic.Survivors(comm, options, model, data, xp)
        rate = schedules.parse(options.lr_schedule, options.lr)     # over the budget's progress (Plan.progress)
        plan, done = elastic.Plan.epoch(len(y), comm.Get_size(), options.batch, options.seed, epoch), 0
        history = []                             # (epoch, its losses): where the parameters went bad, if they do
        count = channel.Get_size()              # the ranks that took the steps a loss takes back
        while True:
            try:
                while epoch < options.epochs:
                    me, count = channel.Get_rank(), channel.Get_size()
                    history.append((epoch, []))
                    # one agreement an epoch: every rank, the ones that met a loss included, passes through it
                    # before any shrinks (push-sum's ranks are not in lockstep; a shrink met by an agreement
                    # aborts Open MPI)
                    with elastic.agreed(channel):
                        while done < plan.steps:
                            batch = plan.batches[me][done]
                            sgp.lr = rate(plan.progress(epoch, done, options.epochs))
                            with slow, timeline.span("gradient", "train"):
                                loss, grad = model.loss_and_gradient(z, X[batch], y[batch])
                            history[-1][1].append(loss)
                            with timeline.span("push-sum step", "train"):
                                z = xp.asarray(sgp.step(grad))
                            done, samples = done + 1, samples + count * len(batch)
                        if options.checkpoint:
                            pushsum.drain()
                    if options.checkpoint:           # the ranks left write theirs; a resume reads as many files
                        checkpoint.save(self.checkpoint_file(options, me), {**run, "ranks": count}, epoch + 1,
                                        epoch=epoch + 1, **pushsum.state())
                    if survivors.reporter:
                        survivors.reporter.evaluate(z, epoch + 1, samples)
                    epoch += 1
                    plan, done = elastic.Plan.epoch(len(y), channel.Get_size(), options.batch, options.seed, epoch), 0
                # the model one would deploy: the survivors' average, used once all agree it is whole
                with elastic.agreed(channel):
                    pushsum.drain()
                    consensus = np.empty_like(pushsum.x)
                    channel.Allreduce(pushsum.debiased(), consensus)
                    consensus /= channel.Get_size()
                    stop_if_diverged(channel, consensus, history, "at the end (the average of the ranks' parameters)")
                break
            except RanksLost:           # on every survivor, after the epoch's (or the average's) agreement
                restart = np.array(pushsum.debiased(), copy=True)
                pushsum.close(abandon=True)     # the death may have been met outside push-sum (the average)
                channel, (epoch, agreed), loss = survivors.recover(channel, (epoch, done))
                samples -= (done - agreed) * count * options.batch
                plan, done = plan.rest(agreed, loss.ranks, options.batch), 0
                pushsum, sgp = gossip_from(restart)
                z = xp.asarray(sgp.parameters)
        pushsum.close()
        summary = survivors.finish(xp.asarray(consensus), samples)
        channel.close(abandon=bool(survivors.losses))
        return summary
