"""A job run again and again in one process (a sweep, a notebook, a test suite) leaves no communicator behind:
MPICH gives a process about 2,000 communicator ids, and a job that keeps one alive each run (a receive left
posted on its private communicator keeps it after its free) stops the sweep after about 2,000 runs with
"Too many communicators".  Each job kind runs again, finishing normally; the count of communicators this process
can still make (tests.support.mpi.communicators_left) must not fall.  Jobs that end on an error
abandon their communicators on purpose (docs/failures.md): not these."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll import gossip, ps, sandblaster
from mpicoll.modelparallel import Pipeline
from mpicoll.models.dense import MLP
from tests.support.mpi import P, RANK, WORLD, communicators_left, everywhere, shared_seed
from tests.support.parameter_servers import run_roles, sgd_on_my_rows
from tests.support.problems import least_squares

pytestmark = pytest.mark.mpi


def sandblaster_job(seed):
    rng = np.random.default_rng(seed)
    A, b = rng.standard_normal((30, 5)), rng.standard_normal(30)

    def least_squares_loss(w, batch):
        r = A @ w - b
        return 0.5 * r @ r / len(b), A.T @ r / len(b)

    sandblaster.run(WORLD, np.zeros(5), least_squares_loss, samples=30, iterations=2)


def parameter_server_job(seed, transport):
    X, y, _ = least_squares(seed)
    server = ps.ParameterServer(WORLD, np.zeros(X.shape[1]), ps.Sync(lr=0.1), servers=1, transport=transport)
    run_roles(server, sgd_on_my_rows(server, X, y, steps=3, seed=seed))


def gossip_job(seed, mailbox):
    pushsum = gossip.PushSum(WORLD, np.full(4, float(RANK)), mailbox=mailbox)
    pushsum.mix()
    pushsum.drain()
    pushsum.close()


def refused_pipeline(seed):
    with pytest.raises(ValueError, match="consecutive"):
        Pipeline(WORLD, MLP(4, 2, [3] * P, dtype=np.float64), bounds=[(0, 1)] * P)


JOBS = {
    "sandblaster": (3, sandblaster_job),
    "parameter-server-p2p": (2, lambda seed: parameter_server_job(seed, "p2p")),
    "parameter-server-onesided": (2, lambda seed: parameter_server_job(seed, "onesided")),
    "gossip-p2p": (1, lambda seed: gossip_job(seed, "p2p")),
    "gossip-onesided": (1, lambda seed: gossip_job(seed, "onesided")),
    "refused-pipeline": (1, refused_pipeline),
}


def test_jobs_run_again_leave_no_communicator_behind():
    """Each job kind runs once (what a first run sets up once and keeps is not counted), then once more between
    two counts; on a difference each runs again between counts of its own, to name the ones that leak."""
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("counts MPICH's communicator ids (Open MPI has far more than the count reaches)")
    seed = shared_seed()
    jobs = {name: run for name, (least, run) in JOBS.items() if P >= least}
    for run in jobs.values():
        run(seed)
    before = communicators_left()
    for run in jobs.values():
        run(seed)
    if communicators_left() == before:
        return
    left = {}
    for name, run in jobs.items():
        before = communicators_left()
        run(seed)
        left[name] = before - communicators_left()
    everywhere(False, f"a run left communicators behind: {left}")
