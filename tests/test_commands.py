"""The commands and launch behaviour, run as a user would: real ``mpiexec`` subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import mpicoll.collectives.algorithms
from mpicoll import ps
from conftest import ROOT, command, launch, mpiexec


def bench(tmp_path, ranks: int, command: str, *options: str):
    """Run ``mpicoll COMMAND OPTIONS --output FILE`` under mpiexec: (its result, the records it wrote)."""
    out = tmp_path / f"{command}.json"
    result = launch(ranks, "-m", "mpicoll", command, *options, "--output", str(out))
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text())

def test_bench_writes_table_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = launch(2, "-m", "mpicoll", "bench", "--sizes", "8,64K,3M", "--iters", "3", "--min-iters", "2",
                    "--warmup", "1", "--output", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    records = json.loads(out.read_text())
    algorithms = set(mpicoll.collectives.algorithms.names())
    assert {r["algorithm"] for r in records} == algorithms
    assert sorted({r["bytes"] for r in records}) == [8, 65536, 3 << 20]
    for record in records:
        assert {"algorithm", "bytes", "ranks", "dtype", "time_s", "algbw_gbps", "busbw_gbps"} <= set(record)
        assert record["ranks"] == 2 and record["dtype"] == "float32" and record["time_s"] > 0
        assert record["busbw_gbps"] == pytest.approx(record["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "per-call overhead of the Python layer" in result.stdout
    assert all(name in result.stdout for name in algorithms)


def test_info_reports_mpi_and_auto_rules():
    result = launch(2, "-m", "mpicoll", "info")
    assert result.returncode == 0, result.stderr
    assert "mpi4py" in result.stdout and "ranks      2" in result.stdout and "allreduce: mpi below" in result.stdout
    assert "allgather (across nodes of several ranks): mpi below 131072 B, hierarchical" in result.stdout
    assert "kernels    numpy: available" in result.stdout and "CUDA-aware " in result.stdout and "GPU " in result.stdout


def test_dead_rank_is_named_by_its_neighbour(tmp_path):
    """A rank dies mid-run: the survivors raise CollectiveTimeout naming it, instead of hanging.

    The rank exits abruptly (no MPI_Finalize).  A SIGKILL does the same to mpicoll, but
    MPICH 5.0.2's Hydra then sometimes tears the whole job down ("unable to forward PMI
    response"), so the test would measure the launcher rather than mpicoll.
    """
    script = tmp_path / "dead.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, numpy as np
        from mpi4py import MPI
        import mpicoll
        world = MPI.COMM_WORLD
        comm = mpicoll.Communicator(world, algorithm="ring")
        comm.Allreduce(np.ones(50000), np.empty(50000))
        world.Barrier()
        time.sleep(0.5)   # let the launcher's own traffic with every rank settle
        if world.rank == world.size - 1:
            os._exit(1)
        try:
            comm.Allreduce(np.ones(50000), np.empty(50000))
            outcome = "finished"
        except mpicoll.CollectiveTimeout as error:
            outcome = str(error)
        # stdout may be lost when the job is torn down: leave the outcome in a file
        with open(os.path.join(sys.argv[1], f"rank{world.rank}.txt"), "w") as handle:
            handle.write(outcome)
        time.sleep(0.5)
        world.Abort(0)
    """))
    result = launch(3, str(script), str(tmp_path), env={"MPICOLL_TIMEOUT": "2"}, extra=["-disable-auto-cleanup"],
                    timeout=120)
    outcomes = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)
                if (tmp_path / f"rank{rank}.txt").exists()}
    assert 0 in outcomes, f"rank 0 left no outcome: {result.stdout} {result.stderr}"
    assert outcomes[0].startswith("Allreduce: rank 0 waited 2 s for rank(s) 2,"), outcomes
    assert all("finished" not in text for text in outcomes.values())


