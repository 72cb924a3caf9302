"""``mpicoll train``: every training method trains for real at 1 to 4 ranks; data loading; the report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mpicoll
from mpicoll.train import METHODS, MLP, Options, SoftmaxRegression, load, train
from mpicoll.models.dense import CNN
from mpicoll.experiments.compare import read_log, report
from mpi4py import MPI

from tests.support.jobs import ROOT
from tests.support.mpi import P, RANK, WORLD, everywhere
from tests.support.problems import allreduce_sgd, digits


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_and_logs(method, tmp_path_factory):
    if not METHODS[method].one_rank and P < METHODS[method].min_ranks:
        pytest.skip(f"{method} needs {METHODS[method].min_ranks} ranks (servers, workers, a coordinator)")
    data = digits()
    alone = METHODS[method].one_rank            # sequential SGD: every rank runs its own, on COMM_SELF
    comm = MPI.COMM_SELF if alone else WORLD
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("logs")) if RANK == 0 else None)
    log = f"{folder}/{method}{f'.{RANK}' if alone else ''}.jsonl"
    model = MLP(data.features, data.classes, [16]) if method in ("dcasgd", "sgp") else \
        SoftmaxRegression(data.features, data.classes)
    start_loss, _ = model.evaluate(model.init(3), data.X_test, data.y_test)
    options = Options(method=method, epochs=2, batch=16, lr=0.05, seed=3, output=log, progress=False,
                      tau=1 if method == "sgp" else 0)
    summary = train(comm, options, model, data)
    summaries = [s for s in WORLD.allgather(summary) if s]
    everywhere(len(summaries) == (P if alone else 1), f"{len(summaries)} ranks reported a summary")
    records, logged = read_log(log)
    final = summary if alone else summaries[0]
    everywhere(logged == json.loads(json.dumps(final)), "the log's summary is the returned one")
    everywhere(final["method"] == method and final["ranks"] == comm.Get_size() and final["wall_s"] > 0
               and final["samples_per_s"] > 0, f"summary {final}")
    if METHODS[method].reports_staleness:       # the servers' staleness histogram, counted in the log
        lags = {int(lag): count for lag, count in final["staleness"].items()}
        everywhere(sum(lags.values()) >= final["samples"] // options.batch and
                   (method != "ps-sync" or set(lags) == {0}), f"{method}: staleness {lags}")
    everywhere([r["epoch"] for r in records][-1] == 2 and all(r["samples"] > 0 for r in records),
               f"records {records}")
    everywhere(final["final_loss"] < 0.8 * start_loss,
               f"{method}: test loss {start_loss:.3f} -> {final['final_loss']:.3f}, not decreasing")


@pytest.mark.mpi(min_size=2)
def test_allreduce_training_equals_single_process_sgd_on_the_combined_batch():
    """allreduce-ring averages the ranks' gradients: the same steps as one process on all their rows."""
    data = digits()
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = Options(method="allreduce-ring", epochs=1, batch=8, lr=0.2, seed=5, progress=False)
    summary = train(WORLD, options, model, data)
    expected = allreduce_sgd(model, data, options, P)
    losses = [s["final_loss"] for s in WORLD.allgather(summary) if s]
    everywhere(abs(losses[0] - expected) < 1e-9, f"final loss {losses[0]!r}, single process {expected!r}")


