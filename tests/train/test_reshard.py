"""``mpicoll train --resume`` on another number of ranks than the run that wrote the checkpoint: the allreduce
methods go on as a run of the new count would, SGP starts every rank from the average of the earlier ranks'
de-biased parameters, Sandblaster L-BFGS hands the gradient's portions to the new workers, and ps-async and
dcasgd servers continue their shards (ps-sync and ps-softsync refuse with the reason: tests/train/test_faults.py).  Real MPI: the run of one count is the whole job,
the other a communicator of all ranks but the last (``--resume`` only compares files, so one job plays both
runs)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.base import checkpoint
from mpicoll.train import MLP, Options, SoftmaxRegression, train

from tests.support.mpi import P, RANK, WORLD, everywhere
from tests.support.problems import allreduce_sgd, digits


def _fewer():
    """A communicator of ranks 0 .. P-2 (None on the last rank)."""
    part = WORLD.Split(0 if RANK < P - 1 else MPI.UNDEFINED, RANK)
    return None if part == MPI.COMM_NULL else part


def _summary(comm, options, model, data):
    """The run's summary on every rank of ``comm`` (None on ranks outside it)."""
    summary = train(comm, options, model, data) if comm is not None else None
    found = [s for s in WORLD.allgather(summary) if s]
    return found[0] if found else None


def _runs(direction: str):
    """(the communicator of the run that writes the checkpoint, that of the run that resumes it; None on ranks
    outside one): P-1 then P ranks ("more"), or P then P-1 ("fewer")."""
    fewer = _fewer()
    return (fewer, WORLD) if direction == "more" else (WORLD, fewer)


def _folder(tmp_path_factory) -> str:
    return WORLD.bcast(str(tmp_path_factory.mktemp("reshard")) if RANK == 0 else None)


@pytest.mark.mpi(min_size=2)
def test_allreduce_resumed_on_fewer_ranks_trains_as_a_run_of_that_many(tmp_path_factory, capfd):
    """P ranks for an epoch, then P-1 resume for the second: its result is the second epoch of allreduce SGD
    over P-1 ranks from the first run's parameters (computed here in one process, float64)."""
    data, folder = digits(), _folder(tmp_path_factory)
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = dict(method="allreduce-ring", batch=8, lr=0.2, seed=5, progress=False, checkpoint=f"{folder}/job")
    train(WORLD, Options(epochs=1, **options), model, data)
    WORLD.Barrier()                                  # rank 0 has written it
    after_one = checkpoint.load(f"{folder}/job.npz", {})["params"]
    fewer = _fewer()
    summary = _summary(fewer, Options(epochs=2, resume=True, **options), model, data)
    expected = allreduce_sgd(model, data, Options(**options), P - 1, params=after_one, epoch=1)
    everywhere(summary["ranks"] == P - 1 and abs(summary["final_loss"] - expected) < 1e-9,
               f"resumed on {P - 1} ranks: final loss {summary['final_loss']!r}, expected {expected!r}")
    said = capfd.readouterr().err
    if RANK == 0:
        assert f"written by {P} ranks, on {P - 1}" in said, said
    if fewer is not None:
        fewer.Free()


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("direction", ["more", "fewer"])
def test_sgp_resumed_on_another_count_starts_every_rank_from_the_average(tmp_path_factory, direction):
    """N ranks checkpoint after an epoch; M resume with nothing left to train: every rank starts from the
    average of the N files' de-biased parameters (x / weight), so the final consensus is that average
    (more: the last rank, which had no file, took part; fewer: a rank read two files)."""
    data, folder = digits(), _folder(tmp_path_factory)
    model = MLP(data.features, data.classes, [12], dtype=np.float64)
    options = dict(method="sgp", batch=8, lr=0.1, seed=3, progress=False, checkpoint=f"{folder}/job", epochs=1)
    first, then = _runs(direction)
    written = P - 1 if direction == "more" else P
    _summary(first, Options(**options), model, data)
    states = [checkpoint.load(checkpoint.path(f"{folder}/job", "rank", r), {}) for r in range(written)]
    average = np.mean([s["x"] / s["weight"] for s in states], axis=0)
    summary = _summary(then, Options(resume=True, **options), model, data)
    expected = model.evaluate(average, data.X_test, data.y_test)[0]
    everywhere(summary["ranks"] == 2 * P - 1 - written and abs(summary["final_loss"] - expected) < 1e-9,
               f"final loss {summary['final_loss']!r}, the average's {expected!r}")
    for comm in (first, then):
        if comm is not None and comm is not WORLD:
            comm.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("direction", ["more", "fewer"])
