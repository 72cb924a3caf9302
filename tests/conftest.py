"""Test harness for runs under ``mpiexec -n N python -m pytest --with-mpi``.

- Only rank 0 reports to the terminal (and writes --junitxml); other ranks
  print just their own failures, prefixed with their rank, to stderr.
- A watchdog per test: a test that runs past MPICOLL_TEST_TIMEOUT seconds
  (default 120) prints which rank is stuck in which test, with every
  thread's traceback, and aborts the whole job instead of hanging CI.
- ``everywhere(ok, message)`` fails a test on every rank when it fails on
  any, naming the ranks, so ranks never drift apart into different tests.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# Without a GPU, Numba's CUDA kernels run in its simulator (set before numba is imported).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.base.launcher import mpiexec_command

WORLD = MPI.COMM_WORLD
P = SIZE = WORLD.Get_size()          # the ranks of this run
RANK = WORLD.Get_rank()
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


# Every parameter-server rule, with each of its variants (test_rules checks none is missing).
RULE_CASES = [("sync", dict(lr=0.1)), ("softsync", dict(lr=0.1, k=0.5)), ("async", dict(lr=0.05, staleness="tau")),
              ("async", dict(lr=0.1, staleness="workers")), ("dcasgd", dict(lr=0.05, lam=0.04)),
              ("dcasgd", dict(lr=0.05, lam=0.04, adaptive=True)), ("downpour", dict(lr=0.3))]
RULE_IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in RULE_CASES]


def everywhere(ok: bool, message: str = "", comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Assert ``ok`` on every rank at once: all ranks fail if any does, naming the failing ranks."""
    failures = comm.allgather(None if ok else message)
    bad = {rank: text for rank, text in enumerate(failures) if text is not None}
    if bad:
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in bad.items())
        pytest.fail(f"failed on rank(s) {sorted(bad)}:\n{lines}", pytrace=False)


def ranks_share_one_node(comm: MPI.Intracomm = MPI.COMM_WORLD) -> bool:
    """True when every rank of ``comm`` runs on this node (shared memory reaches them all)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size() == comm.Get_size()
    finally:
        local.Free()


def require_one_node(channel: str | None = "shared") -> None:
    """Skip a test that forces the shared-memory channel when the ranks span several nodes."""
    if channel == "shared" and not ranks_share_one_node():
        pytest.skip("the shared-memory channel needs every rank on one node")


def shared_seed(comm: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """Fresh entropy, the same on every rank (so a failure can name one seed to replay)."""
    return comm.bcast(int(np.random.SeedSequence().entropy % (1 << 63)) if comm.Get_rank() == 0 else None)


def numba_cuda_or_skip():
    """numba.cuda when it can run kernels here (a GPU, or the simulator), else skip the test."""
    pytest.importorskip("numba", reason="the numba extra is not installed")
    try:
        from numba import cuda
    except ImportError as error:
        pytest.skip(f"numba's CUDA target is not installed: {error}")
    if not cuda.is_available():
        pytest.skip("no CUDA device and NUMBA_ENABLE_CUDASIM is unset")
    return cuda


def cupy_or_skip():
    """cupy when it has a CUDA device here, else skip the test (with the reason)."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the gpu extra)")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("CuPy found no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as error:
        pytest.skip(f"CuPy found no CUDA device: {error}")
    return cupy


class DLPackOnly:
    """Host memory seen only through DLPack (torch CPU tensors, mpi4py's tests' dlpack backends)."""

    def __init__(self, values):
        self.values = values

    def __dlpack__(self, **kwargs):
        return self.values.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.values.__dlpack_device__()


class InterfaceOnly:
    """Host memory seen only through ``__cuda_array_interface__`` (mpi4py's tests' fake GPU arrays)."""

    def __init__(self, values):
        self.values = values
        self.__cuda_array_interface__ = {"shape": values.shape, "typestr": values.dtype.str, "strides": None,
                                         "data": (values.ctypes.data, not values.flags.writeable), "version": 3}


# -- launching real jobs, as a user would ------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent     # the checkout


def command(ranks: int, flags=()) -> list[str]:
    """The package's own command to start ``ranks`` ranks, or skip the test where there is no launcher."""
    try:
        return mpiexec_command(ranks, flags)
    except FileNotFoundError as error:
        pytest.skip(str(error))


def mpiexec() -> str:
    """The launcher program itself (skips the test where there is none)."""
    return command(1)[0]


def launch(ranks: int, *args: str, env: dict | None = None, timeout: float = 240, extra=()) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    # A session of its own: under pytest's, Hydra tears the whole job down when one rank dies.
    return subprocess.run([*command(ranks, extra), sys.executable, *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout, start_new_session=True)
