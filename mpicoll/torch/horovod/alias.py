"""An opt-in ``horovod`` alias: Horovod programs run unchanged, their ``import horovod.torch as hvd`` answered
by :mod:`mpicoll.torch.horovod`.

Horovod's examples import ``horovod`` itself too (for ``horovod.run``), so changing their ``import
horovod.torch`` line is not enough.  :func:`install` adds an import finder that answers ``horovod``,
``horovod.torch`` and ``horovod.torch.<part>`` with mpicoll's modules, and only those names.  It never
shadows a real Horovod: where one is importable, :func:`install` says so and adds nothing.  ``python -m mpicoll.torch.horovod script.py ...`` runs a script
with the alias installed."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

__all__ = ["install", "installed", "MODULES"]

# Horovod's module -> mpicoll's module that answers for it; any other ``horovod.torch.<part>`` is
# ``mpicoll.torch.horovod.<part>`` where mpicoll has that part.
MODULES = {
    "horovod": "mpicoll.torch.horovod.stand_in",
    "horovod.torch": "mpicoll.torch.horovod",
    "horovod.torch.mpi_ops": "mpicoll.torch.horovod.ops",
}


def _target(fullname: str) -> str | None:
    """The mpicoll module answering for Horovod's ``fullname``, None for a name the alias leaves alone."""
    if fullname in MODULES:
        return MODULES[fullname]
    if fullname.startswith("horovod.torch."):
        return "mpicoll.torch.horovod." + fullname[len("horovod.torch."):]
    return None


class _Existing(importlib.abc.Loader):
    """Loads a Horovod name as the mpicoll module imported for it (one module object, two names)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass


class _HorovodAlias(importlib.abc.MetaPathFinder):
    """Finds Horovod's names first (mpicoll's modules are packages on disk: left to Python's own finder, a
    ``horovod.torch.<part>`` would be run a second time under Horovod's name); a part mpicoll lacks is
    a ModuleNotFoundError that says so, and names outside ``horovod.torch`` (``horovod.tensorflow``) are
    not found, as without the alias."""

    def find_spec(self, fullname, path=None, target=None):
        answer = _target(fullname)
        if answer is None:
            return None
        if importlib.util.find_spec(answer) is None:
            raise ModuleNotFoundError(f"No module named {fullname!r}: mpicoll's Horovod alias answers "
                                      f"horovod.torch with mpicoll.torch.horovod, which has no {answer!r}",
                                      name=fullname)
        is_package = fullname in ("horovod", "horovod.torch")
        return importlib.machinery.ModuleSpec(fullname, _Existing(answer), is_package=is_package)


def installed() -> bool:
    """Whether :func:`install` put the alias in place in this process."""
    return any(isinstance(finder, _HorovodAlias) for finder in sys.meta_path)


def install() -> bool:
    """Answer ``import horovod...`` with mpicoll's Horovod API from now on, unless a real Horovod is importable
    (then warn and change nothing).  Returns whether the alias is in place."""
    if installed():
        return True
    if "horovod" in sys.modules or importlib.util.find_spec("horovod") is not None:
        warnings.warn("mpicoll: a real Horovod is installed; `import horovod` keeps importing it (the alias "
                      "answers only where none is)", stacklevel=2)
        return False
    sys.meta_path.insert(0, _HorovodAlias())
    return True
