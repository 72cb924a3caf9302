"""``python -m mpicoll.torch.horovod script.py [args...]``: run a Horovod program unchanged over mpicoll (the
``horovod`` alias of :mod:`.alias` installed first), as ``python script.py`` would; ``-m module`` runs a module.
Launch it on every rank: ``mpiexec -n 4 python -m mpicoll.torch.horovod pytorch_synthetic_benchmark.py``."""

from __future__ import annotations

import os
import runpy
import sys

from .alias import install

USAGE = "usage: python -m mpicoll.torch.horovod script.py [args...]   or   ... -m module [args...]"


def main(argv: list[str]) -> None:
    """Install the alias, then run ``argv`` (a script and its arguments, or ``-m module`` and its) as Python
    would, with ``sys.argv`` and ``sys.path[0]`` as Python sets them."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return
    if not argv or argv == ["-m"]:
        sys.exit(USAGE)
    install()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
