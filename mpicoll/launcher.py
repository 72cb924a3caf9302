"""Finding the MPI launcher: the one place that knows how to start N ranks from Python.

Used by ``mpicoll compare`` (one ``mpicoll train`` job per method), by
``mpicoll cluster run`` and by the tests that launch real jobs.  Shell scripts
use ``scripts/launch``, which also validates hostfiles.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["launcher", "mpiexec_command", "keep_survivors"]


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


def keep_survivors(flavour: str, command: list[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, ``command`` wrapped): survivors of a dead rank keep running, under the launcher of
    ``flavour`` (:func:`launcher`'s); RuntimeError, saying why, for any but MPICH's Hydra.

    Hydra ends the job when a rank dies unless told not to (``-disable-auto-cleanup``), and even then
    sends the others SIGUSR1, whose default action ends them: each rank runs under a shell that ignores
    it and reports a signal death as an exit code (as ``scripts/launch --keep-going`` does).
    """
    if flavour != "mpich":
        raise RuntimeError("a job that outlives a dead rank needs MPICH's Hydra (-disable-auto-cleanup); "
                           "Open MPI needs a fault-tolerant (ULFM) build")
    return ["-disable-auto-cleanup"], ["sh", "-c", 'trap "" USR1; "$@"; exit $?', "rank", *command]


def mpiexec_command(ranks: int, flags=()) -> list[str]:
    """The command that starts ``ranks`` ranks, with the flags the launcher needs and ``flags``."""
    command, flavour = launcher()
    extra = ["--oversubscribe"] if flavour == "openmpi" else []
    return [*command, *extra, *flags, "-n", str(ranks)]
