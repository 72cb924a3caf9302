"""Compressed allreduce: floating-point arrays moved as 16-bit floats, half the bytes of float32.

A :class:`Compression` rounds this rank's contribution to ``float16`` ("fp16") or ``bfloat16`` ("bf16", the
type numpy gets from the ``ml_dtypes`` package), and the 16-bit words are what travel.  How they are summed is
the algorithm's (:meth:`~mpicoll.collectives.algorithms.base.Algorithm.allreduce_compressed`): where owners
round (``direct``; ``hierarchical``, ``auto``'s choice for large buffers), each chunk's owner sums every
rank's words of it in full precision and rounds the sum once, two roundings in all; elsewhere (the ring,
MPI's own) every partial sum is made in float32 and rounded back to 16 bits on its way (numpy's and
``ml_dtypes``' arithmetic on these types), a rounding per hop, never float16 arithmetic's own error.  Every
rank gets the same bits.

**Error feedback** (``error_feedback=True``): what rounding took off this rank's contribution is kept, per
buffer (``key``), and added to that buffer's next contribution, so nothing is lost over the steps of a training
run, only delayed (Seide et al. 2014; Karimireddy et al. 2019).  The residual is exact: the contribution plus
the residual, less what was sent, computed in the input's precision.  Where owners round, each also keeps its
sum's rounding, in its residual's share of the chunk it owns: the ranks' residuals then carry every rounding
of the call.  The residuals are the only state: :meth:`Compression.state_dict` gives them as arrays to save
beside a checkpoint, and :meth:`Compression.load_state_dict` puts them back, so a resumed run continues
exactly.

**Error bound** (documented, and what the tests hold the result to): for p ranks, with u the unit roundoff
of the 16-bit type (2^-11 for float16, 2^-8 for bfloat16) and e half its smallest spacing (2^-25 for
float16, whose subnormals start below 6.1e-5; 2^-134 for bfloat16), each element of the sum is within
``(p + 1) * (u * sum(|x_i|) + e)`` of the exact sum of the contributions (each contribution rounded once,
each of at most p - 1 partial sums once, the result once), to first order in u
(:meth:`Compression.bound`).  float16 overflows past 65504: sums that large give inf (a
:class:`OverflowError` says to use bf16); bfloat16 has float32's range.

Only sums (and averages) compress; the drop-in :class:`~mpicoll.Communicator` never compresses: mpi4py's
semantics are exact.
"""

from __future__ import annotations

import ast
import functools
import json

import numpy as np
from mpi4py import MPI

from .. import compute
from .reduction import Reduction

__all__ = ["Compression", "KINDS", "resolve", "bfloat16", "is_bfloat16", "key_as_saved", "key_from_saved"]

KINDS = ("fp16", "bf16")


def bfloat16() -> np.dtype:
    """numpy's bfloat16, from the ``ml_dtypes`` package (a dependency of mpicoll's)."""
    try:
        import ml_dtypes
    except ImportError:              # missing only in a broken environment
        raise ImportError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes") from None
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (without importing ml_dtypes when it is not loaded).  By its
    type's name: numpy's ``dtype.name`` takes ~1 us, a tenth of a small allreduce's price (measured)."""
    return np.dtype(dtype).type.__name__ == "bfloat16"


_OPS: dict = {}
_REDUCTIONS: dict = {}


