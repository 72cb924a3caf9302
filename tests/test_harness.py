"""The test harness itself (tests/conftest.py): a test that hangs on one rank is aborted, naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

from tests.support.jobs import ROOT, command


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
