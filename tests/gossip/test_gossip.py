"""Push-sum gossip and SGP at 1 to 8 ranks, against a float64 simulation of the same mixing matrices."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import gossip
from tests.support.gpus import numba_cuda_or_skip
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed

MAILBOXES = list(gossip.MAILBOXES)


def random_matrix(seed: int, size: int) -> np.ndarray:
    """A random column-stochastic matrix on a directed, asymmetric graph that contains a ring."""
    rng = np.random.default_rng(seed)
    mask = rng.random((size, size)) < 0.4
    mask |= np.eye(size, dtype=bool) | np.roll(np.eye(size, dtype=bool), 1, axis=0)
    matrix = rng.random((size, size)) * mask
    return matrix / matrix.sum(axis=0)


def graph_and_mixing(name: str, seed: int):
    if name == "matrix":
        mixing = gossip.MatrixMixing(random_matrix(seed, P))
        return mixing.graph, mixing
    if name == "matrices":       # time-varying, user-given
        mixing = gossip.MatrixMixing([random_matrix(seed + k, P) for k in range(3)])
        return mixing.graph, mixing
    return gossip.make(name, P), gossip.UniformMixing()


def simulate(graph, mixing, x0: np.ndarray, rounds: int, tau: int):
    """Every rank's de-biased vector after each round, computed centrally in float64."""
    x, w, in_flight, history = x0.copy(), np.ones(len(x0)), {}, []
    for k in range(rounds):
        matrix = gossip.mixing_matrix(graph, mixing, k)
        keep = np.diag(matrix).copy()
        sent = matrix - np.diag(keep)
        in_flight[k] = (sent @ x, sent @ w)
        x, w = keep[:, None] * x, keep * w
        if k - tau in in_flight:
            dx, dw = in_flight.pop(k - tau)
            x, w = x + dx, w + dw
        history.append(x / w[:, None])
    for dx, dw in in_flight.values():        # drain
        x, w = x + dx, w + dw
    return history, x, w


GRAPHS = ["time-varying-exponential", "exponential", "ring", "complete", "matrix", "matrices"]


@pytest.mark.mpi
@pytest.mark.parametrize("mailbox", MAILBOXES)
@pytest.mark.parametrize("tau", [0, 2])
@pytest.mark.parametrize("graph_name", GRAPHS)
def test_push_sum_matches_the_mixing_matrices_round_by_round(graph_name, tau, mailbox):
    seed = shared_seed()
    everyone = np.random.default_rng(seed).standard_normal((P, 37))
    graph, mixing = graph_and_mixing(graph_name, seed)
    rounds = 12
    history, x_end, w_end = simulate(graph, mixing, everyone, rounds, tau)
    pushsum = gossip.PushSum(WORLD, everyone[RANK], graph=graph, mixing=mixing, tau=tau, mailbox=mailbox)
    worst = 0.0
    for k in range(rounds):
        z = pushsum.mix()
        worst = max(worst, np.abs(z - history[k][RANK]).max())
    pushsum.drain()
    mass = WORLD.allreduce(pushsum.x.copy())
    weights = WORLD.allreduce(pushsum.weight)
    pushsum.close()
    everywhere(worst < 1e-12, f"seed {seed}: rank {RANK} differs from the simulation by {worst:.2e}")
    everywhere(np.allclose(pushsum.x, x_end[RANK], rtol=1e-12, atol=1e-12), "numerator after draining")
    everywhere(np.allclose(mass, everyone.sum(axis=0), rtol=1e-12, atol=1e-12),
               f"sum of x not conserved: off by {np.abs(mass - everyone.sum(axis=0)).max():.2e}")
    everywhere(abs(weights - P) < 1e-12, f"push-sum weights sum to {weights!r}, not {P}")


@pytest.mark.mpi
@pytest.mark.parametrize("piece", [8, 40, 1 << 19])
@pytest.mark.parametrize("graph_name", ["time-varying-exponential", "complete"])
def test_p2p_packets_cut_into_pieces_arrive_whole(graph_name, piece, monkeypatch):
    """Packets (32-byte header + 37 float64 = 328 bytes) cut into pieces that do or do not divide them.

    Only packets to other nodes are cut: every peer is made to look remote here."""
    monkeypatch.setattr(gossip.mailbox, "PIECE_BYTES", piece)
    seed = shared_seed()
    everyone = np.random.default_rng(seed).standard_normal((P, 37))
    graph, mixing = graph_and_mixing(graph_name, seed)
    history, _, _ = simulate(graph, mixing, everyone, 6, tau=1)
    pushsum = gossip.PushSum(WORLD, everyone[RANK], graph=graph, tau=1, mailbox="p2p")
    pushsum.mailbox.on_my_node = {RANK}
    worst = max(np.abs(pushsum.mix() - history[k][RANK]).max() for k in range(6))
    pushsum.drain()
    pushsum.close()
    everywhere(worst < 1e-12, f"seed {seed}, {piece}-byte pieces: rank {RANK} differs by {worst:.2e}")


