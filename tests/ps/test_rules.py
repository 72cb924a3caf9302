"""mpicoll.ps.rules, one process: exact checkpoints of every rule, and which rules allow a warm start."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll import ps
from tests.support.parameter_servers import RULE_CASES, RULE_IDS


def test_the_cases_cover_every_rule():
    assert {name for name, _ in RULE_CASES} == set(ps.RULES)


@pytest.mark.parametrize("name, options", RULE_CASES, ids=RULE_IDS)
def test_parameter_server_rule_state_round_trips_exactly(name, options):
    """Saved mid-run and loaded into a fresh rule, the next updates come out bit for bit the same."""
    rng = np.random.default_rng()
    workers = (1, 2, 3)
    now = [0.0]
    if name == "rescaled":          # its steps follow the workers' times: one clock for both, set per step
        options = {**options, "clock": lambda: now[0]}
    original = ps.make(name, **options)
    original.setup(rng.standard_normal(9), workers)
    for step in range(7):
        now[0] = step * (1 + step % 3)
        original.on_gradient(workers[step % 3], original.version, rng.standard_normal(9))
    copy = ps.make(name, **options)
    copy.setup(np.zeros(9), workers)
    copy.load_state({key: np.array(value, copy=True) for key, value in original.state().items()})
    for step in range(7, 12):
        gradient, worker = rng.standard_normal(9), workers[step % 3]
        now[0] = step * (1 + step % 3)
        assert original.on_gradient(worker, original.version, gradient) == copy.on_gradient(worker, copy.version,
                                                                                            gradient)
    assert np.array_equal(original.w, copy.w) and original.version == copy.version


def test_warm_start_needs_an_asynchronous_rule():
    layout = ps.Layout(MPI.COMM_SELF, 4, (0,), (1,))
    with pytest.raises(ValueError, match="warm start"):
        ps.Server(None, layout, ps.Sync(lr=0.1), np.zeros(4), worker_timeout=1).run(warm_start=5)


@pytest.mark.parametrize("name, options, workers, pushes, expected", [
    ("sync", {}, 5, 1, 5), ("softsync", {"k": 0.5}, 5, 1, 3), ("softsync", {"k": 2}, 5, 1, 2),
    ("async", {}, 5, 1, 1), ("dcasgd", {}, 5, 1, 1), ("downpour", {}, 5, 4, 4), ("ringmaster", {}, 5, 1, 1),
    ("rescaled", {}, 5, 1, 1)])
def test_gradients_per_update_is_what_one_update_takes_in(name, options, workers, pushes, expected):
    """The unit of a training budget counted in updates (one place for it, the rule): a sync round takes every
    worker's gradient, a soft-sync round its quorum, Downpour a push of n_push, the others one."""
    rule = ps.make(name, lr=0.1, **options)
    assert rule.gradients_per_update(workers, pushes) == expected
    rule.setup(np.zeros(3), tuple(range(1, workers + 1)))
    if name == "softsync":                 # the round closes where the budget counts it closed
        assert rule.quorum() == expected


def test_ringmaster_drops_exactly_the_gradients_R_or_more_updates_late():
    """R = 2: a gradient of the current weights or of one update ago is applied at the constant rate; one two
    updates late is dropped (counted, the weights untouched) and its worker answered; by default R = the
    workers' count."""
    rule = ps.Ringmaster(lr=0.5, R=2)
    rule.setup(np.zeros(3), (1, 2, 3))
    assert rule.on_gradient(1, 0, np.ones(3)) == [1] and np.array_equal(rule.w, -0.5 * np.ones(3))
    assert not rule.too_late(0) and rule.too_late(-1)
    rule.on_gradient(2, 0, np.ones(3))                      # one update late: applied, not scaled
    assert np.array_equal(rule.w, -np.ones(3)) and rule.version == 2
    assert rule.on_gradient(3, 0, np.full(3, 7.0)) == [3]   # two late: dropped
    assert np.array_equal(rule.w, -np.ones(3)) and rule.version == 2 and rule.dropped == 1
    default = ps.Ringmaster(lr=0.1)
    default.setup(np.zeros(2), (1, 2, 3, 4))
    assert default.R == 4 and default.too_late(-4) and not default.too_late(-3)
    with pytest.raises(ValueError, match="at least 1"):
        ps.Ringmaster(lr=0.1, R=0)


def test_rescaled_steps_each_worker_in_proportion_to_its_time():
    """Worker 1 sends every second, worker 2 every 3 s: once both times are known their steps are lr c / H,
    H the harmonic mean (1.5 s): 2/3 lr and 2 lr, so each moves the weights alike per second; first gradients
    take lr."""
    now = [0.0]
    rule = ps.Rescaled(lr=0.3, smoothing=0.0, clock=lambda: now[0])
    rule.setup(np.zeros(1), (1, 2))
    rule.on_gradient(1, 0, np.ones(1))                       # times unknown: lr
    rule.on_gradient(2, 0, np.ones(1))
    assert np.allclose(rule.w, -0.6)
    now[0] = 1.0
    rule.on_gradient(1, 0, np.ones(1))                       # only worker 1's time known: still lr
    assert np.allclose(rule.w, -0.9)
    now[0] = 3.0
    rule.on_gradient(2, 0, np.ones(1))                       # c = (1, 3), H = 1.5: worker 2 takes 2 lr
    assert np.allclose(rule.w, -0.9 - 0.6) and np.isclose(rule.step_scale(1), 2 / 3)
    rule.on_leave(2)
    assert rule.step_scale(1) == 1.0
