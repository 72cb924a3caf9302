"""Checkpoint files: written atomically, read back with errors that say what to do."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["save", "load"]


def save(path: str | Path, **arrays) -> Path:
    """Write ``arrays`` to ``path`` (.npz); a crash mid-write leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        np.savez(handle, **arrays)
    os.replace(partial, path)
    return path


def load(path: str | Path, what: str) -> dict[str, np.ndarray]:
    """The arrays of checkpoint ``path``; ``what`` names the run that needs it, for the error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: {what} resumes from the files an earlier run "
                                "wrote with the same --checkpoint prefix and rank count")
    with np.load(path) as stored:
        return {name: stored[name] for name in stored.files}
