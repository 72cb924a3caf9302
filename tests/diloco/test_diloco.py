"""DiLoCo's outer loop (mpicoll.diloco) at every rank count against a single-process simulation of the same
algorithm in float64, written here from the papers' description (all replicas in one loop, the average by
numpy): plain, streaming (fragments, overlap, mixing), local SGD, both inner optimizers; a resumed run equal
to the bit to an uninterrupted one; compressed pseudo-gradients within their rounding; bad options refused."""

from __future__ import annotations

import numpy as np
import pytest

from mpicoll.diloco import SGD, AdamW, DiLoCo, fragments_of, local_sgd
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed

pytestmark = pytest.mark.mpi

SHAPES = [(7,), (3, 5), (1,), (4, 2)]          # awkward sizes; fragments of whole arrays


def problem(seed: int, replica: int):
    """Replica ``replica``'s least-squares loss 0.5 |A x - b|^2 over the arrays of SHAPES (its gradient)."""
    rng = np.random.default_rng([seed, replica])
    n = sum(int(np.prod(s)) for s in SHAPES)
    A, b = rng.standard_normal((n + 3, n)) / np.sqrt(n), rng.standard_normal(n + 3)

    def gradient(params):
        x = np.concatenate([p.ravel() for p in params])
        g = A.T @ (A @ x - b)
        out, at = [], 0
        for p in params:
            out.append(g[at:at + p.size].reshape(p.shape))
            at += p.size
        return out
    return gradient


def start(seed: int):
    rng = np.random.default_rng([seed, 10 ** 6])
    return [rng.standard_normal(s) for s in SHAPES]


def inner_optimizer(kind: str):
    return SGD(0.05, momentum=0.9) if kind == "sgd" else AdamW(0.01, weight_decay=0.01)


def simulated(seed: int, replicas: int, steps: int, inner: str, H: int, outer_lr: float, momentum: float,
              nesterov: bool, fragments: int, overlap: int, mix: float) -> list:
    """Every replica in one process, in the order of the papers: inner steps; fragment f meets at steps t with t
    mod H = f H / F; its average pseudo-gradient (anchor - replica) goes through an outer SGD step, applied
    ``overlap`` steps later, each replica's fragment then mix x its own + (1 - mix) x the anchor; at the end
    the fragments in flight are applied and the others meet once more."""
    grads = [problem(seed, r) for r in range(replicas)]
    params = [start(seed) for _ in range(replicas)]
    optimizers = [inner_optimizer(inner) for _ in range(replicas)]
    anchor = start(seed)
    cuts = fragments_of([int(np.prod(s)) for s in SHAPES], fragments)
    velocity = [[np.zeros(SHAPES[i]) for i in cut] for cut in cuts]
    pending, last = [], [0] * fragments

    def apply(f, average):
        for j, i in enumerate(cuts[f]):
            g = average[j]
            if momentum:
                velocity[f][j] = momentum * velocity[f][j] + g
                d = g + momentum * velocity[f][j] if nesterov else velocity[f][j]
            else:
                d = g
            anchor[i] = anchor[i] - outer_lr * d
            for r in range(replicas):
                params[r][i] = mix * params[r][i] + (1 - mix) * anchor[i]

    def meet(f, due, t):
        average = [np.mean([anchor[i] - params[r][i] for r in range(replicas)], axis=0) for i in cuts[f]]
        pending.append((due, f, average))
        last[f] = t

    def apply_due(t):
        for item in [p for p in pending if p[0] <= t]:
            pending.remove(item)
            apply(item[1], item[2])

    for t in range(1, steps + 1):
        for r in range(replicas):
            optimizers[r].step(params[r], grads[r](params[r]))
        apply_due(t)
        for f in range(fragments):
            offset = f * H // fragments
            if t % H == offset % H and t >= max(offset, 1):
                meet(f, t + overlap, t)
        apply_due(t)
    for item in list(pending):
        pending.remove(item)
        apply(item[1], item[2])
    for f in range(fragments):
        if last[f] < steps:
            meet(f, steps, steps)
    apply_due(steps)
    return anchor


def distributed(seed, steps, inner, stop_at=None, **options):
    """This rank's replica through DiLoCo over COMM_WORLD; with ``stop_at``, saved after that many steps and
    continued from the saved state by fresh objects (a resumed run)."""
    gradient = problem(seed, RANK)
    params, optimizer = start(seed), inner_optimizer(inner)
    outer = DiLoCo(params, **options)
    for t in range(steps):
        if t == stop_at:
            saved = ({k: v.copy() for k, v in outer.state_dict().items()}, optimizer.state_dict(),
                     [p.copy() for p in params])
            params, optimizer = [p.copy() for p in saved[2]], inner_optimizer(inner)
            outer = DiLoCo(params, **options)
            outer.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
        optimizer.step(params, gradient(params))
        outer.step()
    outer.finish()
    return params, outer


