"""PowerSGD (:mod:`mpicoll.collectives.powersgd`) against float64 references: exact where the rank covers the
matrix, the best rank-r approximation where warm-started steps converge, error feedback carried exactly, the
warm-up exact, the same bits on every rank, bad input refused."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll import PowerSGD
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed

pytestmark = pytest.mark.mpi


def gradients(seed: int, shapes, dtype=np.float64) -> list:
    rng = np.random.default_rng([seed, RANK])
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def exact_average(grads: list) -> list:
    return [WORLD.allreduce(g, MPI.SUM) / P for g in grads]


SHAPES = [(30, 7), (5,), (6, 2, 3), (1, 9), (40, 40)]


@pytest.mark.parametrize("algorithm", ["auto", "ring"])
def test_a_rank_that_covers_every_matrix_gives_the_exact_average(algorithm):
    """One power step from a full-rank Q spans the sum's column space: P Q^T / p is the average."""
    compressor = PowerSGD(rank=40, start_step=0, min_compression_rate=0.0, warm_start=False)
    grads = gradients(shared_seed(), SHAPES)
    want = exact_average(grads)
    compressor.allreduce(grads, algorithm=algorithm)
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(grads, want))
    everywhere(worst < 1e-9, f"{worst:.2e} from the exact average")
    everywhere(all(len(set(WORLD.allgather(g.tobytes()))) == 1 for g in grads), "ranks got different bits")


def test_empty_gradients_travel_whole_beside_compressed_ones():
    """A (0, 4) or (3, 0) gradient has nothing to factor: it passes through (it raised numpy's "cannot reshape
    array of size 0"), and the others beside it are compressed as ever."""
    compressor = PowerSGD(rank=2, start_step=0)
    grads = gradients(shared_seed(), [(0, 4), (40, 40), (3, 0)])
    compressor.allreduce(grads)
    everywhere([g.shape for g in grads] == [(0, 4), (40, 40), (3, 0)] and not compressor.compresses((0, 4))
               and compressor.compresses((40, 40)), f"{[g.shape for g in grads]}")


def test_the_first_steps_are_exact_and_then_only_the_factors_travel():
    compressor = PowerSGD(rank=2, start_step=2)
    for step in range(3):
        grads = gradients(shared_seed() + step, SHAPES)
        want = exact_average(grads)
        compressor.allreduce(grads, key="model")
        exact = all(np.allclose(g, w, rtol=0, atol=1e-12) for g, w in zip(grads, want))
        everywhere(exact == (step < 2) or P == 1, f"step {step}: exact {exact}")
    # compressed: (30, 7) -> 37*2 and (40, 40) -> 80*2; (1, 9), (6, 2, 3) would gain less than 2x: whole
    everywhere(compressor.buffers["model"].compressed == [0, 4] and
               compressor.wire_elements([s for s in SHAPES]) == 74 + 5 + 36 + 9 + 160, "what travels")


