"""What torch's ecosystem sends the "mpicoll" backend, at the semantics of gloo's and NCCL's: FSDP2's in-place
all-gather and reduce-scatter, NCCL's integer AVG (Lightning's counters), NaN through MIN and MAX whichever rank
holds it, PREMUL_SUM reduce, any-source recv, all_gather_coalesced, sparse all_reduce, and argument errors (a root
outside the group, split sizes that disagree) raised on every rank with the group still usable; each against
numpy or float64 on the same data, at 1 to 4 ranks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
import torch.distributed as dist  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.torch  # noqa: E402,F401  (registers the backend)
from tests.support.mpi import P, RANK, everywhere, shared_seed  # noqa: E402

pytestmark = pytest.mark.mpi

# torch's newer names where it has them (all_gather_single, reduce_scatter_single), else the older
GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# from MPI's own calls (auto's small ones) to mpicoll's algorithms (2 MiB of float32 and over)
SIZES = [0, 1, P + 1, 1001, (1 << 19) + 3]


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("mpicoll")
    yield
    dist.destroy_process_group()


def the_group_goes_on() -> bool:
    """Whether the default group still reduces rightly (after an error it should have survived)."""
    t = torch.full((3,), float(RANK + 1))
    dist.all_reduce(t)
    return bool(torch.equal(t, torch.full((3,), P * (P + 1) / 2)))


@pytest.mark.parametrize("n", [0, 1, 7, 1000, (1 << 17) + 1])
def test_all_gather_into_tensor_in_place_as_fsdp2_calls_it(n):
    """The input is this rank's block of the output (FSDP2's parameter all-gather); and an input that overlaps the
    output elsewhere is read before anything is written."""
    rng = np.random.default_rng([shared_seed(), n])
    data = torch.from_numpy(rng.standard_normal((P, n)))
    output = torch.zeros(P * n, dtype=torch.float64)
    output[RANK * n:(RANK + 1) * n] = data[RANK]
    GATHER_INTO_TENSOR(output, output[RANK * n:(RANK + 1) * n])
    problems = [] if torch.equal(output, data.reshape(-1)) else ["in place"]
    if n:
        shifted = torch.zeros(P * n + 1, dtype=torch.float64)
        shifted[1:n + 1] = data[RANK]               # the input at the output's start, shifted by one element
        GATHER_INTO_TENSOR(shifted[:P * n], shifted[1:n + 1])
        if not torch.equal(shifted[:P * n], data.reshape(-1)):
            problems.append("overlapping")
    everywhere(not problems, f"n={n}: {problems}")


@pytest.mark.parametrize("n", [0, 1, 7, 1000, (1 << 19) + 1])
def test_reduce_scatter_tensor_in_place_as_fsdp2_calls_it(n):
    """The output is this rank's block of the input (FSDP2's gradient reduce-scatter): it gets the sum of that
    block, and the input's other blocks are left as they were."""
    rng = np.random.default_rng([shared_seed(), n])
    data = torch.from_numpy(rng.integers(-8, 8, (P, P * n)).astype(np.float64))
    mine = data[RANK].clone()
    for op, want in ((dist.ReduceOp.SUM, data.sum(0)), (dist.ReduceOp.AVG, data.sum(0) / P)):
        block = mine.clone()
        REDUCE_SCATTER_TENSOR(block[RANK * n:(RANK + 1) * n], block, op=op)
        expected = mine.clone()
        expected[RANK * n:(RANK + 1) * n] = want[RANK * n:(RANK + 1) * n]
        everywhere(torch.equal(block, expected), f"{op} n={n}: {block[:4].tolist()}")


