"""Checkpoint files: written atomically and durably, verified on reading, and resumed only as a whole set.

Every file records what it belongs to (its *identity*: the training method, the
model and its size, a fingerprint of the data, the rank, worker and server
counts, the file format), the *point* of training it holds (an epoch, an update
count, a step) and a CRC-32 of every array.  :func:`load` refuses a file whose
identity differs from the run asking for it, naming both sides, and a file
damaged anywhere (a flipped byte, a cut-short write) in one line, before
anything is written.  A write goes to ``NAME.partial``, is flushed to disk
(``fsync``) and renamed over the old file, which is kept as
``NAME.previous.npz``, and the folder is synced: a crash at any point leaves
the previous file or the new one, whole.

A run whose state is spread over several files (one per SGP rank, parameter
server, model stage or Sandblaster shard) can be stopped between their writes
(Slurm's SIGTERM reaches every rank at once): :func:`mpicoll.channel.checks.load_checkpoint_set` finds the newest
point that every file of the set still holds, counting the kept previous files,
and resumes all ranks from it, saying so when a newer but incomplete set was
passed over.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from .errors import CheckpointMismatch

__all__ = ["save", "load", "versions", "check", "stamp", "without_ranks", "path", "existing", "CheckpointMismatch",
           "FORMAT"]

FORMAT = 3            # 1: no identity; 2: no point or checksums (mpicoll before checkpoint sets)
_IDENTITY = "__identity__"


def save(path: str | Path, identity: dict, point: int, **arrays) -> Path:
    """Write ``arrays`` to ``path`` (.npz) as the state at ``point`` (an epoch, update or step count), keeping
    the file it replaces as the previous one; a crash mid-write leaves the files as they were."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(path)
    arrays = {name: np.asarray(value) for name, value in arrays.items()}
    stamp = json.dumps({"format": FORMAT, **identity, "point": int(point),
                        "crc32": {name: _crc(value) for name, value in arrays.items()}}, sort_keys=True)
    try:
        with open(partial, "wb") as handle:
            np.savez(handle, **{_IDENTITY: np.array(stamp)}, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)          # a full disk or a signal: leave no half-written file
        raise
    if path.exists():
        os.replace(path, previous(path))
    os.replace(partial, path)
    _sync_folder(path.parent)
    return path


def previous(path: Path) -> Path:
    """Where :func:`save` keeps the file it replaced."""
    return path.with_name(path.name[:-len(".npz")] + ".previous.npz" if path.name.endswith(".npz")
                          else path.name + ".previous")


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _crc(array: np.ndarray) -> int:
    """CRC-32 of an array's dtype, shape and bytes."""
    head = f"{array.dtype.str}{array.shape}".encode()
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1), zlib.crc32(head))


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


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(the recorded stamp, the arrays) of one file, every array checked against its recorded CRC.

    Any damage, wherever the byte is (zip headers, the stamp, the data), is one CheckpointMismatch."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            stamp = json.loads(str(stored[_IDENTITY])) if _IDENTITY in stored.files else {"format": 1}
            if stamp.get("format") != FORMAT:
                return stamp, {}
            arrays = {name: stored[name] for name in stored.files if name != _IDENTITY}
        crcs = stamp["crc32"]
        if set(crcs) != set(arrays):
            raise ValueError(f"arrays {sorted(arrays)} where {sorted(crcs)} were written")
        bad = [name for name, array in arrays.items() if _crc(array) != crcs[name]]
        if bad:
            raise ValueError(f"the checksum of {', '.join(bad)} does not match")
        int(stamp["point"])
    except FileNotFoundError:
        raise                    # renamed by a writer since it was listed (see versions), not damaged
    except Exception as error:  # noqa: BLE001 - a damaged file fails in many ways; all mean the same
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise CheckpointMismatch(f"{path} is damaged ({reason}): it was cut short or changed after it was "
                                 "written; resume from a copy or an earlier set, or start afresh") from None
    return stamp, arrays


def _refuse_other_runs(path: Path, stamp: dict, identity: dict) -> None:
    expected = {"format": FORMAT, **identity}
    differences = [f"{key} {_show(stamp.get(key))} there, {_show(value)} here" for key, value in expected.items()
                   if stamp.get(key) != value]
    if differences:
        raise CheckpointMismatch(f"{path} belongs to another run ({'; '.join(differences)}): resume with the "
                                 "options it was written with, or start afresh under another --checkpoint prefix")


