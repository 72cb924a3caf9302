"""Every MPI message tag mpicoll uses, in one table, so no two parts can collide.

Collective algorithms talk over a private duplicate of the user's communicator
(:class:`mpicoll.channel.context.Context`); parameter servers and gossip over their
own.  Distinct tags still keep each part's messages apart on a shared channel,
and a tag seen in a debugger names its sender.
"""

from enum import IntEnum

__all__ = ["Tag"]


class Tag(IntEnum):
    RING = 11                 # reduce-scatter segments to the right neighbour
    RING_HIGH = 12            # rank p-1 to a chunk's owner, for non-commutative ops
    RING_GATHER = 13          # allgather segments
    RING_CHAIN = 14           # chain broadcast
    PARALLEL = 21
    RECURSIVE_DOUBLING = 31
    SHARED_READY = 41         # ring over shared memory: a partial is ready to read
    SHARED_HIGH = 42
    SHARED_FINAL = 43
    DIRECT = 61               # direct reduce-scatter: chunk q to rank q
    DIRECT_GATHER = 62        # its allgather
    PS_REQUEST = 71           # parameter server: a worker's request header
    PS_GRADIENT = 72
    PS_ANSWER = 73
    PS_WEIGHTS = 74
    PS_FINAL = 75             # the final weights, and the workers each server lost
    PS_FAILED = 76            # a server's last word when it fails: why, to every worker
    PS_GO = 77                # a server's answer to a gradient's header: send it (1), or it is too late (0)
    PS_STATS = 78             # after training, the first server's staleness histogram to the reporting worker
    MODEL_PARALLEL = 81       # a stage's boundary activations forward, their gradients backward
    SANDBLASTER_COMMAND = 82  # Sandblaster: the coordinator's command to every server shard
    SANDBLASTER_REPLY = 83    # a shard's partial dot products, back to the coordinator
    SANDBLASTER_TASK = 84     # the coordinator's task to a worker: a portion of the batch, a report, stop
    SANDBLASTER_DONE = 85     # a worker's "portion done" (its loss) to the coordinator
    SANDBLASTER_WEIGHTS = 86  # a shard's published vector to every worker
    SANDBLASTER_GRADIENT = 87  # a worker's gradient slice for a portion (a header, then the slice) to a shard
    SANDBLASTER_FINAL = 88    # at the end, each shard's parameters to every worker
    SANDBLASTER_FAILED = 89   # a part's last word when it fails: why, to every other rank
    GOSSIP = 91               # push-sum over point-to-point messages
    MISMATCH = 97             # a rank that found its call differs from another's: what it passed, to every rank
    TIMELINE = 98             # at exit, every rank's timeline events to rank 0 (on MPI.COMM_WORLD)
    ROLL_CALL = 99            # after a timeout: "I am alive", from every survivor to every rank
    JOB_FAILED = 100          # a rank's uncaught error, to every other rank, before it ends the job (watchdog)
