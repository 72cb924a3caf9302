"""Test harness for runs under ``mpiexec -n N python -m pytest --with-mpi``.

- Only rank 0 reports to the terminal (and writes --junitxml); other ranks
  print just their own failures, prefixed with their rank, to stderr.
- A watchdog per test: a test that runs past MPICOLL_TEST_TIMEOUT seconds
  (default 120) prints which rank is stuck in which test, with every
  thread's traceback, and aborts the whole job instead of hanging CI.

What tests share (the world, ``everywhere``, launching jobs, toy problems)
is in :mod:`tests.support`; no test imports this module.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

# Without a GPU, Numba's CUDA kernels run in its simulator (set before numba is imported).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
TEST_TIMEOUT = float(os.environ.get("MPICOLL_TEST_TIMEOUT", "120"))

# Peers that stop answering in mpicoll's own algorithms should fail a test
# quickly, well inside the watchdog's limit.
os.environ.setdefault("MPICOLL_TIMEOUT", "60")
# Tests break communicators on purpose and check what each rank saw: let the ranks exit normally.
os.environ.setdefault("MPICOLL_END_BROKEN_JOBS", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "watchdog(seconds): this test may run that long (default "
                            "MPICOLL_TEST_TIMEOUT) before the watchdog aborts it")
    if RANK > 0:
        sys.stdout = open(os.devnull, "w")
        config.option.xmlpath = None


def pytest_runtest_logreport(report):
    # A failure on every rank (``everywhere``) is reported by rank 0 alone.
    if RANK > 0 and report.failed and "failed on rank(s)" not in report.longreprtext:
        sys.stderr.write(f"[rank {RANK}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def watchdog(request):
    """Abort the job, saying which rank is stuck where, if a test never ends."""

    capture = request.config.pluginmanager.getplugin("capturemanager")

    def stuck():
        if capture is not None:              # let the message reach the terminal, not the capture
            capture.suspend_global_capture(in_=False)
        err = sys.stderr
        err.write(f"\n[rank {RANK}] stuck in {request.node.nodeid} for {limit:g} s "
                  f"(MPICOLL_TEST_TIMEOUT); tracebacks follow, then the job is aborted\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
        err.flush()
        time.sleep(0.5)            # let the launcher forward the message before the job is torn down
        MPI.COMM_WORLD.Abort(70)

    marker = request.node.get_closest_marker("watchdog")
    limit = max(TEST_TIMEOUT, marker.args[0]) if marker else TEST_TIMEOUT
    timer = threading.Timer(limit, stuck)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
