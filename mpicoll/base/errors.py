"""Exceptions mpicoll raises, each naming the ranks and values involved."""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["MpicollError", "MismatchError", "CollectiveTimeout", "PeerFailed", "RanksLost", "Told", "ServerFailed",
           "ServerLost", "PartFailed", "NonFiniteError", "Diverged", "MPIRefusal", "ReductionError", "RootError",
           "SetupError", "ConcurrentCall", "Unsupported", "HorovodInternalError"]


class MPIRefusal(MPI.Exception):
    """A call MPI itself would refuse: mpi4py raises ``MPI.Exception`` there, and so does mpicoll,
    with the same error class (``Get_error_class()``) but a message that says what to pass."""

    error_class = MPI.ERR_OTHER

    def __init__(self, message: str):
        super().__init__(self.error_class)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ReductionError(MPIRefusal, TypeError):
    """The op is not defined for the datatype (MPI's rules; MPI_ERR_OP)."""

    error_class = MPI.ERR_OP


class RootError(MPIRefusal, ValueError):
    """The root is not a rank of the communicator (MPI_ERR_ROOT)."""

    error_class = MPI.ERR_ROOT


class MpicollError(RuntimeError):
    """Base of mpicoll's own errors."""


class MismatchError(MpicollError, ValueError):
    """Ranks called the same collective with different counts, datatypes, ops or roots.

    Raised on every rank of the communicator with the same message, so no rank
    is left waiting for the others.  ``per_rank`` maps each rank to what it passed.
    ``settled``: found before any data moved, every rank at the same point with
    nothing in flight, so the communicator's later calls run as if this one had
    not been made (a started call's failure otherwise stops the ones after it).
    """

    def __init__(self, collective: str, per_rank: dict[int, str], settled: bool = False):
        self.collective = collective
        self.per_rank = per_rank
        self.settled = settled
        groups: dict[str, list[int]] = {}
        for rank, value in sorted(per_rank.items()):
            groups.setdefault(value, []).append(rank)
        lines = [f"  ranks {_ranks(ranks)}: {value}" for value, ranks in groups.items()]
        super().__init__(
            f"{collective}: ranks disagree on the call; every rank must pass the same "
            "count, datatype, op and root, use the same algorithm, and make the call from the same thread "
            "(threads that share a communicator must call in the same order on every rank):\n" + "\n".join(lines)
        )


# What keeps a peer out of a collective; a wait that is not a collective (a one-sided access) says its own.
COLLECTIVE_CAUSES = ("dead, hung, or calling a different collective, or this one with another count or type: "
                     "MPICOLL_DEBUG=1 compares every call across ranks")


class CollectiveTimeout(MpicollError, TimeoutError):
    """A peer did not take part in a collective within the timeout (dead, hung or desynchronised)."""

    def __init__(self, collective: str, rank: int, peers, seconds: float, some_of: bool = False, also_silent=(),
                 causes: str | None = None, cut_short: bool = False, alive_outside=()):
        self.collective, self.rank, self.peers, self.seconds = collective, rank, sorted(set(peers)), seconds
        # ranks missing from the call whose watchdog answered the roll call: alive, in no call on the channel
        self.alive_outside = sorted(set(alive_outside))
        self.also_silent = sorted(set(also_silent) - set(self.peers) - set(self.alive_outside))
        who = f"one or more of rank(s) {_ranks(self.peers)}" if some_of else f"rank(s) {_ranks(self.peers)}"
        others = (f" Also silent in the roll call (lost too, or finished and gone): rank(s) "
                  f"{_ranks(self.also_silent)}." if self.also_silent else "")
        if self.alive_outside:
            others += (f" Alive but in no call on this communicator (hung, or still computing; their watchdog "
                       f"answered the roll call): rank(s) {_ranks(self.alive_outside)}.")
        if cut_short:       # it waited for a live peer that waited for the lost: it heard that peer give up
            others += " It stopped waiting before its timeout, when another rank gave up on the call."
        super().__init__(
            f"{collective}: rank {rank} waited {seconds:g} s for {who}, which never took part "
            f"({causes or COLLECTIVE_CAUSES}). Raise MPICOLL_TIMEOUT if a peer "
            f"is just slow; this communicator is no longer usable.{others}"
        )


class ConcurrentCall(MpicollError):
    """A second thread called a collective on a communicator while another thread's call on it was in
    flight.  MPI forbids it (the two calls' messages would be taken for each other's), and the order the
    threads take differs between ranks, so mpicoll refuses the second call instead of serialising it."""

    def __init__(self, collective: str):
        super().__init__(
            f"{collective}: another thread is in a collective call on this communicator; MPI allows one at a "
            "time per communicator, in the same order on every rank. Give each thread its own communicator "
            "(comm.Dup()), or use the nonblocking forms (Iallreduce, mpicoll.iallreduce) from one thread")


class PeerFailed(MpicollError, ConnectionError):
    """MPI reported a failed transfer with a peer (it died, or its connection broke)."""

    def __init__(self, collective: str, rank: int, peers, reason: str):
        self.collective, self.rank, self.peers = collective, rank, sorted(set(peers))
        who = f"rank(s) {_ranks(self.peers)}" if self.peers else "a peer"
        super().__init__(f"{collective}: rank {rank} lost {who}: MPI reports {reason}; this communicator is "
                         "no longer usable")


