"""What the claims' runs rest on (sequential SGD, learning-rate schedules, delay models, staleness) and
``scripts/reproduce-results`` end to end on a small data set."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import ps
from mpicoll.base.straggler import Straggler, parse_delay
from mpicoll.train import Options, SoftmaxRegression, load, train
from mpicoll.train import schedule
from mpicoll.train.common import batches as _batches
from tests.support.jobs import ROOT, mpiexec
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed
from tests.support.parameter_servers import run_roles



@pytest.mark.parametrize("spec, expected", [
    ("constant", [0.2, 0.2, 0.2, 0.2]),
    ("step:0.5,0.75", [0.2, 0.02, 0.002, 0.002]),
    ("step:0.75,0.5", [0.2, 0.02, 0.002, 0.002]),
    ("cosine", [0.2, 0.1, 0.2 * 0.5 * (1 + np.cos(0.75 * np.pi)), 0.0]),
])
def test_learning_rate_schedules_over_the_budget(spec, expected):
    lr_at = schedule.parse(spec, 0.2)
    assert [lr_at(progress) for progress in (0.0, 0.5, 0.75, 1.0)] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("spec", ["step", "step:", "step:0,0.5", "step:1.5", "linear", "cosine:2", "constant:1"])
def test_bad_schedules_are_refused_with_the_forms_that_work(spec):
    with pytest.raises(ValueError, match="write constant, cosine, or step"):
        schedule.parse(spec, 0.1)


@pytest.mark.parametrize("spec", ["gamma:2", "gamma:0,1", "gamma:a,b", "normal:1,2", "exp:-1", "fixed:inf"])
def test_bad_delays_are_refused_with_the_forms_that_work(spec):
    with pytest.raises(ValueError, match="gamma:SHAPE,SCALE_MS"):
        parse_delay(spec)


def test_delays_are_drawn_from_the_distribution_seeded_per_rank():
    draw = parse_delay("gamma:2,1.5")                        # mean 3 ms, variance 4.5 ms^2
    samples = np.array([draw(np.random.default_rng(seed)) for seed in range(4000)]) * 1000
    assert samples.mean() == pytest.approx(3.0, rel=0.06) and samples.var() == pytest.approx(4.5, rel=0.15)
    first, again, other = (Straggler.for_rank(rank, None, "exp:2", seed=7) for rank in (1, 1, 2))
    a, b, c = ([s.delay(s.rng) for _ in range(5)] for s in (first, again, other))
    assert a == b and a != c, "the same rank and seed must draw the same delays, another rank others"
    slow = Straggler(delay=parse_delay("fixed:30"))
    before = time.perf_counter()
    with slow:
        pass
    assert time.perf_counter() - before >= 0.03 and slow.delayed_s == pytest.approx(0.03)


def blobs(rows: int = 600, features: int = 12, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, features)) * 1.5
    y = rng.integers(0, classes, rows)
    return (centres[y] + rng.standard_normal((rows, features))).astype(np.float32), y


@pytest.mark.mpi
def test_sequential_with_a_step_schedule_is_plain_sgd_with_that_schedule(tmp_path_factory):
    """Every rank trains alone (COMM_SELF); the run must equal a float64 loop of SGD with the rate cut
    at half the budget, and a parallel launch of the method is refused on every rank."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("data")) if RANK == 0 else None)
    path = f"{folder}/blobs.npz"
    if RANK == 0:
        np.savez(path, **dict(zip(("X", "y"), blobs())))
    WORLD.Barrier()
    data = load(path, seed=0)
    model = SoftmaxRegression(data.features, data.classes, dtype=np.float64)
    options = Options(method="sequential", epochs=4, batch=16, lr=0.3, lr_schedule="step:0.5", seed=2,
                      progress=False)
    summary = train(MPI.COMM_SELF, options, model, data)
    steps = -(-len(data.y) // options.batch)
    params = model.init(2)
    for epoch in range(options.epochs):
        for step, batch in enumerate(_batches(len(data.y), options.batch, steps, [2, 0, epoch])):
            lr = 0.3 if (epoch * steps + step) < options.epochs * steps / 2 else 0.03
            params = params - lr * model.loss_and_gradient(params, data.X[batch], data.y[batch])[1]
    expected = model.evaluate(params, data.X_test, data.y_test)[0]
    everywhere(abs(summary["final_loss"] - expected) < 1e-9, f"{summary['final_loss']!r} against {expected!r}")
    if P > 1:
        with pytest.raises(mpicoll.SetupError, match="run it with mpiexec -n 1"):
            train(WORLD, options, model, data)


@pytest.mark.mpi(min_size=2)
def test_a_servers_schedule_sets_the_rules_rate_before_each_update():
    """All-ones gradients: the first two updates at 0.1, the rest at 0.01, whatever order they come in."""
    server = ps.ParameterServer(WORLD, np.ones(3), ps.Async(lr=5.0), servers=1)
    steps = 4

    def work(client):
        client.pull()
        for _ in range(steps):
            client.exchange(np.ones(3))

    final, _ = run_roles(server, work, lr_at=lambda version: 0.1 if version < 2 else 0.01)
    updates = steps * (P - 1)
    everywhere(np.allclose(final, 1 - 0.2 - 0.01 * (updates - 2)), f"final weights {final}")


@pytest.mark.mpi(min_size=3)
def test_async_staleness_is_counted_in_the_log(tmp_path_factory):
    """Every gradient's staleness is in the summary; with one server and W workers taking turns, the
    lags spread around W - 1 and there are as many as gradients the servers took."""
    seed = shared_seed()
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("logs")) if RANK == 0 else None)
    X, y = blobs(seed=seed % 1000)
    path = f"{folder}/blobs.npz"
    if RANK == 0:
        np.savez(path, X=X, y=y)
    WORLD.Barrier()
    data = load(path, seed=0)
    model = SoftmaxRegression(data.features, data.classes)
    options = Options(method="ps-async", epochs=2, batch=8, lr=0.05, seed=1, progress=False,
                      delay="exp:1", output=f"{folder}/run.jsonl")
    summary = train(WORLD, options, model, data)
    final = [s for s in WORLD.allgather(summary) if s][0]
    lags = {int(lag): count for lag, count in final["staleness"].items()}
    gradients = final["samples"] // options.batch
    everywhere(sum(lags.values()) >= gradients and max(lags) >= 1, f"staleness {lags}, {gradients} gradients")