def versions(path: str | Path, identity: dict) -> dict[int, Path]:
    """The whole files of ``path`` that belong to the run ``identity`` describes, by the point each holds: the
    file, the one it replaced, and a finished write a stop cut off before its rename.

    The file itself, if there, must be whole and this run's: a damaged or foreign one raises
    :class:`CheckpointMismatch` naming it (the kept previous file is not taken silently in its place).  A
    cut-off write or a damaged previous file is passed over.  FileNotFoundError when there is none.  Files
    that a running writer renames while they are read (a survivor naming the last checkpoint of a run that
    lost a rank) are listed again."""
    path = Path(path)
    for _ in range(_LISTINGS):
        try:
            return _versions(path, identity)
        except _Renamed:
            continue          # a writer renamed a file between the listing and its reading: list again
    raise CheckpointMismatch(f"{path}: its files were renamed while being read, {_LISTINGS} times over: another "
                             "job is writing them; give each job its own --checkpoint prefix")


_LISTINGS = 10


class _Renamed(Exception):
    """A listed file was gone when read: a running writer's rename (:func:`save`) came between."""


def _versions(path: Path, identity: dict) -> dict[int, Path]:
    candidates = [p for p in (path, _partial(path), previous(path)) if p.is_file()]
    if not candidates:
        raise FileNotFoundError(f"no checkpoint at {path}: --resume continues from the files an earlier run wrote "
                                "with the same --checkpoint prefix, method and --model-parallel")
    found, problems = {}, []
    for candidate in candidates:
        try:
            stamp, _ = _read(candidate)
            _refuse_other_runs(candidate, stamp, identity)
        except FileNotFoundError:
            raise _Renamed(candidate) from None
        except CheckpointMismatch as error:
            if candidate == path:
                raise
            problems.append(str(error))
            continue
        found.setdefault(int(stamp["point"]), candidate)
    if not found:
        raise CheckpointMismatch(problems[0])
    return found


def check(path: str | Path, identity: dict) -> None:
    """Raise unless ``path`` holds a whole file of the run ``identity`` describes."""
    versions(path, identity)


def without_ranks(identity: dict) -> dict:
    """An identity less its rank count: what a run resumed on another number of ranks must match (the state
    of a method that can move: its files record the count that wrote them all the same)."""
    return {key: value for key, value in identity.items() if key != "ranks"}


def stamp(path: str | Path, identity: dict) -> dict:
    """What the newest whole file of ``path`` records of the run that wrote it (its identity and ``point``),
    checked against ``identity`` as :func:`versions` does: e.g. the rank count of a run resumed at another."""
    found = versions(path, identity)
    return _read(found[max(found)])[0]


def load(path: str | Path, identity: dict, point: int | None = None) -> dict[str, np.ndarray]:
    """The arrays of checkpoint ``path`` at ``point`` (default: the newest whole file), which must belong to
    the run described by ``identity``."""
    found = versions(path, identity)
    if point is None:
        point = max(found)
    if point not in found:
        raise CheckpointMismatch(f"{path} holds no state of point {point} (only {', '.join(map(str, sorted(found)))})")
    return _read(found[point])[1]


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


def discard(prefix: str | Path) -> None:
    """Remove the files of an earlier run under ``prefix`` (a fresh run with --overwrite), the kept previous
    files and cut-off writes included, so that none of them can be taken for this run's own."""
    for found in existing(prefix):
        for candidate in (found, previous(found), _partial(found)):
            candidate.unlink(missing_ok=True)


def existing(prefix: str | Path) -> list[Path]:
    """The checkpoint files a run with ``--checkpoint prefix`` writes that exist now."""
    prefix = Path(prefix)
    if not prefix.parent.is_dir():
        return []
    found = [path(prefix)] if path(prefix).is_file() else []
    for owner in _OWNERS:
        found += sorted(p for p in prefix.parent.glob(f"{prefix.name}.{owner}*.npz")
                        if not p.name.endswith(".previous.npz"))
    return found
