"""DiLoCo's outer loop over a replica's arrays: replicas that train apart and meet every ``sync_every`` steps.

Each replica (a rank) takes inner steps on its own data with its own optimizer; every ``sync_every`` (H)
steps the replicas meet: each computes its *pseudo-gradient*, the shared weights it last met on (the
*anchor*) minus its own, the replicas average it (one allreduce), and every replica takes the same outer
step, SGD with Nesterov momentum on the anchor (Douillard et al. 2023), then goes on from the new anchor.
Plain local SGD is the case outer lr 1, no momentum: the new anchor is the average of the replicas.

**Streaming** (Douillard et al. 2025): the arrays are cut into ``fragments`` F (whole arrays, consecutive, of
about equal size), fragment f meeting at the steps t with t mod H = f H / F, so the replicas' traffic is
spread over the H steps; with ``overlap`` tau > 0 a fragment's sum travels (a nonblocking allreduce) while the
replica takes tau more inner steps, and is applied then, the replica's fragment becoming ``mix`` x its own +
(1 - ``mix``) x the new anchor (mix 0: the anchor's, as plain DiLoCo).  ``compression`` moves the
pseudo-gradients as 16-bit floats ("fp16", "bf16": :class:`mpicoll.Compression`) or 8-bit integers ("int8":
:mod:`.int8`), the error feedback kept per fragment either way.

Every replica computes the same outer step from the same sum (mpicoll's allreduce gives every rank the same
bits), so the anchors, and the replicas right after a meeting with mix 0, are identical everywhere.
:meth:`state_dict` holds what a checkpoint needs to resume to the bit: the step, the anchor, the outer
optimizer's momentum, the compression's residuals, and the sums still to be applied.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..collectives.api import iallreduce
from ..collectives.compression import Compression
from ..models.dense import unpack
from .int8 import Int8Sums
from .optimizers import SGD
from .state import taken_from, under

__all__ = ["DiLoCo", "fragments_of"]


def fragments_of(sizes: list[int], count: int) -> list[range]:
    """``count`` runs of consecutive arrays (by index) of about equal total size, none empty: the streaming
    fragments (a fragment is whole arrays, as the paper's are whole layers)."""
    if not 1 <= count <= len(sizes):
        raise ValueError(f"fragments={count}: between 1 and the {len(sizes)} arrays (a fragment is whole arrays)")
    total, cuts, start = sum(sizes), [], 0
    done = 0
    for f in range(1, count):
        target = total * f / count
        end = start + 1
        while end < len(sizes) - (count - f - 1) and done + sizes[end - 1] + sizes[end] / 2 <= target:
            done += sizes[end - 1]
            end += 1
        done += sizes[end - 1]
        cuts.append(range(start, end))
        start = end
    cuts.append(range(start, len(sizes)))
    return cuts


class _Meeting:
    """One fragment's meeting in flight: its pseudo-gradient's sum (``buffer``) and when it is applied."""

    def __init__(self, fragment: int, due: int, buffer: np.ndarray, request):
        self.fragment, self.due, self.buffer, self.request = fragment, due, buffer, request

    def summed(self) -> np.ndarray:
        if self.request is not None:
            self.request.wait()
            self.request = None
        return self.buffer


class DiLoCo:
    """The outer loop of one replica over ``params`` (a list of host arrays, updated in place): call
    :meth:`step` after each inner step, :meth:`finish` after the last.

    ``comm``: an MPI or mpicoll communicator of the replicas (default COMM_WORLD), whose allreduce
    (``algorithm``) sums the pseudo-gradients; or ``start_sum(buffer) -> request`` (``wait()`` leaves the sum
    over the replicas in ``buffer``) with ``replicas``, for another transport (a torch ProcessGroup).
    """

    def __init__(self, params: list, *, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, overlap: int = 0, mix: float = 0.0,
                 compression: str | Compression | None = None, comm=None, algorithm: str = "auto",
                 start_sum: Callable | None = None, replicas: int | None = None):
        params = list(params)
        if not params or any(not isinstance(p, np.ndarray) or p.dtype.kind != "f" for p in params):
            raise TypeError("DiLoCo steps host (numpy) floating-point arrays: one or more")
        if sync_every < 1:
            raise ValueError(f"sync_every={sync_every}: at least 1 inner step between meetings")
        if not 0 <= overlap < sync_every:
            raise ValueError(f"overlap={overlap}: from 0 to sync_every - 1 ({sync_every - 1}) inner steps")
        if not 0 <= mix < 1:
            raise ValueError(f"mix={mix}: the share of a replica's own weights kept at a meeting, from 0 to below 1")
        self.params, self.sync_every, self.overlap, self.mix = params, sync_every, overlap, mix
        int8 = compression == "int8"
        if isinstance(compression, str) and not int8:
            compression = Compression(compression, error_feedback=True)
        self.compression = None if int8 else compression
        self.fragments = fragments_of([p.size for p in params], fragments)
        # one outer optimizer a fragment (its momentum is of that fragment's arrays, stepped at its meetings)
        self.outer = [SGD(outer_lr, outer_momentum, nesterov and outer_momentum > 0) for _ in self.fragments]
        self.offsets = [f * sync_every // len(self.fragments) for f in range(len(self.fragments))]
        self.anchor = [p.copy() for p in params]
        self.t = 0
        self.in_flight: list[_Meeting] = []
        self.last_met = [0] * len(self.fragments)     # the step each fragment last began a meeting at
        self.meetings = 0                 # meetings begun, of every fragment
        self.bytes_summed = 0             # this replica's contributions to the sums, as moved (16-bit words when
                                          # compressed); a ring allreduce sends about twice that
        self.int8 = None
        if start_sum is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD if comm is None else comm
            replicas = comm.Get_size()
            if int8:
                self.int8 = Int8Sums(comm, algorithm, replicas)
                start_sum = self.int8.start
            else:
                start_sum = lambda buffer, key: iallreduce(buffer, comm=comm, algorithm=algorithm, out=buffer,
                                                           compression=self.compression, key=key)
        elif int8:
            raise ValueError("compression='int8' sums over mpicoll's allreduce: pass comm=, not start_sum=")
        elif replicas is None:
            raise ValueError("start_sum needs replicas: how many replicas the sum is over")
        else:
            given = start_sum
            start_sum = lambda buffer, key: given(buffer)
        self.replicas, self._start_sum = replicas, start_sum

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, outer={self.outer[0]!r}, fragments={len(self.fragments)}, "
                f"overlap={self.overlap}, compression={self.int8 or self.compression!r}, replicas={self.replicas})")

    # -- the loop --------------------------------------------------------------------------------------------

    def step(self) -> None:
        """After an inner step: apply the meetings due now, then start those this step begins."""
        self.t += 1
        self._apply_due(self.t)
        for f in self._beginning_at(self.t):
            self._start(f, self.t + self.overlap)
        self._apply_due(self.t)

    def meets_next(self) -> bool:
        """Whether the next :meth:`step` communicates (begins a meeting, or applies one): an elastic run agrees
        on such steps before it uses them (:mod:`mpicoll.train.local`)."""
        t = self.t + 1
        return any(m.due <= t for m in self.in_flight) or bool(self._beginning_at(t))

    def _beginning_at(self, t: int) -> list[int]:
        """The fragments whose meetings begin at step ``t`` (fragment f's at the steps t >= 1 with t mod H = its
        offset f H / F)."""
        return [f for f, offset in enumerate(self.offsets) if t % self.sync_every == offset and t >= 1]

    def finish(self) -> None:
        """After the last inner step: apply the meetings in flight, and meet on every fragment that took inner
        steps since its last meeting, so every replica ends on the same weights (the anchor)."""
        for meeting in list(self.in_flight):
            self._apply(meeting)
        for f in range(len(self.fragments)):
            if self.last_met[f] < self.t:
                self._start(f, self.t)
        self._apply_due(self.t)
        for param, anchor in zip(self.params, self.anchor):    # with mix > 0 the replicas still differ
            param[...] = anchor

    def _start(self, f: int, due: int) -> None:
        arrays = self.fragments[f]
        pieces = [(self.anchor[i] - self.params[i]).ravel() for i in arrays]
        buffer = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        self.bytes_summed += buffer.size * (1 if self.int8 else 2 if self.compression is not None else buffer.itemsize)
        self.meetings += 1
        self.last_met[f] = self.t
        self.in_flight.append(_Meeting(f, due, buffer, self._start_sum(buffer, f"diloco{f}")))

    def _apply_due(self, t: int) -> None:
        for meeting in [m for m in self.in_flight if m.due <= t]:
            self._apply(meeting)

    def _apply(self, meeting: _Meeting) -> None:
        """The outer step on the fragment's anchor from the average pseudo-gradient, then the replica's fragment
        taken to it (mixed with its own by ``mix``)."""
        average = meeting.summed() / self.replicas
        self.in_flight.remove(meeting)
        arrays = self.fragments[meeting.fragment]
        self.outer[meeting.fragment].step([self.anchor[i] for i in arrays],
                                          unpack(average, [self.anchor[i].shape for i in arrays]))
        for i in arrays:
            if self.mix:
                self.params[i] *= self.mix
                self.params[i] += (1 - self.mix) * self.anchor[i]
            else:
                self.params[i][...] = self.anchor[i]

    # -- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """What resumes this replica's outer loop to the bit (the sums in flight are waited for, not applied):
        the step, the anchor, the outer momentum, the compression's residuals, the sums still to apply."""
        state = {"t": np.array(self.t), "meetings": np.array(self.meetings), "bytes_summed": np.array(self.bytes_summed),
                 "last_met": np.array(self.last_met)}
        state.update({f"anchor{i}": a for i, a in enumerate(self.anchor)})
        for f, outer in enumerate(self.outer):
            state.update(under(f"outer{f}.", outer.state_dict()))
        if self.compression is not None:
            state.update(under("compression.", self.compression.state_dict()))
        if self.int8 is not None:
            state.update(under("int8.", self.int8.state_dict()))
        for n, meeting in enumerate(self.in_flight):
            state[f"flight{n}"] = meeting.summed()
            state[f"flight{n}.at"] = np.array([meeting.fragment, meeting.due])
        return state

    def load_state_dict(self, state: dict) -> None:
        self.t, self.meetings, self.bytes_summed = int(state["t"]), int(state["meetings"]), int(state["bytes_summed"])
        self.last_met = [int(t) for t in state["last_met"]]
        for i, a in enumerate(self.anchor):
            a[...] = state[f"anchor{i}"]
        for f, outer in enumerate(self.outer):
            outer.load_state_dict(taken_from(f"outer{f}.", state))
        if self.compression is not None:
            self.compression.load_state_dict(taken_from("compression.", state))
        if self.int8 is not None:
            self.int8.load_state_dict(taken_from("int8.", state))
        self.in_flight = [_Meeting(int(state[f"flight{n}.at"][0]), int(state[f"flight{n}.at"][1]),
                                   np.array(state[f"flight{n}"]), None)
                          for n in range(sum(1 for k in state if k.startswith("flight") and k.endswith(".at")))]
