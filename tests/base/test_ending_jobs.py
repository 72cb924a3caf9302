"""``mpicoll.end_job``: every rank of a job that cannot go on ends, with status 70 and the reason said, even when
all its ranks give up at the same moment (survivors that time out together, a failure told to every rank).

Real jobs of 4 ranks: under Open MPI with fault tolerance (``tests.support.jobs.fault_tolerant``, skipped where the
Open MPI environment is missing) and under the default launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess

from tests.support.jobs import ROOT, fault_tolerant, launch

# Every rank ends the job at once, right after a barrier: the race end_job's turns are for.
ALL_AT_ONCE = """
from mpi4py import MPI
import mpicoll
MPI.COMM_WORLD.Barrier()
mpicoll.end_job(f"rank {MPI.COMM_WORLD.Get_rank()} gives up")
print("after end_job", flush=True)
"""


def test_every_rank_ending_the_job_at_once_ends_it_under_fault_tolerance():
    """Open MPI's launcher under ``--with-ft ulfm`` hung in 6 of 10 such jobs, one after another, and returned 0
    in some, while the ranks called MPI_Abort together (docs/elastic.md); taking turns, 0 of 30.  Four jobs."""
    start, env = fault_tolerant(4)
    for _ in range(4):
        job = subprocess.Popen([*start, "-c", ALL_AT_ONCE], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)           # the launcher, with every rank gone: the hang tested
            raise AssertionError(f"the job never ended: {job.communicate()[1][-2000:]}") from None
        assert job.returncode == 70, (job.returncode, err[-2000:])
        assert "after end_job" not in out
        assert "mpicoll: rank 0 ends the job: rank 0 gives up" in err, err[-2000:]


def test_every_rank_ending_the_job_at_once_ends_it():
    result = launch(4, "-c", ALL_AT_ONCE, timeout=60)
    assert result.returncode == 70, result.stderr[-2000:]
    assert "after end_job" not in result.stdout
    assert "ends the job: rank" in result.stderr and " gives up" in result.stderr


# A program that finalizes MPI itself and goes on in Python, its communicator never freed: the watchdog's thread,
# which answers roll calls on every live channel twice a second, must make no MPI call after MPI_Finalize.
FINALIZES_ITSELF = """
import time, numpy as np
from mpi4py import MPI
import mpicoll
comm = mpicoll.Communicator(MPI.COMM_WORLD)
comm.Allreduce(MPI.IN_PLACE, np.ones(8, np.float32))
MPI.Finalize()
time.sleep(1.2)
print("went on", flush=True)
"""


def test_a_program_that_finalizes_mpi_itself_and_goes_on_ends_cleanly():
    """MPICH ends a process that calls MPI after MPI_Finalize ("Attempting to use an MPI routine ... after
    finalizing MPICH", status 1): the thread's first answers did so here."""
    result = launch(2, "-c", FINALIZES_ITSELF, timeout=60)
    assert result.returncode == 0 and result.stdout.count("went on") == 2, result.stderr[-2000:]
    assert "after finalizing" not in result.stderr, result.stderr[-2000:]
