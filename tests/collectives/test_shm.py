"""The on-node allreduce (``shm``, mpicoll/collectives/_shm.c): every type and op against numpy's reduction in
rank order, bit for bit, at awkward sizes and across chunks, in place and not, through the compiled fast path and
the checked one; ranks that disagree all get the MismatchError and go on; its window is unlinked while it lives."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.base import ops
from mpicoll.channel.checks import Fingerprint
from mpicoll.collectives import communicator
from mpicoll.collectives.algorithms import node
from tests.support.mpi import P, RANK, WORLD, everywhere, ranks_share_one_node, shared_seed

pytestmark = pytest.mark.mpi

TYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64",
         "complex64", "complex128", "bool"]


@pytest.fixture(autouse=True)
def one_node():
    if not node.available():
        pytest.skip("the on-node allreduce was not built here (no C compiler at install)")
    if not ranks_share_one_node():
        pytest.skip("the on-node allreduce needs every rank on one node")
    if P == 1:
        pytest.skip("one rank: auto runs MPI's call")


def contribution(rng, dtype: np.dtype, n: int) -> np.ndarray:
    """Random values of ``dtype``, NaN and infinities among the floats', small integers (products wrap)."""
    if dtype.kind == "b":
        return rng.random(n) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-3 if dtype.kind == "i" else 0, 4, n).astype(dtype)
    x = rng.standard_normal(n) * 4
    if dtype.kind == "c":
        x = x + 1j * rng.standard_normal(n)
    x = x.astype(dtype)
    if n > 4:
        x[rng.integers(0, n, 2)] = np.nan
        x[rng.integers(0, n)] = np.inf
    return x


def in_rank_order(contributions: list, op) -> np.ndarray:
    """numpy's reduction of the contributions in rank order: ((x0 op x1) op x2) ..."""
    entry = ops.of_mpi(op)
    total = contributions[0].copy()
    with np.errstate(all="ignore"):            # inf * 0 and the like: NaN, as the node gives
        for x in contributions[1:]:
            entry.ufunc(total, x, out=total, **entry.keywords)
    return total


def agrees(out: np.ndarray, expected: np.ndarray, op_name: str) -> bool:
    """Bit for bit, but for complex products, whose rounding numpy's vector loops (fused multiply-adds, where the
    machine has them) and C's formula make differently: within float precision there (and the same bits on every
    rank, which every test checks)."""
    if out.dtype.kind == "c" and op_name == "prod":
        return np.allclose(out, expected, rtol=1e-5, equal_nan=True)
    return np.array_equal(out, expected, equal_nan=out.dtype.kind in "fc")


def same_bits_everywhere(out: np.ndarray) -> bool:
    bits = WORLD.allgather(out.tobytes())
    return all(b == bits[0] for b in bits)


def cases(types=TYPES):
    for name in types:
        dtype = np.dtype(name)
        for entry in ops.OPS:
            if entry.name in node.OPS and dtype.kind in entry.kinds and not (dtype.kind == "c" and entry.ufunc in
                                                                              (np.minimum, np.maximum)):
                yield name, entry.name


