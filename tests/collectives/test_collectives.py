"""Every algorithm against MPI's own collective, on fresh random data, at any rank count.

Run under mpiexec: ``mpiexec -n 4 python -m pytest --with-mpi tests/collectives/test_collectives.py``.
Each test loops over its cases and fails on every rank at once (``everywhere``),
listing the cases that went wrong and the seed that reproduces them.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from tests.support.collectives import Cases, close, make
from tests.support.gpus import DLPackOnly, InterfaceOnly
from tests.support.mpi import P, RANK, WORLD, everywhere

pytestmark = pytest.mark.mpi


SIZES = sorted({0, 1, max(P - 1, 0), P + 1, 17, 1000})

REDUCTIONS = [  # (dtype, ops)
    ("float32", ["SUM", "PROD", "MIN", "MAX"]),
    ("float64", ["SUM", "PROD", "MIN", "MAX"]),
    ("float16", ["SUM", "MAX"]),
    ("complex128", ["SUM", "PROD"]),
    ("int32", ["SUM", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR"]),
    ("int64", ["SUM", "MAX"]),
    ("uint8", ["SUM", "MIN", "BXOR"]),
    ("int16", ["SUM", "BOR"]),
    ("int8", ["SUM", "BAND"]),
    ("uint16", ["MAX", "BXOR"]),
    ("uint64", ["SUM", "MIN"]),
    ("complex64", ["SUM"]),
    ("bool", ["LAND", "LOR", "LXOR"]),
    ("longdouble", ["SUM"]),
]


def test_allreduce_matches_mpi(comm, mpi):
    cases = Cases(mpi)
    rng = cases.rng
    # every dtype and op over the world; over the other communicators (their handling is what differs) a third
    for dtype, ops in REDUCTIONS if mpi is WORLD else REDUCTIONS[::3]:
        for op_name in ops:
            op = getattr(MPI, op_name)
            for count in SIZES:
                send = make(rng, dtype, count, op_name)
                kept = send.copy()
                reference = np.empty_like(send)
                mpi.Allreduce(send, reference, op)
                result = np.full_like(send, 7)
                comm.Allreduce(send, result, op)
                name = f"{dtype} {op_name} n={count}"
                cases.check(name, close(result, reference, dtype), result)
                cases.check(name + " (send buffer written)", np.array_equal(send, kept))
                in_place = send.copy()
                comm.Allreduce(MPI.IN_PLACE, in_place, op)
                cases.check(name + " in place", close(in_place, reference, dtype), in_place)
    cases.judge()


def test_allreduce_large_buffer(comm, mpi):
    """A few MiB with an odd count: many segments, uneven chunks."""
    cases = Cases(mpi)
    rng = cases.rng
    for dtype in ("float32", "int64"):
        send = make(rng, dtype, 3 * 2**20 // np.dtype(dtype).itemsize + 7)
        reference = np.empty_like(send)
        mpi.Allreduce(send, reference)
        result = np.empty_like(send)
        comm.Allreduce(send, result)
        cases.check(f"{dtype} n={send.size}", close(result, reference, dtype), result)
    cases.judge()


def test_allreduce_non_commutative_user_ops(comm, mpi):
    """User ops that only rank order gets right: projections, and composition of affine maps."""
    cases = Cases(mpi)
    p = mpi.Get_size()
    rng = cases.rng

    def first(inbuf, inoutbuf, datatype):
        np.frombuffer(inoutbuf, np.float64)[:] = np.frombuffer(inbuf, np.float64)

    def compose(inbuf, inoutbuf, datatype):
        # (a1, b1) o (a2, b2) = (a1 a2, a1 b2 + b1): x -> a1 (a2 x + b2) + b1, lower rank outside
        left = np.frombuffer(inbuf, np.float64).reshape(-1, 2)
        right = np.frombuffer(inoutbuf, np.float64).reshape(-1, 2)
        right[:, 1] = left[:, 0] * right[:, 1] + left[:, 1]
        right[:, 0] = left[:, 0] * right[:, 0]

    projection = MPI.Op.Create(first, commute=False)
    affine = MPI.Op.Create(compose, commute=False)
    pair = MPI.DOUBLE.Create_contiguous(2).Commit()
    try:
        for count in SIZES:
            send = rng.standard_normal(count)
            everyone = np.array(mpi.allgather(send))
            result = np.empty_like(send)
            comm.Allreduce(send, result, projection)
            cases.check(f"first-of n={count}", np.array_equal(result, everyone[0]), result)

            maps = np.column_stack([rng.uniform(0.5, 1.5, count), rng.standard_normal(count)])
            everyone = np.array(mpi.allgather(maps))
            expected = everyone[-1].copy()
            for q in range(p - 2, -1, -1):     # fold in rank order, right to left
                expected[:, 1] = everyone[q][:, 0] * expected[:, 1] + everyone[q][:, 1]
                expected[:, 0] = everyone[q][:, 0] * expected[:, 0]
            composed = np.empty_like(maps)
            comm.Allreduce([maps, count, pair], [composed, count, pair], affine)
            cases.check(f"affine n={count}", np.allclose(composed, expected, rtol=1e-12), composed)
            in_place = maps.copy()
            comm.Allreduce(MPI.IN_PLACE, [in_place, count, pair], affine)
            cases.check(f"affine in place n={count}", np.allclose(in_place, expected, rtol=1e-12), in_place)
    finally:
        pair.Free()
        projection.Free()
        affine.Free()
    cases.judge()


def test_reduce_scatter_block_matches_mpi(comm, mpi):
    cases = Cases(mpi)
    p = mpi.Get_size()
    rng = cases.rng
    for dtype, ops in REDUCTIONS[:5]:
        for op_name in ops[:2]:
            op = getattr(MPI, op_name)
            for block in (0, 1, 2, 17, 300):
                send = make(rng, dtype, block * p, op_name)
                kept = send.copy()
                reference = np.empty(block, send.dtype)
                mpi.Reduce_scatter_block(send, reference, op)
                result = np.empty(block, send.dtype)
                comm.Reduce_scatter_block(send, result, op)
                name = f"{dtype} {op_name} block={block}"
                cases.check(name, close(result, reference, dtype))
                cases.check(name + " (send buffer written)", np.array_equal(send, kept))
                in_place = send.copy()
                comm.Reduce_scatter_block(MPI.IN_PLACE, in_place, op)
                cases.check(name + " in place", close(in_place[:block], reference, dtype))
    cases.judge()


def test_allgather_matches_mpi(comm, mpi):
    cases = Cases(mpi)
    p, rank = mpi.Get_size(), mpi.Get_rank()
    rng = cases.rng
    for dtype in ("float64", "int8", "complex64", "bool"):
        for block in (0, 1, 3, 17, 1000):
            send = make(rng, dtype, block)
            reference = np.empty(block * p, send.dtype)
            mpi.Allgather(send, reference)
            result = np.empty_like(reference)
            kept = send.copy()
            comm.Allgather(send, result)
            cases.check(f"{dtype} block={block}", np.array_equal(result, reference), result)
            cases.check(f"{dtype} block={block} (send buffer written)", np.array_equal(send, kept))
            in_place = np.zeros_like(reference)
            in_place[rank * block:(rank + 1) * block] = send
            comm.Allgather(MPI.IN_PLACE, in_place)
            cases.check(f"{dtype} block={block} in place", np.array_equal(in_place, reference), in_place)
    cases.judge()


def test_bcast_from_every_root(comm, mpi):
    cases = Cases(mpi)
    p = mpi.Get_size()
    rng = cases.rng
    for root in range(p):
        for dtype in ("float32", "int64", "uint8"):
            for count in (0, 1, 17, 5000):
                data = make(rng, dtype, count)
                reference = data.copy()
                mpi.Bcast(reference, root)
                comm.Bcast(data, root)
                cases.check(f"root={root} {dtype} n={count}", np.array_equal(data, reference), data)
    cases.judge()


def test_buffer_specifications_like_mpi4py(comm, mpi):
    """Every form mpi4py accepts gives mpi4py's answer."""
    cases = Cases(mpi)
    p, rank = mpi.Get_size(), mpi.Get_rank()
    rng = cases.rng
    data = rng.standard_normal(12)
    reference = np.empty(12)
    mpi.Allreduce(data, reference)

    out = np.empty(12)
    comm.Allreduce([data, MPI.DOUBLE], [out, MPI.DOUBLE])
    cases.check("[buf, datatype]", close(out, reference, "float64"))
    out = np.empty(12)
    comm.Allreduce([data, "d"], [out, "d"])
    cases.check("[buf, typecode]", close(out, reference, "float64"))
    part = np.empty(5)
    comm.Allreduce((data, 5, MPI.DOUBLE), (part, 5, MPI.DOUBLE))
    cases.check("(buf, count, datatype)", close(part, reference[:5], "float64"))
    part_ref = np.empty(4)
    mpi.Allreduce([data, (4, 3), MPI.DOUBLE], part_ref)
    comm.Allreduce([data, (4, 3), MPI.DOUBLE], part[:4])
    cases.check("[buf, (count, displ), datatype]", close(part[:4], part_ref, "float64"))
    in_place = data.copy()
    comm.Allreduce(None, in_place)
    cases.check("None means in place", close(in_place, reference, "float64"))
    fortran = np.asfortranarray(data.reshape(3, 4))
    out2 = np.empty((3, 4), order="F")
    comm.Allreduce(fortran, out2)
    ref2 = np.empty((3, 4), order="F")
    mpi.Allreduce(fortran, ref2)
    cases.check("Fortran-ordered arrays", close(out2, ref2, "float64"))
    flags = bytearray(rng.integers(0, 256, 9, dtype=np.uint8).tobytes())
    got, want = bytearray(9), bytearray(9)
    comm.Allreduce(bytes(flags), got, MPI.BOR)
    mpi.Allreduce(bytes(flags), want, MPI.BOR)
    cases.check("bytes and bytearray", got == want)
    # pair types: MAXLOC over (value, rank)
    pairs = np.zeros(6, dtype=[("value", "f4"), ("index", "i4")])
    pairs["value"] = rng.standard_normal(6)
    pairs["index"] = rank
    got, want = np.empty_like(pairs), np.empty_like(pairs)
    comm.Allreduce([pairs, MPI.FLOAT_INT], [got, MPI.FLOAT_INT], MPI.MAXLOC)
    mpi.Allreduce([pairs, MPI.FLOAT_INT], [want, MPI.FLOAT_INT], MPI.MAXLOC)
    cases.check("MAXLOC on FLOAT_INT", got.tobytes() == want.tobytes(), got)
    # padded pair types and strided datatypes are handed to MPI unchanged
    pairs = np.zeros(5, dtype=np.dtype([("value", "f8"), ("index", "i4")], align=True))
    pairs["value"] = rng.standard_normal(5)
    pairs["index"] = rank
    got, want = np.empty_like(pairs), np.empty_like(pairs)
    comm.Allreduce([pairs, MPI.DOUBLE_INT], [got, MPI.DOUBLE_INT], MPI.MINLOC)
    mpi.Allreduce([pairs, MPI.DOUBLE_INT], [want, MPI.DOUBLE_INT], MPI.MINLOC)
    cases.check("MINLOC on DOUBLE_INT (padded)", np.array_equal(got, want))
    vector = MPI.DOUBLE.Create_vector(3, 1, 2).Commit()
    try:
        got, want = data[:6].copy(), data[:6].copy()
        comm.Bcast([got, 1, vector], root=p - 1)
        mpi.Bcast([want, 1, vector], root=p - 1)
        cases.check("strided vector datatype", np.array_equal(got, want))
    finally:
        vector.Free()
    cases.judge()