@pytest.mark.mpi
def test_local_sgd_meeting_every_step_is_allreduce_sgd():
    """localsgd with --sync-every 1 averages the replicas after each step from the same weights: the average of
    (w - lr g_r) is allreduce SGD's step, so the same loss as one process on the combined batch."""
    data = digits()
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = Options(method="localsgd", epochs=1, batch=8, lr=0.2, seed=5, sync_every=1, progress=False)
    summary = train(WORLD, options, model, data)
    expected = allreduce_sgd(model, data, options, P)
    found = [s for s in WORLD.allgather(summary) if s][0]
    everywhere(abs(found["final_loss"] - expected) < 1e-9, f"final loss {found['final_loss']!r}, single process "
               f"{expected!r}")
    steps = -(-len(data.y) // (P * options.batch))
    everywhere(found["communication"]["meetings"] == steps, f"{found['communication']}, {steps} steps")


@pytest.mark.mpi(min_size=2)
def test_diloco_trains_its_replicas_to_one_model_meeting_rarely():
    """diloco meeting every 10 steps: far fewer meetings than steps, the bytes of each meeting's pseudo-gradient
    counted, and every rank ends on the same weights (the summary's model is every replica's)."""
    data = digits()
    model = MLP(data.features, data.classes, [16], dtype=np.float64)
    options = Options(method="diloco", epochs=3, batch=16, lr=0.1, seed=2, sync_every=10, fragments=2,
                      progress=False)
    summary = train(WORLD, options, model, data)
    found = [s for s in WORLD.allgather(summary) if s][0]
    steps = 3 * -(-len(data.y) // (P * options.batch))
    meetings = found["communication"]["meetings"]
    everywhere(steps // 10 <= meetings // 2 <= steps // 10 + 1 and found["final_accuracy"] > 0.85,
               f"{meetings} meetings of 2 fragments in {steps} steps, accuracy {found['final_accuracy']}")
    sent = found["communication"]["bytes_summed_per_rank"]
    everywhere(meetings // 2 * model.size * 8 <= sent <= (meetings // 2 + 1) * model.size * 8, f"{sent} bytes")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression, feedback", [("fp16", False), ("bf16", True)])
def test_compressed_training_stays_near_exact_allreduce_training_and_its_replicas_identical(compression, feedback):
    """--compression: the gradients' sum moves as 16-bit floats, the same bits on every rank, so the replicas
    stay identical; one epoch lands near the exact run (float64 model, the reference of the test above)."""
    data = digits()
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = dict(method="allreduce-ring", epochs=1, batch=8, lr=0.2, seed=5, progress=False)
    exact = allreduce_sgd(model, data, Options(**options), P)
    summary = train(WORLD, Options(**options, compression=compression, error_feedback=feedback), model, data)
    loss = [s["final_loss"] for s in WORLD.allgather(summary) if s][0]
    everywhere(abs(loss - exact) < 0.01 * exact and loss != exact, f"final loss {loss!r}, exact {exact!r}")
    everywhere(summary is None or summary["options"]["compression"] == compression, "the log names it")


@pytest.mark.mpi
@pytest.mark.parametrize("rank", [10, 1])
def test_powersgd_training_is_exact_where_its_rank_covers_the_weights_and_near_it_where_not(rank):
    """--compression powersgd: with the rank of the softmax weights' smaller side (10 classes) every step is the
    exact average, so the run is exact allreduce training (float64, 1e-9); rank 1 lands near it."""
    data = digits()
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = dict(method="allreduce-auto", epochs=1, batch=8, lr=0.2, seed=5, progress=False)
    exact = allreduce_sgd(model, data, Options(**options), P)
    summary = train(WORLD, Options(**options, compression="powersgd", powersgd_rank=rank, powersgd_start=2), model,
                    data)
    loss = [s["final_loss"] for s in WORLD.allgather(summary) if s][0]
    near = abs(loss - exact) < 1e-9 if rank == 10 else (abs(loss - exact) < 0.1 * exact and loss != exact)
    everywhere(near, f"rank {rank}: final loss {loss!r}, exact {exact!r}")


@pytest.mark.mpi(min_size=2)
def test_model_parallel_training_is_allreduce_training_of_its_replicas():
    """--model-parallel K at P ranks: P/K replicas, each a pipeline of K stages; the result must be plain
    allreduce SGD over P/K ranks (computed here in one process, float64)."""
    k = 3 if P == 3 else 2
    if P % k:
        pytest.skip(f"{P} ranks make no whole replicas of {k} stages")
    replicas = P // k
    data = digits()
    model = MLP(data.features, data.classes, [16, 12], dtype=np.float64)
    options = Options(method="allreduce-ring", epochs=1, batch=8, lr=0.2, seed=5, progress=False, model_parallel=k)
    summary = train(WORLD, options, model, data)
    expected = allreduce_sgd(model, data, options, replicas)
    losses = [s["final_loss"] for s in WORLD.allgather(summary) if s]
    everywhere(len(losses) == 1 and abs(losses[0] - expected) < 1e-9, f"final loss {losses}, expected {expected!r}")
    with pytest.raises(mpicoll.SetupError, match="whole replicas"):
        train(WORLD, Options(method="allreduce-ring", epochs=1, model_parallel=P + 1, progress=False), model, data)


@pytest.mark.mpi(min_size=4)
def test_downpour_of_one_pipelined_replica_is_adagrad_on_the_whole_model():
    """--method downpour --model-parallel 2 at 4 ranks: 2 server ranks (one per stage, each holding only its
    stage's layers) and one replica of 2 stages; Downpour's update is Adagrad, elementwise, so the result
    must be single-process Adagrad on the whole model over the same batches (float64)."""
    if P != 4:
        pytest.skip("one replica of 2 stages and a server per stage: 4 ranks")
    import math
    from mpicoll.train.common import batches as _batches
    data = digits()
    model = MLP(data.features, data.classes, [16, 12], dtype=np.float64)
    options = Options(method="downpour", epochs=1, batch=8, lr=0.05, seed=5, progress=False, model_parallel=2)
    summary = train(WORLD, options, model, data)
    params, history = model.init(options.seed), np.zeros(model.size)
    for batch in _batches(len(data.y), options.batch, math.ceil(len(data.y) / options.batch), [options.seed, 0, 0]):
        g = model.loss_and_gradient(params, data.X[batch], data.y[batch])[1]
        history += g * g
        params -= options.lr * g / (np.sqrt(history) + 1e-8)
    expected = model.evaluate(params, data.X_test, data.y_test)[0]
    losses = [s["final_loss"] for s in WORLD.allgather(summary) if s]
    everywhere(len(losses) == 1 and abs(losses[0] - expected) < 1e-9, f"final loss {losses}, expected {expected!r}")
    with pytest.raises(mpicoll.SetupError, match="whole replicas"):
        train(WORLD, Options(method="downpour", epochs=1, model_parallel=2, servers=2, progress=False), model, data)


@pytest.mark.parametrize("arrays, words", [
    (None, "no such file; the built-in data sets are digits and mnist1d"),
    ("garbage", "not an .npz archive"),
    ("csv", "(a text or CSV file?); convert it, e.g. for a CSV with the label last: a = np.loadtxt("),
    ("damaged zip", "not a readable .npz"),
    ({"X": np.zeros((4, 2))}, "missing array(s) y"),
    ({"X": np.zeros((4, 2)), "y": np.zeros(3, int)}, "one label per sample"),
    ({"X": np.full((4, 2), np.nan), "y": np.zeros(4, int)}, "NaN"),
    ({"X": np.zeros((4, 2)), "y": np.array([0, 1, 0.5, 1])}, "integers"),
    ({"X": np.zeros((4, 2)), "y": np.zeros(4, int), "X_test": np.zeros((2, 2))}, "both X_test and y_test"),
    ({"X": np.zeros((4, 2)), "y": np.zeros(4, int), "X_test": np.zeros((2, 3)), "y_test": np.zeros(2, int)},
     "X_test has 3 features"),
])
def test_bad_data_files_get_clear_errors(tmp_path, arrays, words):
    path = tmp_path / "data.npz"
    if arrays == "garbage":
        path.write_bytes(b"not a zip file")
    elif arrays == "csv":
        path.write_text("0.5,1.5,0\n2.5,3.5,1\n")
    elif arrays == "damaged zip":
        path.write_bytes(b"PK\x03\x04 and then nothing")
    elif arrays is not None:
        np.savez(path, **arrays)
    with pytest.raises(ValueError, match=None) as error:
        load(str(path))
    assert words in str(error.value) and "allow_pickle" not in str(error.value)


@pytest.mark.parametrize("name", ["mnist", "MNIST-1D", "digit"])
def test_a_near_miss_of_a_built_in_data_set_is_named(name):
    with pytest.raises(ValueError) as error:
        load(name)
    meant = "digits" if name == "digit" else "mnist1d"
    assert f"(did you mean --data {meant}?)" in str(error.value)


def test_a_users_npz_with_its_own_test_set(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 3))
    y = (X[:, 0] > 0).astype(int)
    np.savez(tmp_path / "mine.npz", X=X, y=y, X_test=X[:10] * 2, y_test=y[:10])
    data = load(str(tmp_path / "mine.npz"))
    assert data.X.shape == (60, 3) and data.X_test.shape == (10, 3) and data.classes == 2
    assert np.allclose(data.X.mean(axis=0), 0, atol=1e-6) and data.X.dtype == np.float32


def test_model_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    X, y = rng.standard_normal((7, 5)), rng.integers(0, 3, 7)
    for model in (SoftmaxRegression(5, 3, dtype=np.float64), MLP(5, 3, [4, 6], dtype=np.float64),
                  CNN(5, 3, channels=(3, 2), dtype=np.float64)):
        params = model.init(2) + 0.1 * rng.standard_normal(model.size)
        _, grad = model.loss_and_gradient(params, X, y)
        numeric = np.empty(model.size)
        for i in range(model.size):
            step = np.zeros(model.size)
            step[i] = 1e-6
            numeric[i] = (model.loss_and_gradient(params + step, X, y, gradient=False)[0]
                          - model.loss_and_gradient(params - step, X, y, gradient=False)[0]) / 2e-6
        assert np.allclose(grad, numeric, rtol=1e-4, atol=1e-7), type(model).__name__


def test_one_pass_evaluation_is_the_loss_and_the_predictions_accuracy():
    """Model.evaluate's one forward pass (the models' logits) against its definition: two passes."""
    rng = np.random.default_rng()
    X, y = rng.standard_normal((37, 5)).astype(np.float32), rng.integers(0, 3, 37)
    for model in (SoftmaxRegression(5, 3), MLP(5, 3, [4, 6]), CNN(5, 3, channels=(3, 2))):
        params = model.init(2) + np.float32(0.5) * rng.standard_normal(model.size).astype(np.float32)
        loss, _ = model.loss_and_gradient(params, X, y, gradient=False)
        assert model.evaluate(params, X, y) == (float(loss), float((model.predict(params, X) == y).mean()))


def test_the_cli_trains_the_numpy_cnn_without_torch(tmp_path):
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    from mpicoll.cli import main
    log = tmp_path / "run.jsonl"
    assert main(["train", "--model", "cnn", "--epochs", "2", "--quiet", "--output", str(log)]) == 0
    _, summary = read_log(log)
    assert summary["model_size"] == CNN(64, 10).size and summary["final_accuracy"] > 0.5, summary


def test_the_report_comes_from_recorded_logs(tmp_path):
    pytest.importorskip("matplotlib")
    data = digits()
    logs = []
    for method in ("allreduce-ring", "sgp"):
        logs.append(tmp_path / f"{method}.jsonl")
        train(WORLD, Options(method=method, epochs=2, output=str(logs[-1]), progress=False),
              SoftmaxRegression(data.features, data.classes), data)
    markdown = report(logs, tmp_path / "report", target=0.5).read_text()
    for method in ("allreduce-ring", "sgp"):
        assert f"| {method} | 1 | 1 |" in markdown
    # runs of one method make one row: means ± spread, and wall time as a ratio to the first row
    again = tmp_path / "allreduce-ring.2.jsonl"
    train(WORLD, Options(method="allreduce-ring", epochs=2, output=str(again), progress=False),
          SoftmaxRegression(data.features, data.classes), data)
    rows = {line.split(" | ")[0][2:]: line.split(" | ")
            for line in report([logs[0], again, logs[1]], tmp_path / "grouped", target=0.5).read_text().splitlines()
            if line.startswith("| allreduce-ring") or line.startswith("| sgp")}
    ring, sgp = rows["allreduce-ring"], rows["sgp"]
    walls = [read_log(log)[1]["wall_s"] for log in (logs[0], again)]
    assert ring[2] == "2" and sgp[2] == "1" and "±" in ring[6] and "±" not in sgp[6], rows
    assert float(ring[6].split(" ± ")[0]) == pytest.approx(np.mean(walls), abs=0.01) and ring[7] == "1.00", ring
    assert float(sgp[7]) == pytest.approx(read_log(logs[1])[1]["wall_s"] / np.mean(walls), abs=0.01), sgp
    for png in ("loss_vs_time.png", "accuracy_vs_epoch.png"):
        assert (tmp_path / "report" / png).stat().st_size > 5000
    broken = tmp_path / "broken.jsonl"
    broken.write_text(logs[0].read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl line 2: not JSON"):
        report([broken], tmp_path / "again")


@pytest.mark.mpi
@pytest.mark.parametrize("method, compression", [
    ("allreduce-ring", {}), ("sgp", {}), ("ps-sync", {}),
    ("allreduce-ring", {"compression": "fp16", "error_feedback": True}),
    ("allreduce-auto", {"compression": "powersgd", "powersgd_rank": 1, "powersgd_start": 3}),
    ("diloco", {"sync_every": 7, "inner_optimizer": "adamw", "lr": 0.01}),
    ("localsgd", {"sync_every": 6, "fragments": 2, "overlap": 2, "mix": 0.3, "compression": "bf16",
                  "inner_momentum": 0.9}),
    ("diloco", {"sync_every": 5, "compression": "int8"})])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(method, compression, tmp_path_factory):
    """Stop after 2 of 4 epochs (checkpoints after every epoch), resume: the same final model, to the bit.  A
    compression's state (the error feedback's residuals, PowerSGD's step count, factors and residuals) is in the
    checkpoint too: without it, the resumed run's loss differs."""
    if method == "ps-sync" and P < 2:
        pytest.skip("a parameter server needs a server and a worker")
    data = digits()
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("checkpoints")) if RANK == 0 else None)
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)

    def run(epochs, **extra):
        options = Options(**{**dict(method=method, epochs=epochs, batch=16, lr=0.05, seed=4, progress=False,
                                     transport="p2p"), **compression, **extra})
        summary = train(WORLD, options, model, data)
        return [s for s in WORLD.allgather(summary) if s][0]

    straight = run(4)
    run(2, checkpoint=f"{folder}/job")
    resumed = run(4, checkpoint=f"{folder}/job", resume=True, output=f"{folder}/resumed.jsonl")
    epochs = [r["epoch"] for r in read_log(f"{folder}/resumed.jsonl")[0]]
    everywhere(epochs and epochs[0] == 3, f"{method}: the resumed run evaluated epochs {epochs}, not from 3")
    everywhere(resumed["final_loss"] == straight["final_loss"],
               f"{method}: resumed run ends at loss {resumed['final_loss']!r}, uninterrupted "
               f"{straight['final_loss']!r}")




