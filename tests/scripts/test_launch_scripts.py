"""scripts/launch with hostfiles, and the Slurm scripts run outside Slurm, as a user's shell would run them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import mpicoll.collectives.algorithms
from tests.support.jobs import ROOT, kill_rank_when, mpiexec, script_env


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


def test_launch_elastic_starts_open_mpi_with_fault_tolerance_and_tells_mpich_users_what_to_install():
    """Under Open MPI's launcher, --elastic (and --keep-going) add the fault-tolerance flags mpicoll's own
    launchers use, and the job runs; under MPICH's, one line says what to install."""
    from tests.support.jobs import fault_tolerant
    from mpicoll.base.launcher import OPENMPI_FAULT_TOLERANCE
    start, env = fault_tolerant(2)          # skips where there is no Open MPI environment
    program = [start[-1], "-c", "from mpi4py import MPI; w = MPI.COMM_WORLD; w.rank or print('size', w.size)"]
    for flag in ("--elastic", "--keep-going"):
        result = subprocess.run(["bash", "scripts/launch", flag, "-n", "2", *program], cwd=ROOT, capture_output=True,
                                text=True, timeout=60, env={**env, "MPIEXEC": start[0]})
        assert result.returncode == 0 and "size 2" in result.stdout, result.stderr
        assert " ".join(OPENMPI_FAULT_TOLERANCE) in result.stderr.splitlines()[0], result.stderr
    mpich = subprocess.run(["bash", "scripts/launch", "--elastic", "-n", "2", "true"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**script_env(), "MPIEXEC": mpiexec()})
    assert mpich.returncode == 2 and mpich.stderr.count("\n") == 1 and "pip install openmpi" in mpich.stderr, \
        mpich.stderr


# A rank that SIGKILLs itself in the first launch (MPICOLL_RESTART=0) when it is the VICTIM-th; then each rank
# says which launch it is in and how many ranks there are.
_DIES_ONCE = ("import os, signal, sys; from mpi4py import MPI; w = MPI.COMM_WORLD\n"
              "victim = int(sys.argv[1]) % w.size if sys.argv[1] != 'last' else w.size - 1\n"
              "if w.rank == victim and (os.environ['MPICOLL_RESTART'] == '0' or sys.argv[1] == 'last'):\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              "w.Barrier(); w.rank or print('launch', os.environ['MPICOLL_RESTART'], 'size', w.size)")


def _launch(tmp_path, *args, timeout=60) -> subprocess.CompletedProcess:
    """scripts/launch ARGS, run from ``tmp_path``; on a timeout its whole process group (every rank) is killed."""
    job = subprocess.Popen(["bash", str(ROOT / "scripts" / "launch"), *args], cwd=tmp_path, env=script_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def test_restarts_relaunch_without_the_host_that_lost_a_rank(tmp_path):
    """Ranks 2 and 3 run on the hostfile's second host (MPICH places them in order); rank 2 dies: the job is
    relaunched on the first host alone, and the records are removed."""
    if "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
        pytest.skip("an MPICH hostfile")
    (tmp_path / "hosts").write_text("localhost:2\n127.0.0.1:2\n")
    result = _launch(tmp_path, "-n", "4", "--hostfile", "hosts", "--restarts", "2", sys.executable, "-c",
                     _DIES_ONCE, "2")
    assert result.returncode == 0, result.stderr
    assert "launch: lost rank 2 on 127.0.0.1 (signal 9); restart 1 of 2 on 2 ranks" in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == "launch 1 size 2", result.stdout
    assert not list(tmp_path.glob(".mpicoll-restart*"))


def test_restarts_relaunch_without_a_host_that_does_not_answer(tmp_path):
    """No rank reports a death when a whole host vanishes (its shells go with it): the loop asks every host of
    the hostfile to run a one-rank job, and relaunches without those that do not answer.  (A host that cannot
    be reached at all stands in for one that vanished mid-run: the same question finds both.)"""
    if "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
        pytest.skip("an MPICH hostfile")
    (tmp_path / "hosts").write_text("localhost:2\nnohost.invalid:2\n")
    result = _launch(tmp_path, "-n", "4", "--hostfile", "hosts", "--restarts", "1", sys.executable, "-c",
                     "import os; from mpi4py import MPI; w = MPI.COMM_WORLD\n"
                     "w.rank or print('launch', os.environ['MPICOLL_RESTART'], 'size', w.size)")
    assert result.returncode == 0, result.stderr
    assert "launch: lost host nohost.invalid (it does not answer); restart 1 of 1 on 2 ranks" in result.stderr, \
        result.stderr
    assert result.stdout.splitlines() == ["launch 1 size 2"], result.stdout


def test_restarts_stop_when_none_is_left_and_a_job_that_lost_no_rank_is_not_relaunched(tmp_path):
    mpiexec()
    always = _launch(tmp_path, "-n", "3", "--restarts", "1", sys.executable, "-c", _DIES_ONCE, "last")
    assert always.returncode != 0
    lines = [line for line in always.stderr.splitlines() if line.startswith("launch:")]
    assert lines[0].startswith("launch: lost rank 2 on ") and lines[0].endswith("restart 1 of 1 on 2 ranks"), lines
    assert "lost rank 1 on" in lines[1] and "no restart left (--restarts 1)" in lines[1], lines
    failed = _launch(tmp_path, "-n", "2", "--restarts", "3", sys.executable, "-c", "import sys; sys.exit(3)")
    assert failed.returncode == 3 and "no rank was killed by a signal: not relaunched" in failed.stderr, failed.stderr
    assert failed.stderr.count("+ ") == 1, failed.stderr          # launched once


def test_a_training_job_that_lost_a_rank_is_relaunched_on_the_rest_and_resumes(tmp_path):
    """mpicoll train at 4 ranks with --checkpoint; rank 2 SIGKILLed from outside once the log shows epoch 1:
    the relaunch on 3 ranks resumes from the checkpoint and finishes; the log holds each epoch once."""
    mpiexec()
    log = tmp_path / "run.jsonl"
    job = subprocess.Popen(["bash", str(ROOT / "scripts" / "launch"), "-n", "4", "--restarts", "1", sys.executable,
                            "-m", "mpicoll", "train", "--epochs", "3", "--batch", "16", "--delay", "fixed:8",
                            "--checkpoint", "ckpt/run", "--output", str(log), "--quiet"], cwd=tmp_path,
                           env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        kill_rank_when(job, log, 2, '"epoch": 1,')
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, err[-3000:]
    assert "launch: lost rank 2 on" in err and "restart 1 of 1 on 3 ranks" in err, err[-3000:]
    assert "mpicoll train: relaunch 1 on 3 ranks, resuming from --checkpoint ckpt/run" in err, err[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["epoch"] for r in records if "epoch" in r] == [1, 2, 3], records
    assert records[-1]["summary"] and records[-1]["ranks"] == 3
