"""Pseudo-gradients summed as 8-bit integers, one byte an element (a quarter of float32's, half of bf16's).

Each meeting's sum goes in two calls: the largest magnitude over the replicas (one float's MAX allreduce), then
the integers' own SUM allreduce.  Every replica's values are scaled so that a sum over ``replicas`` of them still
fits an int8: with L = 127 // replicas levels a side, replica i sends q_i = round(y_i / u), u = max|y| / L, and
the sum of the q_i is exact in int8 on every rank (the same bits everywhere, whatever the algorithm).  y_i is the
pseudo-gradient plus what the replica's earlier meetings rounded off (error feedback, kept per fragment), so
nothing is lost for good, only late.  The price of one byte is resolution: L = 31 levels a side at 4 replicas,
7 at 16, 1 at 64; more than 127 replicas cannot be summed this way and are refused.
"""

from __future__ import annotations

import numpy as np

from ..collectives.api import allreduce, iallreduce
from .state import taken_from, under

__all__ = ["Int8Sums"]


class _Dequantized:
    """A meeting's int8 sum in flight: ``wait()`` leaves its value, as floats, in ``buffer``."""

    def __init__(self, request, words: np.ndarray, unit: float, buffer: np.ndarray):
        self.request, self.words, self.unit, self.buffer = request, words, unit, buffer

    def wait(self) -> None:
        self.request.wait()
        np.multiply(self.words, self.unit, out=self.buffer, casting="unsafe")


class Int8Sums:
    """Starts the int8 sums of the pseudo-gradients of ``replicas`` replicas over ``comm`` (``algorithm``)."""

    def __init__(self, comm, algorithm: str, replicas: int):
        if replicas > 127:
            raise ValueError(f"int8 pseudo-gradients: {replicas} replicas cannot share an int8 sum (at most 127: "
                             "each gets 127 // replicas levels a side); use bf16")
        self.comm, self.algorithm, self.levels = comm, algorithm, 127 // replicas
        self.residuals: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return "int8"

    def start(self, buffer: np.ndarray, key: str) -> _Dequantized:
        """The sum over the replicas of ``buffer`` (with this replica's carried rounding), started."""
        carried = self.residuals.get(key)
        wanted = buffer if carried is None else buffer + carried
        local = np.array([float(np.max(np.abs(wanted))) if wanted.size else 0.0])
        largest = float(allreduce(local, op="max", comm=self.comm, algorithm=self.algorithm)[0])
        unit = largest / self.levels if largest > 0 else 1.0
        words = np.clip(np.rint(wanted / unit), -self.levels, self.levels).astype(np.int8)
        self.residuals[key] = (wanted - words * unit).astype(buffer.dtype)
        return _Dequantized(iallreduce(words, comm=self.comm, algorithm=self.algorithm, out=words), words, unit,
                            buffer)

    def state_dict(self) -> dict[str, np.ndarray]:
        return under("residual.", self.residuals)

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {key: np.array(value) for key, value in taken_from("residual.", state).items()}