def sizes(dtype: np.dtype) -> list[int]:
    """0, 1, fewer than the ranks, odd counts, past the chunks reduced whole (split), one below and past a slot
    (two chunks): all of them for float32 and int32, a few for the other types."""
    per_slot = node.SLOT_BYTES // dtype.itemsize
    if dtype.name in ("float32", "int32"):
        return [0, 1, max(P - 1, 1), 17, node.SMALL_BYTES // dtype.itemsize + 3, per_slot - 1, per_slot + 5]
    return [1, 17, node.SMALL_BYTES // dtype.itemsize + 3]


@pytest.mark.parametrize("path", ["auto", "shm"])      # auto: the compiled fast path from the node's first call
def test_every_type_and_op_gives_numpys_reduction_in_rank_order_bit_for_bit(path):
    seed = shared_seed()
    comm = mpicoll.Communicator(WORLD, algorithm=path)
    # the checked path reaches the same node: a few types there (4 ranks share 2 cores in the suite)
    for case, (name, op_name) in enumerate(cases(TYPES if path == "auto" else ("float32", "int32", "bool"))):
        dtype, op = np.dtype(name), ops.find(op_name).mpi_op
        for n in sizes(dtype):
            # every rank's contribution made here from the shared seed: the reference needs no message
            everyone = [contribution(np.random.default_rng([seed, case, n, q]), dtype, n) for q in range(P)]
            mine, expected = everyone[RANK], in_rank_order(everyone, op)
            out = np.empty_like(mine)
            comm.Allreduce(mine, out, op)
            ok = agrees(out, expected, op_name)
            in_place = mine.copy()
            comm.Allreduce(MPI.IN_PLACE, in_place, op)
            ok = ok and agrees(in_place, expected, op_name) and in_place.tobytes() == out.tobytes()
            if not ok:
                break
        if dtype.kind == "c" and op_name == "prod":
            ok = ok and same_bits_everywhere(out)
        everywhere(ok, f"{name} {op_name} n={n}: {out[:4]} (in place {in_place[:4]}) != {expected[:4]}")
    made = comm.context().kept.get(node.KEY)
    everywhere(made is not None and made.calls > 0, "the calls went through the node")
    if path == "auto" and communicator.FastCall is not None:
        everywhere(type(comm.__dict__.get("Allreduce")).__name__ == "FastCall", "auto's allreduce is the C path")


@pytest.mark.parametrize("stores", ["cached", "streamed"])
def test_either_stores_into_the_slots_give_the_same_bits(stores, monkeypatch):
    """Streamed stores (past the caches, then a fence) and cached ones: the same reduction, across chunks; "learn"
    (the default, which the tests above run) tries both after a size's two warm-up calls and keeps the faster."""
    monkeypatch.setattr(node, "STORES", stores)
    seed = shared_seed()
    comm = mpicoll.Communicator(WORLD, algorithm="shm")
    for case, name in enumerate(("float32", "int32", "float16", "int8")):
        dtype = np.dtype(name)
        for n in sizes(np.dtype(name)) + [3 * node.SLOT_BYTES // dtype.itemsize + 7]:
            everyone = [contribution(np.random.default_rng([seed, case, n, q]), dtype, n) for q in range(P)]
            out = everyone[RANK].copy()
            comm.Allreduce(MPI.IN_PLACE, out, MPI.SUM)
            everywhere(agrees(out, in_rank_order(everyone, MPI.SUM), "sum"), f"{stores} {name} n={n}: {out[:4]}")
    learning = mpicoll.Communicator(WORLD, algorithm="shm")
    monkeypatch.setattr(node, "STORES", "learn")
    big = np.ones(node.SLOT_BYTES // 4 + 3, np.float32)
    for _ in range(4):              # two to warm up, then one each way
        learning.Allreduce(MPI.IN_PLACE, big, MPI.SUM)
    chosen = learning.context().kept[node.KEY].chosen()
    everywhere(big[0] == P ** 4 and list(chosen) == [1 << 20] and chosen[1 << 20][0] in ("cached", "streamed"),
               f"{big[0]}, {chosen}")


def test_views_bfloat16_and_16_bit_compression_through_the_array_api():
    rng = np.random.default_rng([shared_seed(), RANK])
    import ml_dtypes
    comm = mpicoll.Communicator(WORLD)
    big = rng.standard_normal(3 * 5001).astype(np.float32)
    view = big[::3]                                          # a strided view: packed once, reduced in the node
    expected = in_rank_order(WORLD.allgather(view.copy()), MPI.SUM)
    everywhere(np.array_equal(mpicoll.allreduce(view, comm=comm), expected), "a strided view")
    words = rng.standard_normal(4099).astype(ml_dtypes.bfloat16)
    everyone = WORLD.allgather(words)
    expected = everyone[0]
    for x in everyone[1:]:                                   # each addition in float32, rounded once
        expected = (expected.astype(np.float32) + x.astype(np.float32)).astype(ml_dtypes.bfloat16)
    got = mpicoll.allreduce(words, comm=comm)
    everywhere(np.array_equal(got.view(np.uint16), expected.view(np.uint16)), "bfloat16 sums")
    made = comm.context().kept.get(node.KEY)
    everywhere(made is not None and made.calls >= 2, "through the node")


def test_ranks_that_pass_different_counts_or_ops_all_get_the_mismatch_and_go_on():
    comm = mpicoll.Communicator(WORLD)
    comm.Allreduce(MPI.IN_PLACE, np.ones(5000, np.float32), MPI.SUM)    # the node made, the fast path in
    for mine in [np.ones(5000 + (RANK == P - 1), np.float32),            # a count
                 np.ones(5000, np.float32 if RANK else np.float64)]:      # a type
        with pytest.raises(mpicoll.MismatchError) as raised:
            comm.Allreduce(MPI.IN_PLACE, mine, MPI.SUM)
        said = str(raised.value)
        everywhere(raised.value.settled and said.count("Allreduce(count=") == 2 and "algorithm=shm" in said, said)
    with pytest.raises(mpicoll.MismatchError):
        comm.Allreduce(MPI.IN_PLACE, np.ones(7, np.int32), MPI.MAX if RANK == 0 else MPI.MIN)
    x = np.full(9999, RANK + 1.0)
    comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)                             # the calls after go on, right
    everywhere(np.array_equal(x, np.full(9999, P * (P + 1) / 2)), "the call after the mismatches")


@pytest.mark.parametrize("collective", ["Bcast", "Allreduce"])
def test_ranks_that_reach_a_disagreement_apart_all_meet_the_nodes_mismatch(collective, monkeypatch):
    """A large call the communicator's fingerprint also compares (a bcast's side channel, the tags): the even ranks
    reach the node 20 ms late, while the others' waits look at the side channel every step; every rank must meet
    the node's one settled MismatchError.  (A rank that took the side channel's answer waited for messages from
    ranks that had gone on: a 60 s timeout, seen at 4 ranks in CI.)"""
    monkeypatch.setattr(node, "YIELD_SECONDS", 0.0)          # waits go to Python (and its alarms) at once
    monkeypatch.setattr(Fingerprint, "LOOK_EVERY", 0.0)
    made = node.node_of

    def late(ctx):
        if RANK % 2 == 0 and ctx.collective == collective:
            time.sleep(0.02)
        return made(ctx)
    monkeypatch.setattr(node, "node_of", late)
    for _ in range(2):
        comm = mpicoll.Communicator(WORLD, algorithm="shm")
        comm.timeout = 10
        comm.Allreduce(np.ones(4), np.empty(4))                 # the first call's full check, the node made
        n = communicator.FINGERPRINT_FROM
        data = np.ones(n + (collective == "Allreduce" and RANK == P - 1))
        with pytest.raises(mpicoll.MismatchError) as raised:
            comm.Bcast(data, root=RANK % 2) if collective == "Bcast" else comm.Allreduce(MPI.IN_PLACE, data)
        everywhere(raised.value.settled, repr(raised.value))
        comm.close()


@pytest.mark.parametrize("stores", ["cached", "streamed"])
def test_several_threads_a_rank_give_the_same_bits(stores, monkeypatch):
    """A rank with cores to spare cuts its large copies and reductions among its threads (OpenMP's): 3 threads
    (an odd count) give every collective the same bits as one, for sizes that leave one piece, two, three and an
    uneven rest, past a slot, and for 3 and 4 ranks the partial each thread keeps for itself."""
    monkeypatch.setattr(node, "THREADS", 3)
    monkeypatch.setattr(node, "STORES", stores)
    seed = shared_seed()
    comm = mpicoll.Communicator(WORLD, algorithm="shm")
    piece = node._shm.PIECE_BYTES
    for case, (name, op_name) in enumerate([("float32", "sum"), ("float16", "sum"), ("int8", "max"),
                                             ("float64", "prod")]):
        dtype, op = np.dtype(name), ops.find(op_name).mpi_op
        for n in [P * piece * k // dtype.itemsize + 11 for k in (1, 2, 3)] + [3 * node.SLOT_BYTES // dtype.itemsize + 7]:
            everyone = [contribution(np.random.default_rng([seed, case, n, q]), dtype, n) for q in range(P)]
            out = np.empty_like(everyone[RANK])
            comm.Allreduce(everyone[RANK], out, op)
            everywhere(agrees(out, in_rank_order(everyone, op), op_name), f"allreduce {name} n={n}: {out[:4]}")
            block = n // P
            scattered = np.empty(block, dtype)
            comm.Reduce_scatter_block(everyone[RANK][:P * block], scattered, op)
            expected = in_rank_order([x[:P * block] for x in everyone], op)[RANK * block:(RANK + 1) * block]
            everywhere(agrees(scattered, expected, op_name), f"reduce_scatter {name} n={n}: {scattered[:4]}")
            gathered, reference = np.empty(P * n, dtype), np.empty(P * n, dtype)
            comm.Allgather(everyone[RANK], gathered)
            WORLD.Allgather(everyone[RANK], reference)
            everywhere(gathered.tobytes() == reference.tobytes(), f"allgather {name} n={n}")
    made = comm.context().kept[node.KEY]
    everywhere(made.threads == (3 if node._shm.OPENMP else 1), f"{made.threads} threads")


def test_reduce_scatter_through_the_node_gives_numpys_reduction_in_rank_order():
    """``shm``'s reduce_scatter: each rank's block of the reduction, reduced in rank order as the allreduce is, bit
    for bit, at awkward block sizes and past a slot's share, for a few types and ops; a rank with another count
    gets the MismatchError with every other."""
    seed = shared_seed()
    comm = mpicoll.Communicator(WORLD, algorithm="shm")
    for case, (name, op_name) in enumerate([("float32", "sum"), ("float64", "max"), ("int16", "prod"),
                                             ("float16", "sum"), ("bool", "lxor")]):
        dtype, op = np.dtype(name), ops.find(op_name).mpi_op
        for n in (0, 1, 5, 1001, node.SLOT_BYTES // P // dtype.itemsize + 3):
            everyone = [contribution(np.random.default_rng([seed, case, n, q]), dtype, P * n) for q in range(P)]
            expected = in_rank_order(everyone, op)[RANK * n:(RANK + 1) * n]
            out = np.empty(n, dtype)
            comm.Reduce_scatter_block(everyone[RANK], out, op)
            everywhere(agrees(out, expected, op_name), f"{name} {op_name} n={n}: {out[:4]} != {expected[:4]}")
    with pytest.raises(mpicoll.MismatchError) as raised:
        comm.Reduce_scatter_block(np.ones(P * (4 + (RANK == 0)), np.float32), np.empty(4 + (RANK == 0), np.float32))
    said = str(raised.value)
    everywhere("Reduce_scatter_block(count=5" in said and "Reduce_scatter_block(count=4" in said, said)
    out = np.empty(3, np.float32)
    comm.Reduce_scatter_block(np.full(P * 3, 2, np.float32), out, MPI.SUM)      # the call after goes on
    everywhere(np.array_equal(out, np.full(3, 2.0 * P)), f"the call after the mismatch: {out}")


def test_allgather_and_bcast_through_the_node_give_mpis_bytes():
    """``shm``'s allgather and bcast move bytes through the node's slots: every rank's block (or the root's
    buffer) in order, against MPI's own call on the same data, at awkward sizes, past a slot, in place, from
    every root; a rank whose root or block differs gets the MismatchError with every other, and the calls after
    go on."""
    seed = shared_seed()
    comm = mpicoll.Communicator(WORLD, algorithm="shm")
    for n in (0, 1, 3, 1001, node.SLOT_BYTES // 8 + 5, 2 * node.SLOT_BYTES // 8 + 1):
        for dtype in (np.float64, np.int8):
            mine = np.random.default_rng([seed, n, RANK]).integers(-100, 100, n).astype(dtype)
            expected = np.empty(P * n, dtype)
            WORLD.Allgather(mine, expected)
            out = np.full(P * n, 7, dtype)
            comm.Allgather(mine, out)
            in_place = np.zeros(P * n, dtype)
            in_place[RANK * n:(RANK + 1) * n] = mine
            comm.Allgather(MPI.IN_PLACE, in_place)
            everywhere(np.array_equal(out, expected) and np.array_equal(in_place, expected), f"allgather n={n}")
            for root in range(P):
                buf = mine.copy()
                comm.Bcast(buf, root)
                reference = mine.copy()
                WORLD.Bcast(reference, root)
                everywhere(np.array_equal(buf, reference), f"bcast n={n} root={root}")
    everywhere(comm.context().kept[node.KEY].calls > 0, "the calls went through the node")
    with pytest.raises(mpicoll.MismatchError):
        comm.Allgather(np.ones(10 + (RANK == 0), np.uint8), np.empty(P * (10 + (RANK == 0)), np.uint8))
    if P > 1:
        with pytest.raises(mpicoll.MismatchError):
            comm.Bcast(np.ones(10, np.uint8), RANK % 2)
    buf = np.full(5, float(RANK))
    comm.Bcast(buf, P - 1)
    everywhere(np.array_equal(buf, np.full(5, P - 1.0)), "the call after the mismatches")


def test_the_window_is_unlinked_while_it_lives():
    """MPI unlinks the node's segment once every rank has mapped it: nothing is left in /dev/shm, whatever
    becomes of the ranks (a killed rank's job left MPICH's own segments, not this one)."""
    comm = mpicoll.Communicator(WORLD)
    comm.Allreduce(MPI.IN_PLACE, np.ones(100, np.float32), MPI.SUM)
    region = comm.context().shared_regions("shm").regions(1, np.uint8)[0]
    address = region.__array_interface__["data"][0]
    where = "not mapped"
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(v, 16) for v in line.split()[0].split("-"))
            if low <= address < high:
                where = line.split(maxsplit=5)[5].strip() if len(line.split()) > 5 else "anonymous"
    everywhere(where.endswith("(deleted)") or where == "anonymous" or not where.startswith("/dev/shm"),
               f"the node's window is mapped from {where}")
