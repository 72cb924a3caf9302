"""Parameter-server training over MPI: sharded servers, pluggable update rules.

    from mpi4py import MPI
    from mpicoll import ps

    server = ps.ParameterServer(MPI.COMM_WORLD, init=w0, rule=ps.DCASGD(lr=0.1, lam=0.04), servers=1)
    if server.is_server:
        stats = server.serve()                 # returns when every worker has closed
    else:
        w = server.client.pull()
        for batch in batches:
            w = server.client.exchange(gradient(w, batch))
        server.client.close()
    final = server.gather_weights()            # the full vector, on every rank

Run with ``mpiexec -n S+W``: the first S ranks serve one shard each.
``transport="onesided"`` moves gradients and weights through MPI windows
(:mod:`mpicoll.ps.windows`) instead of point-to-point messages.  See
:mod:`mpicoll.ps.rules` for the rules (sync, softsync, async, dcasgd, downpour).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..base import failure
from ..base.errors import PartFailed
from ..channel import notices
from ..channel.context import Context
from ..base.tags import Tag
from .client import Client, Schedule
from .layout import Layout
from .rules import DCASGD, RULES, Async, Downpour, Rescaled, Ringmaster, Rule, SoftSync, Sync, make
from .server import Diverged, Server, ServerStats, WorkerLost
from .transports import TRANSPORTS
from .windows import Windows

__all__ = ["ParameterServer", "Layout", "Client", "Schedule", "Server", "ServerStats", "WorkerLost", "Diverged",
           "Rule", "Sync", "SoftSync", "Async", "DCASGD", "Downpour", "Ringmaster", "Rescaled", "make", "RULES", "TRANSPORTS"]


class ParameterServer:
    """One rank's part in a parameter-server job: a server of one shard, or a worker with a client.

    Collective: every rank of ``comm`` constructs it with the same ``init``
    (only the servers' slices are used) and ``servers``; each server rank
    needs its own ``rule`` instance.
    """

    def __init__(self, comm: MPI.Intracomm, init: np.ndarray, rule: Rule, *, servers: int | list[int] = 1,
                 transport: str = "p2p"):
        init = np.ascontiguousarray(init).reshape(-1)
        if init.dtype not in (np.float32, np.float64):
            raise TypeError(f"parameters must be float32 or float64, got {init.dtype}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.layout = Layout.split(comm, init.size, servers)
        self.context = Context(comm)
        self.context.on_death = "acknowledge"      # under ULFM a dead worker is dropped, as without it
        self.rule = rule
        self.transport = transport
        self.windows = None
        if transport == "onesided":
            self.context.rendezvous()                 # allocating windows blocks until every rank is here
            self.windows = Windows(self.context, self.layout, init.dtype)
        self.is_server = self.layout.is_server
        self.weights = init[self.layout.shard(self.layout.rank)].copy() if self.is_server else None
        self.client = None if self.is_server else Client(self.context, self.layout, init.dtype, self.windows,
                                                         reads_live=rule.reads_live, asks_first=rule.refuses_late)
        if self.is_server:          # a worker that lost another server says so (tell_servers): stop
            notices.listen(self.context, self.layout.workers, Tag.PS_FAILED, PartFailed)
        self.stats: ServerStats | None = None
        self.lost: list[int] = []        # workers lost during training (known after gather_weights)
        self._unclean = False

    def serve(self, worker_timeout: float | None = None, *, checkpoint: str | None = None, every: int = 100,
              resume: bool = False, warm_start: int = 0, identity: dict | None = None,
              lr_at=None, state: dict | None = None) -> ServerStats:
        """Run this server's loop until every worker has closed or been dropped; returns its statistics.

        ``worker_timeout``: seconds of silence after which a worker counts as lost
        (default MPICOLL_TIMEOUT).  ``checkpoint``: a path prefix; each server saves
        ``PREFIX.server<rank>.npz`` every ``every`` updates and at the end, and
        ``resume=True`` continues from those files (workers learn where from
        ``client.pull()`` and ``client.versions``).  ``warm_start=k``: the first
        worker trains alone for k updates before the others' first pull is answered.  ``identity``:
        what else the checkpoint belongs to (e.g. the training run's data), refused on resume if it differs.
        ``lr_at``: a learning-rate schedule, update count -> the rule's rate, set before each update.
        ``state``: with ``resume``, the arrays of a set of servers' files chosen together
        (:func:`mpicoll.channel.checks.load_checkpoint_set` over every rank) instead of this server's newest file:
        servers stopped between their writes then resume from the newest point all of them hold.
        """
        if not self.is_server:
            raise RuntimeError(f"rank {self.layout.rank} is a worker: use .client")
        if resume and not checkpoint:
            raise ValueError("resume=True needs the checkpoint prefix to resume from")
        self._unclean = True          # until serve returns: an error leaves messages in flight
        try:
            self.stats = Server(self.context, self.layout, self.rule, self.weights, self.windows,
                                worker_timeout, lr_at).run(checkpoint=checkpoint, every=every, resume=resume,
                                                    warm_start=warm_start, identity=identity, state=state)
        except Exception as error:
            notices.tell(self.context, self.layout.workers, error, Tag.PS_FAILED)     # they stop now, not later
            self.context.broken_by(error)
            raise
        self._unclean = bool(self.stats.lost)
        return self.stats

    def tell_servers(self, error: BaseException) -> None:
        """A worker that cannot go on (it lost a server) tells the living servers why, so that they stop now
        too (a :class:`mpicoll.PartFailed` in their loop), not when the job ends around them."""
        if not self.is_server:
            notices.tell(self.context, self.layout.servers, error, Tag.PS_FAILED)

    def gather_weights(self) -> np.ndarray:
        """The servers' final full parameter vector, on every rank still in the job.

        Every rank calls it (after serving, or after closing its client).  Each
        server sends its shard point to point to every rank, with the list of
        workers it lost, and waits only for the sends to ranks it did not lose, so
        a dead worker does not stop the others from getting the result; afterwards
        ``lost`` names the lost workers on every rank that got the result.  A lost
        worker that is merely late still gets it where it shares the server's node;
        one on another node is sent nothing (it raises CollectiveTimeout after twice
        its timeout, if the job has not ended first): a send to a rank whose link
        failed crashed MPICH's UCX transport (a segmentation fault in ``MPI_Isend``,
        after a node was cut off: tests/cluster), and no MPI call tells a rank cut
        off from one merely late.
        """
        layout, ctx = self.layout, self.context
        dtype = self.weights.dtype if self.is_server else self.client.weights.dtype
        full = np.empty(layout.size, dtype)
        if not self.is_server and not self.client.closed:
            raise RuntimeError(f"worker rank {layout.rank}: close the client before gathering the weights")
        size = ctx.size
        notes = {server: np.zeros(size, np.int8) for server in layout.servers}     # 1: a worker that server lost
        requests, peers = [], []
        for server in layout.servers:
            if server == layout.rank:
                full[layout.shard(server)] = self.weights
                notes[server][self.stats.lost if self.stats else []] = 1
            else:
                requests += [ctx.irecv(notes[server], server, Tag.PS_FINAL), ctx.irecv(full[layout.shard(server)],
                                                                                     server, Tag.PS_FINAL)]
                peers += [server, server]
        if self.is_server:
            mine = notes[layout.rank]
            for rank in ctx.living(ctx.others()):
                if mine[rank] and rank not in ctx.on_this_node:
                    continue              # a lost worker on another node: its link may be down (see above)
                sends = [ctx.isend(mine, rank, Tag.PS_FINAL), ctx.isend(self.weights, rank, Tag.PS_FINAL)]
                if not mine[rank]:        # to a lost worker on this node: sent in case it lives, never waited for
                    requests += sends
                    peers += [rank, rank]
        # a server sends the result once every worker has closed or been dropped after the worker timeout
        # (by default this same timeout) of silence: a worker that finished waits for that, and a margin
        ctx.waitall(requests, peers, limit=None if self.is_server else 2 * ctx.timeout)
        self.lost = sorted(int(rank) for rank in np.flatnonzero(np.logical_or.reduce(list(notes.values()))))
        return full

    def close(self) -> None:
        """Release the private communicator (after serving or after the client closed).

        A rank whose run went wrong (a server that dropped a worker or raised, a
        client that timed out) keeps it instead: late messages may still arrive,
        and a freed communicator's identity can be reused by the next one, where
        they would be taken for new requests.  Windows (one-sided) are freed only
        after a clean run: freeing them needs every rank, a lost one included.
        """
        lost = self.stats.lost if self.is_server and self.stats else self.client and self.client.servers_lost
        if self.client is not None:
            self.client.weights = self.client.weights.copy()      # off the window memory
        if self.windows is not None and not lost and not self._unclean and not self.context.broken:
            self.context.rendezvous()
            self.windows.free()
        self.windows = None
        if self.lost and failure.fault_tolerant():     # each survivor leaves without MPI_Finalize: not before
            failure.meet_survivors(self.context.comm)  # every other has taken in what it sent
        self.context.free(abandon=self._unclean)
