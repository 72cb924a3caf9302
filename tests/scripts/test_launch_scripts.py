"""scripts/launch with hostfiles, and the Slurm scripts run outside Slurm, as a user's shell would run them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mpicoll.collectives.algorithms
from tests.support.jobs import ROOT, mpiexec, script_env


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
