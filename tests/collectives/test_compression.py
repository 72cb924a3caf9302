"""Compressed allreduce (``compression="fp16"`` or ``"bf16"``, :mod:`mpicoll.collectives.compression`): within the
documented error of the exact sum (float64, from MPI's own allreduce) on every rank, the same bits on every rank,
for awkward sizes and every algorithm; error feedback's residual carried exactly; refusals in one line."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.collectives.algorithms import direct, hierarchical
from mpicoll.collectives.compression import Compression
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def pieces_at_test_sizes(monkeypatch):
    """hierarchical's own phases (across nodes: its node sums rounded at their owners) at every test size, and
    the owners' exchange in several pieces of uneven counts (4099 words) from a few thousand elements."""
    monkeypatch.setattr(hierarchical, "ACROSS_NODES_FROM", dict.fromkeys(hierarchical.ACROSS_NODES_FROM, 0))
    monkeypatch.setattr(direct, "PIECE_ELEMENTS", 4099)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("count", [0, 1, max(P - 1, 1), 1003, 100_003])
@pytest.mark.parametrize("algorithm", ["ring", "auto", "mpi", "hierarchical", "direct"])
def test_a_compressed_sum_is_within_the_documented_bound_and_the_same_on_every_rank(kind, count, algorithm):
    rng = np.random.default_rng([shared_seed(), RANK, count])
    x = (rng.standard_normal(count) * rng.choice([1e-3, 1.0, 300.0], count)).astype(np.float32)
    exact = WORLD.allreduce(x.astype(np.float64), MPI.SUM)
    magnitude = WORLD.allreduce(np.abs(x.astype(np.float64)), MPI.SUM)
    result = mpicoll.allreduce(x, compression=kind, algorithm=algorithm)
    bound = Compression(kind).bound(P, magnitude)
    worst = float(np.max(np.abs(result - exact) / np.maximum(bound, 1e-300))) if count else 0.0
    everywhere(result.dtype == np.float32 and result.shape == x.shape and worst <= 1.0,
               f"{kind} {algorithm} {count}: error {worst:.3g} of the bound")
    everywhere(len(set(WORLD.allgather(result.tobytes()))) == 1, "ranks got different bits")


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_an_average_in_float64_into_out(kind):
    x = np.random.default_rng([shared_seed(), RANK]).standard_normal((7, 13))
    out = np.empty_like(x)
    result = mpicoll.allreduce(x, op="average", compression=kind, out=out)
    exact = WORLD.allreduce(x, MPI.SUM) / P
    magnitude = WORLD.allreduce(np.abs(x), MPI.SUM) / P
    everywhere(result is out and out.dtype == np.float64 and
               bool(np.all(np.abs(out - exact) <= Compression(kind).bound(P, magnitude))),
               f"{kind} average off the bound")