def test_watchdog_names_the_stuck_rank(tmp_path):
    """A test that hangs on one rank is aborted, naming rank and test, instead of hanging CI."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import time
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi
        def test_rank_one_never_arrives():
            if MPI.COMM_WORLD.rank == 1:
                time.sleep(60)
            MPI.COMM_WORLD.Barrier()
    """))
    result = subprocess.run([*command(2), sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p",
                             "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "MPICOLL_TEST_TIMEOUT": "3", "PYTHONPATH": str(ROOT)})
    assert result.returncode != 0
    assert "stuck in test_hang.py::test_rank_one_never_arrives" in result.stderr, result.stderr


def script_env(**extra) -> dict:
    """The environment a user's shell would have: this venv's bin first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), **extra}


def test_launcher_runs_a_command_with_a_hostfile():
    mpiexec()
    result = subprocess.run(["bash", "scripts/launch", "-n", "2", "--hostfile", "hostfiles/localhost.mpich", sys.executable,
                             "-c", "from mpi4py import MPI; w = MPI.COMM_WORLD; n = w.allreduce(1); "
                                   "w.rank or print('ranks', n, 'size', w.size)"],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120)
    if "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
        pytest.skip("the localhost example is an MPICH hostfile")
    assert result.returncode == 0, result.stderr
    assert "ranks 2 size 2" in result.stdout


@pytest.mark.parametrize("content", ["localhost:2  # this laptop\n", "localhost:2\r\n\r\n"],
                         ids=["trailing-comment", "crlf"])
def test_launcher_cleans_comments_and_windows_line_ends(tmp_path, content):
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(content.encode())
    if "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
        pytest.skip("an MPICH hostfile")
    result = subprocess.run(["bash", "scripts/launch", "-n", "2", "--hostfile", str(hostfile), sys.executable, "-c",
                             "from mpi4py import MPI; w = MPI.COMM_WORLD; w.rank or print('size', w.size)"],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "size 2" in result.stdout, result.stderr


@pytest.mark.parametrize("content, words", [
    (None, "does not exist"),
    ("# nothing here\n\n", "names no host"),
    ("node01 slots=4\n", "line 1"),
    ("localhost:0\n", "1 to 99999 slots"),
    ("localhost:99999999999999999999\n", "1 to 99999 slots"),
])
def test_launcher_explains_a_bad_hostfile(tmp_path, content, words):
    """Refused before the launcher starts, naming the line (Hydra dies of SIGFPE on 0 slots, spins on huge ones)."""
    mpiexec()
    hostfile = tmp_path / "hosts"
    if content is not None:
        hostfile.write_text(content)
    if content and "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
        pytest.skip("this hostfile is valid for Open MPI")
    result = subprocess.run(["bash", "scripts/launch", "-n", "2", "--hostfile", str(hostfile), "true"],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and words in result.stderr, result.stderr


def test_slurm_script_runs_the_benchmark_outside_slurm(tmp_path):
    """The batch script is plain bash: with the mpiexec launcher it runs anywhere."""
    mpiexec()
    prefix = tmp_path / "run"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "bench.sbatch")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=240,
                            env=script_env(MPICOLL_LAUNCHER="mpiexec", SLURM_NTASKS="2", MPICOLL_OUTPUT=str(prefix),
                                           MPICOLL_BENCH_ARGS="--sizes 8,64K --iters 2 --min-iters 2 --warmup 1"))
    assert result.returncode == 0, result.stdout + result.stderr
    records = json.loads(prefix.with_suffix(".json").read_text())
    assert {r["ranks"] for r in records} == {2} and len(records) == 2 * len(mpicoll.collectives.algorithms.names())
    assert prefix.with_suffix(".png").exists()


def test_slurm_train_and_compare_scripts_run_outside_slurm(tmp_path):
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    mpiexec()
    env = script_env(MPICOLL_LAUNCHER="mpiexec", SLURM_NTASKS="2", MPICOLL_TRAIN_ARGS="--epochs 2 --quiet",
                     MPICOLL_COMPARE_ARGS="--methods allreduce-ring,sgp --data digits --model softmax --epochs 2 --quiet",
                     MPICOLL_OUTPUT=str(tmp_path / "out.jsonl"))
    result = subprocess.run(["bash", str(ROOT / "scripts" / "train.sbatch")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[-1])["ranks"] == 2
    env["MPICOLL_OUTPUT"] = str(tmp_path / "report")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "compare.sbatch")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| sgp | 2 |" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("args, words", [(["train", "--epocs", "3"], "unrecognized arguments: --epocs 3 (did you "
                                                                       "mean --epochs?)"),
                                         (["train", "--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
                                         (["trian"], "invalid choice: 'trian'")])
def test_a_usage_error_is_one_line_per_job_not_one_usage_per_rank(args, words):
    result = launch(4, "-m", "mpicoll", *args)
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert words in lines[0] and lines[0].endswith("--help"), lines


def test_every_option_of_every_command_says_what_it_does():
    import argparse
    from mpicoll.cli import make_parser

    def silent(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word, sub in action.choices.items():
                    yield from silent(sub, f"{name} {word}")
            elif not action.help:
                yield f"{name} {'/'.join(action.option_strings) or action.dest}"

    assert list(silent(make_parser(), "mpicoll")) == []


def test_one_option_chooses_how_ranks_exchange_for_parameter_servers_and_gossip():
    """--transport is the one name for p2p or onesided (parameter servers and SGP alike); --mailbox, SGP's old
    name for it, sets the same thing."""
    from mpicoll.cli import make_parser
    from mpicoll.train import Options
    parse = make_parser().parse_args
    for words, expected in [([], "p2p"), (["--transport", "onesided"], "onesided"), (["--mailbox", "onesided"],
                                                                                    "onesided")]:
        options = Options.from_args(parse(["train", "--method", "sgp", *words]))
        assert options.transport == expected and not hasattr(options, "mailbox"), words


ANNOUNCED = {"srun": {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3"},
             "Open MPI's mpirun": {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"}}


@pytest.mark.parametrize("who", ANNOUNCED)
def test_a_launch_that_started_more_tasks_than_mpi_sees_stops_before_any_work(tmp_path, who):
    """A launcher announced 3 tasks, MPI (the MPICH wheel, started alone) sees a world of 1: the command says so
    in one line with the fix, the library raises before its first collective; MPICOLL_CHECK_LAUNCH=0 lets the
    process run alone."""
    output = tmp_path / "train.jsonl"
    env = script_env(**ANNOUNCED[who])
    result = subprocess.run([sys.executable, "-m", "mpicoll", "train", "--epochs", "1", "--output", str(output)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    # (where Open MPI's variables meet another MPI, mpi4py adds a warning of its own before it)
    lines = result.stderr.splitlines()
    assert lines[-1].startswith(f"mpicoll train: {who} started 3 tasks"), result.stderr
    assert sum(line.startswith("mpicoll") for line in lines) == 1 and (who != "srun" or len(lines) == 1), lines
    assert "world of 1" in result.stderr and ("--mpi=pmi2" in result.stderr) == (who == "srun"), result.stderr
    assert not output.exists()
    program = "import numpy, mpicoll; print(mpicoll.allreduce(numpy.ones(2)))"
    library = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    assert library.returncode == 1 and "LaunchMismatch" in library.stderr, library.stderr
    alone = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env={**env, "MPICOLL_CHECK_LAUNCH": "0"},
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0 and alone.stdout.strip() == "[1. 1.]", alone.stderr


def test_bench_kernels_reports_bandwidth_against_copy(tmp_path):
    out = tmp_path / "kernels.json"
    result = subprocess.run([sys.executable, "-m", "mpicoll", "bench-kernels", "--elements", "100003", "--iters", "2",
                             "--threads", "1", "--backends", "numpy,numba,cupy", "--output", str(out)],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = json.loads(out.read_text())
    for record in records:
        assert {"kernel", "backend", "elements", "dtype", "time_s", "gbps", "fraction_of_copy"} <= set(record)
        assert record["elements"] == 100003 and record["time_s"] > 0 and record["gbps"] > 0
    numpy_rows = {r["kernel"]: r for r in records if r["backend"] == "numpy"}
    assert numpy_rows["copy"]["fraction_of_copy"] == pytest.approx(1.0)
    assert {"dcasgd", "dcasgd_adaptive", "adagrad", "sgd", "scaled_accumulate", "reduce_sum"} <= set(numpy_rows)
    if "numba" in result.stdout.split("skipped")[0]:
        assert any(r["backend"] == "numba" and r["kernel"] == "dcasgd" for r in records)
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        assert "# cupy: skipped" in result.stdout


@pytest.mark.parametrize("transport", ps.TRANSPORTS)
def test_parameter_server_survives_a_worker_killed_by_sigkill(tmp_path, transport):
    """async training, 1 server + 3 workers, under ``scripts/launch --keep-going``; one worker
    is killed with SIGKILL mid-run: training finishes, the server's log names the lost rank, and the
    healthy workers get the final weights and learn which worker was lost."""
    script = tmp_path / "ps_dead.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time, numpy as np
        from mpi4py import MPI
        from mpicoll import ps
        world = MPI.COMM_WORLD
        rng = np.random.default_rng(0)
        X = rng.standard_normal((300, 8)); y = X @ rng.standard_normal(8)
        server = ps.ParameterServer(world, np.zeros(8), ps.Async(lr=0.05), servers=1, transport=sys.argv[2])
        doomed = server.layout.workers[-1]
        outcome = ""
        if server.is_server:
            stats = server.serve(worker_timeout=1.0)
            outcome = f"lost {stats.lost} updates {stats.updates}"
        else:
            w = server.client.pull().copy()
            for step in range(400):
                if world.rank == doomed and step == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                pick = rng.integers(0, 300, 16)
                w = server.client.exchange(X[pick].T @ (X[pick] @ w - y[pick]) / 16).copy()
            server.client.close()
            outcome = f"trained, error {np.linalg.norm(X @ w - y) / np.linalg.norm(y):.1e}"
        final = server.gather_weights()
        outcome += f"; final error {np.linalg.norm(X @ final - y) / np.linalg.norm(y):.1e}, lost {server.lost}"
        server.close()
        with open(os.path.join(sys.argv[1], f"rank{world.rank}.txt"), "w") as handle:
            handle.write(outcome)
        # MPI_Finalize would wait for the dead rank: rank 0 ends the job once the survivors have written
        deadline = time.time() + 20
        while world.rank == 0 and time.time() < deadline and len(os.listdir(sys.argv[1])) < 4:
            time.sleep(0.05)
        time.sleep(0.2 if world.rank == 0 else 30)
        world.Abort(0)
    """))
    result = subprocess.run([str(ROOT / "scripts" / "launch"), "--keep-going", "-n", "4", sys.executable, str(script),
                             str(tmp_path), transport], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MPIEXEC": mpiexec()}, start_new_session=True)
    outcomes = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in range(4)
                if (tmp_path / f"rank{rank}.txt").exists()}
    assert outcomes.get(0, "").startswith("lost [3]"), (outcomes, result.stderr[-2000:])
    assert all(outcomes.get(rank, "").startswith("trained") for rank in (1, 2)), outcomes
    assert all(outcomes[rank].endswith("lost [3]") and float(outcomes[rank].split("final error ")[1][:7]) < 0.05
               for rank in (0, 1, 2)), outcomes
    # Hydra reports the dead process: the server drops it at once, not after the worker timeout
    assert "worker rank 3 died (the MPI library reports its process gone): dropped" in result.stderr, \
        result.stderr[-2000:]


