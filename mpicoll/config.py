"""Settings read from the environment, so one launch line can tune every rank alike.

=========================  =======================================================
``MPICOLL_DEBUG=1``        cross-rank checks of count, datatype, op and root on
                           every call, and a finiteness check of float inputs
``MPICOLL_TIMEOUT=S``      seconds a rank waits for a peer inside mpicoll's own
                           algorithms before raising CollectiveTimeout (default
                           300; 0 waits forever)
``MPICOLL_SEGMENT=BYTES``  pipeline segment of the ring algorithm (default 1M)
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
=========================  =======================================================

Every rank must see the same values (mpiexec forwards the environment).
"""

from __future__ import annotations

import os

__all__ = ["debug", "timeout", "segment_bytes", "channel", "end_broken_jobs", "parse_bytes", "cores"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'256K' -> 262144; plain integers are bytes."""
    text = text.strip().upper()
    digits = text.rstrip("KMGIB")
    unit = text[len(digits):]
    try:
        return int(float(digits) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"not a byte count: {text!r} (use e.g. 4096, 256K, 16M)") from None


def debug() -> bool:
    return os.environ.get("MPICOLL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def timeout() -> float:
    text = os.environ.get("MPICOLL_TIMEOUT", "300")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"MPICOLL_TIMEOUT must be a number of seconds (0: wait forever), got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"MPICOLL_TIMEOUT must be >= 0 seconds and finite (0: wait forever), got {text!r}")
    return value


def segment_bytes() -> int:
    value = parse_bytes(os.environ.get("MPICOLL_SEGMENT", "1M"))
    if value <= 0:
        raise ValueError(f"MPICOLL_SEGMENT must be positive, got {value}")
    return value


def channel() -> str:
    """How the collective algorithms move data between ranks: "shared", "p2p" or "auto"."""
    if "MPICOLL_TRANSPORT" in os.environ:
        raise ValueError("MPICOLL_TRANSPORT is now called MPICOLL_CHANNEL (auto, shared or p2p): rename it")
    value = os.environ.get("MPICOLL_CHANNEL", "auto").strip().lower()
    if value not in ("auto", "shared", "p2p"):
        raise ValueError(f"MPICOLL_CHANNEL must be auto, shared or p2p, got {value!r}")
    return value


def end_broken_jobs() -> bool:
    """Whether a process whose communicator broke ends the job at exit (MPI_Abort) instead of hanging."""
    value = os.environ.get("MPICOLL_END_BROKEN_JOBS", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"MPICOLL_END_BROKEN_JOBS must be 0 or 1, got {value!r}")
    return value == "1"


def cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