class Compression:
    """Move an allreduce's floating-point array as ``kind`` ("fp16" or "bf16"); with ``error_feedback``,
    carry each buffer's rounding error into its next call (per ``key``: one per distinct buffer)."""

    def __init__(self, kind: str, error_feedback: bool = False):
        if kind not in KINDS:
            raise ValueError(f"compression must be one of {', '.join(KINDS)}, got {kind!r}")
        self.kind, self.error_feedback = kind, error_feedback
        self.unit_roundoff = 2.0 ** -11 if kind == "fp16" else 2.0 ** -8
        self.least = 2.0 ** -25 if kind == "fp16" else 2.0 ** -134        # half the smallest spacing
        self.residuals: dict = {}         # key -> what rounding took off that buffer's last contribution

    def __repr__(self) -> str:
        return f"Compression({self.kind!r}, error_feedback={self.error_feedback})"

    @functools.cached_property
    def dtype(self) -> np.dtype:
        """The 16-bit float type, found at first use: importing ml_dtypes takes about 0.5 s, which the on-node
        allreduce's first call paid when its op table made Compression objects (measured, December 7)."""
        return np.dtype(np.float16) if self.kind == "fp16" else bfloat16()

    def bound(self, ranks: int, magnitude):
        """The documented error of a compressed sum over ``ranks`` ranks, elementwise, for ``magnitude`` the
        sum of the contributions' absolute values."""
        return (ranks + 1) * (self.unit_roundoff * magnitude + self.least)

    @property
    def op(self) -> MPI.Op:
        """The user op that adds the 16-bit words as floats of this kind (MPI has no bfloat16 type, and
        numpy's float16 arithmetic is emulated element by element: mpicoll.compute adds float16 by its bits)."""
        if self.kind not in _OPS:
            _OPS[self.kind] = MPI.Op.Create(lambda incoming, inout, datatype: compute.add_narrow(
                np.frombuffer(incoming, np.uint16), np.frombuffer(inout, np.uint16), self.dtype), commute=True)
        return _OPS[self.kind]

    def compress(self, x: np.ndarray, key=None) -> np.ndarray:
        """This rank's contribution as 16-bit words (uint16, x's shape), its residual (with error feedback)
        added first and the new one kept."""
        return self.narrow(x, np.empty(x.shape, np.uint16), self.residual(key, x))

    def residual(self, key, x: np.ndarray) -> np.ndarray | None:
        """With error feedback, buffer ``key``'s residual (zeros on its first call), which must be of ``x``'s
        shape and dtype; None without."""
        if not self.error_feedback:
            return None
        residual = self.residuals.get(key)
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise ValueError(f"error feedback: buffer {key!r} was {residual.shape} {residual.dtype} and is "
                             f"now {x.shape} {x.dtype}; give each buffer its own key")
        if residual is None:
            residual = self.residuals[key] = np.zeros_like(x)
        return residual

    def narrow(self, x: np.ndarray, words: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
        """``words`` <- ``x`` (plus ``residual``, which keeps what the rounding took off) as 16-bit words."""
        return compute.narrow(x, words, self.dtype, residual)

    @property
    def reduction(self) -> Reduction:
        """The words' sum (:attr:`op` on uint16), as an algorithm reduces."""
        if self.kind not in _REDUCTIONS:
            _REDUCTIONS[self.kind] = Reduction(self.op, MPI.UINT16_T, np.uint16)
        return _REDUCTIONS[self.kind]

    def forget(self) -> None:
        """Drop every buffer's residual (the buffers were replaced)."""
        self.residuals.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        """The residuals, as flat name -> array (what ``np.savez`` or a checkpoint takes), with what they were
        made by: :meth:`load_state_dict` of the same kind and error feedback puts them back."""
        keys = list(self.residuals)
        return {"compression": np.array(json.dumps({"made_by": repr(self), "keys": [key_as_saved(k) for k in keys]})),
                **{f"residual{i}": self.residuals[key] for i, key in enumerate(keys)}}

    def load_state_dict(self, state: dict) -> None:
        """Take the residuals of :meth:`state_dict`'s ``state`` in place of this one's; ValueError if it was
        made by another compression (``state["compression"]`` says which)."""
        about = json.loads(str(state["compression"]))
        if about["made_by"] != repr(self):
            raise ValueError(f"the saved state is of {about['made_by']}, not of {self!r}")
        self.residuals = {key_from_saved(key): np.array(state[f"residual{i}"])
                          for i, key in enumerate(about["keys"])}

    def decompress(self, words: np.ndarray, out: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """``out`` <- the values of the 16-bit ``words`` times ``scale``."""
        return compute.widen(words, out, self.dtype, scale)


def key_as_saved(key) -> str:
    """A buffer's key as a state dict saves it (its repr; :func:`key_from_saved` reads it back): str, int,
    float, bool, None, or tuples of them (TypeError naming the key otherwise).  Shared by every compression
    that keeps a state per buffer (this module's residuals, :class:`mpicoll.PowerSGD`'s factors)."""
    text = repr(key)
    try:
        if key_from_saved(text) == key:
            return text
    except (ValueError, SyntaxError):
        pass
    raise TypeError(f"a state with buffer key {key!r} cannot be saved: use str, int or tuple keys")


def key_from_saved(text: str):
    """The buffer key :func:`key_as_saved` wrote."""
    return ast.literal_eval(text)


def resolve(compression) -> Compression | None:
    """``compression`` as given to a collective: None, a kind's name (no error feedback), or a
    :class:`Compression` (kept by the caller, with its residuals)."""
    if compression is None or isinstance(compression, Compression):
        return compression
    if isinstance(compression, str):
        return Compression(compression)
    raise TypeError(f"compression must be None, one of {', '.join(KINDS)}, or a Compression, got {compression!r}")