@pytest.mark.mpi
def test_a_compression_without_a_state_to_resume_starts_afresh_saying_why(tmp_path_factory, capfd):
    """Resumed with another --compression, or from a run that kept no state: the parameters resume, and the
    compression's state starts afresh, said once by rank 0."""
    data = digits()
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("checkpoints")) if RANK == 0 else None)
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)

    def run(epochs, **extra):
        train(WORLD, Options(method="allreduce-ring", epochs=epochs, batch=16, lr=0.05, seed=4, progress=False,
                             checkpoint=f"{folder}/job", **extra), model, data)
        return capfd.readouterr().err

    run(1, compression="fp16", error_feedback=True)
    said = run(2, compression="bf16", error_feedback=True, resume=True)
    everywhere(said.count("starts afresh: its state is not in the checkpoint (it was saved by Compression('fp16', "
                          "error_feedback=True))") == (RANK == 0), f"rank {RANK} said: {said!r}")
    run(3, resume=True)             # saved without compression: the older state files beside it are not its own
    said = run(4, compression="bf16", error_feedback=True, resume=True)
    everywhere(said.count("starts afresh: its state is not in the checkpoint (the earlier run kept none)") ==
               (RANK == 0) and "resuming from the checkpoint set after" not in said, f"rank {RANK} said: {said!r}")


