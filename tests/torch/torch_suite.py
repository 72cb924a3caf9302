"""torch's own distributed test suite over the "mpicoll" backend, unmodified, the way torch once ran its MPI
backend through it: every rank a process of one MPI job, the default group made once here, and
``DistributedTest._DistTestBase`` (``torch/testing/_internal/distributed/distributed_test.py`` of the
installed torch) as a test case.

    mpiexec -n 3 python -m pytest tests/torch/torch_suite.py --with-mpi -p no:cacheprovider

Not named ``test_*``: the suite's tiers collect it only where scripts/run-tests names it (at 3 ranks), in a
pytest of its own (it makes the default group at import; the other torch modules' fixtures make it too, and
collected beside them their tests error with "trying to initialize the default process group twice").

The suite gates tests on the backend's name, read once at import (``BACKEND``): by default it is told
"mpicoll", and runs what torch runs for a backend it does not know (its gloo- and nccl-only tests skip);
``MPICOLL_TORCH_SUITE_AS=gloo`` tells it "gloo", so that its gloo-gated CPU tests run against mpicoll too (the
group is still mpicoll's), where a few tests fail by torch's own design: ``monitored_barrier`` is gloo's alone in
torch, and ``test_get_backend`` compares the backend's name with the one it was told.
``MPICOLL_TORCH_SUITE_BACKEND=gloo`` runs gloo itself in the same harness, for the comparison.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import unittest

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (the test extra installs it)")
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll.torch  # noqa: E402,F401  (registers the backend)

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
BACKEND = os.environ.get("MPICOLL_TORCH_SUITE_BACKEND", "mpicoll")


def _shared_directories() -> str:
    """One temporary folder for the job's ranks, with what torch's suite expects in it (its file barrier)."""
    folder = tempfile.mkdtemp(prefix="mpicoll-torch-suite-") if WORLD.rank == 0 else None
    if folder:
        for name in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(folder, name))
    return WORLD.bcast(folder)


TEMP_DIR = _shared_directories()
# Some of torch's tests let a call time out on purpose, and go on, as gloo's groups let them: a timeout does not end
# this job at exit (MPICOLL_END_BROKEN_JOBS, for harnesses such as this one; docs/failures.md)
os.environ.setdefault("MPICOLL_END_BROKEN_JOBS", "0")
_DEBUG_LEVEL = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
os.environ.update(BACKEND=os.environ.get("MPICOLL_TORCH_SUITE_AS", BACKEND), WORLD_SIZE=str(WORLD.size),
                  TEMP_DIR=TEMP_DIR, INIT_METHOD="env://")
if BACKEND == "gloo":                       # gloo's own rendezvous, arranged from MPI
    mpicoll.torch.init_process_group("gloo")
else:
    dist.init_process_group(BACKEND)

from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: E402
from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest  # noqa: E402


# torch's decorators skip a test in its own harness (one process a rank, started by the test) by leaving the rank's
# process with a code the parent reads as a skip: here, in the rank's only process, the same code is a skip
_SKIP_CODES = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


class TestTorchSuite(TestCase, DistributedTest._DistTestBase):
    """torch's whole base of distributed tests, on this job's default group."""

    rank = WORLD.rank                   # what torch's own harness gives its test cases
    world_size = WORLD.size

    def setUp(self):
        super().setUp()
        # torch's harness starts every test in fresh processes; here tests share them, and a test that set
        # torch's debug level (its with_dist_debug_levels leaves DETAIL in the environment, and DETAIL makes some
        # tests expect gloo's wrapper) would leave it to the next
        if _DEBUG_LEVEL is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = _DEBUG_LEVEL
        dist.set_debug_level_from_env()

    def _callTestMethod(self, method):
        try:
            super()._callTestMethod(method)
        except SystemExit as leaving:
            if leaving.code not in _SKIP_CODES:
                raise
            raise unittest.SkipTest(_SKIP_CODES[leaving.code]) from None

    @classmethod
    def tearDownClass(cls):
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(TEMP_DIR, ignore_errors=True)
        super().tearDownClass()
