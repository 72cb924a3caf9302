"""PowerSGD: gradients averaged over the ranks as low-rank approximations (Vogels, Karimireddy and Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).

Each gradient matrix M (n x m; a gradient of more dimensions is viewed as (shape[0], the rest)) travels as two
thin factors: one step of power iteration from the last step's Q (warm start),

    P = M Q          (n x r)    summed over the ranks, then orthonormalised (QR)
    Q = M^T P        (m x r)    summed over the ranks
    M <- P Q^T / p             the average's rank-r approximation, the same bits on every rank

so a matrix moves (n + m) r numbers instead of n m.  Gradients with one dimension, and matrices too small
to gain ``min_compression_rate`` (n m < rate (n + m) r), travel whole in the first of the two allreduces.
**Error feedback**: what the approximation missed of this rank's gradient (its gradient plus the last
residual, less the approximation) is added to the next step's gradient, so nothing is lost, only delayed.
The first ``start_step`` steps of each buffer are averaged exactly (a warm-up, as the paper and torch's
``powerSGD_hook`` do).  The factors travel by mpicoll's allreduce (any algorithm; ``algorithm=`` as elsewhere).

State is kept per ``key`` (one per distinct list of gradients: a bucket, a model): its step count, its Q
factors and residuals.  Every rank must pass the same shapes in the same order; Q starts from the same
random matrices everywhere (``seed``).  :meth:`PowerSGD.state_dict` gives that state as arrays to save beside a
checkpoint and :meth:`PowerSGD.load_state_dict` puts it back, so a resumed run continues exactly.
"""

from __future__ import annotations

import json

import numpy as np

from . import api
from .compression import key_as_saved, key_from_saved
from .nonblocking import Request

__all__ = ["PowerSGD"]


class _Buffer:
    """One key's state: the shapes it was made for, its step count, Q factors and residuals."""

    def __init__(self, shapes: list[tuple], dtype, compressed: list[int]):
        self.shapes, self.dtype, self.compressed = shapes, dtype, compressed
        self.step = 0
        self.qs: dict[int, np.ndarray] = {}
        self.residuals: dict[int, np.ndarray] = {}


