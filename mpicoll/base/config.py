"""Settings read from the environment, so one launch line can tune every rank alike.

=========================  =======================================================
``MPICOLL_DEBUG=1``        cross-rank checks of count, datatype, op and root on
                           every call, and a finiteness check of float inputs
``MPICOLL_TIMEOUT=S``      seconds a rank waits for a peer inside mpicoll's own
                           algorithms before raising CollectiveTimeout (default
                           300; 0 waits forever)
``MPICOLL_SEGMENT=BYTES``  pipeline segment of the ring algorithm, 1 to 1G (default 1M)
``MPICOLL_CHANNEL=C``      how mpicoll's algorithms move data: ``shared``
                           (one-sided, through a shared-memory window; only
                           when all ranks share a node), ``p2p`` (MPI
                           point-to-point), or ``auto`` (the default: shared
                           when possible)
``MPICOLL_END_BROKEN_JOBS``  1 (default): a process whose communicator broke
                           ends the whole job at exit with MPI_Abort instead of
                           hanging in MPI_Finalize; 0: leave it to the program
``MPICOLL_AUTO_<COLL>``    the ``auto`` choice for one collective, e.g.
                           ``MPICOLL_AUTO_ALLREDUCE=mpi:512K,ring`` (see auto.py)
``MPICOLL_TIMELINE=FILE``  write a Chrome trace of every rank's collectives,
                           waits and phases to FILE at exit (see timeline.py)
``MPICOLL_UCX_DEFAULTS``   1 (default): importing mpicoll before MPI starts
                           sets UCX's TCP segments to 512k unless you set them
                           (see ucx.py); 0: leave UCX alone
``MPICOLL_KERNELS=K``      force the host kernels: ``numpy`` or ``numba``
                           (default: chosen by size)
``MPICOLL_CUDA_AWARE``     0 or 1: whether device buffers go to MPI directly
                           (default: asked of the MPI library)
``MPICOLL_FAST_PATH=F``    how ``auto`` and the torch backend hand small calls to
                           MPI: ``c`` (the default where the compiled paths were
                           built at install) or ``python`` (the same paths in
                           Python: ~0.1 us a call slower through ``auto``, ~1-2 us
                           through ``dist.all_reduce``)
``MPICOLL_JOIN_JOBS``      0 (default) or 1: join the separate MPI jobs of a
                           torch world (torchrun's workers) with MPI's
                           connect/accept under MPICH (mpicoll.torch.joining:
                           it crashed in some runs here, so it is opt-in)
=========================  =======================================================

Switches take 1/0, yes/no, true/false or on/off.  Every value is checked where
it is read, and a bad one is a ValueError naming the variable and what it takes;
:func:`check_all` reads them all at once (``mpicoll train`` does, before any
rank starts).  Every rank must see the same values (mpiexec forwards the
environment).
"""

from __future__ import annotations

import os