@pytest.mark.mpi
def test_train_returns_once_the_checkpoint_every_rank_resumes_from_is_written(tmp_path_factory, monkeypatch):
    """Every rank resumes from the first replica's file: with its writer slowed, no rank returns from train()
    before the file holds the last epoch (a train() after it in the same program read a file still being
    written, 1 run in about 16 of the 2-rank tests)."""
    from mpicoll.base import checkpoint
    data = digits()
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("written")) if RANK == 0 else None)
    save = checkpoint.save

    def slow_save(*args, **kwargs):
        time.sleep(0.5)
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", slow_save)
    train(WORLD, Options(method="allreduce-ring", epochs=1, batch=64, lr=0.05, progress=False,
                         checkpoint=f"{folder}/job"), SoftmaxRegression(data.features, data.classes), data)
    try:
        held = sorted(checkpoint.versions(checkpoint.path(f"{folder}/job"), {}))
    except FileNotFoundError:
        held = []
    everywhere(held == [1], f"rank {RANK} found the checkpoint holding {held} when train() returned")


class _PoisonedOnLastRank(MLP):
    """An MLP whose gradient and loss on the last rank turn NaN at its third gradient (step 3 of epoch 1)."""

    calls = 0

    def loss_and_gradient(self, params, X, y, gradient=True):
        loss, grad = super().loss_and_gradient(params, X, y, gradient)
        self.calls += 1
        if RANK == P - 1 and self.calls == 3:
            grad[::7] = np.nan
            loss = np.nan
        return loss, grad


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["allreduce-ring", "sgp"])
def test_training_that_diverges_stops_every_rank_naming_where_it_went_bad(method, tmp_path_factory):
    """A NaN gradient on one rank: every rank raises Diverged naming that rank and step (the allreduce methods
    after that epoch, before its checkpoint is written; SGP at the end), instead of a run that ends with
    loss nan and exit status 0.  A healthy run of the same model is untouched by the check."""
    data = digits()
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("diverged")) if RANK == 0 else None)
    model = _PoisonedOnLastRank(data.features, data.classes, [16])
    options = Options(method=method, epochs=2, batch=16, lr=0.1, seed=3, progress=False,
                      checkpoint=f"{folder}/job" if method == "allreduce-ring" else None)
    with pytest.raises(mpicoll.Diverged, match=rf"on rank\(s\) {P - 1}, at step 3 of epoch 1\. Try a smaller --lr"):
        train(WORLD, options, model, data)
    if method == "allreduce-ring":
        everywhere(not list(Path(folder).iterdir()), "a checkpoint of the diverged epoch was written")
    healthy = train(WORLD, Options(method=method, epochs=1, batch=16, lr=0.1, seed=3, progress=False),
                    MLP(data.features, data.classes, [16]), data)
    losses = [s["final_loss"] for s in WORLD.allgather(healthy) if s]
    everywhere(len(losses) == 1 and np.isfinite(losses[0]), f"healthy run: {losses}")

