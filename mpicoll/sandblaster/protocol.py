"""Who does what in a Sandblaster job, and the messages between them.

Rank 0 is the **coordinator**: it runs L-BFGS (:mod:`.lbfgs`) and holds only
scalars.  The next S ranks are **server shards**: each holds one contiguous
slice of every vector L-BFGS uses (parameters, gradient, direction, history)
and performs the coordinator's commands on it.  The remaining W ranks are
**workers**: they compute gradients over portions of the batch.

Every message is point to point on the job's private communicator:

- coordinator -> each shard, ``SANDBLASTER_COMMAND``: a :data:`COMMAND_WORDS`
  float64 array ``[op, operands...]`` (vectors by their index in the name list);
  a ``DOTS`` command is answered on ``SANDBLASTER_REPLY`` with the shard's partial
  dot products, which the coordinator sums in shard order, a ``SAVE`` once the shard's
  checkpoint is written;
- shard -> each worker, ``SANDBLASTER_WEIGHTS``: the shard's slice of a published
  vector; publications are numbered 1, 2, ... in order, so a worker that needs
  publication p receives every shard's messages up to p;
- coordinator -> worker, ``SANDBLASTER_TASK``: ``[kind, publication, batch, portion,
  first row, end row]``; worker -> coordinator, ``SANDBLASTER_DONE``: ``[publication,
  portion, loss summed over the rows, rows]``, or ``[-1, ...]`` to say goodbye;
- worker -> each shard, ``SANDBLASTER_GRADIENT``: a header ``[publication, portion]``
  and then the gradient slice summed over the rows (``[-1, -1]`` and no slice:
  this worker sends no more);
- at the end, coordinator -> each shard, ``SANDBLASTER_FINAL``: which workers were lost
  (int8 per rank); shard -> each live worker, ``SANDBLASTER_FINAL``: the final parameters' slice.

Messages between two ranks on one tag arrive in order, so headers and slices pair up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..base.chunks import balanced_bounds

__all__ = ["Op", "Task", "Roles", "COMMAND_WORDS", "batch_rows", "coordinator_patience"]

COMMAND_WORDS = 128            # a command's float64 words: 62 dot products or 62 terms of a combination
HEADER = np.int64


class Op(enum.IntEnum):
    DOTS = 1        # [DOTS, pairs, a1, b1, a2, b2, ...] -> partial dot products
    SWAP = 3        # [SWAP, a, b]
    PUBLISH = 4     # [PUBLISH, vector]: send this shard of it to every worker
    COLLECT = 5     # [COLLECT, into, publication, portions, rows]: gradient = sum of the portions / rows
    FINISH = 6      # [FINISH], then a mask of the lost workers on SANDBLASTER_FINAL: drain, send the
                    # parameters to the live workers, stop
    COMBINATION = 7  # [COMBINATION, out, terms, v1, c1, v2, c2, ...]: out = c1 v1 + c2 v2 + ..., in order
                     # (out none of them)
    SAVE = 8        # [SAVE, iteration]: write this shard's checkpoint, then answer 1.0 on SANDBLASTER_REPLY


class Task(enum.IntEnum):
    GRADIENT = 1    # the gradient at a publication over rows [first, end) of a batch
    REPORT = 2      # evaluate the parameters of a publication (the reporting worker)
    STOP = 3        # no more tasks; publication: the last one, to drain


@dataclass(frozen=True)
class Roles:
    """The ranks of one job: the coordinator, S shards, W workers; and each shard's slice."""

    size: int                # parameters
    ranks: int
    servers: int

    def __post_init__(self):
        if self.servers < 1 or self.ranks < self.servers + 2:
            raise ValueError(f"Sandblaster needs a coordinator, {max(self.servers, 1)} server shard(s) and at least "
                             f"one worker: mpiexec -n {max(self.servers, 1) + 2} or more (got {self.ranks} ranks)")
        if self.size < self.servers:
            raise ValueError(f"{self.size} parameters cannot be sharded over {self.servers} servers")

    coordinator = 0

    @property
    def shards(self) -> range:
        return range(1, 1 + self.servers)

    @property
    def workers(self) -> range:
        return range(1 + self.servers, self.ranks)

    def role(self, rank: int) -> str:
        return "coordinator" if rank == 0 else "server" if rank in self.shards else "worker"

    def slice(self, shard: int) -> slice:
        """The slice of every vector that shard rank ``shard`` holds."""
        bounds = balanced_bounds(self.size, self.servers)
        index = shard - 1
        return slice(bounds[index], bounds[index + 1])


def batch_rows(samples: int, batch: int, number: int, seed: int = 0) -> np.ndarray:
    """The rows of batch ``number``: every row when ``batch`` covers the data (full-batch L-BFGS),
    else ``batch`` rows drawn without replacement, the same on every rank for a (seed, number)."""
    if batch >= samples:
        return np.arange(samples)
    return np.sort(np.random.default_rng([seed, number]).choice(samples, batch, replace=False))


def coordinator_patience(ctx) -> float:
    """Seconds a shard or worker waits for the coordinator's next word before counting it lost: twice the
    timeout, since the coordinator itself may spend a whole timeout waiting on a silent worker first
    (0: no limit, as the timeout)."""
    return 2 * ctx.timeout