__all__ = ["debug", "timeout", "segment_bytes", "channel", "end_broken_jobs", "kernels", "cuda_aware",
           "ucx_defaults", "fast_path", "join_jobs", "parse_bytes", "cores", "check_all"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'256K' -> 262144; plain integers are bytes."""
    text = text.strip().upper()
    digits = text.rstrip("KMGIB")
    unit = text[len(digits):]
    try:
        return int(float(digits) * _UNITS[unit])
    except (ValueError, KeyError, OverflowError):
        raise ValueError(f"not a byte count: {text!r} (use e.g. 4096, 256K, 16M)") from None


_ON, _OFF = ("1", "yes", "true", "on"), ("0", "no", "false", "off")


def _switch(variable: str, default: bool | None) -> bool | None:
    text = os.environ.get(variable, "").strip().lower()
    if not text:
        return default
    if text not in _ON + _OFF:
        raise ValueError(f"{variable} must be 1 or 0 (yes/no, true/false, on/off), got "
                         f"{os.environ[variable]!r}")
    return text in _ON


def _choice(variable: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(variable, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{variable} must be {', '.join(c or 'empty' for c in choices)}, got {os.environ[variable]!r}")
    return value


def debug() -> bool:
    return _switch("MPICOLL_DEBUG", False)


DEFAULT_TIMEOUT = 300.0     # seconds, where MPICOLL_TIMEOUT is not set


def timeout() -> float:
    text = os.environ.get("MPICOLL_TIMEOUT", f"{DEFAULT_TIMEOUT:g}")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"MPICOLL_TIMEOUT must be a number of seconds (0: wait forever), got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"MPICOLL_TIMEOUT must be >= 0 seconds and finite (0: wait forever), got {text!r}")
    return value


def segment_bytes() -> int:
    text = os.environ.get("MPICOLL_SEGMENT", "1M")
    try:
        value = parse_bytes(text)
    except ValueError as error:
        raise ValueError(f"MPICOLL_SEGMENT: {error}") from None
    if not 0 < value <= _MAX_SEGMENT:
        raise ValueError(f"MPICOLL_SEGMENT must be a byte count from 1 to 1G, such as 1M (one message of the ring's "
                         f"pipeline: a segment as large as the whole message leaves it unpipelined), got {text!r}")
    return value


_MAX_SEGMENT = 1 << 30      # bytes: a message MPI counts in int elements of any type, and scratch numpy can make


def channel() -> str:
    """How the collective algorithms move data between ranks: "shared", "p2p" or "auto"."""
    if "MPICOLL_TRANSPORT" in os.environ:
        raise ValueError("MPICOLL_TRANSPORT is now called MPICOLL_CHANNEL (auto, shared or p2p): rename it")
    return _choice("MPICOLL_CHANNEL", ("auto", "shared", "p2p"), "auto")


def end_broken_jobs() -> bool:
    """Whether a process whose communicator broke ends the job at exit (MPI_Abort) instead of hanging."""
    return _switch("MPICOLL_END_BROKEN_JOBS", True)


def kernels() -> str:
    """The host kernels ``MPICOLL_KERNELS`` forces: "numpy", "numba", or "" (chosen by size)."""
    return _choice("MPICOLL_KERNELS", ("", "numpy", "numba"), "")


def cuda_aware() -> bool | None:
    """``MPICOLL_CUDA_AWARE`` as forced (True/False), or None: ask the MPI library."""
    return _switch("MPICOLL_CUDA_AWARE", None)


def ucx_defaults() -> bool:
    return _switch("MPICOLL_UCX_DEFAULTS", True)


def fast_path() -> str:
    """``MPICOLL_FAST_PATH``: "c" or "python" (mpicoll.collectives.communicator, mpicoll.torch.backend)."""
    return _choice("MPICOLL_FAST_PATH", ("c", "python"), "c")


def shm_stores() -> str:
    """``MPICOLL_SHM_STORES``: how the on-node allreduce writes into its slots (mpicoll/collectives/_shm.c):
    "learn" (the faster of the two, measured per size), "cached" or "streamed" (past the caches)."""
    return _choice("MPICOLL_SHM_STORES", ("learn", "cached", "streamed"), "learn")


def shm_threads() -> int | None:
    """``MPICOLL_SHM_THREADS``: threads a rank gives the on-node collectives' large copies and reductions (None,
    unset: one, the calling thread; docs/benchmarks.md says why)."""
    text = os.environ.get("MPICOLL_SHM_THREADS", "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise ValueError(f"MPICOLL_SHM_THREADS must be a count of threads from 1 to 1024, got {text!r}")
    return int(text)


def check_launch() -> bool:
    """Whether a launch whose announced task count differs from MPI's world stops (mpicoll.base.launcher)."""
    return _switch("MPICOLL_CHECK_LAUNCH", True)


def join_jobs() -> bool:
    """Whether a torch world of separate MPI jobs is joined into one communicator (mpicoll.torch.joining)."""
    return _switch("MPICOLL_JOIN_JOBS", False)


def check_all() -> None:
    """Read every setting above, raising the first bad one's ValueError."""
    timeout(), segment_bytes(), channel(), end_broken_jobs(), debug(), kernels(), cuda_aware(), ucx_defaults()
    fast_path(), shm_stores(), shm_threads(), check_launch(), join_jobs(), restart()


def cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def restart() -> int:
    """Which relaunch of a job this is (``MPICOLL_RESTART``, set by ``scripts/launch --restarts``; 0: the first
    launch): ``mpicoll train`` resumes a relaunched job from its --checkpoint."""
    text = os.environ.get("MPICOLL_RESTART", "").strip() or "0"
    if not text.isdigit():
        raise ValueError(f"MPICOLL_RESTART must be a count of relaunches (0 or more), got {text!r}")
    return int(text)
