"""A launch that started more tasks than MPI sees (separate one-rank worlds) stops before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.jobs import ROOT, script_env


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