@pytest.mark.mpi(min_size=2)
def test_a_resumed_model_parallel_run_ends_where_an_uninterrupted_one_does(tmp_path_factory):
    """--model-parallel 2: one checkpoint file per stage, written by the first replica's stages; stop after
    2 of 4 epochs, resume: the same final model.  Stage files with no epoch in common are refused on every rank
    (a set torn between its writes resumes from the newest common epoch: tests/base/test_checkpoint.py)."""
    if P % 2:
        pytest.skip(f"{P} ranks make no whole replicas of 2 stages")
    data = digits()
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("stages")) if RANK == 0 else None)
    model = MLP(data.features, data.classes, [16, 12], dtype=np.float64)

    def run(epochs, **extra):
        options = Options(method="allreduce-ring", epochs=epochs, batch=8, lr=0.2, seed=5, progress=False,
                          model_parallel=2, **extra)
        summary = train(WORLD, options, model, data)
        return [s for s in WORLD.allgather(summary) if s][0]

    straight = run(4)
    run(2, checkpoint=f"{folder}/job")
    files = sorted(p.name for p in Path(folder).iterdir())
    everywhere(files == ["job.stage0.npz", "job.stage0.previous.npz", "job.stage1.npz", "job.stage1.previous.npz"],
               f"files written: {files}")
    resumed = run(4, checkpoint=f"{folder}/job", resume=True)
    everywhere(resumed["final_loss"] == straight["final_loss"],
               f"resumed run ends at loss {resumed['final_loss']!r}, uninterrupted {straight['final_loss']!r}")
    run(1, checkpoint=f"{folder}/early")
    if RANK == 0:       # stage 1 at epoch 1 only, stage 0 at epochs 3 and 4: no epoch in common
        shutil.copy(f"{folder}/early.stage1.npz", f"{folder}/job.stage1.npz")
        os.remove(f"{folder}/job.stage1.previous.npz")
    WORLD.Barrier()
    with pytest.raises(mpicoll.SetupError, match=r"hold no epoch in common \(rank 0: 3, 4; rank 1: 1"):
        run(5, checkpoint=f"{folder}/job", resume=True)