@pytest.mark.mpi
@pytest.mark.parametrize("mailbox", MAILBOXES)
@pytest.mark.parametrize("graph_name", ["time-varying-exponential", "exponential", "ring", "complete"])
def test_averaging_reaches_the_exact_mean_at_the_rate_the_graph_implies(graph_name, mailbox):
    seed = shared_seed()
    everyone = np.random.default_rng(seed).standard_normal((P, 1000))
    mean = everyone.mean(axis=0)
    graph, mixing = graph_and_mixing(graph_name, seed)
    theory = gossip.rounds_to_average(graph, mixing, 1e-6)
    pushsum = gossip.PushSum(WORLD, everyone[RANK], graph=graph, mailbox=mailbox)
    reached = None
    for k in range(1, 2 * theory + 8):
        z = pushsum.mix()
        error = WORLD.allreduce(np.linalg.norm(z - mean) / np.linalg.norm(mean), op=MPI.MAX)
        if error < 1e-6:
            reached = k
            break
    pushsum.close()
    # A few rounds of slack: the spectral rate is asymptotic, the starting error is not 1.
    everywhere(reached is not None and reached <= 1.1 * theory + 2 * graph.period + 2,
               f"{graph_name} at {P} ranks: relative error < 1e-6 after {reached} rounds; theory says {theory}")
    if graph_name == "time-varying-exponential" and P & (P - 1) == 0:
        everywhere(reached is not None and reached <= max(1, int(math.log2(P))),
                   f"a power-of-two exponential graph averages exactly in log2(p) rounds, took {reached}")


@pytest.mark.mpi
@pytest.mark.parametrize("mailbox", MAILBOXES)
@pytest.mark.parametrize("tau", [0, 1])
def test_sgp_reaches_the_least_squares_optimum(tau, mailbox):
    """Each rank holds its own rows; SGP minimises the sum over every rank's rows."""
    seed = shared_seed()
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((40 * P, 6))
    y = X @ rng.standard_normal(6) + 0.01 * rng.standard_normal(40 * P)
    optimum = np.linalg.lstsq(X, y, rcond=None)[0]
    rows, targets = X[RANK::P], y[RANK::P]
    sgp = gossip.SGP(gossip.PushSum(WORLD, np.zeros(6), tau=tau, mailbox=mailbox), lr=0.05)
    z = sgp.parameters.copy()
    for step in range(300):
        sgp.lr = 0.2 / (1 + step / 100)             # decaying: decentralised SGD's bias vanishes
        z = sgp.step(rows.T @ (rows @ z - targets) / len(targets)).copy()
    sgp.gossip.drain()
    z = sgp.gossip.debiased().copy()
    sgp.gossip.close()
    error = np.linalg.norm(z - optimum) / np.linalg.norm(optimum)
    everywhere(error < 1e-2, f"seed {seed}: SGP (tau={tau}) ended {error:.2e} from the optimum")


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_stops_mixing_is_named(monkeypatch):
    monkeypatch.setenv("MPICOLL_TIMEOUT", "2")
    pushsum = gossip.PushSum(WORLD, np.ones(10), graph="ring", mailbox="onesided")
    pushsum.mix()
    outcome = "finished"
    if RANK != 0:
        try:
            pushsum.mix()                      # rank 0 never sends its second round
        except mpicoll.CollectiveTimeout as error:
            outcome = str(error)
    WORLD.Barrier()
    pushsum._progress.stop()                  # the channel is broken on some ranks: no collective close
    expected = "waited 2 s for rank(s) 0" if RANK == 1 else None
    everywhere(expected is None or (expected in outcome and "push-sum" in outcome), f"rank {RANK}: {outcome}")