def test_bench_ps_reports_every_rule(tmp_path):
    result, records = bench(tmp_path, 3, "bench-ps", "--sizes", "64K", "--seconds", "0.3", "--compute-ms", "2",
                            "--rules", "sync,async,dcasgd", "--straggler", "2=3", "--link-gbps", "1")
    assert result.stdout.count("every worker on the server's node, no link crossed") == 6, result.stdout
    assert {(r["rule"], r["straggler"]) for r in records} == {(rule, s) for rule in ("sync", "async", "dcasgd")
                                                              for s in ("", "2=3")}
    for record in records:
        assert record["params"] == 65536 // 4 and record["workers"] == 2 and record["updates_per_s"] > 0
        assert 0 < record["update_fraction_of_copy"] and record["gbps"] > 0
        assert record["remote_workers"] == 0 and record["of_link_bound"] == 0


def test_bench_sandblaster_times_every_worker_count_and_case(tmp_path):
    result, records = bench(tmp_path, 4, "bench-sandblaster", "--params", "4096", "--rows", "64", "--compute-ms", "4",
                            "--iterations", "2")
    assert [(r["workers"], r["straggler"], r["backup"]) for r in records] == \
        [(1, False, True), (2, False, True), (2, True, False), (2, True, True)]
    for record in records:
        assert record["iterations"] == 2 and record["evaluation_s"] > 0 and 0 < record["efficiency"]
        assert (record["backups"] == 0) if not record["backup"] else record["backups"] >= 0
    assert "efficiency" in result.stdout