@pytest.mark.parametrize("name, module, shapes", [("mnist1d", "mnist1d", ((4000, 40), (1000, 40))),
                                                   ("digits", "sklearn", ((1438, 64), (359, 64)))])
def test_a_built_in_data_set_is_made_once_and_cached(tmp_path, monkeypatch, name, module, shapes):
    """The cached arrays are the made ones to the bit; a later load (a new process) reads them without
    importing the package that made them (scikit-learn's import costs each rank ~0.7 s of CPU); a damaged
    cache is made again."""
    pytest.importorskip(module, reason=f"{name} needs the data extra")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    data = load(name)
    assert (data.X.shape, data.X_test.shape, data.classes, data.name) == (*shapes, 10, name)
    cache = tmp_path / "mpicoll" / f"{name}.npz"
    assert cache.is_file()
    again = load(name)
    assert np.array_equal(again.X, data.X) and np.array_equal(again.y_test, data.y_test)
    assert again.fingerprint() == data.fingerprint()
    imported = subprocess.run([sys.executable, "-c", f"import sys; from mpicoll.train import load; load({name!r}); "
                               f"print({module!r} in sys.modules)"], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path)})
    assert imported.stdout.split() == ["False"], imported.stderr[-2000:]
    with np.load(cache) as kept:
        made = {key: kept[key] for key in kept.files}
    cache.write_bytes(cache.read_bytes()[:100])             # cut short (a full disk)
    assert load(name).fingerprint() == data.fingerprint()
    with np.load(cache) as remade:                          # made again, whole
        assert remade.files == list(made) and all(np.array_equal(remade[key], made[key]) for key in made)