CASES = [  # (inner, H, outer lr, momentum, nesterov, fragments, overlap, mix)
    ("sgd", 4, 0.7, 0.9, True, 1, 0, 0.0),          # DiLoCo
    ("adamw", 5, 0.7, 0.9, True, 1, 0, 0.0),        # DiLoCo with its transformers' inner optimizer
    ("sgd", 4, 1.0, 0.0, False, 1, 0, 0.0),         # local SGD
    ("sgd", 6, 0.5, 0.8, False, 3, 0, 0.0),         # streaming, plain momentum
    ("adamw", 4, 0.7, 0.9, True, 2, 1, 0.3),        # streaming, overlapped, mixed (0.3: not its own 1 - mix)
    ("sgd", 3, 0.7, 0.9, True, 4, 2, 0.0),          # a fragment per array, overlapped
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-H{c[1]}-F{c[5]}-tau{c[6]}-mix{c[7]}" for c in CASES])
def test_every_replica_ends_where_the_single_process_simulation_does(case):
    inner, H, lr, momentum, nesterov, fragments, overlap, mix = case
    seed, steps = shared_seed(), 13                      # 13: not a multiple of any H, so finish() meets too
    params, outer = distributed(seed, steps, inner, sync_every=H, outer_lr=lr, outer_momentum=momentum,
                                nesterov=nesterov, fragments=fragments, overlap=overlap, mix=mix)
    expected = simulated(seed, P, steps, inner, H, lr, momentum, nesterov, fragments, overlap, mix)
    worst = max(float(np.max(np.abs(p - e))) for p, e in zip(params, expected))
    everywhere(worst < 1e-12, f"{case}: off the simulation by {worst:.3g}")
    bits = WORLD.allgather(b"".join(p.tobytes() for p in params))
    everywhere(len(set(bits)) == 1, "the replicas end on different bits")
    scheduled = [[t for t in range(1, steps + 1) if t % H == (f * H // fragments) % H] for f in range(fragments)]
    expected_meetings = sum(len(ts) + (not ts or ts[-1] < steps) for ts in scheduled)   # + finish()'s
    everywhere(outer.meetings == expected_meetings, f"{outer.meetings} meetings, not {expected_meetings}")


def test_local_sgd_replaces_the_replicas_by_their_average():
    """After a meeting of local SGD every replica holds the mean of the replicas' weights before it."""
    seed = shared_seed()
    gradient, params = problem(seed, RANK), start(seed)
    optimizer = SGD(0.05)
    outer = local_sgd(params, sync_every=3)
    for t in range(3):
        optimizer.step(params, gradient(params))
        if t == 2:
            before = [np.mean(WORLD.allgather(p), axis=0) for p in params]
        outer.step()
    worst = max(float(np.max(np.abs(p - b))) for p, b in zip(params, before))
    everywhere(worst < 1e-13, f"off the average by {worst:.3g}")


@pytest.mark.parametrize("options", [dict(fragments=1, overlap=0), dict(fragments=3, overlap=2, mix=0.3)],
                         ids=["plain", "streaming"])
def test_a_resumed_run_is_the_uninterrupted_one_to_the_bit(options):
    """Saved after 9 steps (meetings in flight with overlap 2) and continued by fresh objects from the saved
    state: the same bits as the run that never stopped, compressed with error feedback as well."""
    seed = shared_seed()
    for compression in (None, "bf16", "int8"):
        kwargs = dict(sync_every=4, compression=compression, **options)
        whole, _ = distributed(seed, 15, "adamw", **kwargs)
        resumed, _ = distributed(seed, 15, "adamw", stop_at=9, **kwargs)
        everywhere(all(np.array_equal(a, b) for a, b in zip(whole, resumed)), f"{compression}: resumed differs")


@pytest.mark.parametrize("compression, width, within", [("bf16", 2, 0.05), ("int8", 1, 0.1)])
def test_compressed_pseudo_gradients_stay_within_their_rounding(compression, width, within):
    """bf16 (8 bits of mantissa) and int8 (127 // P levels a side of a scale all replicas share), with error
    feedback: the replicas agree to the bit, stay near the exact run (what a meeting rounds off is carried into
    the next), and a meeting moves ``width`` bytes an element."""
    seed = shared_seed()
    exact, _ = distributed(seed, 13, "sgd", sync_every=4)
    rounded, outer = distributed(seed, 13, "sgd", sync_every=4, compression=compression)
    scale = max(float(np.max(np.abs(e))) for e in exact)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(exact, rounded))
    everywhere(0 < worst < within * scale, f"{compression} off the exact run by {worst:.3g} (scale {scale:.3g})")
    bits = WORLD.allgather(b"".join(p.tobytes() for p in rounded))
    everywhere(len(set(bits)) == 1, "the replicas differ")
    everywhere(outer.bytes_summed == width * outer.meetings * sum(int(np.prod(s)) for s in SHAPES), "bytes")


def test_more_replicas_than_an_int8_sum_holds_are_refused():
    from mpicoll.diloco.int8 import Int8Sums
    with pytest.raises(ValueError, match="128 replicas cannot share an int8 sum"):
        Int8Sums(WORLD, "auto", 128)


def test_bad_options_are_refused_in_one_line():
    params = start(0)
    for options, words in [(dict(sync_every=0), "sync_every=0"), (dict(sync_every=4, overlap=4), "overlap=4"),
                           (dict(sync_every=4, fragments=5), "fragments=5"), (dict(sync_every=4, mix=1.0), "mix=1.0"),
                           (dict(sync_every=4, outer_lr=0), "lr > 0")]:
        with pytest.raises(ValueError, match=words):
            DiLoCo(params, **options)
    with pytest.raises(TypeError, match="floating-point"):
        DiLoCo([np.zeros(3, np.int32)], sync_every=2)