def test_every_buffer_kind_and_count_form_mpi4py_takes(comm, mpi):
    """What mpi4py's own tests miss: foreign buffer kinds, 4-item specs, per-rank counts, uneven sizes,
    empty messages; each compared with mpi4py's answer to the same call, and nothing outside the
    message touched."""
    cases = Cases(mpi)
    p, rank = mpi.Get_size(), mpi.Get_rank()
    rng = cases.rng
    for wrap in (DLPackOnly, InterfaceOnly):
        kind = wrap.__name__
        data = rng.integers(-50, 50, 2 * p + 1).astype(np.float64)      # not divisible by p
        got, want = np.full_like(data, np.nan), np.empty_like(data)
        comm.Allreduce(wrap(data), wrap(got))
        mpi.Allreduce(data, want)
        cases.check(f"{kind}: Allreduce of {data.size}", np.array_equal(got, want), got)
        comm.Allreduce(MPI.IN_PLACE, [wrap(got), MPI.DOUBLE], MPI.MAX)
        mpi.Allreduce(MPI.IN_PLACE, want, MPI.MAX)
        cases.check(f"{kind}: [obj, datatype] in place", np.array_equal(got, want), got)
        block = rng.integers(0, 9, 3).astype(np.int32)
        gathered = np.zeros(3 * p, np.int32)
        comm.Allgather(wrap(block), wrap(gathered))
        cases.check(f"{kind}: Allgather", np.array_equal(gathered, np.concatenate(mpi.allgather(block))))
        root_data = data.copy() if rank == p - 1 else np.zeros_like(data)
        comm.Bcast(wrap(root_data), root=p - 1)
        cases.check(f"{kind}: Bcast", np.array_equal(root_data, mpi.bcast(data, root=p - 1)))

    # [buf, count, displ, datatype] and [buf, (count, displ), datatype]: only the message is touched
    data = rng.integers(-50, 50, 10).astype(np.float64)
    for spec in (lambda b: [b, 5, 3, MPI.DOUBLE], lambda b: [b, (5, 3), MPI.DOUBLE], lambda b: [b, 5, 3, "d"]):
        got, want = np.full(10, -7.0), np.full(10, -7.0)
        comm.Allreduce(spec(data), spec(got))
        MPI.Intracomm.Allreduce(mpi, spec(data), spec(want))
        cases.check(f"4-item/displ spec {spec(np.zeros(1))[1:]}", np.array_equal(got, want), got)

    # explicit counts are per rank in Allgather and Reduce_scatter_block (mpi4py), extra room untouched
    count = 2
    send = rng.integers(0, 9, count).astype(np.int64)
    got, want = np.full(count * p + 3, -1, np.int64), np.full(count * p + 3, -1, np.int64)
    comm.Allgather([send, MPI.INT64_T], [got, count, MPI.INT64_T])
    MPI.Intracomm.Allgather(mpi, [send, MPI.INT64_T], [want, count, MPI.INT64_T])
    cases.check("Allgather with a per-rank count", np.array_equal(got, want), got)
    whole = rng.integers(0, 9, count * p + 2).astype(np.int64)
    got, want = np.full(count + 1, -1, np.int64), np.full(count + 1, -1, np.int64)
    comm.Reduce_scatter_block([whole, count, MPI.INT64_T], [got, count, MPI.INT64_T])
    MPI.Intracomm.Reduce_scatter_block(mpi, [whole, count, MPI.INT64_T], [want, count, MPI.INT64_T])
    cases.check("Reduce_scatter_block with a per-rank count", np.array_equal(got, want))
    got, want = whole.copy(), whole.copy()
    comm.Reduce_scatter_block(MPI.IN_PLACE, [got, count, MPI.INT64_T])
    MPI.Intracomm.Reduce_scatter_block(mpi, MPI.IN_PLACE, [want, count, MPI.INT64_T])
    cases.check("Reduce_scatter_block in place with a per-rank count", np.array_equal(got[:count], want[:count])
                and np.array_equal(got[count * p:], whole[count * p:]))

    # empty messages: [None, datatype], as mpi4py's test_msgzero, and a count of 0
    null = [None, MPI.INT]
    comm.Allreduce(null, null)
    comm.Reduce_scatter_block(null, null)
    comm.Allgather(null, null)
    comm.Bcast(null)
    comm.Allreduce([data, 0, MPI.DOUBLE], [np.empty(0), 0, MPI.DOUBLE])
    cases.check("empty messages", True)

    # what mpi4py refuses is refused with mpi4py's kind of exception
    for call, kind in [
        (lambda: comm.Allreduce([data, MPI.DOUBLE], [np.empty(10, np.int64), MPI.INT64_T]), ValueError),
        (lambda: comm.Allreduce([data, 2, 3, MPI.DOUBLE, 0], np.empty(2)), ValueError),
        (lambda: comm.Allreduce(data, np.empty(10)[::1].view(np.float64).reshape(10)[:9]), ValueError),
        (lambda: comm.Allreduce(data, bytes(80)), BufferError),
        (lambda: comm.Allreduce(data, 42), TypeError),
        (lambda: comm.Bcast([None, 3, MPI.INT]), ValueError),
        (lambda: comm.Bcast(data, root=p), MPI.Exception),                       # MPI_ERR_ROOT, as in mpi4py
        (lambda: comm.Allreduce(np.ones(2, complex), np.empty(2, complex), MPI.MAX), MPI.Exception),  # MPI_ERR_OP
    ]:
        try:
            call()
            cases.check(f"no {kind.__name__}", False)
        except kind:
            pass
    cases.judge()