@pytest.mark.watchdog(300)
def test_reproduce_quick_writes_claims_that_follow_from_its_own_logs(tmp_path):
    """``scripts/reproduce-results --quick`` on a data file: every claim record is well formed, and its
    figures are recomputed here from the runs' own logs."""
    pytest.importorskip("matplotlib")
    X, y = blobs(rows=900, seed=3)
    np.savez(tmp_path / "blobs.npz", X=X, y=y)
    out = tmp_path / "results"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce-results"), "--quick", "--claims", "abcdef",
                             "--data", str(tmp_path / "blobs.npz"), "--output", str(out), "--max-train", "500"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MPIEXEC": mpiexec(),
                                 "MPICOLL_END_BROKEN_JOBS": "1"})      # (d): survivors end their job
    assert result.returncode == 0, result.stderr[-3000:]
    claims = json.loads((out / "claims.json").read_text())
    with np.load(out / "runs" / "data.npz") as subset:              # 720 training, 180 test samples, cut
        assert (len(subset["y"]), len(subset["y_test"])) == (500, 125)
    assert claims["setting"]["data"].endswith("data.npz")
    records = {record["id"]: record for record in claims["claims"]}
    assert list(records) == ["a-dcasgd-a", "a-dcasgd-c", "b", "c", "d", "e-diloco", "e-localsgd", "f-ringmaster",
                             "f-rescaled"], list(records)
    assert all(set(r) == {"id", "claim", "setting", "reproduced", "figures", "note"} for r in records.values())
    for emulated in ("c", "e-diloco", "e-localsgd"):        # --quick makes no cluster
        assert records[emulated]["reproduced"] is None and "skipped" in records[emulated]["note"]
    for rule in ("ringmaster", "rescaled"):                 # (f) from its own logs: accuracy and wall time
        figures = records[f"f-{rule}"]["figures"]
        for name in ("ps-async", rule):
            logged = [json.loads(log.read_text().splitlines()[-1]) for log in sorted((out / "runs").glob(
                f"f-{name}-seed*.jsonl"))]
            assert len(logged) == 2 and figures[name]["accuracy"]["mean"] == pytest.approx(
                statistics.fmean(s["final_accuracy"] for s in logged))
        assert isinstance(records[f"f-{rule}"]["reproduced"], bool)

    def errors(pattern):
        logs = sorted((out / "runs").glob(pattern))
        assert len(logs) == 2, logs
        return [1 - json.loads(log.read_text().splitlines()[-1])["final_accuracy"] for log in logs]

    figures = records["a-dcasgd-a"]["figures"]
    for label, pattern in (("sequential", "a-sequential-*.jsonl"), ("asgd M=2", "a-asgd-M2-*.jsonl"),
                           ("dcasgd-a M=2", "a-dcasgd-a-M2-*.jsonl")):
        assert figures["test error"][label]["mean"] == pytest.approx(statistics.fmean(errors(pattern)))
        assert figures["test error"][label]["sd"] == pytest.approx(statistics.stdev(errors(pattern)))
    sequential, asgd = statistics.fmean(errors("a-sequential-*.jsonl")), statistics.fmean(errors("a-asgd-*.jsonl"))
    closed, a = figures["gap closed"]["M=2"], records["a-dcasgd-a"]
    if asgd > sequential:
        dc = statistics.fmean(errors("a-dcasgd-a-M2-*.jsonl"))
        assert closed == pytest.approx((asgd - dc) / (asgd - sequential)) and a["reproduced"] == (closed >= 0.5)
    else:
        assert closed is None and "no gap to close" in a["note"] and not a["reproduced"], a
    assert "dcasgd-c M=2" in records["a-dcasgd-c"]["figures"]["test error"]
    walls = {label: records["b"]["figures"][label]["wall s"]["mean"] for label in ("sync", "softsync", "async")}
    accuracy = {label: records["b"]["figures"][label]["accuracy"]["mean"] for label in walls}
    expected = all(walls[m] < walls["sync"] and accuracy[m] >= accuracy["sync"] - 0.01 for m in ("softsync", "async"))
    assert records["b"]["reproduced"] == expected, records["b"]
    killed = records["d"]["figures"]
    assert killed["workers killed mid-run"] == killed["killed runs that finished"] == "2 of 2", records["d"]
    for output in sorted((out / "runs").glob("d-downpour-killed-*.out")):    # between messages, or inside one
        assert re.search(r"worker rank 2 died (in the middle of [a-z ]+ )?\(the MPI library reports its process "
                         r"gone\): dropped", output.read_text()), output.read_text()[-2000:]
    report = (out / "report.md").read_text()
    assert "the claims use a fixed random 500 and 125 of them" in report
    assert all(f"## {record['claim']}" in report for record in records.values())
    assert all((out / png).stat().st_size > 5000 for png in ("a-error-vs-updates.png", "a-error-vs-time.png",
                                                              "a-staleness.png", "b-error-vs-time.png"))
    assert "[ 20 |" in result.stderr, result.stderr[-2000:]          # a progress line per run


def test_the_low_communication_claims_figures_count_meetings_and_bytes_from_the_summaries():
    """(e)'s figures: a low-communication run's meetings and bytes as its summary counts them; an allreduce run's
    one meeting a step (samples / ranks / batch) of a float32 gradient of the model's size."""
    from mpicoll.experiments.claims import _bytes_contributed, _meetings
    ring = {"samples": 2560, "ranks": 4, "options": {"batch": 32}, "model_size": 1000}
    diloco = {**ring, "communication": {"meetings": 5, "bytes_summed_per_rank": 20000}}
    assert _meetings(ring) == 20 and _bytes_contributed(ring) == 20 * 1000 * 4
    assert _meetings(diloco) == 5 and _bytes_contributed(diloco) == 20000
