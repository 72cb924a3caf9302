"""A node: the ranks of one communicator on one machine, reducing and moving data through one shared-memory
segment, in C (``_shm.c``, which has the protocol as a table).

Each rank has a region of one MPI shared-memory window: a control block and
two slots of :data:`SLOT_BYTES`.  A call copies each rank's chunk into its
slot and every rank reads the others' straight out of theirs; a chunk of up
to :data:`SMALL_BYTES` is reduced by every rank whole, a larger one split
(each rank reduces its slice, then copies the others' out).  Every
predefined op on every numeric numpy type (bool for the logical and bitwise
ops, float16 and bfloat16 sums as mpicoll's 16-bit words) is reduced in rank
order, each element by one rank: the same bits on every rank.  A rank told
to (:data:`THREADS`, ``MPICOLL_SHM_THREADS``) cuts its large copies and
reductions among that many OpenMP threads: for a rank with cores to spare.

Made once per context (:func:`node_of`), it serves ``shm``'s collectives
and ``hierarchical``'s stages inside each node; :func:`carries` says where
it can (every rank on one node, not under MPI's fault tolerance, the C
extension built).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ...base import config, failure, ops
from ...base.errors import MismatchError

try:
    from .. import _shm
except ImportError:               # built without a C compiler: callers take their fallbacks
    _shm = None

if TYPE_CHECKING:
    from ...channel.context import Context
    from ..reduction import Reduction

__all__ = ["available", "carries", "node_of", "codes", "plain", "KEY", "SLOT_BYTES", "SMALL_BYTES", "TYPES", "OPS"]

# The element types and ops, numbered as _shm.c numbers them
TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64", "float16",
         "bfloat16", "complex64", "complex128", "bool")
OPS = ("sum", "prod", "min", "max", "land", "lor", "lxor", "band", "bor", "bxor")
_TYPE_CODES = {name: code for code, name in enumerate(TYPES)}

SLOT_BYTES = 1 << 20           # a chunk: each rank's two slots hold two chunks (2 MiB + 256 B a rank)
SMALL_BYTES = 16 << 10         # chunks up to this many bytes are reduced whole by every rank
SPINS = 4000                   # polls of a wait before it yields the core, where each rank has a core
STORES = None                  # into the slots: "cached", "streamed" (past the caches), "learn" (the faster,
                               # measured); None: MPICOLL_SHM_STORES's (default "learn")
THREADS = None                 # a rank's threads for its large copies and reductions (OpenMP's, where the
                               # extension has it); None: MPICOLL_SHM_THREADS's, else 1 (docs/benchmarks.md)
YIELD_SECONDS = 1e-3           # yielding the core, before a wait goes to the communicator's (deadline, roll call)

KEY = "shm.node"             # the node, in its context's ``kept``


def available() -> bool:
    """Whether the C extension was built (``auto`` chooses the node only then)."""
    return _shm is not None


def carries(ctx: Context) -> bool:
    """Whether this communicator's calls can go through a node: the C extension, every rank on one node, and
    not under MPI's fault tolerance.  The same answer on every rank."""
    return _shm is not None and not ctx.spans_nodes and not failure.fault_tolerant()


@functools.cache
def _narrow_ops() -> tuple:
    """((op, type code), ...): the user ops that add 16-bit floats as their bits (compression, bfloat16 sums);
    made once (their MPI ops are made once by :mod:`~mpicoll.collectives.compression`)."""
    from ..compression import Compression
    return tuple((Compression(kind).op, _TYPE_CODES[name]) for kind, name in (("fp16", "float16"), ("bf16", "bfloat16")))


def node_of(ctx: Context):
    """This context's node (a ``_shm.Node``), made on first use: collective, every rank of ``ctx`` must be here
    (its window's allocation checks that they make the same call first)."""
    node = ctx.kept.get(KEY)
    if node is not None:
        return node
    # each rank's region from its first 64-byte boundary (its control block's lines): MPI's window gave regions
    # 16-byte aligned ones (the communicators of mpi4py's own tests, MPICH 5.0.2)
    regions = ctx.shared_regions("shm").regions(_shm.CONTROL_BYTES + 2 * SLOT_BYTES + 64, np.uint8)
    region = [whole[-whole.__array_interface__["data"][0] % 64:][:_shm.CONTROL_BYTES + 2 * SLOT_BYTES]
              for whole in regions]

    def stalled(rank: int, step: int) -> None:
        ctx.wait_until(lambda: node.arrived(rank, step), [rank])

    def mismatched(calls) -> None:
        described = {q: _described(count, type_code, op_code) for q, (count, type_code, op_code) in enumerate(calls)}
        raise MismatchError(ctx.collective, described, settled=True)

    def refuse() -> None:
        ctx.begin(ctx.collective)           # raises, naming what broke the channel
        raise RuntimeError(f"{ctx.collective}: an on-node allreduce was interrupted midway, so the ranks' steps "
                           "differ; close() this communicator on every rank and call again")

    node = ctx.kept[KEY] = _shm.Node(
        regions=region, rank=ctx.rank, slot_bytes=SLOT_BYTES, small_bytes=SMALL_BYTES,
        spins=SPINS if ctx.spin_seconds else 0, yield_seconds=YIELD_SECONDS, stalled=stalled, mismatched=mismatched,
        refuse=refuse, ops=tuple(ops.find(name).mpi_op for name in OPS), narrow=_narrow_ops(), in_place=MPI.IN_PLACE,
        stores=STORES or config.shm_stores(), threads=THREADS or config.shm_threads() or 1)
    return node


# the fingerprints' kinds of the node's allgather, bcast and reduce_scatter (+ the type), as _shm.c numbers them
ALLGATHER_KIND, BCAST_KIND, REDUCE_SCATTER_KIND = 100, 101, 200


def _described(count: int, type_code: int, op_code: int) -> str:
    if type_code == ALLGATHER_KIND:
        return f"Allgather({count} bytes a rank, algorithm=shm)"
    if type_code == BCAST_KIND:
        return f"Bcast({count} bytes, root={op_code}, algorithm=shm)"
    collective = "Allreduce"
    if type_code >= REDUCE_SCATTER_KIND:
        collective, type_code = "Reduce_scatter_block", type_code - REDUCE_SCATTER_KIND
    type_name = TYPES[type_code] if type_code < len(TYPES) else f"type {type_code}"
    op_name = OPS[op_code].upper() if op_code < len(OPS) else f"op {op_code}"
    return f"{collective}(count={count}, dtype={type_name}, op={op_name}, algorithm=shm)"


def codes(reduction: Reduction) -> tuple[int, int] | None:
    """(type, op) as the node numbers them, or None where it does not reduce this op on this type."""
    entry = ops.of_mpi(reduction.op) if reduction.op.is_predefined else None
    dtype = reduction.dtype
    if entry is None:
        if dtype == np.uint16:
            for op, type_code in _narrow_ops():
                if op == reduction.op:
                    return type_code, 0
        return None
    if entry.name not in OPS or dtype.kind not in entry.kinds or not dtype.isnative:
        return None
    name = "bool" if dtype.kind == "b" else dtype.name
    if name not in _TYPE_CODES or (dtype.kind == "c" and entry.name not in ("sum", "prod")):
        return None
    return _TYPE_CODES[name], OPS.index(entry.name)



def plain(array) -> bool:
    """A C-contiguous numpy array: the node moves its bytes (device arrays go the fallback's way)."""
    return isinstance(array, np.ndarray) and array.flags.c_contiguous
