"""A parameter-server job whose worker is killed (SIGKILL) goes on without it (a real ``mpiexec`` job)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mpicoll import ps
from tests.support.jobs import ROOT, launch, mpiexec


@pytest.mark.parametrize("transport", ps.TRANSPORTS)
def test_parameter_server_survives_a_worker_killed_by_sigkill(tmp_path, transport):
    """async training, 1 server + 3 workers, under ``scripts/launch --keep-going``; one worker
    is killed with SIGKILL mid-run: training finishes, the server's log names the lost rank, and the
    healthy workers get the final weights and learn which worker was lost."""
    script = tmp_path / "ps_dead.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time, numpy as np
        from mpi4py import MPI
        from mpicoll import ps
        world = MPI.COMM_WORLD
        rng = np.random.default_rng(0)
        X = rng.standard_normal((300, 8)); y = X @ rng.standard_normal(8)
        server = ps.ParameterServer(world, np.zeros(8), ps.Async(lr=0.05), servers=1, transport=sys.argv[2])
        doomed = server.layout.workers[-1]
        outcome = ""
        if server.is_server:
            stats = server.serve(worker_timeout=1.0)
            outcome = f"lost {stats.lost} updates {stats.updates}"
        else:
            w = server.client.pull().copy()
            for step in range(400):
                if world.rank == doomed and step == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                pick = rng.integers(0, 300, 16)
                w = server.client.exchange(X[pick].T @ (X[pick] @ w - y[pick]) / 16).copy()
            server.client.close()
            outcome = f"trained, error {np.linalg.norm(X @ w - y) / np.linalg.norm(y):.1e}"
        final = server.gather_weights()
        outcome += f"; final error {np.linalg.norm(X @ final - y) / np.linalg.norm(y):.1e}, lost {server.lost}"
        server.close()
        with open(os.path.join(sys.argv[1], f"rank{world.rank}.txt"), "w") as handle:
            handle.write(outcome)
        # MPI_Finalize would wait for the dead rank: rank 0 ends the job once the survivors have written
        deadline = time.time() + 20
        while world.rank == 0 and time.time() < deadline and len(os.listdir(sys.argv[1])) < 4:
            time.sleep(0.05)
        time.sleep(0.2 if world.rank == 0 else 30)
        world.Abort(0)
    """))
    result = subprocess.run([str(ROOT / "scripts" / "launch"), "--keep-going", "-n", "4", sys.executable, str(script),
                             str(tmp_path), transport], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MPIEXEC": mpiexec()}, start_new_session=True)
    outcomes = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in range(4)
                if (tmp_path / f"rank{rank}.txt").exists()}
    assert outcomes.get(0, "").startswith("lost [3]"), (outcomes, result.stderr[-2000:])
    assert all(outcomes.get(rank, "").startswith("trained") for rank in (1, 2)), outcomes
    assert all(outcomes[rank].endswith("lost [3]") and float(outcomes[rank].split("final error ")[1][:7]) < 0.05
               for rank in (0, 1, 2)), outcomes
    # Hydra reports the dead process: the server drops it at once, not after the worker timeout
    assert "worker rank 3 died (the MPI library reports its process gone): dropped" in result.stderr, \
        result.stderr[-2000:]


# Rank 0 is the server of the windows, rank 1 a worker; the access of one waits for the other, which never answers
# in time, as a rank cut off never does (Open MPI's fault tolerance, seen across emulated nodes).  "put": rank 0 puts
# weights into rank 1's window, which cannot complete while rank 1 makes no MPI progress (MPICH's passive target):
# rank 1 is stopped (SIGSTOP; a rank merely computing is progressed by its watchdog thread, which answers roll calls,
# and the put completes).  "update": rank 1 holds a shared lock on rank 0's live weights (a pull cut off in the
# middle) and sleeps, and rank 0's exclusive lock on its own window, to update them, waits for it.
STUCK_ACCESS = """
import os, signal, sys, time
import numpy as np
from mpi4py import MPI
from mpicoll.channel.context import Context
from mpicoll.ps.layout import Layout
from mpicoll.ps.windows import Windows
world = MPI.COMM_WORLD
context = Context(world)
layout = Layout.split(world, 16, 1)
windows = Windows(context, layout, np.float32)
access = sys.argv[1]
world.Barrier()
if world.Get_rank() == 0:
    start = time.monotonic()
    if access == "put":
        windows.put_weights(1)
    else:
        time.sleep(0.5)
        with windows.updating():
            pass
    print(f"rank 0: the {access} returned after {time.monotonic() - start:.1f} s", flush=True)
else:
    if access == "update":
        windows.live_win.Lock(0, MPI.LOCK_SHARED)
        windows.live_win.Get(windows.versions[:1].view(np.uint8), 0, 0)
        windows.live_win.Flush(0)
    else:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(12)
    if access == "update":
        windows.live_win.Unlock(0)
world.Barrier()
"""


@pytest.mark.parametrize("access", ["put", "update"])
def test_a_one_sided_access_that_waits_on_a_rank_that_never_answers_ends_the_job_naming_it(tmp_path, access):
    script = tmp_path / "stuck_access.py"
    script.write_text(STUCK_ACCESS)
    job = launch(2, str(script), access, env={"MPICOLL_TIMEOUT": "2"}, timeout=120)
    said = job.stdout + job.stderr
    assert job.returncode != 0 and f"the {access} returned" not in said, said[-3000:]
    assert "rank 0 ends the job: a parameter server's one-sided transfer" in said and "for rank(s) 1" in said and \
        "cut off: an access to a rank cut off never returns; --transport p2p" in said, said[-3000:]
    assert "collective" not in said, said[-3000:]          # not a collective's causes (a different collective ...)