def test_warm_started_steps_converge_to_the_best_rank_r_approximation():
    """The same gradients every step (no error feedback): power iteration on the average, whose rank-2
    approximation error approaches the truncated SVD's.  The average has a rank-2 part shared by every rank over
    each rank's noise, so its second and third singular values stand apart: power iteration closes the gap as
    (s3/s2)^steps, and a plain random matrix's are so close that some seeds needed more than 30 steps (CI: error
    30.31 against the best 29.96)."""
    compressor = PowerSGD(rank=2, start_step=0, error_feedback=False)
    shared = np.random.default_rng([shared_seed(), 2])
    base = gradients(shared_seed(), [(40, 30)])[0] + 3 * shared.standard_normal((40, 2)) @ shared.standard_normal((2, 30))
    average = WORLD.allreduce(base, MPI.SUM) / P
    u, s, vt = np.linalg.svd(average)
    best = np.linalg.norm(average - (u[:, :2] * s[:2]) @ vt[:2])
    for _ in range(30):
        grad = base.copy()
        compressor.allreduce([grad])
    error = np.linalg.norm(average - grad)
    everywhere(error <= best * 1.01 + 1e-12, f"error {error:.4g} against the best rank-2 {best:.4g}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_error_feedback_carries_what_the_approximation_missed_exactly(dtype):
    """After each step the residual is this rank's gradient plus the last residual, less the approximation;
    summed over steps, what was applied plus the residuals is what was contributed."""
    compressor = PowerSGD(rank=1, start_step=1)
    contributed = applied = 0.0
    for step in range(4):
        grads = gradients(shared_seed() + step, [(20, 10), (3,)], dtype)
        before = compressor.buffers["k"].residuals.get(0, np.zeros((20, 10), dtype)).copy() \
            if "k" in compressor.buffers else np.zeros((20, 10), dtype)
        mine = grads[0].copy()
        compressor.allreduce(grads, key="k")
        if step >= 1:
            residual = compressor.buffers["k"].residuals[0]
            tolerance = 1e-12 if dtype == np.float64 else 1e-5
            everywhere(np.allclose(residual, (mine + before) - grads[0], rtol=0, atol=tolerance),
                       f"step {step}: residual not carried")
        contributed += WORLD.allreduce(mine, MPI.SUM) / P
        applied += grads[0]
    total = applied + WORLD.allreduce(compressor.buffers["k"].residuals[0], MPI.SUM) / P
    everywhere(np.allclose(total, contributed, atol=1e-9 if dtype == np.float64 else 1e-4),
               "applied plus residuals is not what was contributed")


def test_a_started_call_gives_the_blocking_ones_bits():
    a, b = PowerSGD(rank=2, start_step=0), PowerSGD(rank=2, start_step=0)
    grads = gradients(shared_seed(), SHAPES, np.float32)
    copies = [g.copy() for g in grads]
    request = a.start(grads, key=0)
    b.allreduce(copies, key=0)
    request.wait()
    everywhere(all(np.array_equal(g, c) for g, c in zip(grads, copies)), "started differs from blocking")


def test_bad_input_is_refused_in_one_line():
    compressor = PowerSGD()
    for grads, words in [([np.ones((4, 4), np.float32), np.ones(3)], "one dtype"),
                         ([np.ones((4, 4), np.int32)], "float32 or float64"),
                         ([np.ones((4, 8))[:, :4]], "C-contiguous"), ([], "no gradients")]:
        with pytest.raises((TypeError, ValueError), match=words):
            compressor.allreduce(grads)
    compressor.allreduce([np.ones((4, 4))], key="a")
    with pytest.raises(ValueError, match="own key"):
        compressor.allreduce([np.ones((4, 5))], key="a")
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=0)


def test_a_saved_and_loaded_state_goes_on_as_if_never_stopped(tmp_path_factory):
    """Steps past the warm-up, the state (step counts, Q factors, residuals of two keys) saved and loaded into a
    new PowerSGD: its next steps give the first one's bits; a PowerSGD of other settings refuses it."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("state")) if RANK == 0 else None)
    rng = np.random.default_rng([shared_seed(), RANK])
    shapes = {"a": [(40, 30), (30,), (3, 4, 5)], 3: [(64, 8)]}

    def step():
        return {key: [rng.standard_normal(shape) for shape in kinds] for key, kinds in shapes.items()}

    kept, saved = PowerSGD(rank=2, start_step=2), f"{folder}/rank{RANK}.npz"
    for _ in range(4):
        for key, gradients in step().items():
            kept.allreduce(gradients, key=key)
    np.savez(saved, **kept.state_dict())
    again = PowerSGD(rank=2, start_step=2)
    again.load_state_dict(dict(np.load(saved)))
    for _ in range(3):
        for key, gradients in step().items():
            mine = kept.allreduce([g.copy() for g in gradients], key=key)
            theirs = again.allreduce(gradients, key=key)
            everywhere(all(np.array_equal(m, t) for m, t in zip(mine, theirs)), f"{key}: the loaded state went another way")
    with pytest.raises(ValueError, match=r"the saved state is of PowerSGD\(rank=2, .*not of PowerSGD\(rank=1"):
        PowerSGD(rank=1, start_step=2).load_state_dict(kept.state_dict())
