"""Checkpoint files: written atomically and durably, and read back only into the run they belong to.

Every file records what it belongs to (its *identity*: the training method, the
model and its size, a fingerprint of the data, the rank, worker and server
counts, the file format), and :func:`load` refuses a file whose identity
differs from the run asking for it, naming both sides, before anything is
written.  A write goes to ``NAME.partial``, is flushed to disk (``fsync``),
renamed over the old file and the folder synced, so a crash at any point
leaves either the previous checkpoint or the new one, whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .errors import SetupError

__all__ = ["save", "load", "check", "identity_of", "path", "existing", "written_together", "CheckpointMismatch",
           "FORMAT"]

FORMAT = 2            # 1: files without an identity (mpicoll before checkpoints recorded it)
_IDENTITY = "__identity__"


class CheckpointMismatch(ValueError):
    """A checkpoint belongs to another run (different method, model, data, or rank counts)."""


def save(path: str | Path, identity: dict, **arrays) -> Path:
    """Write ``arrays`` and ``identity`` to ``path`` (.npz); a crash mid-write leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    stamp = json.dumps({"format": FORMAT, **identity}, sort_keys=True)
    with open(partial, "wb") as handle:
        np.savez(handle, **{_IDENTITY: np.array(stamp)}, **arrays)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the OS lets a folder be synced)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def identity_of(path: str | Path) -> dict:
    """The identity a checkpoint file records ({"format": 1} for files from before identities)."""
    try:
        with np.load(path) as stored:
            return json.loads(str(stored[_IDENTITY])) if _IDENTITY in stored.files else {"format": 1}
    except Exception as error:  # noqa: BLE001 - a cut-short or foreign file fails in several ways
        raise CheckpointMismatch(f"{path} is not a readable checkpoint ({type(error).__name__}: {error}); it may "
                                 "have been cut short or replaced: resume from a copy, or start afresh") from None


def load(path: str | Path, identity: dict) -> dict[str, np.ndarray]:
    """The arrays of checkpoint ``path``, which must belong to the run described by ``identity``."""
    check(path, identity)
    with np.load(path) as stored:
        return {name: stored[name] for name in stored.files if name != _IDENTITY}


def check(path: str | Path, identity: dict) -> None:
    """Raise :class:`CheckpointMismatch` unless ``path`` records ``identity`` (and this file format)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: --resume continues from the files an earlier run wrote "
                                "with the same --checkpoint prefix, method, rank count and --model-parallel")
    stored = identity_of(path)
    expected = {"format": FORMAT, **identity}
    differences = [f"{key} {_show(stored.get(key))} there, {_show(value)} here" for key, value in expected.items()
                   if stored.get(key) != value]
    if differences:
        raise CheckpointMismatch(f"{path} belongs to another run ({'; '.join(differences)}): resume with the "
                                 "options it was written with, or start afresh under another --checkpoint prefix")


def written_together(comm, point: int | None, unit: str) -> None:
    """Refuse, with one :class:`~mpicoll.errors.SetupError` on every rank, a set of files (one per stage,
    shard, ...) recording different points of training: a run stopped between their writes, whose parts
    would resume apart.  ``point``: what this rank's file records (None: it reads none), counted in
    ``unit`` ("epochs", "steps").  Collective over ``comm``."""
    points = sorted({p for p in comm.allgather(point) if p is not None})
    if len(points) > 1:
        raise SetupError(dict.fromkeys(range(comm.Get_size()), (
            f"--resume: the checkpoint files were written after different {unit} ({', '.join(map(str, points))}; "
            "the earlier run stopped while writing them): start afresh, or restore one set's files")), comm.Get_size())


def _show(value) -> str:
    return "none" if value is None else str(value)


_OWNERS = ("rank", "server", "stage")   # files kept per training rank (SGP), parameter server, model stage


def path(prefix: str | Path, owner: str | None = None, rank: int = 0) -> Path:
    """The file of a run with ``--checkpoint prefix``: ``PREFIX.npz`` (one for the whole run), or
    ``PREFIX.rank<r>.npz`` / ``PREFIX.server<r>.npz`` / ``PREFIX.stage<s>.npz`` (one per ``owner``)."""
    if owner is None:
        return Path(f"{prefix}.npz")
    if owner not in _OWNERS:
        raise ValueError(f"checkpoint owner must be one of {', '.join(_OWNERS)}, got {owner!r}")
    return Path(f"{prefix}.{owner}{rank}.npz")


def existing(prefix: str | Path) -> list[Path]:
    """The checkpoint files a run with ``--checkpoint prefix`` writes that exist now."""
    prefix = Path(prefix)
    if not prefix.parent.is_dir():
        return []
    found = [path(prefix)] if path(prefix).is_file() else []
    for owner in _OWNERS:
        found += sorted(prefix.parent.glob(f"{prefix.name}.{owner}*.npz"))
    return found