@pytest.mark.mpi
@pytest.mark.parametrize("mailbox", MAILBOXES)
def test_a_drained_state_resumes_exactly(mailbox):
    """Bitwise over p2p; over windows, packets from several in-peers are summed in arrival
    order, so float32 results agree to rounding only."""
    seed = shared_seed()
    x0 = np.random.default_rng([seed, RANK]).standard_normal(50).astype(np.float32)
    straight = gossip.PushSum(WORLD, x0, graph="exponential", mailbox=mailbox)
    for _ in range(10):
        expected = straight.mix().copy()
    straight.close()
    first = gossip.PushSum(WORLD, x0, graph="exponential", mailbox=mailbox)
    for _ in range(4):
        first.mix()
    first.drain()
    state = first.state()
    first.close()
    second = gossip.PushSum(WORLD, np.zeros(50, np.float32), graph="exponential", mailbox=mailbox)
    second.load_state(state)
    for _ in range(6):
        got = second.mix().copy()
    second.close()
    same = np.array_equal(got, expected) if mailbox == "p2p" else np.allclose(got, expected, rtol=1e-5, atol=1e-6)
    everywhere(same, f"resumed run differs by {np.abs(got - expected).max():.2e}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("wrong", ["size", "dtype", "round", "missing"])
def test_a_state_that_does_not_fit_on_one_rank_is_refused_on_every_rank(wrong):
    """load_state is collective: one rank's bad state stops every rank at once (SetupError naming it),
    instead of leaving the others to gossip into a timeout; nothing changes."""
    x0 = np.arange(8, dtype=np.float32) + RANK
    pushsum = gossip.PushSum(WORLD, x0, graph="exponential", mailbox="p2p")
    state = {"x": np.zeros(8, np.float32), "weight": np.array(1.0), "round": np.array(4)}
    if RANK == P - 1:
        state = {"size": {**state, "x": np.zeros(9, np.float32)}, "dtype": {**state, "x": np.zeros(8)},
                 "round": {**state, "round": np.array(5)}, "missing": {"weight": state["weight"]}}[wrong]
    error = None
    try:
        pushsum.load_state(state)
    except mpicoll.SetupError as caught:
        error = caught
    unchanged = np.array_equal(pushsum.x, x0) and pushsum.round == 0
    pushsum.close()
    everywhere(error is not None and f"rank {P - 1}" in str(error) and unchanged, f"{error!r}, unchanged {unchanged}")


def test_mixing_matrices_are_validated():
    problems = []
    good = random_matrix(1, 4)
    for bad, words in [(good * 1.01, "not column-stochastic: column 0"), (np.eye(3) - 0.5 * np.eye(3, k=1), "negative"),
                       (np.ones((3, 4)) / 3, "square")]:
        try:
            gossip.MatrixMixing(bad)
            problems.append(f"no error for a matrix that should fail with {words!r}")
        except ValueError as error:
            if words not in str(error):
                problems.append(f"{words!r} not in: {error}")
    try:
        gossip.make("torus", 4)
        problems.append("no error for an unknown graph")
    except ValueError as error:
        if "time-varying-exponential" not in str(error):
            problems.append(str(error))
    graph = gossip.TimeVaryingExponential(8)
    if [graph.out_peers(3, k) for k in range(4)] != [(4,), (5,), (7,), (4,)]:
        problems.append(f"time-varying exponential peers of 3: {[graph.out_peers(3, k) for k in range(4)]}")
    if graph.in_peers(0, 2) != (4,):
        problems.append(f"in-peers of 0 at round 2: {graph.in_peers(0, 2)}")
    assert not problems, problems


@pytest.mark.mpi
def test_device_arrays_go_in_and_come_out():
    cuda = numba_cuda_or_skip()
    pushsum = gossip.PushSum(WORLD, cuda.to_device(np.full(8, float(RANK), np.float32)), graph="complete")
    out = cuda.device_array(8, np.float32)
    pushsum.mix(out=out)
    mean = (P - 1) / 2
    first = out.copy_to_host()
    sgp = gossip.SGP(pushsum, lr=0.5)
    sgp.step(cuda.to_device(np.ones(8, np.float32)), out=out)
    second = out.copy_to_host()
    pushsum.close()
    everywhere(np.allclose(first, mean), f"after one complete round: {first}, expected {mean}")
    everywhere(np.allclose(second, mean - 0.5), f"after one SGP step: {second}, expected {mean - 0.5}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mailbox", MAILBOXES)
def test_a_round_is_sent_while_the_receiver_computes(mailbox):
    """With tau = 1 a round only sends; that must not wait for a receiver busy outside MPI
    (MPICH's Get would: mpicoll's one-sided mailbox uses Accumulate and Put only)."""
    import time
    pushsum = gossip.PushSum(WORLD, np.ones(100_000), graph="ring", tau=1, mailbox=mailbox)
    WORLD.Barrier()
    took = 0.0
    if RANK == (0 + 1) % P:                   # rank 0's out-peer on the ring: busy, outside MPI
        until = time.perf_counter() + 1.0
        while time.perf_counter() < until:
            pass
    if RANK == 0:
        start = time.perf_counter()
        pushsum.mix()
        took = time.perf_counter() - start
    else:
        pushsum.mix()
    pushsum.drain()
    pushsum.close()
    everywhere(took < 0.5, f"rank 0's first round took {took:.3f} s while its receiver computed for 1 s")


@pytest.mark.mpi(min_size=2)
def test_a_freed_onesided_mailbox_frees_once_and_refuses_use():
    """Freeing swaps the window's handle out first (as mpi4py frees its objects): a second close does nothing,
    and a use after it is refused, never a read of freed memory."""
    pushsum = gossip.PushSum(WORLD, np.ones(4), mailbox="onesided")
    mailbox = pushsum.mailbox
    pushsum.close()
    mailbox.close()                                       # a second free: nothing
    refused = []
    for use in (lambda: mailbox.win.Lock(RANK), lambda: mailbox.take(0)):
        try:
            use()
        except (MPI.Exception, AttributeError) as error:
            refused.append(type(error).__name__)
    everywhere(len(refused) == 2 and mailbox.win == MPI.WIN_NULL, f"refused: {refused}")