def test_train_shows_progress_and_refuses_a_bad_data_file(tmp_path):
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    result = launch(2, "-m", "mpicoll", "train", "--method", "allreduce-auto", "--epochs", "3",
                    "--output", str(tmp_path / "run.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "epoch   3/3 [####################]" in result.stderr and "test accuracy" in result.stderr
    assert json.loads((tmp_path / "run.jsonl").read_text().splitlines()[-1])["final_accuracy"] > 0.8
    (tmp_path / "bad.npz").write_bytes(b"nonsense")
    result = launch(2, "-m", "mpicoll", "train", "--data", str(tmp_path / "bad.npz"))
    assert result.returncode != 0 and "not an .npz archive" in result.stderr, result.stderr


def test_an_output_log_belongs_to_one_run(tmp_path):
    """A second run onto an existing --output is refused and leaves it as it was; --overwrite replaces it, but
    not while another run holds it (two runs never interleave in one file); --resume appends."""
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    import fcntl
    log = tmp_path / "run.jsonl"
    first = launch(2, "-m", "mpicoll", "train", "--epochs", "2", "--output", str(log), "--checkpoint",
                   str(tmp_path / "ck"))
    assert first.returncode == 0, first.stderr
    before = log.read_bytes()
    again = launch(2, "-m", "mpicoll", "train", "--epochs", "2", "--output", str(log))
    lines = again.stderr.splitlines()
    assert again.returncode != 0 and len(lines) == 1 and "--output" in lines[0] and "--overwrite" in lines[0], lines
    assert log.read_bytes() == before
    with open(log, "a") as held:                  # another run writing it: holds the same lock a run holds
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = launch(2, "-m", "mpicoll", "train", "--epochs", "2", "--output", str(log), "--overwrite")
    assert busy.returncode != 0 and "being written by another run" in busy.stderr, busy.stderr
    assert log.read_bytes() == before
    resumed = launch(2, "-m", "mpicoll", "train", "--epochs", "3", "--output", str(log), "--checkpoint",
                     str(tmp_path / "ck"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert log.read_bytes().startswith(before) and [r.get("epoch") for r in records if "epoch" in r] == [1, 2, 3]
    replaced = launch(2, "-m", "mpicoll", "train", "--epochs", "1", "--output", str(log), "--overwrite")
    assert replaced.returncode == 0 and len(log.read_text().splitlines()) == 2, replaced.stderr


@pytest.mark.parametrize("method", ["allreduce-ring", "ps-async"])
def test_ctrl_c_ends_every_rank_with_one_line_saying_where_training_stopped(tmp_path, method):
    """Ctrl-C in a terminal reaches the launcher and every rank (one process group): the job ends, and of mpicoll
    only the reporting rank speaks, once: the epoch reached and the checkpoint to resume from."""
    import signal
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    log = tmp_path / "run.jsonl"
    job = subprocess.Popen([*command(2), sys.executable, "-m", "mpicoll", "train", "--method", method, "--epochs",
                            "100000", "--output", str(log), "--checkpoint", str(tmp_path / "ck")], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGINT)
    try:
        errors = job.communicate(timeout=60)[1]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    ours = [line for line in errors.splitlines() if line.startswith("mpicoll") or "Traceback" in line]
    assert job.returncode != 0 and len(ours) == 1, errors[-3000:]
    assert re.fullmatch(rf"mpicoll train: interrupted after epoch \d+ of 100000; --checkpoint {tmp_path / 'ck'} "
                        r"holds the last state saved: the same command with --resume continues from there",
                        ours[0]), ours


def test_compare_writes_a_report_and_plot_redraws_it(tmp_path):
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    pytest.importorskip("matplotlib")
    folder = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "mpicoll", "compare", "-n", "3", "--algorithms",
                             "allreduce-ring,ps-async,sgp", "--repeats", "2", "--output", str(folder), "--data",
                             "digits", "--model", "softmax", "--epochs", "1", "--quiet"],
                            cwd=ROOT, capture_output=True, text=True, timeout=240, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MPIEXEC": mpiexec()})
    assert result.returncode == 0, result.stderr
    table = (folder / "report.md").read_text()
    assert all(f"| {name} | 3 | 2 |" in table for name in ("allreduce-ring", "ps-async", "sgp")), table
    # the second round runs the methods in reverse order, so drift favours none
    launched = re.findall(r"--method (\S+)", result.stderr)
    assert launched == ["allreduce-ring", "ps-async", "sgp", "sgp", "ps-async", "allreduce-ring"], launched
    redrawn = subprocess.run([sys.executable, "-m", "mpicoll", "plot", *map(str, sorted(folder.glob("*.jsonl"))),
                              "--output", str(tmp_path / "again")], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert redrawn.returncode == 0 and (tmp_path / "again" / "loss_vs_time.png").exists(), redrawn.stderr
    assert (tmp_path / "again" / "report.md").read_text().count("|") == table.count("|")
    best = max(json.loads(log.read_text().splitlines()[-1])["final_accuracy"] for log in folder.glob("*.jsonl"))
    assert f"Target accuracy: {0.9 * best:.1%}, 90% of the best final accuracy." in table, table


def test_compare_gives_every_method_a_look_of_its_own():
    from mpicoll.experiments.compare import _looks
    from mpicoll.train.run import METHODS
    looks = _looks([*METHODS, *(f"more-{i}" for i in range(20 - len(METHODS)))])
    assert len({(look["color"], look["linestyle"]) for look in looks.values()}) == 20


def test_bench_gossip_reports_sgp_against_allreduce(tmp_path):
    result, records = bench(tmp_path, 3, "bench-gossip", "--sizes", "64K", "--iters", "3", "--compute-ms", "1",
                            "--straggler", "2=2")
    averaging = [r for r in records if r["kind"] == "averaging"]
    assert {r["graph"] for r in averaging} == {"time-varying-exponential", "exponential"}
    assert all(r["rounds"] and r["theory_rounds"] for r in averaging), averaging
    runs = [r for r in records if r["kind"] == "iterations"]
    assert {(r["method"], r["mailbox"], r["tau"], r["straggler"]) for r in runs} >= {
        ("allreduce", "-", 0, ""), ("sgp", "onesided", 1, "2=2"), ("sgp", "p2p", 0, "")}
    for record in runs:
        assert record["iterations_per_s"] > 0 and record["bytes_per_iteration"] > 0 and record["ranks"] == 3
        assert record["method"] != "allreduce" or record["ratio_to_allreduce"] == 1.0


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "bcast"])
def test_bench_times_every_collective(tmp_path, collective):
    _, records = bench(tmp_path, 2, "bench", "--collective", collective, "--sizes", "8,256K", "--iters", "3",
                       "--min-iters", "2", "--warmup", "1", "--algorithms", "ring,auto")
    assert {r["collective"] for r in records} == {collective}
    assert {r["algorithm"] for r in records} == {"mpi", "ring", "auto"}
    factor = {"reduce_scatter": 0.5, "allgather": 0.5, "bcast": 1.0}[collective]
    for record in records:
        assert record["busbw_gbps"] == pytest.approx(record["algbw_gbps"] * factor)


def test_bench_gossip_sets_iterations_against_what_the_links_allow():
    from mpicoll.benchmarks.gossip import link_report
    records = [{"method": "allreduce", "mailbox": "-", "tau": 0, "params": 1 << 20, "dtype": "float32",
                "straggler": "", "iterations_per_s": 10.0, "bytes_per_iteration": 6 << 20},
               {"method": "sgp", "mailbox": "p2p", "tau": 1, "params": 1 << 20, "dtype": "float32",
                "straggler": "", "iterations_per_s": 20.0, "bytes_per_iteration": 4 << 20}]
    lines = link_report(records, nodes=4, ranks=4, gbps=1.0, compute_ms=30.0)
    ring, sgp = records
    assert ring["link_ms"] == pytest.approx((6 << 20) * 8 / 1e6) and sgp["link_ms"] == pytest.approx((4 << 20) * 8 / 1e6)
    assert ring["of_link_bound"] == pytest.approx((30 + ring["link_ms"]) / 100)    # no overlap: computation + link
    assert sgp["of_link_bound"] == pytest.approx(max(30, sgp["link_ms"]) / 50)    # tau > 0: the larger of the two
    assert len(lines) == 3 and "4 nodes at 1 Gbit/s" in lines[0]
    assert "no link crossed" in link_report(records, nodes=1, ranks=4, gbps=1.0, compute_ms=30.0)[0]


def test_bench_torch_times_mpicoll_against_gloo_and_mpi(tmp_path):
    pytest.importorskip("torch", reason="the torch extra is not installed")
    result, records = bench(tmp_path, 2, "bench-torch", "--sizes", "4K,64K", "--algorithms", "auto,ring", "--iters", "2")
    assert [r["bytes"] for r in records] == [4096, 65536] and all(r["ranks"] == 2 for r in records)
    assert all(r[f"{peer}_s"] > 0 for r in records for peer in ("gloo", "mpi", "auto", "ring")), records
    assert "x gloo" in result.stdout and "x MPI" in result.stdout