class PowerSGD:
    """Average lists of gradient arrays over the ranks as rank-``rank`` approximations (module docstring)."""

    def __init__(self, rank: int = 2, *, start_step: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD: rank must be at least 1, got {rank}")
        if start_step < 0:
            raise ValueError(f"PowerSGD: start_step must be 0 or more, got {start_step}")
        self.rank, self.start_step, self.min_compression_rate = rank, start_step, min_compression_rate
        self.error_feedback, self.warm_start, self.seed = error_feedback, warm_start, seed
        self.buffers: dict = {}

    def __repr__(self) -> str:
        return (f"PowerSGD(rank={self.rank}, start_step={self.start_step}, min_compression_rate="
                f"{self.min_compression_rate}, error_feedback={self.error_feedback}, warm_start={self.warm_start})")

    def forget(self) -> None:
        """Drop every buffer's state (step count, factors, residuals): the buffers were replaced."""
        self.buffers.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every buffer's state (step count, Q factors, residuals), as flat name -> array (what ``np.savez`` or
        a checkpoint takes), with what it was made by; :meth:`load_state_dict` puts it back."""
        keys, state = list(self.buffers), {}
        about = {"made_by": repr(self), "buffers": []}
        for n, key in enumerate(keys):
            buffer = self.buffers[key]
            about["buffers"].append({"key": key_as_saved(key), "shapes": [list(shape) for shape in buffer.shapes],
                                     "dtype": buffer.dtype.str, "step": buffer.step})
            state.update({f"q{n}.{i}": q for i, q in buffer.qs.items()})
            state.update({f"residual{n}.{i}": residual for i, residual in buffer.residuals.items()})
        return {"powersgd": np.array(json.dumps(about)), **state}

    def load_state_dict(self, state: dict) -> None:
        """Take the buffers of :meth:`state_dict`'s ``state`` in place of this one's; ValueError if it was made
        by a PowerSGD of other settings (``state["powersgd"]`` says which)."""
        about = json.loads(str(state["powersgd"]))
        if about["made_by"] != repr(self):
            raise ValueError(f"the saved state is of {about['made_by']}, not of {self!r}")
        buffers = {}
        for n, saved in enumerate(about["buffers"]):
            shapes = [tuple(shape) for shape in saved["shapes"]]
            buffer = _Buffer(shapes, np.dtype(saved["dtype"]),
                             [i for i, shape in enumerate(shapes) if self.compresses(shape)])
            buffer.step = int(saved["step"])
            for name, array in state.items():
                kind, _, index = name.partition(".")
                if kind in (f"q{n}", f"residual{n}"):
                    (buffer.qs if kind[0] == "q" else buffer.residuals)[int(index)] = np.array(array)
            buffers[key_from_saved(saved["key"])] = buffer
        self.buffers = buffers

    def compresses(self, shape: tuple) -> bool:
        """Whether a gradient of ``shape`` travels as factors (else whole)."""
        if len(shape) < 2:
            return False
        n, m = shape[0], int(np.prod(shape[1:]))
        if n == 0 or m == 0:                # nothing to factor: an empty gradient travels whole (as nothing)
            return False
        r = min(self.rank, n, m)
        return n * m >= self.min_compression_rate * (n + m) * r

    def wire_elements(self, shapes: list[tuple]) -> int:
        """The numbers each rank sends into the allreduces per step for gradients of ``shapes``, once compressing."""
        total = 0
        for shape in shapes:
            if self.compresses(shape):
                n, m = shape[0], int(np.prod(shape[1:]))
                total += (n + m) * min(self.rank, n, m)
            else:
                total += int(np.prod(shape))
        return total

    def allreduce(self, gradients: list, *, comm=None, algorithm: str = "auto", key=None) -> list:
        """Replace each of ``gradients`` (C-contiguous float32 or float64 numpy arrays of one dtype, this rank's)
        by its average over the ranks, PowerSGD's approximation once the buffer is past ``start_step``.
        Collective: every rank passes the same shapes, in the same order.  Returns ``gradients``."""
        buffer = self._buffer(key, gradients)
        communicator = api._communicator(comm, algorithm)
        ranks = communicator.Get_size()
        step, buffer.step = buffer.step, buffer.step + 1
        if step < self.start_step or not buffer.compressed:
            _average_whole(gradients, communicator)
            return gradients
        compressed = set(buffer.compressed)
        plain = [g for i, g in enumerate(gradients) if i not in compressed]
        matrices = {i: gradients[i].reshape(gradients[i].shape[0], -1) for i in buffer.compressed}
        local = {}
        for i, matrix in matrices.items():
            if self.error_feedback:
                matrix += buffer.residuals.setdefault(i, np.zeros_like(matrix))
                local[i] = matrix.copy()
        ps = {i: matrix @ self._q(buffer, i, matrix) for i, matrix in matrices.items()}
        # first allreduce: the whole gradients and the P factors, summed
        first = _concatenate([*plain, *ps.values()], buffer.dtype)
        api.allreduce(first, comm=communicator, algorithm=communicator.algorithm, out=first)
        rest = _scatter(first, plain)
        for g in plain:
            g /= ranks
        for i, p in ps.items():
            p[...] = rest[: p.size].reshape(p.shape)
            rest = rest[p.size:]
            ps[i] = np.linalg.qr(p)[0]          # orthonormal columns: the same bits on every rank
        # second allreduce: the Q factors, summed
        qs = {i: matrix.T @ ps[i] for i, matrix in matrices.items()}
        second = _concatenate(list(qs.values()), buffer.dtype)
        api.allreduce(second, comm=communicator, algorithm=communicator.algorithm, out=second)
        for i, matrix in matrices.items():
            q = second[: qs[i].size].reshape(qs[i].shape)
            second = second[qs[i].size:]
            np.matmul(ps[i], q.T, out=matrix)
            matrix /= ranks
            if self.error_feedback:
                np.subtract(local[i], matrix, out=buffer.residuals[i])
            if self.warm_start:
                buffer.qs[i] = q.copy()
        return gradients

    def start(self, gradients: list, *, comm=None, algorithm: str = "auto", key=None) -> Request:
        """:meth:`allreduce`, started on the communicator's nonblocking worker (its two allreduces and the
        matrix products run there while the caller goes on); ``wait()`` gives ``gradients``.  Leave them
        alone until then."""
        communicator = api._communicator(comm, algorithm)
        self._buffer(key, gradients)         # refuse bad input in the caller's thread
        return communicator.start(Request("PowerSGD", lambda worker: self.allreduce(
            gradients, comm=worker, algorithm=worker.algorithm, key=key), gradients))

    def _buffer(self, key, gradients: list) -> _Buffer:
        """``key``'s state, made on its first call; the same shapes and dtype every call."""
        if not gradients:
            raise ValueError("PowerSGD: no gradients to average")
        arrays = [g for g in gradients if not (isinstance(g, np.ndarray) and g.flags.c_contiguous and g.flags.writeable)]
        if arrays:
            raise TypeError("PowerSGD averages writable C-contiguous numpy arrays in place; got "
                            f"{type(arrays[0]).__name__}{'' if not isinstance(arrays[0], np.ndarray) else ' (a view)'}")
        dtypes = {g.dtype for g in gradients}
        if len(dtypes) > 1 or next(iter(dtypes)) not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"PowerSGD averages float32 or float64 gradients of one dtype, got {sorted(map(str, dtypes))}")
        shapes = [g.shape for g in gradients]
        buffer = self.buffers.get(key)
        if buffer is None:
            compressed = [i for i, shape in enumerate(shapes) if self.compresses(shape)]
            buffer = self.buffers[key] = _Buffer(shapes, gradients[0].dtype, compressed)
        elif buffer.shapes != shapes or buffer.dtype != gradients[0].dtype:
            raise ValueError(f"PowerSGD: buffer {key!r} was {len(buffer.shapes)} gradients of {buffer.dtype} and is "
                             f"now {len(shapes)} of {gradients[0].dtype} (or other shapes); give each its own key")
        return buffer

    def _q(self, buffer: _Buffer, i: int, matrix: np.ndarray) -> np.ndarray:
        """The Q factor to start from: the last step's (warm start), or the same random one on every rank."""
        q = buffer.qs.get(i)
        if q is None or not self.warm_start:
            r = min(self.rank, *matrix.shape)
            q = np.random.default_rng([self.seed, i, 0 if self.warm_start else buffer.step]).standard_normal(
                (matrix.shape[1], r)).astype(matrix.dtype)
        return q


def _concatenate(parts: list, dtype) -> np.ndarray:
    return np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0, dtype)


def _scatter(flat: np.ndarray, arrays: list) -> np.ndarray:
    """Copy the leading elements of ``flat`` into ``arrays`` in turn; returns what is left of ``flat``."""
    for a in arrays:
        a.reshape(-1)[...] = flat[: a.size]
        flat = flat[a.size:]
    return flat


def _average_whole(gradients: list, communicator) -> None:
    """The exact average of every gradient, in one allreduce."""
    flat = _concatenate(gradients, gradients[0].dtype)
    api.allreduce(flat, "average", comm=communicator, algorithm=communicator.algorithm, out=flat)
    _scatter(flat, gradients)