class RanksLost(PeerFailed):
    """Ranks of the communicator died, and MPI's fault tolerance (ULFM) said so.

    Raised on every survivor with the same ``lost`` ranks: the first survivor to
    hear of the death revoked the communicator, so none waits for the dead, and
    the survivors agreed on who is gone by shrinking it.  The communicator is
    unusable from then on; :meth:`mpicoll.Communicator.shrink` returns one of the
    survivors to go on with (mpicoll's own state set up anew on its first call).
    A communicator whose ``on_death`` is "revoke" leaves the shrinking to its
    owner: there ``lost`` is what MPI had named to this rank, empty on one that
    learnt of the death from another survivor's revoke.
    """

    def __init__(self, collective: str, rank: int, lost):
        self.collective, self.rank = collective, rank
        self.lost = self.peers = sorted(set(lost))
        who = (f"rank(s) {_ranks(self.lost)} died (MPI's fault tolerance told rank {rank})" if self.lost else
               f"a rank died (rank {rank} learnt it from another survivor's revoke, before MPI named the dead to it)")
        MpicollError.__init__(self, f"{collective}: {who}; this communicator is revoked on every survivor: go on "
                                    "with comm.shrink(), a communicator of the survivors, or end the job")


class Told(MpicollError):
    """A failure another rank told this one of (:mod:`mpicoll.channel.notices`): ``sender`` raised and said why.

    ``reason`` is its words; ``kind`` the name of its error's class and ``lost`` the ranks that error said were
    gone (dead or silent; empty for other errors), carried as data so that the rank told can act on them
    without reading the words."""

    def __init__(self, rank: int, sender: int, reason: str, kind: str = "", lost=()):
        self.rank, self.sender, self.reason, self.kind, self.lost = rank, sender, reason, kind, sorted(set(lost))
        super().__init__(self.describe())

    def describe(self) -> str:
        return f"rank {self.rank}: rank {self.sender} failed: {self.reason}"

    def says_ranks_died(self) -> bool:
        """Whether the sender's error was the loss of ranks (dead, cut off or silent)."""
        return issubclass(globals().get(self.kind, type(None)), (PeerFailed, CollectiveTimeout, ServerLost))


class ServerFailed(Told):
    """A parameter server raised (a checkpoint of another run, a lost worker under sync, a full disk, ...)
    and told its workers why; raised on each worker, which cannot go on without that shard."""

    @property
    def server(self) -> int:
        return self.sender

    def describe(self) -> str:
        return f"worker rank {self.rank}: parameter server rank {self.sender} failed: {self.reason}"


class ServerLost(MpicollError):
    """A parameter server died, or was cut off: its shard of the weights is gone, and no rule trains on without
    it.  ``servers``: the lost ones, where known.  Raised on every rank left (``mpicoll train``: naming the
    servers' last checkpoint)."""

    def __init__(self, message: str, servers=()):
        self.servers = sorted(set(servers))
        super().__init__(message)


class PartFailed(Told):
    """Another part of a job whose parts depend on each other (a Sandblaster coordinator, shard or worker)
    raised and told every rank why; raised on each of them, which cannot go on without it."""

    @property
    def peer(self) -> int:
        return self.sender


class Diverged(MpicollError, FloatingPointError):
    """Training diverged: the model's parameters hold NaN or Inf, or every gradient a parameter server
    receives does, so no step can come that would mend them.  Raised on every rank of the job alike,
    saying where the values first went bad."""


class NonFiniteError(MpicollError, FloatingPointError):
    """Debug mode found NaN or Inf in a contribution; names the ranks that sent them."""

    def __init__(self, collective: str, ranks):
        self.collective, self.ranks = collective, sorted(ranks)
        super().__init__(
            f"{collective}: NaN or Inf in the contribution of rank(s) {_ranks(self.ranks)} "
            "(MPICOLL_DEBUG checks finiteness; unset it to let non-finite values through)"
        )


class SetupError(MpicollError, ValueError):
    """Some rank could not start (bad input, a checkpoint of another run, ...).

    Raised on every rank with the same text, so all stop together; ``per_rank``
    maps each failing rank to its reason.
    """

    def __init__(self, per_rank: dict[int, str], ranks: int):
        self.per_rank = per_rank
        groups: dict[str, list[int]] = {}
        for rank, reason in sorted(per_rank.items()):
            groups.setdefault(reason, []).append(rank)
        if len(groups) == 1 and len(per_rank) == ranks:
            text = next(iter(groups))
        else:
            text = "; ".join(f"rank {_ranks(r)}: {reason}" for reason, r in groups.items())
        super().__init__(text)


class WorkersLost(MpicollError):
    """Every worker of a Sandblaster job fell silent: no gradient can be computed."""


class WorkerLost(MpicollError):
    """Synchronous training lost a worker: it cannot go on, and says which (a RuntimeError, as every
    :class:`mpicoll.MpicollError`: ``mpicoll train`` prints it in one line)."""


class LaunchMismatch(MpicollError):
    """The launcher started a different number of tasks than MPI sees in its world: the processes are not
    one job.  Raised before any work, on every rank, with the fix."""


class CheckpointMismatch(MpicollError, ValueError):
    """A checkpoint belongs to another run (different method, model, data, or rank counts), or is damaged."""


class Unsupported(MpicollError, RuntimeError):
    """A call mpicoll does not serve (a collective, op or tensor kind of torch.distributed's, say): the
    message names it and what to do instead.  Never a silent wrong answer."""


class HorovodInternalError(MpicollError):
    """A call of Horovod's API (:mod:`mpicoll.torch.horovod`) that failed on every rank taking part: the
    ranks disagree on it (shape, dtype, root, op), it cannot run with ranks that have joined, or a peer was
    lost.  Horovod's name, and a RuntimeError as Horovod's, so Horovod programs catch it as they do."""


class ClusterError(MpicollError):
    """The cluster cannot do what was asked; the message says why and what to do."""


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)
