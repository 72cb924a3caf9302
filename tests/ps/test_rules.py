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
    original = ps.make(name, **options)
    original.setup(rng.standard_normal(9), workers)
    for step in range(7):
        original.on_gradient(workers[step % 3], original.version, rng.standard_normal(9))
    copy = ps.make(name, **options)
    copy.setup(np.zeros(9), workers)
    copy.load_state({key: np.array(value, copy=True) for key, value in original.state().items()})
    for step in range(7, 12):
        gradient, worker = rng.standard_normal(9), workers[step % 3]
        assert original.on_gradient(worker, original.version, gradient) == copy.on_gradient(worker, copy.version,
                                                                                            gradient)
    assert np.array_equal(original.w, copy.w) and original.version == copy.version


def test_warm_start_needs_an_asynchronous_rule():
    layout = ps.Layout(MPI.COMM_SELF, 4, (0,), (1,))
    with pytest.raises(ValueError, match="warm start"):
        ps.Server(None, layout, ps.Sync(lr=0.1), np.zeros(4), worker_timeout=1).run(warm_start=5)


@pytest.mark.parametrize("name, options, workers, pushes, expected", [
    ("sync", {}, 5, 1, 5), ("softsync", {"k": 0.5}, 5, 1, 3), ("softsync", {"k": 2}, 5, 1, 2),
    ("async", {}, 5, 1, 1), ("dcasgd", {}, 5, 1, 1), ("downpour", {}, 5, 4, 4)])
def test_gradients_per_update_is_what_one_update_takes_in(name, options, workers, pushes, expected):
    """The unit of a training budget counted in updates (one place for it, the rule): a sync round takes every
    worker's gradient, a soft-sync round its quorum, Downpour a push of n_push, the others one."""
    rule = ps.make(name, lr=0.1, **options)
    assert rule.gradients_per_update(workers, pushes) == expected
    rule.setup(np.zeros(3), tuple(range(1, workers + 1)))
    if name == "softsync":                 # the round closes where the budget counts it closed
        assert rule.quorum() == expected