@pytest.mark.parametrize("kind, dtype", [("fp16", np.float64), ("bf16", np.float64), ("fp16", np.float32)])
def test_error_feedback_carries_each_buffers_residual_exactly(kind, dtype):
    """Per key: the residual after a call is the contribution plus the residual before, less what was sent;
    over steps, what was sent plus the last residual is what was contributed.  float32 contributions of 64Ki
    elements and more take mpicoll.compute's float16 loops."""
    compression = Compression(kind, error_feedback=True)
    rng = np.random.default_rng([shared_seed(), RANK])
    contributed, sent = {"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 0.0}
    for step in range(5):
        for key, size in (("a", 70_000), ("b", 10)):
            x = rng.standard_normal(size).astype(dtype)
            before = compression.residuals.get(key, np.zeros(size, dtype)).copy()       # updated in place
            q = compression.decompress(compression.compress(x, key), np.empty(size, dtype))
            everywhere(np.array_equal(compression.residuals[key], (x + before) - q),
                       f"step {step} {key}: residual not carried exactly")
            contributed[key] = contributed[key] + x
            sent[key] = sent[key] + q
    for key in ("a", "b"):
        everywhere(np.allclose(sent[key] + compression.residuals[key], contributed[key], rtol=0,
                               atol=1e-12 if dtype == np.float64 else 1e-5),
                   f"{key}: sent + residual != contributed")
        mpicoll.allreduce(np.ones(3), compression=compression, key="c")      # a new key starts from nothing
    with pytest.raises(ValueError, match="give each buffer its own key"):
        compression.compress(np.ones(4, dtype), "a")


@pytest.mark.parametrize("algorithm", ["direct", "hierarchical", "ring"])
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_error_feedback_through_owners_that_round_the_sums_loses_no_rounding(algorithm, kind):
    """direct and hierarchical (between nodes, or among all ranks on one node) sum each chunk's rounded
    contributions at its owner in full precision and round once more, keeping that rounding in the owner's
    residual: over 6 steps of float64 contributions, the sums delivered plus every rank's last residual are
    the sums contributed, to float64's precision.  The ring rounds every partial sum on its way and keeps none
    of those roundings: off by far more (from 3 ranks; at 2 its one partial sum is the final one)."""
    carried = algorithm != "ring"
    if not carried and P < 3:
        pytest.skip("the partial sums' rounding shows from 3 ranks on")
    compression = Compression(kind, error_feedback=True)
    rng = np.random.default_rng([shared_seed(), RANK])
    delivered, contributed = np.zeros(5003), np.zeros(5003)
    for _ in range(6):
        x = rng.standard_normal(5003) * rng.choice([1e-3, 1.0, 300.0], 5003)
        delivered += mpicoll.allreduce(x, compression=compression, key="g", algorithm=algorithm)
        contributed += WORLD.allreduce(x, MPI.SUM)
    lost = np.abs(delivered + WORLD.allreduce(compression.residuals["g"], MPI.SUM) - contributed)
    scale = np.abs(contributed) + 1
    worst = float(np.max(lost / scale))
    if carried:
        everywhere(worst < 1e-12, f"{algorithm}: {worst:.3g} of the sums lost, beyond float64's rounding")
    else:
        everywhere(worst > 1e-6, f"{algorithm}: {worst:.3g}: the partial sums' rounding was expected to show")


def test_what_cannot_compress_is_refused_in_one_line():
    with pytest.raises(TypeError, match="float32 or float64"):
        mpicoll.allreduce(np.ones(4, np.int32), compression="fp16")
    with pytest.raises(ValueError, match="only sums and averages"):
        mpicoll.allreduce(np.ones(4), op="max", compression="bf16")
    with pytest.raises(ValueError, match="compression must be one of fp16, bf16"):
        mpicoll.allreduce(np.ones(4), compression="fp8")
    with pytest.raises(OverflowError, match="use bf16"):
        mpicoll.allreduce(np.full(4, 40000.0), compression="fp16") if P > 1 else \
            mpicoll.allreduce(np.full(4, 70000.0), compression="fp16")
    summed = mpicoll.allreduce(np.full(4, 40000.0), compression="bf16")
    everywhere(bool(np.all(np.abs(summed - 40000.0 * P) <= 40000.0 * P * 2 * 2.0 ** -8)), "bf16 lost the range")


def outcome(call):
    """What a call gave: its result, or its error's type and text (what every rank can compare)."""
    try:
        return call()
    except Exception as error:          # (the test compares what each rank met)
        return f"{type(error).__name__}: {error}"


def alike_everywhere(got) -> bool:
    """Whether every rank met the same outcome: the same bits, or the same error."""
    return len(set(WORLD.allgather(got if isinstance(got, str) else got.tobytes()))) == 1


@pytest.mark.parametrize("count", [100, 1 << 20])
@pytest.mark.parametrize("algorithm", ["auto", "ring", "direct"])
@pytest.mark.parametrize("started", [False, True])
def test_a_nan_or_inf_in_one_ranks_input_gives_every_rank_the_same_outcome(count, algorithm, started):
    """A NaN or inf in rank 0's input only: every rank gets NaN or inf there, as the uncompressed sum, and no
    error (rank 0 returned inf while the others raised 'the sum overflowed'); a sum that does overflow raises the
    same OverflowError on every rank, naming the elements, and the NaN from an input as such."""
    def call(x):
        if started:
            return mpicoll.iallreduce(x, compression="fp16", algorithm=algorithm).wait()
        return mpicoll.allreduce(x, compression="fp16", algorithm=algorithm)

    failures = []
    for bad in (np.inf, -np.inf, np.nan):
        x = np.ones(count, np.float32)
        if RANK == 0:
            x[3] = bad
        got = outcome(lambda: call(x))
        want = np.full(count, float(P), np.float32)
        want[3] = bad
        if not alike_everywhere(got) or isinstance(got, str) or not np.array_equal(got, want, equal_nan=True):
            failures.append(f"{bad}: {got if isinstance(got, str) else got[:6]}")
    x = np.ones(count, np.float32)
    x[5] = 40000.0 if P > 1 else 70000.0          # overflows float16 once summed (alone: once rounded)
    if RANK == 0:
        x[3] = np.nan
    said = outcome(lambda: call(x))
    if not alike_everywhere(said) or not isinstance(said, str) or not said.startswith(
            "OverflowError: compression fp16: the sum overflowed the 16-bit type at 1 element(s) (the first at "
            "index 5), on every rank; 1 other element(s) are NaN or inf because an input was"):
        failures.append(f"overflow: {said if isinstance(said, str) else said[:6]}")
    everywhere(not failures, f"{algorithm} {count}: {failures}")


def test_error_feedback_goes_on_after_a_call_that_overflowed():
    """A contribution past float16's 65504 is refused on every rank, and the residual is dropped at that element:
    the next calls of the same buffer sum as ever (the residual kept what could not be sent, -inf, and every
    later call raised OverflowError)."""
    compression = Compression("fp16", error_feedback=True)
    x = np.ones(10, np.float32)
    if RANK == 0:
        x[1] = 70000.0
    first = outcome(lambda: mpicoll.allreduce(x, compression=compression, key="w"))
    later = [outcome(lambda: mpicoll.allreduce(np.full(10, 0.5, np.float32), compression=compression, key="w"))
             for _ in range(2)]
    residual = compression.residuals["w"]
    everywhere(isinstance(first, str) and first.startswith("OverflowError") and "residual was dropped" in first
               and all(not isinstance(got, str) and np.array_equal(got, np.full(10, 0.5 * P)) for got in later)
               and bool(np.all(np.isfinite(residual))), f"{first}; then {later}; residual {residual}")


def test_a_started_compressed_allreduce_gives_the_blocking_ones_bits():
    """iallreduce(compression=...): x is taken when started (it may change at once), the sum given when waited for."""
    compression = Compression("fp16", error_feedback=True)
    again = Compression("fp16", error_feedback=True)
    x = np.random.default_rng([shared_seed(), RANK]).standard_normal(5001).astype(np.float32)
    started = mpicoll.iallreduce(x, "average", compression=compression, key="g")
    blocking = mpicoll.allreduce(x.copy(), "average", compression=again, key="g")
    x[:] = np.nan                               # the started call rounded x already
    result = started.wait()
    everywhere(np.array_equal(result, blocking) and np.array_equal(compression.residuals["g"], again.residuals["g"]),
               "a started compressed call differs from the blocking one")


@pytest.mark.parametrize("count", [0, 1, max(P - 1, 1), 1003, 100_003])
@pytest.mark.parametrize("algorithm", ["ring", "auto", "mpi"])
def test_bfloat16_arrays_sum_within_the_bound_and_move_their_bits(count, algorithm):
    """bfloat16 arrays (ml_dtypes'; MPI has no such type): sums and averages move the 16-bit words with float32
    additions (the compressed sum's bound, the same bits everywhere), min and max are exact, allgather and
    broadcast move the bits; in place, into out, and reduce_scatter too."""
    bf16 = Compression("bf16").dtype
    rng = np.random.default_rng([shared_seed(), RANK, count])
    x = (rng.standard_normal(count) * 10).astype(bf16)
    wide = x.astype(np.float64)
    exact, magnitude = WORLD.allreduce(wide, MPI.SUM), WORLD.allreduce(np.abs(wide), MPI.SUM)
    bound = Compression("bf16").bound(P, magnitude)
    total = mpicoll.allreduce(x, algorithm=algorithm)
    average = mpicoll.allreduce(x, "average", algorithm=algorithm)
    in_place = x.copy()
    mpicoll.allreduce(in_place, algorithm=algorithm, out=in_place)
    largest = mpicoll.allreduce(x, "max", algorithm=algorithm)
    everywhere(total.dtype == bf16 and bool(np.all(np.abs(total.astype(np.float64) - exact) <= bound))
               and bool(np.all(np.abs(average.astype(np.float64) - exact / P) <= bound / P + np.abs(exact / P) / 128))
               and np.array_equal(in_place, total) and np.array_equal(largest, np.maximum.reduce(WORLD.allgather(x))),
               f"bfloat16 {algorithm} {count}")
    everywhere(len(set(WORLD.allgather(total.tobytes()))) == 1, "ranks got different bits")
    gathered = mpicoll.allgather(x, algorithm=algorithm)
    out = np.zeros((P * count, 2), bf16)[:, 0]                # not contiguous: written through a copy
    mpicoll.allgather(x, algorithm=algorithm, out=out)
    root = P - 1
    sent = mpicoll.broadcast(x, root, algorithm=algorithm)
    everywhere(np.array_equal(gathered.view(np.uint16), np.concatenate(WORLD.allgather(x)).view(np.uint16))
               and np.array_equal(out, gathered)
               and np.array_equal(sent.view(np.uint16), WORLD.bcast(x, root).view(np.uint16)), "bfloat16 bits moved")
    rows = (rng.standard_normal(P * 3) * 10).astype(bf16)
    share = mpicoll.reduce_scatter(rows, algorithm=algorithm)
    expected = WORLD.allreduce(rows.astype(np.float64), MPI.SUM)[RANK * 3:(RANK + 1) * 3]
    everywhere(share.dtype == bf16 and bool(np.all(np.abs(share.astype(np.float64) - expected) <= Compression(
        "bf16").bound(P, WORLD.allreduce(np.abs(rows.astype(np.float64)), MPI.SUM)[RANK * 3:(RANK + 1) * 3]))),
        "bfloat16 reduce_scatter")


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_saved_and_loaded_state_goes_on_as_if_never_stopped(kind, tmp_path_factory):
    """Three steps, the state saved (np.savez) and loaded into a new Compression: its next steps give the bits
    the first one's give; a state of other settings or an unsavable key is refused in one line."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("state")) if RANK == 0 else None)
    rng = np.random.default_rng([shared_seed(), RANK])
    steps = [{key: rng.standard_normal(size) for key, size in ((("layer", 1), 1003), (7, 5))} for _ in range(5)]
    kept, saved = Compression(kind, error_feedback=True), f"{folder}/rank{RANK}.npz"
    for step in steps[:3]:
        for key, x in step.items():
            mpicoll.allreduce(x, compression=kept, key=key)
    np.savez(saved, **kept.state_dict())
    again = Compression(kind, error_feedback=True)
    again.load_state_dict(dict(np.load(saved)))
    for step in steps[3:]:
        for key, x in step.items():
            mine, theirs = (mpicoll.allreduce(x, compression=c, key=key) for c in (kept, again))
            everywhere(np.array_equal(mine, theirs) and np.array_equal(kept.residuals[key], again.residuals[key]),
                       f"{key}: the loaded state went another way")
    with pytest.raises(ValueError, match=r"the saved state is of Compression\('.*', error_feedback=True\), not of"):
        Compression("bf16" if kind == "fp16" else "fp16", error_feedback=True).load_state_dict(kept.state_dict())
    mpicoll.allreduce(np.ones(2), compression=kept, key=object())
    with pytest.raises(TypeError, match="cannot be saved: use str, int or tuple keys"):
        kept.state_dict()
