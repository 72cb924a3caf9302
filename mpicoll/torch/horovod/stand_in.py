"""What ``import horovod`` gives under mpicoll's alias (:mod:`.alias`): the package Horovod's programs import
beside ``horovod.torch``, for its version and ``horovod.run``."""

from __future__ import annotations

from ...base.errors import Unsupported

__all__ = ["run", "__version__"]

__version__ = "0.28.1"      # the Horovod whose API mpicoll.torch.horovod follows


def run(func, *args, **kwargs):
    """Horovod starts ranks itself here (``horovod.run(main, np=N)``); mpicoll's ranks are MPI's."""
    raise Unsupported("horovod.run (starting ranks from Python) is not supported by mpicoll's Horovod alias: "
                      "start the script under MPI instead, `mpiexec -n N python -m mpicoll.torch.horovod "
                      "script.py ...`, which runs it on every rank")
