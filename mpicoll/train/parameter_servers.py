"""The parameter-server family: ``ps-sync``, ``ps-softsync``, ``ps-async``, ``dcasgd`` and ``downpour``, one per
update rule of :mod:`mpicoll.ps` (Downpour also over pipelines of model stages, DistBelief's layout)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import arrays, ps
from ..base import checkpoint, failure, timeline
from ..base.errors import CollectiveTimeout, PeerFailed, ServerLost, Told
from ..base.tags import Tag
from ..channel.checks import load_checkpoint_set
from ..models.dense import Model
from . import schedule as schedules
from .common import Family, Options, batches, check_whole_replicas, setup, steps_per_epoch
from .report import Reporter

__all__ = ["ParameterServers"]

# what each rule takes from the options, besides the learning rate
_RULE_OPTIONS = {
    "sync": lambda options: {},
    "softsync": lambda options: {"k": options.softsync_k},
    "async": lambda options: {"staleness": options.staleness},
    "dcasgd": lambda options: {"lam": options.lam, "adaptive": options.adaptive},
    "downpour": lambda options: {},
    "ringmaster": lambda options: {"R": options.ringmaster_r or None},
    "rescaled": lambda options: {},
}


class ParameterServers(Family):
    """``--servers`` server ranks hold the weights in shards and apply the update ``rule``; the others train."""

    min_ranks = 2            # a server and a worker
    reports_staleness = True
    fixed_ranks = ("its servers count updates in rounds of the workers there were, and a round may be open in the "
                   "files; ps-async, dcasgd and downpour continue on another number of workers")

    def __init__(self, name: str, rule: str):
        super().__init__(name)
        self.rule_name = rule
        self.downpour = rule == "downpour"        # Downpour's fetch/push cadence, and pipelines of stages
        if not ps.RULES[rule].waits_for_rounds:   # one gradient an update, whoever sends it
            self.reshards = ("each server continues its shard (the weights, the rule's state, the update count), "
                             "the same --servers; the data is divided among the new workers, and each starts from "
                             "the weights it pulls")

    def _server_identity(self, layout, rule, run: dict) -> dict:
        """What a server's checkpoint must match on resuming: at another worker count (a rule that
        :attr:`reshards`), all but the rank and worker counts."""
        identity = ps.server.checkpoint_identity(layout, rule, run)
        return {k: v for k, v in identity.items() if k not in ("ranks", "workers")} if self.reshards else identity

    def rule(self, options: Options, workers: int) -> tuple[ps.Rule, int]:
        """(the server's rule, how many gradients one of its updates takes in: the budget's unit)."""
        rule = ps.make(self.rule_name, lr=options.lr, **_RULE_OPTIONS[self.rule_name](options))
        return rule, rule.gradients_per_update(workers, options.n_push)

    def workers(self, options: Options, size: int) -> int:
        return size - options.servers

    def reporting_rank(self, options: Options) -> int:
        return options.servers * options.model_parallel

    def check(self, options: Options, model: Model, size: int) -> None:
        if size <= options.servers:
            raise ValueError(f"{options.method} needs more ranks than its {options.servers} server(s): "
                             f"mpiexec -n {options.servers + 1} or more")

    def check_model_parallel(self, options: Options, model: Model, size: int) -> None:
        if not self.downpour:
            super().check_model_parallel(options, model, size)
        check_whole_replicas(options, model, size, servers=options.model_parallel * options.servers,
                             workers="worker ")
        if options.checkpoint:
            raise ValueError("downpour --model-parallel does not checkpoint yet: drop --checkpoint (the allreduce "
                             "methods do)")

    def checkpoint_file(self, options: Options, rank: int) -> Path | None:
        """Each server's file; workers keep none."""
        return ps.server.checkpoint_file(options.checkpoint, rank) if rank < options.servers else None

    def check_resume(self, comm: MPI.Intracomm, options: Options, model: Model, run: dict) -> None:
        """Each server's file must be its own, written at this rank count; workers keep none."""
        self.check_rank_count(comm, options, run)
        if comm.Get_rank() < options.servers:
            layout = ps.Layout.split(comm, model.size, options.servers)
            rule, _ = self.rule(options, len(layout.workers))
            checkpoint.check(self.checkpoint_file(options, layout.rank), self._server_identity(layout, rule, run))

    def run(self, comm, options, model, data, xp, run):
        if options.model_parallel > 1:
            return self._pipelines(comm, options, model, data, xp)
        rank, size = comm.Get_rank(), comm.Get_size()
        workers = tuple(range(options.servers, size))
        rule, per_update = self.rule(options, len(workers))
        server = ps.ParameterServer(comm, arrays.as_host(model.init(options.seed)), rule,
                                    servers=options.servers, transport=options.transport)
        me, steps, X, y, slow = setup(comm, options, data, xp, workers)
        state = None
        earlier = self.earlier_ranks(options, run) if options.resume else size
        if options.resume:                      # the newest point every server's file holds (a stop between writes)
            self.say_resharded(comm, options, earlier)
            mine = self.checkpoint_file(options, rank)
            state = load_checkpoint_set(comm, mine, self._server_identity(server.layout, rule, run)
                                        if server.is_server else {}, "updates")
        budget = options.epochs * steps * len(workers)        # gradients, over every worker
        reporter = Reporter(options, model, data, xp, ranks=size) if me == 0 else None
        started = time.perf_counter()
        with self._a_lost_server_names_the_checkpoint(options, server):
            if server.is_server:
                every = max(1, budget // options.epochs // per_update)       # updates per epoch
                server.serve(warm_start=options.warm_start, checkpoint=options.checkpoint, every=every,
                             resume=options.resume, identity=run, state=state,
                             lr_at=schedules.per_update(options.lr_schedule, options.lr, budget // per_update))
            else:
                client = server.client
                schedule = ps.Schedule(client, options.n_fetch, options.n_push) if self.downpour else None
                w = xp.asarray(client.pull())
                done = min(client.versions.values()) * per_update            # more than 0 when resumed
                before = earlier - options.servers          # the workers of the run resumed, whose epochs were
                shift = round(done * steps * len(workers) / (steps_per_epoch(len(data.y), before, options.batch) *
                                                             before)) - done      # of other lengths by rounding
                done += shift
                reported = done * options.epochs // budget
                epoch, skip = divmod(done // len(workers), steps)            # where this worker's batches were
                while done < budget:
                    taken = batches(len(y), options.batch, steps, [options.seed, rank, epoch])[skip:]
                    skip = 0
                    for batch in taken:
                        with slow, timeline.span("gradient", "train"):
                            loss, grad = model.loss_and_gradient(w, X[batch], y[batch])
                        with timeline.span("exchange with the servers", "train"):
                            w = xp.asarray(schedule.step(arrays.as_host(grad)) if schedule else client.exchange(grad))
                        done = min(client.versions.values()) * per_update + shift    # gradients the servers took
                        if done >= budget:
                            break
                        if reporter and done * options.epochs // budget > reported:
                            reported = done * options.epochs // budget
                            reporter.evaluate(w, reported, done * options.batch)
                    epoch += 1
                client.close()
            final = server.gather_weights()
        staleness = _staleness(server, workers[0])
        server.close()
        if server.lost and rank not in server.lost:
            # MPI_Finalize would wait for the lost ranks: once the result is out, every survivor leaves without
            # it under ULFM, or ends the job (one alone may not reach the others when a node is cut off)
            failure.end_after_losing(f"worker rank(s) {server.lost} were lost during training; the others finished",
                                     server.context.world_ranks(server.lost))
            if workers[0] in server.lost and rank == min(set(workers) - set(server.lost), default=None):
                reporter = Reporter.take_over(options, model, data, xp, size, started)     # the log's writer died
        if reporter:
            reporter.evaluate(xp.asarray(final), options.epochs, budget * options.batch)
            return reporter.finish(xp.asarray(final), staleness=staleness, workers_lost=server.lost)
        return None

    @contextlib.contextmanager
    def _a_lost_server_names_the_checkpoint(self, options: Options, server: ps.ParameterServer):
        """A server lost (dead, silent, or reported so by another rank) ends the run on every rank, as a
        :class:`ServerLost` that names the servers' last checkpoint (a worker tells the other servers); other
        errors pass as they are."""
        try:
            yield
        except (PeerFailed, CollectiveTimeout, Told, ServerLost) as error:
            lost = _servers_lost(error, options.servers)
            if not lost:
                raise
            saved = self.last_checkpoint(options, range(options.servers), "update")
            ended = ServerLost(f"rank {MPI.COMM_WORLD.Get_rank()} lost parameter server rank(s) "
                               f"{', '.join(map(str, lost))}, and no rule trains on without a shard of the weights; "
                               f"{saved} (what it saw: {error})", lost)
            server.tell_servers(ended)
            raise ended from None

    def _pipelines(self, comm, options, model, data, xp):
        """Downpour over R replicas of a model cut into K pipelined stages (DistBelief): the first K x S ranks
        serve, S shards per stage, each stage's shards holding only that stage's layers; rank K x S +
        replica x K + stage computes that stage of that replica, and pushes its gradient to and fetches its
        weights from its own stage's shards only (one parameter server per stage, over that stage's ranks).
        Every replica takes ``epochs`` passes over its shard of the data."""
        from ..modelparallel import stage as cut, stage_init
        rank, size, k, per_stage = comm.Get_rank(), comm.Get_size(), options.model_parallel, options.servers
        servers = k * per_stage
        is_server = rank < servers
        stage = rank // per_stage if is_server else (rank - servers) % k
        replica, replicas = (None if is_server else (rank - servers) // k), (size - servers) // k
        stage_comm = comm.Split(stage, rank)                      # this stage's shards first, then its workers
        pipe_comm = comm.Split(MPI.UNDEFINED if is_server else replica, rank)
        rule, per_update = self.rule(options, replicas)
        server = ps.ParameterServer(stage_comm, arrays.as_host(stage_init(model, k, stage, options.seed)), rule,
                                    servers=per_stage, transport=options.transport)
        _, steps, X, y, slow = setup(comm, options, data, xp, tuple(range(replicas)), me=replica)
        reporter = Reporter(options, model, data, xp, ranks=size) if rank == servers else None
        pipe = None if is_server else cut(pipe_comm, model, micro_batches=min(k, options.batch))
        if is_server:
            budget = options.epochs * steps * replicas                      # gradients into each stage
            server.serve(warm_start=options.warm_start,
                         lr_at=schedules.per_update(options.lr_schedule, options.lr, budget // per_update))
        else:
            schedule = ps.Schedule(server.client, options.n_fetch, options.n_push)
            w = xp.asarray(server.client.pull())
            for epoch in range(options.epochs):
                for batch in batches(len(y), options.batch, steps, [options.seed, replica, epoch]):
                    with slow, timeline.span("gradient", "train"):
                        loss, grad = pipe.loss_and_gradient(w, X[batch], y[batch])
                    with timeline.span("exchange with the servers", "train"):
                        w = xp.asarray(schedule.step(arrays.as_host(grad)))
                score = pipe.evaluate(w, data.X_test, data.y_test) if replica == 0 else None
                if reporter:
                    reporter.evaluate(None, epoch + 1, (epoch + 1) * steps * options.batch * replicas, measured=score)
            server.client.close()
        final = server.gather_weights()                           # this stage's, on every rank of the stage
        server.close()
        score = pipe.evaluate(xp.asarray(final), data.X_test, data.y_test) if replica == 0 else None
        if pipe:
            pipe.close()
            pipe_comm.Free()
        stage_comm.Free()
        return reporter.finish(None, measured=score) if reporter else None


def _servers_lost(error: Exception, servers: int) -> list:
    """The servers (of the first ``servers`` ranks) that ``error`` says are gone, dead or silent, as heard by
    this rank, or by another that told it (its notice names them; ["?"] where a lost server is not named)."""
    if isinstance(error, ServerLost):
        return error.servers or ["?"]
    if isinstance(error, Told):
        named = [rank for rank in error.lost if rank < servers]
        return named or (["?"] if error.kind == ServerLost.__name__ else [])
    return [peer for peer in error.peers if peer < servers]


STALENESS_BINS = 64        # lags counted one by one; longer ones share the last bin


def _staleness(server: ps.ParameterServer, reporter: int) -> dict[int, int] | None:
    """The first server's staleness histogram {updates between a gradient's weights and its use: count},
    sent to the reporting worker, which writes the log; None on every other rank."""
    layout, ctx = server.layout, server.context
    first, counts = layout.servers[0], np.zeros(STALENESS_BINS + 1, np.int64)
    if layout.rank == first and reporter not in server.lost:
        for lag, count in server.stats.staleness.items():
            counts[min(lag, STALENESS_BINS)] += count
        ctx.wait(ctx.isend(counts, reporter, Tag.PS_STATS), reporter)
    elif layout.rank == reporter:
        ctx.wait(ctx.irecv(counts, first, Tag.PS_STATS), first)
        return {lag: int(count) for lag, count in enumerate(counts) if count}
    return None


