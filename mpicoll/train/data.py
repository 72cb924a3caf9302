"""Training data: scikit-learn's handwritten digits by default (shipped with the
package, no download), MNIST-1D (``--data mnist1d``: generated, no download), or
the user's own ``.npz`` file; each worker takes its shard.  The built-in sets are
kept in ``~/.cache/mpicoll`` after the first run."""

from __future__ import annotations

import difflib
import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Dataset", "load", "BUILT_IN"]

BUILT_IN = ("digits", "mnist1d")


@dataclass
class Dataset:
    X: np.ndarray          # float32, standardised with the training statistics
    y: np.ndarray          # int64 class labels 0..classes-1
    X_test: np.ndarray
    y_test: np.ndarray
    name: str
    shape: tuple = ()      # one sample's shape, for models that care (a CNN): (8, 8) for the digits; () = flat

    @property
    def classes(self) -> int:
        return int(max(self.y.max(), self.y_test.max())) + 1

    @property
    def features(self) -> int:
        return self.X.shape[1]

    def fingerprint(self) -> str:
        """A short digest of the training set, so a checkpoint knows which data it was trained on."""
        digest = hashlib.blake2b(digest_size=8)
        for array in (self.X, self.y):
            digest.update(np.ascontiguousarray(array).tobytes())
        return f"{self.X.shape[0]}x{self.X.shape[1]}:{digest.hexdigest()}"

    def shard(self, index: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Worker ``index`` of ``count``'s rows of the training set (every count-th row)."""
        return self.X[index::count], self.y[index::count]


def _digits():
    """scikit-learn's handwritten digits: 1,797 images of 8 x 8 pixels, 10 classes (no test split: one is cut).

    Kept in the cache (:func:`_cached`) after the first run: importing scikit-learn costs each rank of each job
    about 0.7 s of CPU, as much as a short run's training."""
    def make():
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise SystemExit("the default data set is scikit-learn's digits: pip install -e '.[data]' "
                             "(or pass --data FILE.npz with arrays X and y)") from None
        digits = load_digits()
        return {"X": digits.data, "y": digits.target}

    arrays = _cached("digits", make)
    return arrays["X"], arrays["y"], None, None


def _mnist1d():
    """MNIST-1D (Greydanus 2020): 4,000 training and 1,000 test signals of 40 points, 10 classes.

    Generated with the ``mnist1d`` package's default arguments (seeded, so every rank and every machine gets the
    same), never downloaded, and kept in the cache (:func:`_cached`) after the first run.
    """
    def make():
        try:
            from mnist1d.data import get_dataset_args, make_dataset
        except ImportError:
            raise SystemExit("--data mnist1d needs the mnist1d package: pip install -e '.[data]'") from None
        made = make_dataset(get_dataset_args())
        return {"X": made["x"], "y": made["y"], "X_test": made["x_test"], "y_test": made["y_test"]}

    arrays = _cached("mnist1d", make)
    return arrays["X"], arrays["y"], arrays["X_test"], arrays["y_test"]


def _cached(name: str, make) -> dict[str, np.ndarray]:
    """The arrays of built-in data set ``name``: from ``~/.cache/mpicoll/NAME.npz`` (``XDG_CACHE_HOME``) when
    there, else ``make()``'s, then kept there.  Ranks may race to write it: each writes its own file, then
    renames it into place (the same arrays; a reader sees one whole file or none; one it cannot read is made
    again)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mpicoll" / f"{name}.npz"
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as saved:
                return {key: saved[key] for key in saved.files}
        except Exception:            # noqa: BLE001 - a damaged cache (a full disk once): made again below
            pass
    arrays = make()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        temporary = cache.with_name(f"{name}.{socket.gethostname()}.{os.getpid()}.npz")   # a home shared by nodes
        np.savez(temporary, **arrays)
        os.replace(temporary, cache)
    except OSError:
        pass                         # no cache: made again next time
    return arrays


def _npz(path: str):
    file = Path(path)
    if not file.is_file():
        close = difflib.get_close_matches(path.lower().replace("-", ""), BUILT_IN, n=1, cutoff=0.6)
        meant = f" (did you mean --data {close[0]}?)" if close else ""
        raise ValueError(f"--data {path}: no such file; the built-in data sets are {' and '.join(BUILT_IN)}{meant}")
    with open(file, "rb") as head:
        magic = head.read(6)
    if not magic.startswith((b"PK", b"\x93NUMPY")):               # neither a zip (.npz) nor an .npy array
        raise ValueError(f"--data {path}: not an .npz archive (a text or CSV file?); convert it, e.g. for a CSV "
                         "with the label last: a = np.loadtxt(path, delimiter=','); "
                         "np.savez('data.npz', X=a[:, :-1], y=a[:, -1].astype(int))")
    try:
        arrays = np.load(file, allow_pickle=False)
    except Exception as error:                    # numpy raises several kinds for a bad file
        raise ValueError(f"--data {path}: not a readable .npz file ({error})") from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ValueError(f"--data {path}: a single .npy array, not an .npz archive; save one with "
                         "np.savez(path, X=features, y=labels)")
    with arrays:
        missing = [name for name in ("X", "y") if name not in arrays.files]
        if missing:
            raise ValueError(f"--data {path}: missing array(s) {', '.join(missing)}; it has "
                             f"{', '.join(arrays.files) or 'none'} (need X: samples x features, y: labels)")
        X, y = arrays["X"], arrays["y"]
        X_test = arrays["X_test"] if "X_test" in arrays.files else None
        y_test = arrays["y_test"] if "y_test" in arrays.files else None
    if (X_test is None) != (y_test is None):
        raise ValueError(f"--data {path}: give both X_test and y_test, or neither")
    return X, y, X_test, y_test


def _check(X, y, where: str):
    if X.ndim != 2 or y.ndim != 1 or len(X) != len(y):
        raise ValueError(f"{where}: X must be samples x features and y one label per sample; got X {X.shape}, "
                         f"y {y.shape}")
    for name, array in (("X", X), ("y", y)):
        if array.dtype.kind not in "biuf":
            raise ValueError(f"{where}: {name} holds {array.dtype} values; it must be numeric (map string "
                             "labels to 0..classes-1, e.g. with np.unique(y, return_inverse=True))")
    if not np.issubdtype(y.dtype, np.integer) and not np.array_equal(y, np.round(y)):
        raise ValueError(f"{where}: labels must be integers 0..classes-1, got {y.dtype} values")
    if len(y) and y.min() < 0:
        raise ValueError(f"{where}: labels must be integers 0..classes-1, found {y.min()}")
    if not np.isfinite(X).all():
        raise ValueError(f"{where}: X contains NaN or Inf")


def load(path: str | None = None, *, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """The digits (``path`` None or "digits"), MNIST-1D ("mnist1d") or an .npz file; a test split is cut
    when the data has none."""
    name = path or "digits"
    X, y, X_test, y_test = _digits() if name == "digits" else _mnist1d() if name == "mnist1d" else _npz(path)
    where = name
    _check(np.asarray(X), np.asarray(y), where)
    X, y = np.asarray(X, np.float64), np.asarray(y).astype(np.int64)
    if X_test is None:
        order = np.random.default_rng(seed).permutation(len(y))
        cut = int(round(len(y) * (1 - test_fraction)))
        X, y, X_test, y_test = X[order[:cut]], y[order[:cut]], X[order[cut:]], y[order[cut:]]
    else:
        _check(np.asarray(X_test), np.asarray(y_test), f"{where} (test)")
        X_test, y_test = np.asarray(X_test, np.float64), np.asarray(y_test).astype(np.int64)
        if X_test.shape[1] != X.shape[1]:
            raise ValueError(f"{where}: X_test has {X_test.shape[1]} features, X has {X.shape[1]}")
    if len(y) == 0 or len(y_test) == 0:
        raise ValueError(f"{where}: need at least one training and one test sample")
    absent = np.setdiff1d(np.arange(max(y.max(), y_test.max()) + 1), y)
    if absent.size:
        raise ValueError(f"{where}: labels must be 0..classes-1 with every class in the training set; "
                         f"{absent.size} of {max(y.max(), y_test.max()) + 1} have no training sample (e.g. "
                         f"{absent[0]}): remap them, e.g. with np.unique(y, return_inverse=True)")
    mean, scale = X.mean(axis=0), X.std(axis=0)
    scale[scale == 0] = 1.0
    return Dataset(((X - mean) / scale).astype(np.float32), y, ((X_test - mean) / scale).astype(np.float32),
                   y_test, name if name in BUILT_IN else Path(path).name, {"digits": (8, 8)}.get(name, ()))
