"""A peer that dies mid-collective is named by its neighbour (a real ``mpiexec`` job)."""

from __future__ import annotations

import textwrap
import time

import numpy as np
import pytest

from tests.support.jobs import launch


def outcomes_of(script, folder) -> dict[int, str]:
    """Run ``script`` on 3 ranks (timeout 2 s, Hydra keeping the others when one dies); {rank: the outcome it
    wrote into ``folder``} for ranks 0 and 1, rank 0's required."""
    result = launch(3, str(script), str(folder), env={"MPICOLL_TIMEOUT": "2"}, extra=["-disable-auto-cleanup"],
                    timeout=120)
    outcomes = {rank: (folder / f"rank{rank}.txt").read_text() for rank in (0, 1)
                if (folder / f"rank{rank}.txt").exists()}
    assert 0 in outcomes, f"rank 0 left no outcome: {result.stdout} {result.stderr}"
    return outcomes


# The last rank dies between two ring allreduces; ``{before_the_call}`` runs on the survivors before the second.
_ONE_DIES = """
import os, sys, time, numpy as np
from mpi4py import MPI
import mpicoll
from tests.support.outcomes import leave_outcome
world = MPI.COMM_WORLD
comm = mpicoll.Communicator(world, algorithm="{algorithm}")
comm.Allreduce(np.ones(50000), np.empty(50000))
world.Barrier()
time.sleep(0.5)   # let the launcher's own traffic with every rank settle
if world.rank == world.size - 1:
    os._exit(1)
{before_the_call}
try:
    comm.Allreduce(np.ones(50000), np.empty(50000))
    outcome = "finished"
except mpicoll.CollectiveTimeout as error:
    outcome = str(error)
leave_outcome(sys.argv[1], world.rank, outcome)
world.Abort(0)
"""


def test_dead_rank_is_named_by_its_neighbour(tmp_path):
    """A rank dies mid-run: the survivors raise CollectiveTimeout naming it, instead of hanging.

    The rank exits abruptly (no MPI_Finalize).  A SIGKILL does the same to mpicoll, but
    MPICH 5.0.2's Hydra then sometimes tears the whole job down ("unable to forward PMI
    response"), so the test would measure the launcher rather than mpicoll.
    """
    script = tmp_path / "dead.py"
    script.write_text(_ONE_DIES.format(before_the_call="", algorithm="ring"))
    outcomes = outcomes_of(script, tmp_path)
    assert outcomes[0].startswith("Allreduce: rank 0 waited 2 s for rank(s) 2,"), outcomes
    assert all("finished" not in text for text in outcomes.values())


def test_dead_rank_is_named_by_the_on_node_allreduce(tmp_path):
    """The same under auto, whose allreduce on one node is the node's shared memory, reached from C (the fast
    path): the survivors' wait for the dead rank's step is the communicator's, with its deadline and roll call."""
    from mpicoll.collectives.algorithms import node
    if not node.available():
        pytest.skip("the on-node allreduce was not built here (no C compiler at install)")
    script = tmp_path / "dead.py"
    script.write_text(_ONE_DIES.format(before_the_call="", algorithm="auto").replace(
        "outcome = str(error)", "outcome = str(error) + ' | node ' + str(type(comm.__dict__.get('Allreduce')))"))
    outcomes = outcomes_of(script, tmp_path)
    assert outcomes[0].startswith("Allreduce: rank 0 waited 2 s for rank(s) 2,") and "FastCall" in outcomes[0], \
        outcomes
    assert all("finished" not in text for text in outcomes.values())


def test_a_survivor_that_comes_late_to_the_call_is_not_named_with_the_dead(tmp_path):
    """Rank 1 comes to the call after rank 0 gave up on the dead rank 2 (it waited for a live neighbour that
    waited for the lost one, and its own deadline runs from its own start): it joins rank 0's roll call at once,
    and neither survivor names it lost.  It was named "also silent" (and, where rank 0 waited for it, missing)
    when it answered only at its own timeout, after rank 0 stopped listening (met under CI's load)."""
    script = tmp_path / "late.py"
    # past rank 0's 2 s deadline, well within its 2 s of listening after it
    script.write_text(_ONE_DIES.format(before_the_call="if world.rank == 1:\n    time.sleep(2.6)", algorithm="ring"))
    outcomes = outcomes_of(script, tmp_path)
    assert set(outcomes) == {0, 1}, outcomes
    assert outcomes[0].startswith("Allreduce: rank 0 waited 2 s for rank(s) 2,"), outcomes
    assert outcomes[1].startswith("Allreduce: rank 1 waited "), outcomes
    assert "for rank(s) 2," in outcomes[1] and "another rank gave up on the call" in outcomes[1], outcomes
    assert all("Also silent" not in text for text in outcomes.values()), outcomes