def test_sandblaster_resumed_on_another_count_of_workers_ends_where_an_uninterrupted_run_does(tmp_path_factory,
                                                                                            direction):
    """A coordinator, a shard and N-2 workers for two epochs' evaluations, then M-2 workers resume: the L-BFGS
    state is the coordinator's and the shard's, so the run ends where an uninterrupted one of N ranks does
    (up to the order the portions' gradients are summed in)."""
    data, folder = digits(), _folder(tmp_path_factory)
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = dict(method="sandblaster-lbfgs", seed=2, progress=False, epochs=4)
    first, then = _runs(direction)
    straight = _summary(first, Options(**options), model, data)
    _summary(first, Options(**{**options, "epochs": 2}, checkpoint=f"{folder}/job"), model, data)
    resumed = _summary(then, Options(**options, checkpoint=f"{folder}/job", resume=True), model, data)
    everywhere(abs(resumed["final_loss"] - straight["final_loss"]) < 1e-7,
               f"resumed on {resumed['ranks']} ranks: {resumed['final_loss']!r}, uninterrupted on "
               f"{straight['ranks']}: {straight['final_loss']!r}")
    for comm in (first, then):
        if comm is not None and comm is not WORLD:
            comm.Free()


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("method, direction", [("ps-async", "more"), ("dcasgd", "more"), ("ps-async", "fewer")])
def test_a_parameter_server_resumed_on_another_count_of_workers_continues_its_shard(tmp_path_factory, capfd, method,
                                                                                    direction):
    """A server and N-1 workers for an epoch, then a server and M-1 workers resume: with nothing left to train
    the run ends at the server's saved weights (its shard moved, whatever the worker count); one more epoch
    goes on from its update count, one gradient an update."""
    data, folder = digits(), _folder(tmp_path_factory)
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = dict(method=method, batch=8, lr=0.1, seed=4, progress=False, checkpoint=f"{folder}/job")
    first, then = _runs(direction)
    written, resumed = (P - 1, P) if direction == "more" else (P, P - 1)
    _summary(first, Options(epochs=1, **options), model, data)
    saved = checkpoint.load(checkpoint.path(f"{folder}/job", "server", 0), {})
    summary = _summary(then, Options(epochs=1, resume=True, **options), model, data)
    expected = model.evaluate(saved["w"], data.X_test, data.y_test)[0]
    everywhere(summary["ranks"] == resumed and abs(summary["final_loss"] - expected) < 1e-12,
               f"final loss {summary['final_loss']!r}, the saved weights' {expected!r}")
    said = capfd.readouterr().err
    if RANK == 0:
        assert f"written by {written} ranks, on {resumed}" in said, said
    summary = _summary(then, Options(epochs=2, resume=True, **options), model, data)
    after = checkpoint.load(checkpoint.path(f"{folder}/job", "server", 0), {})
    per_epoch = int(saved["version"])                 # one epoch's gradients, about the same at any worker count
    everywhere(summary["final_loss"] < expected and abs(int(after["version"]) - 2 * per_epoch) <= P,
               f"after one more epoch: loss {summary['final_loss']!r} (was {expected!r}), updates "
               f"{int(after['version'])} (one epoch: {per_epoch})")
    for comm in (first, then):
        if comm is not None and comm is not WORLD:
            comm.Free()