def test_integer_avg_is_nccls_the_sum_divided_toward_zero():
    """Lightning sends AVG of an int64 counter to every backend not named gloo (NCCL takes it: its sum, then C's
    integer division); gloo refuses it.  Against float64 on random signed and unsigned values."""
    rng = np.random.default_rng(shared_seed())
    problems = []
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        for n in SIZES[:4]:
            high = 100 if dtype not in (torch.int8, torch.uint8) else 120 // P   # no sum overflows the type
            data = rng.integers(0 if dtype == torch.uint8 else -high, high + 1, (P, n))
            t = torch.from_numpy(data[RANK].copy()).to(dtype)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            want = np.trunc(data.sum(0) / P).astype(np.int64)
            if t.dtype != dtype or not np.array_equal(t.numpy().astype(np.int64), want):
                problems.append(f"{dtype} n={n}: {t[:4].tolist()} want {want[:4].tolist()}")
    everywhere(not problems, str(problems[:4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_min_and_max_keep_a_nan_whichever_rank_holds_it(dtype):
    """MPI's own MIN and MAX (auto's small calls) drop a NaN or keep it by the rank holding it; mpicoll's
    algorithms (large calls) and gloo keep it.  Every rank holding it in turn, small and large tensors; the
    other elements are numpy's min and max."""
    rng = np.random.default_rng(shared_seed())
    problems = []
    for holder in range(P):
        for n in (3, 1001, (1 << 19) + 3):
            data = rng.integers(-8, 8, (P, n)).astype(np.float64)
            data[holder, 1] = np.nan
            for op, ufunc in ((dist.ReduceOp.MIN, np.minimum), (dist.ReduceOp.MAX, np.maximum)):
                t = torch.from_numpy(data[RANK].copy()).to(dtype)
                dist.all_reduce(t, op=op)
                want = ufunc.reduce(data, axis=0)
                got = t.double().numpy()
                if not np.array_equal(got, want, equal_nan=True):
                    problems.append(f"{op} NaN on rank {holder} n={n}: {got[:3].tolist()} want {want[:3].tolist()}")
    everywhere(not problems, str(problems[:4]))


def test_premul_sum_reduce_scales_the_sum_and_leaves_other_ranks_inputs():
    rng = np.random.default_rng(shared_seed())
    data = torch.from_numpy(rng.integers(-8, 8, (P, 33)).astype(np.float64))
    factor = 0.5
    for root in range(P):
        t = data[RANK].clone()
        dist.reduce(t, root, op=dist._make_nccl_premul_sum(factor))
        want = data.sum(0) * factor if RANK == root else data[RANK]
        everywhere(torch.equal(t, want), f"root {root}: rank {RANK} has {t[:3].tolist()}, want {want[:3].tolist()}")


def test_recv_from_any_source_names_the_sender():
    """Rank 0 takes one message from each other rank, in whichever order they come (torch's recv without src,
    and irecv's Work's _source_rank)."""
    if P == 1:
        return
    if RANK == 0:
        senders = []
        for _ in range(P - 1):
            t = torch.empty(3)
            sender = dist.recv(t)
            senders.append(sender)
            if not torch.equal(t, torch.full((3,), float(sender))):
                senders.append(f"from {sender}: {t.tolist()}")
        work = dist.irecv(t := torch.empty(3), tag=7)
        work.wait()
        senders.append(("irecv", work._source_rank(), t[0].item()))
        ok = sorted(senders[:P - 1]) == list(range(1, P)) and senders[-1] == ("irecv", 1, 10.0)
        everywhere(ok, f"rank 0 got {senders}")
    else:
        dist.send(torch.full((3,), float(RANK)), 0)
        if RANK == 1:
            dist.send(torch.full((3,), 10.0), 0, tag=7)
        everywhere(True, "")


def test_all_gather_coalesced_is_an_all_gather_per_tensor():
    rng = np.random.default_rng(shared_seed())
    shapes = [(3,), (2, 2), (0,), (5,)]
    data = [torch.from_numpy(rng.standard_normal((P, *shape))) for shape in shapes]
    outputs = [[torch.empty(shape, dtype=torch.float64) for shape in shapes] for _ in range(P)]   # [rank][tensor]
    dist.all_gather_coalesced(outputs, [d[RANK].clone() for d in data])
    ok = all(torch.equal(torch.stack([outputs[r][i] for r in range(P)]), d) for i, d in enumerate(data))
    everywhere(ok, "all_gather_coalesced differs from every rank's tensors")


@pytest.mark.parametrize("dense_dims", [0, 1, 2])
def test_sparse_all_reduce_is_the_sum(dense_dims):
    """COO tensors whose indices overlap across ranks, some ranks with none; against the dense sum."""
    rng = np.random.default_rng([shared_seed(), dense_dims])
    shape = (6, 4) + (3,) * dense_dims
    dense = torch.from_numpy(rng.integers(-3, 4, (P, *shape)).astype(np.float32))
    dense *= torch.from_numpy(rng.random((P, 6, 4)) < 0.3).reshape(P, 6, 4, *([1] * dense_dims))
    if P > 1:
        dense[1] = 0                                 # a rank with no entries
    t = dense[RANK].to_sparse(2)
    dist.all_reduce(t)
    everywhere(t.is_sparse and torch.equal(t.to_dense(), dense.sum(0)), f"{t.to_dense().flatten()[:6].tolist()}")


def test_a_root_outside_the_group_is_refused_at_the_call_and_the_group_goes_on():
    problems = []
    for name, call in [("broadcast", lambda: dist.broadcast(torch.ones(2), P + 5)),
                       ("reduce", lambda: dist.reduce(torch.ones(2), P + 5)),
                       ("broadcast -1", lambda: dist.distributed_c10d._get_default_group().broadcast(
                           [torch.ones(2)], _root(-1)))]:
        try:
            call()
            problems.append(f"{name}: no error")
        except (mpicoll.RootError, ValueError) as error:
            if "not a rank of this group" not in str(error) and "not part of group" not in str(error):
                problems.append(f"{name}: {error}")
    everywhere(not problems and the_group_goes_on(), str(problems))


def _root(rank: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts


def test_split_sizes_that_disagree_are_a_mismatch_on_every_rank_and_the_group_goes_on():
    """Rank 0 says it sends one row more to the last rank than that rank says it receives: every rank gets a
    MismatchError naming each rank's counts (it gave no error and left part of the output stale), and the
    group's next calls run."""
    if P == 1:
        return
    sends = [1] * P
    receives = [1] * P
    if RANK == 0:
        sends[P - 1] = 2
    out = torch.full((sum(receives), 2), -1.0)
    try:
        dist.all_to_all_single(out, torch.ones((sum(sends), 2)), output_split_sizes=receives,
                               input_split_sizes=sends)
        said = "no error"
    except mpicoll.MismatchError as error:
        said = str(error)
    ok = "all_to_all_single" in said and "sends [2" in said
    everywhere(ok and the_group_goes_on(), f"rank {RANK}: {said}")
