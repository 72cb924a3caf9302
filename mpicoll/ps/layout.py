"""Who serves and who trains, and which slice of the parameters each server owns.

``mpiexec -n S+W`` gives S server ranks (the first S, unless ``servers=`` names
others) and W workers.  The flat parameter vector is split into S contiguous
shards whose sizes differ by at most one element; each shard is served on its
own (Downpour's sharded servers), so a worker talks to every server with the
matching slice of its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from ..base.chunks import balanced_bounds

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    comm: MPI.Intracomm
    size: int                       # parameters in the flat vector
    servers: tuple[int, ...]        # server ranks, in shard order
    workers: tuple[int, ...]

    @classmethod
    def split(cls, comm: MPI.Intracomm, size: int, servers: int | list[int] = 1) -> "Layout":
        """Pick S server ranks (a count: the first S ranks; or a list of ranks) and make the rest workers."""
        ranks = list(range(comm.Get_size()))
        chosen = tuple(ranks[:servers]) if isinstance(servers, int) else tuple(sorted(set(servers)))
        if not chosen or not set(chosen) <= set(ranks):
            raise ValueError(f"servers={servers!r}: need at least one server among ranks 0..{len(ranks) - 1}")
        workers = tuple(r for r in ranks if r not in chosen)
        if not workers:
            raise ValueError(f"{len(ranks)} ranks and {len(chosen)} server(s) leave no worker: "
                             "launch more ranks (mpiexec -n SERVERS+WORKERS)")
        if size < len(chosen):
            raise ValueError(f"{size} parameters cannot be sharded over {len(chosen)} servers")
        return cls(comm, size, chosen, workers)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def is_server(self) -> bool:
        return self.rank in self.servers

    def shard(self, server: int) -> slice:
        """The slice of the parameter vector that server rank ``server`` owns."""
        bounds = balanced_bounds(self.size, len(self.servers))
        index = self.servers.index(server)
        return slice(bounds[index], bounds[index + 1])
