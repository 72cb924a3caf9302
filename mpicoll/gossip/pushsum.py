"""Push-sum gossip and Stochastic Gradient Push (Assran et al. 2018).

Each rank holds a numerator ``x`` and a push-sum weight ``w`` (1 at the start).
A round sends each out-peer its share of (x, w), keeps its own share, and adds
what its in-peers sent; the de-biased parameters are ``z = x / w``.  Because
the mixing matrices are column-stochastic, the sums of x and of w over the ranks
never change, so z converges to the exact average even on directed graphs.

With ``tau > 0`` a round's messages are folded in ``tau`` rounds later: they
travel while the next gradients are computed, and a rank blocks only when the
messages of round k - tau have not all arrived (tau = 0: synchronous).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
from mpi4py import MPI

from .. import arrays, compute
from ..channel.checks import agree
from ..channel.context import Context
from ..channel.progress import Progress
from ..channel.watchdog import watching
from .mailbox import OneSidedMailbox, PointToPointMailbox
from .mixing import Mixing, UniformMixing
from .topology import Graph, make

__all__ = ["PushSum", "SGP", "MAILBOXES"]

MAILBOXES = {"p2p": PointToPointMailbox, "onesided": OneSidedMailbox}    # the first is the default


class PushSum:
    """Push-sum averaging of one flat parameter vector over ``comm`` (collective to create).

    ``x0``: this rank's starting vector (float32 or float64; a CUDA array is
    copied to the host, where the mixing happens).  ``graph``: a name from
    :mod:`mpicoll.gossip.topology` or a :class:`Graph`; ``mixing``: shares per
    round (default: uniform over out-peers and self); a :class:`MatrixMixing`
    brings its own graph.  ``mailbox``: how gossip arrives, ``"p2p"`` (default) or ``"onesided"``.
    Every rank must call :meth:`mix` the same number of times.
    """

    def __init__(self, comm: MPI.Intracomm, x0, *, graph: str | Graph = "time-varying-exponential",
                 mixing: Mixing | None = None, tau: int = 0, mailbox: str = "p2p"):
        if tau < 0:
            raise ValueError(f"tau (rounds a message may stay in flight) must be >= 0, got {tau}")
        if mailbox not in MAILBOXES:
            raise ValueError(f"mailbox must be one of {', '.join(MAILBOXES)}, got {mailbox!r}")
        self.ctx = Context(comm, "push-sum")
        self.rank, self.size = self.ctx.rank, self.ctx.size
        self.mixing = mixing or UniformMixing()
        self.graph = make(getattr(self.mixing, "graph", None) or graph, self.size)
        self.tau, self.mailbox_kind = tau, mailbox
        self.x = np.array(arrays.as_host(x0), copy=True).reshape(-1)     # our own numerator
        if self.x.dtype not in (np.float32, np.float64):
            raise TypeError(f"push-sum mixes float32 or float64 parameters, got {self.x.dtype}")
        self.weight = 1.0
        self.round = 0              # rounds sent
        self.folded = 0             # rounds whose messages have been folded in
        self._z = np.empty_like(self.x)
        self.mailbox = MAILBOXES[mailbox](self.ctx, self.graph, self.x.size, self.x.dtype, slots=tau + 2)
        # messages travel while we compute only if MPI is called meanwhile: peers write into our
        # window (one-sided), or rounds stay in flight across a gradient (tau > 0)
        self._progress = Progress(self.ctx.comm).start() if mailbox == "onesided" or tau > 0 else None
        self.bytes_sent = 0
        self.wait_s = 0.0

    def mix(self, out=None) -> np.ndarray:
        """One gossip round; returns the de-biased parameters (also written to ``out``, any array)."""
        with self._inside_mpi():
            return self._mix(out)

    def _inside_mpi(self):
        """While this rank is in MPI anyway, its progress thread would only compete for MPI's lock."""
        return self._progress.paused() if self._progress is not None else contextlib.nullcontext()

    def _mix(self, out) -> np.ndarray:
        round = self.round
        keep, shares = self.mixing.shares(self.graph, self.rank, round)
        self.mailbox.expect(round)
        self.mailbox.send(round, shares, self.x, self.weight)
        self.bytes_sent += len(shares) * self.x.nbytes
        self.round += 1
        self._fold(self.folded if self.folded <= round - self.tau else None, keep)
        return self.debiased(out)

    def drain(self) -> None:
        """Fold in every message still in flight (collective: every rank at the same round).

        Afterwards all the mass is in the ranks' (x, w): the state to checkpoint,
        or to read the final average from.
        """
        with self._inside_mpi():
            while self.folded < self.round:
                self._fold(self.folded, 1.0)

    def _fold(self, round: int | None, keep: float) -> None:
        """x = keep * x + the packets of ``round`` (none: just keep)."""
        if round is None:
            np.multiply(self.x, self.x.dtype.type(keep), out=self.x)
            self.weight *= keep
            return
        started = time.perf_counter()
        packets = self.mailbox.take(round)
        self.wait_s += time.perf_counter() - started
        self.folded = round + 1
        try:
            if not packets:
                self._fold(None, keep)
                return
            (first_weight, first), *rest = packets
            compute.scaled_accumulate(self.x, first, keep, 1.0)
            self.weight = keep * self.weight + first_weight
            for weight, payload in rest:
                compute.reduce(self.x, payload, out=self.x, op="sum")
                self.weight += weight
        finally:
            self.mailbox.release()

    def debiased(self, out=None) -> np.ndarray:
        """z = x / w, this rank's estimate of the average."""
        np.divide(self.x, self.x.dtype.type(self.weight), out=self._z)
        if out is not None:
            arrays.copy_into(out, self._z)
            return out
        return self._z

    # -- state ---------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """What a checkpoint needs; call :meth:`drain` first, so nothing is in flight."""
        return {"x": self.x.copy(), "weight": np.array(self.weight), "round": np.array(self.round)}

    def load_state(self, state) -> None:
        """Continue from a :meth:`state`, each rank from its own (collective: every rank calls it).

        A state that does not fit this push-sum on any rank, or states of
        different rounds, are refused on every rank with one
        :class:`mpicoll.SetupError` before anything changes: gossip
        between ranks at different rounds would wait forever for messages.
        """
        def round_of(state) -> int | None:
            try:
                return int(state["round"])
            except (KeyError, TypeError, ValueError):
                return None

        with watching(self.ctx, "PushSum.load_state"):
            rounds = self.ctx.comm.allgather(round_of(state))

        def fits() -> None:
            x = state["x"]
            if x.shape != self.x.shape or x.dtype != self.x.dtype:
                raise ValueError(f"the state holds {x.shape} {x.dtype} parameters; this push-sum has "
                                 f"{self.x.shape} {self.x.dtype}")
            if rounds[self.rank] != rounds[0]:
                raise ValueError(f"the state is at round {rounds[self.rank]}, rank 0's at round {rounds[0]}: "
                                 "resume every rank from states saved at the same point")

        agree(self.ctx.comm, fits)
        self.x[...] = state["x"]
        self.weight, self.round = float(state["weight"]), rounds[self.rank]
        self.folded = self.round
        self.mailbox.restart_at(self.round)

    def close(self, abandon: bool = False) -> None:
        """Release the mailbox and the private communicator (collective).

        After a timeout or a death met here (a peer lost), or with ``abandon`` (a death met elsewhere, as by
        the collective that averages push-sum's result), only the progress thread stops: freeing the window
        would wait for the lost peer, and messages may still be on their way.
        """
        if self._progress is not None:
            self._progress.stop()
        if not (abandon or self.ctx.broken):
            self.mailbox.close()
        self.ctx.free(abandon)


class SGP:
    """Stochastic Gradient Push: a local SGD step on the numerator, then one gossip round.

    As in the paper's Algorithm 1: x <- x - lr * g(z), then push-sum; the
    gradient is taken at the de-biased parameters z.

        sgp = SGP(PushSum(comm, w0, tau=1), lr=0.1)
        z = sgp.parameters
        for batch in batches:
            z = sgp.step(gradient(z, batch))    # gradient at the de-biased parameters
    """

    def __init__(self, gossip: PushSum, lr: float):
        self.gossip, self.lr = gossip, lr
        self._staging = arrays.Staging(gossip.x.size, gossip.x.dtype, "the parameters are {size} {dtype}")

    @property
    def parameters(self) -> np.ndarray:
        return self.gossip.debiased()

    def step(self, gradient, out=None) -> np.ndarray:
        """x -= lr * gradient (taken at z), mix; returns the new de-biased parameters."""
        compute.sgd(self.gossip.x, self._staging.host(gradient), self.lr)
        return self.gossip.mix(out)