_LATE_IN_MPIS_OWN_CALL = """
import os, time, numpy as np
os.environ["MPICOLL_AUTO_ALLREDUCE"] = "mpi:2M,hierarchical"   # (on one node auto's allreduce is the node's)
from mpi4py import MPI
import mpicoll
world = MPI.COMM_WORLD
comm = mpicoll.Communicator(world)          # auto: after the first call, small calls go to MPI's own
comm.Allreduce(np.ones(8), np.empty(8))
world.Barrier()
time.sleep(0.5)
if world.rank == world.size - 1:
    time.sleep(60)        # hung: MPI knows nothing of it (a dead rank MPICH names without a roll call)
if world.rank == 1:
    time.sleep(2.6)       # past rank 0's 2 s deadline, well within its 2 s of listening after it
comm.Allreduce(np.ones(8), np.empty(8))
"""


def test_a_survivor_that_comes_late_to_mpis_own_call_is_not_named_with_the_dead(tmp_path):
    """As above, with a hung rank, in MPI's own blocking call (``auto``'s small calls), which only the watchdog's
    thread can end: rank 0's watchdog holds the roll call at its deadline and ends the job; rank 1's, seeing that
    roll call while rank 1 is stuck in the call, answers at once.  Rank 0 named "rank(s) 1, 2" when rank 1
    answered only at its own deadline."""
    script = tmp_path / "late_in_mpi.py"
    script.write_text(_LATE_IN_MPIS_OWN_CALL)
    result = launch(3, str(script), env={"MPICOLL_TIMEOUT": "2"}, timeout=120)
    ended = [line for line in result.stderr.splitlines() if line.startswith("mpicoll: rank 0 ends the job:")]
    assert ended and "Allreduce (MPI's own): rank 0 waited 2 s for rank(s) 2," in ended[0], result.stderr[-3000:]
    assert "Also silent" not in ended[0], ended[0]