@pytest.mark.mpi
def test_auto_learns_on_its_first_call_whether_nodes_of_several_ranks_are_spanned():
    """auto's across-nodes rules apply where every node holds several consecutive ranks (emulated nodes:
    scripts/run-tests' multi-node tier), and nowhere else."""
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    members = local.allgather(RANK)
    local.Free()
    nodes = WORLD.allgather((len(members), members == list(range(members[0], members[0] + len(members)))))
    expected = 1 < len(members) < P and len({n for n, _ in nodes}) == 1 and all(run for _, run in nodes)
    with mpicoll.Communicator(WORLD) as comm:
        comm.Allreduce(np.ones(4), np.empty(4))
        everywhere(comm.across_nodes == expected, f"across_nodes {comm.across_nodes}, expected {expected}")


@pytest.mark.mpi
def test_across_nodes_hierarchical_works_inside_each_node_through_its_shared_memory(monkeypatch):
    """Across nodes of several ranks, ``hierarchical``'s stages inside each node go through the node's shared
    memory in C (local rank j's block, the last also the rest of an uneven count): exact sums of integer
    values, as MPI's own calls give them, in place and out, at counts below, at and past the node's ranks and a
    slot; reduce_scatter and allgather likewise."""
    from mpicoll.channel.nodes import node_layout
    from mpicoll.collectives.algorithms import hierarchical, node
    monkeypatch.setattr(hierarchical, "ACROSS_NODES_FROM", dict.fromkeys(hierarchical.ACROSS_NODES_FROM, 0))
    cases = Cases(WORLD)
    rng = cases.rng
    with mpicoll.Communicator(WORLD, algorithm="hierarchical") as comm:
        comm.Allreduce(np.ones(4), np.empty(4))          # its context made
        layout = node_layout(comm.context())
        if layout is None or not layout.splits(in_rank_order=True) or not node.available():
            pytest.skip("needs nodes of several consecutive ranks (the multi-node tier) and the C extension")
        k = layout.per_node
        for dtype in ("float32", "int64", "float64"):
            for count in sorted({k, k + 1, 2 * k - 1, 1001, node.SLOT_BYTES // 4 * 3 + 5}):
                send = rng.integers(-50, 50, count).astype(dtype)
                reference = np.empty_like(send)
                WORLD.Allreduce(send, reference)
                result = np.full_like(send, 7)
                comm.Allreduce(send, result)
                cases.check(f"{dtype} n={count}", np.array_equal(result, reference), result)
                in_place = send.copy()
                comm.Allreduce(MPI.IN_PLACE, in_place, MPI.MAX)
                WORLD.Allreduce(MPI.IN_PLACE, send, MPI.MAX)
                cases.check(f"{dtype} MAX n={count} in place", np.array_equal(in_place, send), in_place)
            for block in (1, 3, 1001):
                send = rng.integers(-50, 50, block * P).astype(dtype)
                reference, result = np.empty(block, dtype), np.full(block, 7, dtype)
                WORLD.Reduce_scatter_block(send, reference)
                comm.Reduce_scatter_block(send, result)
                cases.check(f"reduce_scatter {dtype} block={block}", np.array_equal(result, reference))  # each its own
                reference, result = np.empty(block * P, dtype), np.full(block * P, 7, dtype)
                WORLD.Allgather(send[:block], reference)
                comm.Allgather(send[:block], result)
                cases.check(f"allgather {dtype} block={block}", np.array_equal(result, reference), result)
        made = layout.local.kept.get(node.KEY)
        cases.check("the stages inside the node went through its shared memory", made is not None and made.calls > 0)
    cases.judge()
