"""The commands and launch behaviour, run as a user would: real ``mpiexec`` subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec on PATH or beside the Python interpreter")
    return found


def launch(ranks: int, *args: str, env: dict | None = None, timeout: float = 240, extra=()) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([mpiexec(), *extra, "-n", str(ranks), sys.executable, *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_writes_table_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = launch(2, "-m", "mpicoll", "bench", "--sizes", "8,64K,3M", "--iters", "3", "--min-iters", "2",
                    "--warmup", "1", "--output", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    records = json.loads(out.read_text())
    algorithms = {"mpi", "ring", "parallel", "recursive_doubling", "auto"}
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


def test_dead_rank_is_named_by_its_neighbour(tmp_path):
    """A rank killed mid-run: the survivors raise CollectiveTimeout instead of hanging."""
    script = tmp_path / "dead.py"
    script.write_text(textwrap.dedent("""
        import os, time, numpy as np
        from mpi4py import MPI
        import mpicoll
        world = MPI.COMM_WORLD
        comm = mpicoll.Communicator(world, algorithm="ring")
        comm.Allreduce(np.ones(50000), np.empty(50000))
        world.Barrier()
        time.sleep(0.5)   # let the launcher's own traffic with every rank settle
        if world.rank == world.size - 1:
            os.kill(os.getpid(), 9)
        try:
            comm.Allreduce(np.ones(50000), np.empty(50000))
            print(f"rank {world.rank}: finished", flush=True)
        except mpicoll.CollectiveTimeout as error:
            print(f"rank {world.rank}: {error}", flush=True)
        world.Abort(0)
    """))
    result = launch(3, str(script), env={"MPICOLL_TIMEOUT": "2"}, extra=["-disable-auto-cleanup"], timeout=120)
    assert "rank 0: Allreduce: rank 0 waited 2 s for rank(s) 2" in result.stdout, result.stdout + result.stderr
    assert "finished" not in result.stdout


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
    result = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p",
                             "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "MPICOLL_TEST_TIMEOUT": "3", "PYTHONPATH": str(ROOT)})
    assert result.returncode != 0
    assert "stuck in test_hang.py::test_rank_one_never_arrives" in result.stderr, result.stderr
