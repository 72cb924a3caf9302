"""UCX settings mpicoll changes before MPI starts, and why.

UCX is the transport under the MPICH wheel (and many Open MPI builds).  Over
TCP it moves at most one segment, 64 KiB by default, per call into MPI's
progress engine.  A rank that computes while its messages travel (SGP with
tau > 0, asynchronous parameter servers) calls MPI about once a millisecond
from :mod:`mpicoll.channel.progress`, so its background transfers crawl at about
64 MB/s: half of a 1 Gbit/s link, a twentieth of 10 Gbit/s.  Measured across
emulated nodes (``docs/multi-node.md``): 4 MiB exchanged while both ranks poll
every millisecond took 83-90 ms with the default segment and 39-41 ms with
512 KiB ones; SGP rounds with 30 ms of computation, 45-55 ms per iteration
against 40-44.

So, when ``mpicoll`` is imported before ``mpi4py.MPI`` (which starts MPI) and
the user has set neither variable, it sets ``UCX_TCP_TX_SEG_SIZE`` and
``UCX_TCP_RX_SEG_SIZE`` to 512k (UCX refuses a receive segment smaller than
the send segment, so both or neither).  Transports other than TCP ignore
them.  ``MPICOLL_UCX_DEFAULTS=0`` leaves UCX alone; imported after MPI has
started, mpicoll changes nothing (export the variables yourself).

Where ``torchrun`` started the process (``TORCHELASTIC_RUN_ID`` set) and ``MPICOLL_JOIN_JOBS=1`` asks for its
MPI job to be joined to the others with ``MPI_Comm_accept``/``MPI_Comm_connect`` (:mod:`mpicoll.torch.joining`),
in which MPICH 5.0.2's UCX netmod crashed far more often than its OFI netmod here (7 of 8 runs against 2 of 8),
MPICH is told to use OFI unless the user chose a netmod (``MPIR_CVAR_CH4_NETMOD=ofi``; other MPIs ignore it).
"""

from __future__ import annotations

import os
import sys

from . import config

__all__ = ["DEFAULTS", "JOINED_DEFAULTS", "apply_defaults"]

DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}
JOINED_DEFAULTS = {"MPIR_CVAR_CH4_NETMOD": "ofi"}       # for jobs that torchrun started, to be joined


def apply_defaults(environ=os.environ) -> bool:
    """Set :data:`DEFAULTS` in ``environ`` if MPI has not started and the user set none of them (and
    :data:`JOINED_DEFAULTS` likewise where torchrun started this process); True if any was set."""
    if "mpi4py.MPI" in sys.modules or environ.get("MPICOLL_UCX_DEFAULTS", "1").strip().lower() in ("0", "no", "false", "off"):
        return False
    chosen = False
    joining = "TORCHELASTIC_RUN_ID" in environ and config.join_jobs()
    for defaults, wanted in ((DEFAULTS, True), (JOINED_DEFAULTS, joining)):
        if wanted and not any(name in environ for name in defaults):
            environ.update(defaults)
            chosen = True
    return chosen