def test_a_rank_that_never_makes_the_first_call_is_named_under_that_calls_name(tmp_path):
    """The last rank never comes to the communicator's first call (whose set-up waits for every rank): the
    others name it, and the call (it read "collective: rank 0 waited ...", seen when a rank died before a
    run's final average).  That wait's roll call runs on the program's communicator, where a message of the
    program's own with the roll call's usual tag (99) waits for rank 1: it stays the program's (it was taken
    for rank 0's answer, and its size made a MismatchError of the timeout)."""
    script = tmp_path / "absent.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, numpy as np
        from mpi4py import MPI
        import mpicoll
        from tests.support.outcomes import leave_outcome
        world = MPI.COMM_WORLD
        if world.rank == world.size - 1:
            time.sleep(8)
            os._exit(1)
        if world.rank == 0:
            world.Send(np.arange(3.0), 1, 99)
        try:
            mpicoll.Communicator(world, algorithm="ring").Allgather(np.ones(4), np.empty(4 * world.size))
            outcome = "finished"
        except mpicoll.CollectiveTimeout as error:
            outcome = str(error)
        if world.rank == 1:
            mine = np.zeros(3)
            world.Recv(mine, 0, 99)
            outcome += f" (the program's message: {mine.tolist()})"
        leave_outcome(sys.argv[1], world.rank, outcome)
        world.Abort(0)
    """))
    outcomes = outcomes_of(script, tmp_path)
    assert outcomes[0].startswith("Allgather: rank 0 waited 2 s for rank(s) 2"), outcomes
    assert outcomes.get(1, "").startswith("Allgather: rank 1 waited ") and "for rank(s) 2" in outcomes[1] and \
        outcomes[1].endswith("(the program's message: [0.0, 1.0, 2.0])"), outcomes


def test_a_late_peers_message_never_lands_in_memory_the_survivors_let_go(tmp_path):
    """The last rank comes to an allreduce after the others timed out, dropped the communicator and made new
    arrays: its messages land in the buffers of the receives they had posted, which must still be theirs.
    mpi4py frees a request Python drops, and the buffer with it: rank 0 died of a segmentation fault (its
    1 MiB landing buffer unmapped) when the late message came, 3 runs of 3, before the requests were kept."""
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent("""
        import gc, os, sys, time, numpy as np
        os.environ["MPICOLL_CHANNEL"] = "p2p"         # messages (3 ranks on 2 cores would share memory)
        from mpi4py import MPI
        import mpicoll
        from tests.support.outcomes import leave_outcome, wait_for_outcomes
        world = MPI.COMM_WORLD
        late = world.rank == world.size - 1
        comm = mpicoll.Communicator(world, algorithm="ring")
        comm.Allreduce(np.ones(1000), np.empty(1000))
        if late:
            world.Barrier()                           # the others have given up, and let go
            try:
                comm.Allreduce(np.ones(1000), np.empty(1000))
            except mpicoll.CollectiveTimeout:
                pass
            world.Barrier()
            wait_for_outcomes(sys.argv[1])
        else:
            try:
                comm.Allreduce(np.ones(1000), np.empty(1000))
                outcome = "finished"
            except mpicoll.CollectiveTimeout:
                outcome = "timed out"      # goes on outside the handler, whose traceback holds the call's frames
            if outcome == "timed out":
                del comm
                gc.collect()
                made = [np.full(size // 8, 7.0) for size in range(64, 2 ** 21, 2 ** 16) for _ in range(2)]
                world.Barrier()
                world.Barrier()                       # waits while the late rank's messages arrive
                overwritten = sum(int((array != 7.0).any()) for array in made)
                outcome = f"{overwritten} arrays overwritten"
            leave_outcome(sys.argv[1], world.rank, outcome)
        world.Abort(0)
    """))
    outcomes = outcomes_of(script, tmp_path)
    assert set(outcomes.values()) == {"0 arrays overwritten"}, outcomes


@pytest.mark.mpi(min_size=2)
def test_a_message_of_the_programs_own_with_the_roll_calls_tag_is_not_taken_for_a_roll_call():
    """A communicator's first call waits for every rank on the program's own communicator (its private channel is
    made after): a message of the program's there, carrying the tag of mpicoll's roll call, is not taken for
    another rank's roll call (which would end that wait as a failure), and stays the program's."""
    import mpicoll
    from mpicoll.base.tags import Tag
    from tests.support.mpi import RANK, WORLD, everywhere
    program = WORLD.Dup()
    if RANK == 0:
        program.Send(np.arange(3.0), 1, Tag.ROLL_CALL)      # small, so sent at once: there while rank 1 waits
        time.sleep(0.3)
    comm = mpicoll.Communicator(program, algorithm="ring")
    total = np.empty(4)
    comm.Allreduce(np.ones(4), total)
    got = np.zeros(3)
    if RANK == 1:
        program.Recv(got, 0, Tag.ROLL_CALL)
    comm.close()
    program.Free()
    everywhere(np.all(total == WORLD.Get_size()) and (RANK != 1 or np.all(got == np.arange(3.0))),
               f"rank {RANK}: {total} {got}")


# Rank 1 computes for longer than MPICOLL_TIMEOUT before a small (MPI's own) call rank 0 waits in, then makes
# two more; every rank says when a call returns to the program.
_LATE_RANK = """
import sys, time, numpy as np
from mpi4py import MPI
import mpicoll
comm = mpicoll.Communicator(MPI.COMM_WORLD)
x, out = np.ones(8), np.empty(8)
comm.Allreduce(x, out)
if comm.rank == 1:
    time.sleep(8)
for call in (2, 3):
    comm.Allreduce(x, out)
    print(f"rank {comm.rank}: call {call} returned", flush=True)
"""


@pytest.mark.parametrize("fast_path", ["c", "python"])
def test_a_rank_late_past_the_timeout_is_named_late_and_the_job_ends_where_it_says(tmp_path, fast_path):
    """Rank 0's watchdog ends the job on the call rank 1 is 8 s late to (MPICOLL_TIMEOUT=3), naming rank 1; that
    call never returns to rank 0's program (it did, once rank 1 came, and rank 0 went on to its next calls before
    the abort), and rank 1, late, says so rather than blame rank 0 ("rank 1 waited 0 s for rank(s) 0")."""
    script = tmp_path / "late_rank.py"
    script.write_text(_LATE_RANK)
    start = time.monotonic()
    result = launch(2, str(script), env={"MPICOLL_TIMEOUT": "3", "MPICOLL_FAST_PATH": fast_path}, timeout=120)
    seconds = time.monotonic() - start
    lines = (result.stdout + result.stderr).splitlines()
    ended = [line for line in lines if line.startswith("mpicoll: rank 0 ends the job:")]
    assert result.returncode != 0 and seconds < 30, (result.returncode, seconds, result.stderr[-2000:])
    assert ended and "rank 0 waited 3 s for rank(s) 1" in ended[0], result.stderr[-3000:]
    assert not any(line.startswith("rank 0: call") for line in lines), result.stdout
    assert not any("for rank(s) 0" in line for line in lines), result.stderr[-3000:]
    late = [line for line in lines if line.startswith("mpicoll: rank 1 ends the job:")]
    assert all("rank 1 came late to its call" in line for line in late), late
