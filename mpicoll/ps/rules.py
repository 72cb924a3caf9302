"""Update rules: how a server turns the gradients that reach it into new weights.

One instance per shard, shared by every transport.  The server calls
``on_gradient(worker, version, g)`` for each gradient (``version``: how many
updates the worker's weights had seen) and sends fresh weights to the workers
the rule returns, if they are waiting for them.

=============  ================================================================
``Sync``       wait for a gradient from every active worker, apply their mean,
               answer everyone (hard-synchronous SGD)
``SoftSync``   apply the mean of the first K gradients computed on the current
               weights; a gradient computed on older weights arriving after its
               round closed is dropped as stale (as TensorFlow's
               SyncReplicasOptimizer does), and its worker gets fresh weights
``Async``      apply each gradient on arrival (ASGD), answer that worker only;
               ``staleness="tau"`` scales the rate by 1/tau (tau = updates
               applied since the worker's weights), ``"workers"`` by 1/W
``DCASGD``     Async plus delay compensation (Zheng et al. 2017): a backup of the
               weights last sent to each worker, ``g + lam g*g*(w - w_bak)``;
               ``adaptive=True`` is DC-ASGD-a
``Downpour``   Async with Adagrad on the server (Dean et al. 2012)
``Ringmaster`` ASGD at a constant rate that drops every gradient whose delay
               (updates since its weights) is ``R`` or more, before it moves
               (Maranjyan, Tyurin and Richtarik, ICML 2025)
``Rescaled``   ASGD whose step for each worker is in proportion to its time
               between gradients, so every worker weighs alike whatever its
               speed (Mahran, Maranjyan and Richtarik, 2026)
=============  ================================================================
"""

from __future__ import annotations

import math
import time

import numpy as np

from .. import compute

__all__ = ["Rule", "Sync", "SoftSync", "Async", "DCASGD", "Downpour", "Ringmaster", "Rescaled", "make", "RULES"]


class Rule:
    name = "?"
    tolerates_lost_workers = True     # can training go on when a worker stops answering?
    arrays_per_gradient = 3           # shard-sized arrays one gradient's update reads or writes
    waits_for_rounds = False          # does an update need gradients from several workers?
    reads_live = True                 # may workers read the weights without telling the server?
    refuses_late = False              # may a gradient be dropped for its version alone? (then workers ask first)

    def gradients_per_update(self, workers: int, pushes: int = 1) -> int:
        """How many gradients one update of the weights takes in, with ``workers`` workers each sending
        ``pushes`` gradients per message (Downpour's n_push): the unit of a training budget in updates."""
        return 1

    def setup(self, weights: np.ndarray, workers: tuple[int, ...]) -> None:
        """Take the shard's initial weights and the workers that will train."""
        self.w = weights
        self.active = set(workers)
        self.version = 0          # updates applied so far
        self.dropped = 0          # stale gradients discarded

    def on_gradient(self, worker: int, version: int, gradient: np.ndarray) -> list[int]:
        raise NotImplementedError

    def too_late(self, version: int) -> bool:
        """Would a gradient computed on weights of ``version`` be dropped unread?  (Only rules that
        set ``refuses_late`` say yes; their workers send the header first and the gradient if asked.)"""
        return False

    def refuse(self, worker: int) -> list[int]:
        """A gradient was refused for being late, before it moved; returns who may get weights."""
        self.dropped += 1
        return [worker]

    def state(self) -> dict[str, np.ndarray]:
        """Everything needed to continue exactly: weights, counters and optimizer state."""
        return {"w": self.w, "version": np.array(self.version), "dropped": np.array(self.dropped)}

    def load_state(self, state) -> None:
        """Continue from ``state()`` of an earlier run (after ``setup``)."""
        if state["w"].shape != self.w.shape or state["w"].dtype != self.w.dtype:
            raise ValueError(f"checkpoint holds {state['w'].shape} {state['w'].dtype} weights; this shard is "
                             f"{self.w.shape} {self.w.dtype}: resume with the same model, servers and dtype")
        self.w[...] = state["w"]
        self.version, self.dropped = int(state["version"]), int(state["dropped"])

    def on_pull(self, worker: int) -> None:
        """``worker`` is about to be sent the current weights without a gradient of its own."""

    def on_leave(self, worker: int) -> list[int]:
        """A worker has finished (or was lost); returns who may now get weights."""
        self.active.discard(worker)
        return []

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


class _Rounds(Rule):
    """Average gradients computed on the current weights until a round is full.

    Each gradient is kept until its round closes and the round's sum is taken
    in worker order, so a round's update does not depend on the order the
    gradients arrived in: runs repeat bit for bit, and a resumed run ends
    where an uninterrupted one does.
    """

    waits_for_rounds = True
    arrays_per_gradient = 4           # keep it (read g, write the copy), sum it (read the copy, update total)

    def __init__(self, lr: float):
        self.lr = lr

    def setup(self, weights, workers):
        super().setup(weights, workers)
        self.total = np.zeros_like(weights)
        self.kept: dict[int, np.ndarray] = {}       # worker -> its gradient buffer, reused every round
        self.contributors: list[int] = []

    def quorum(self) -> int:
        raise NotImplementedError

    def state(self):
        kept = [self.kept[w] for w in self.contributors]
        return {**super().state(), "contributors": np.array(self.contributors, np.int64),
                "gradients": np.stack(kept) if kept else np.zeros((0, self.w.size), self.w.dtype)}

    def load_state(self, state):
        super().load_state(state)
        self.contributors = [int(w) for w in state["contributors"]]
        for worker, gradient in zip(self.contributors, state["gradients"]):
            self._keep(worker, gradient)

    def _keep(self, worker: int, gradient: np.ndarray) -> None:
        if worker not in self.kept:
            self.kept[worker] = np.empty_like(self.w)
        self.kept[worker][...] = gradient

    def too_late(self, version: int) -> bool:
        return version != self.version                 # computed on weights of a closed round

    def on_gradient(self, worker, version, gradient):
        if self.too_late(version):
            return self.refuse(worker)
        if worker in self.contributors:
            raise ValueError(f"worker {worker} sent two gradients in round {self.version}")
        self._keep(worker, gradient)
        self.contributors.append(worker)
        return self._close_if_full()

    def on_leave(self, worker):
        super().on_leave(worker)
        return self._close_if_full() if self.contributors else []

    def _close_if_full(self) -> list[int]:
        if len(self.contributors) < min(self.quorum(), max(len(self.active), 1)):
            return []
        first, *rest = sorted(self.contributors)
        self.total[...] = self.kept[first]
        for worker in rest:
            compute.reduce(self.total, self.kept[worker], op="sum")
        compute.sgd(self.w, self.total, self.lr, tau=len(self.contributors))   # w -= lr * mean
        self.version += 1
        answered, self.contributors = self.contributors, []
        return answered


class Sync(_Rounds):
    name = "sync"
    tolerates_lost_workers = False

    def gradients_per_update(self, workers: int, pushes: int = 1) -> int:
        return workers

    def quorum(self) -> int:
        return len(self.active)


class SoftSync(_Rounds):
    """``k``: a count of workers, or a fraction of them (0.9: 90%, rounded up).

    Rounds close without the slowest workers, whose gradients then arrive late:
    their workers send the header first and the payload only if the round is
    still open, so a refused gradient never crosses the network.
    """

    name = "softsync"
    refuses_late = True

    def __init__(self, lr: float, k: float = 0.9):
        super().__init__(lr)
        if k <= 0:
            raise ValueError(f"softsync k must be positive, got {k}")
        self.k = k

    def setup(self, weights, workers):
        super().setup(weights, workers)
        self.workers = len(workers)

    def gradients_per_update(self, workers: int, pushes: int = 1) -> int:
        """A round closes at ``k`` gradients: a count, or a fraction of the workers rounded up."""
        return math.ceil(self.k * workers) if self.k < 1 else int(self.k)

    def quorum(self) -> int:
        return self.gradients_per_update(self.workers)


class Async(Rule):
    name = "async"

    def __init__(self, lr: float, staleness: str = "none"):
        if staleness not in ("none", "tau", "workers"):
            raise ValueError(f"staleness must be none, tau or workers, got {staleness!r}")
        self.lr, self.staleness = lr, staleness

    def setup(self, weights, workers):
        super().setup(weights, workers)
        self.workers = len(workers)

    def scale(self, version: int) -> float:
        if self.staleness == "tau":
            return float(max(1, self.version - version))
        return float(self.workers) if self.staleness == "workers" else 1.0

    def on_gradient(self, worker, version, gradient):
        compute.sgd(self.w, gradient, self.lr, tau=self.scale(version))
        self.version += 1
        return [worker]


class DCASGD(Rule):
    name = "dcasgd"
    arrays_per_gradient = 5           # read w, g, w_bak; write w, w_bak (DC-ASGD-a: +2 for m)
    reads_live = False                # the backup must be exactly what each worker got

    def __init__(self, lr: float, lam: float = 0.04, *, adaptive: bool = False, beta: float = 0.95,
                 eps: float = 1e-7):
        self.lr, self.lam, self.adaptive, self.beta, self.eps = lr, lam, adaptive, beta, eps
        self.arrays_per_gradient = 7 if adaptive else 5

    def setup(self, weights, workers):
        super().setup(weights, workers)
        # the weights each worker last received: all start from the initial ones
        self.backup = {worker: weights.copy() for worker in workers}
        self.mean_square = np.zeros_like(weights) if self.adaptive else None

    def state(self):
        workers = sorted(self.backup)
        extra = {"backup_workers": np.array(workers, np.int64), "backups": np.stack([self.backup[w] for w in workers])}
        if self.adaptive:
            extra["mean_square"] = self.mean_square
        return {**super().state(), **extra}

    def load_state(self, state):
        """Also from a run of other workers: a worker the checkpoint has no backup of starts from the weights
        (as every worker of a fresh run does); a worker's first pull sets its backup anyway."""
        super().load_state(state)
        saved = dict(zip((int(w) for w in state["backup_workers"]), state["backups"]))
        for worker, backup in self.backup.items():
            backup[...] = saved.get(worker, self.w)
        if self.adaptive:
            self.mean_square[...] = state["mean_square"]

    def on_gradient(self, worker, version, gradient):
        if self.adaptive:
            compute.dcasgd_adaptive(self.w, gradient, self.backup[worker], self.mean_square, self.lr, self.lam,
                                    beta=self.beta, eps=self.eps, refresh_backup=True)
        else:
            compute.dcasgd(self.w, gradient, self.backup[worker], self.lr, self.lam, refresh_backup=True)
        self.version += 1
        return [worker]       # it gets exactly the weights its backup now holds

    def on_pull(self, worker):
        self.backup[worker][...] = self.w


class Downpour(Rule):
    name = "downpour"
    arrays_per_gradient = 5           # read w, g, h; write w, h

    def __init__(self, lr: float, eps: float = 1e-8):
        self.lr, self.eps = lr, eps

    def gradients_per_update(self, workers: int, pushes: int = 1) -> int:
        return pushes

    def setup(self, weights, workers):
        super().setup(weights, workers)
        self.history = np.zeros_like(weights)

    def state(self):
        return {**super().state(), "history": self.history}

    def load_state(self, state):
        super().load_state(state)
        self.history[...] = state["history"]

    def on_gradient(self, worker, version, gradient):
        compute.adagrad(self.w, gradient, self.history, self.lr, self.eps)
        self.version += 1
        return [worker]


class Ringmaster(Rule):
    """Ringmaster ASGD: each gradient is applied on arrival at the constant rate ``lr``, unless its delay, the
    updates applied since the weights it was computed on, is ``R`` or more: then it is dropped and its worker
    gets the current weights.  Its workers send the header first, so a dropped gradient never crosses the
    network (the paper's Ringmaster stops such computations; here the worker's next one starts from fresh
    weights).  The paper proves optimal time complexity with R = max(1, ceil(sigma^2 / epsilon)), which needs
    the gradients' noise and the target accuracy; the default here, None, is R = the number of workers, which
    keeps a gradient when fewer updates than workers came between (the delay plain ASGD has when every worker
    runs at the same speed)."""

    name = "ringmaster"
    refuses_late = True

    def __init__(self, lr: float, R: int | None = None):
        if R is not None and R < 1:
            raise ValueError(f"ringmaster R must be at least 1, got {R}")
        self.lr, self.threshold = lr, R

    def setup(self, weights, workers):
        super().setup(weights, workers)
        self.R = self.threshold or len(workers)

    def too_late(self, version: int) -> bool:
        return self.version - version >= self.R

    def on_gradient(self, worker, version, gradient):
        if self.too_late(version):          # a transport that does not ask first: read, then dropped
            self.dropped += 1
            return [worker]
        compute.sgd(self.w, gradient, self.lr)
        self.version += 1
        return [worker]


class Rescaled(Rule):
    """Rescaled ASGD: each gradient is applied on arrival, worker i's at ``lr * c_i / H``, where c_i is the time
    between its gradients' arrivals (its computation and its round trip, measured here, smoothed by
    ``smoothing``) and H the harmonic mean of the workers' c: a worker that takes 3x as long per gradient takes
    3x the step, so each contributes the same rate per second and plain ASGD's bias toward the fast workers'
    data (it minimises their arrival-weighted objective) goes; the total rate per second stays plain ASGD's
    (sum_i lr c_i / H / c_i = n lr / H = lr sum_i 1 / c_i).  A worker's first gradients, before its time is
    known, take ``lr``."""

    name = "rescaled"

    def __init__(self, lr: float, smoothing: float = 0.8, clock=time.perf_counter):
        if not 0 <= smoothing < 1:
            raise ValueError(f"rescaled smoothing must be from 0 to below 1, got {smoothing}")
        self.lr, self.smoothing, self.clock = lr, smoothing, clock

    def setup(self, weights, workers):
        super().setup(weights, workers)
        self.arrived: dict[int, float] = {}       # when each worker's last gradient arrived
        self.cycle: dict[int, float] = {}         # each worker's smoothed time between gradients

    def state(self):
        workers = sorted(self.arrived)
        return {**super().state(), "timed_workers": np.array(workers, np.int64),
                "arrived": np.array([self.arrived[w] for w in workers], np.float64),
                "cycle": np.array([self.cycle.get(w, 0.0) for w in workers], np.float64)}

    def load_state(self, state):
        """The workers' times too (their arrivals on the clock of the run that saved them: a resumed run's first
        gradient of each worker measures its time afresh where that clock is another process's)."""
        super().load_state(state)
        workers = [int(w) for w in state["timed_workers"]]
        self.arrived = dict(zip(workers, (float(t) for t in state["arrived"])))
        self.cycle = {w: float(c) for w, c in zip(workers, state["cycle"]) if c > 0}

    def step_scale(self, worker: int) -> float:
        """c_worker / H over the workers whose time is known (1 while this worker's is not)."""
        mine = self.cycle.get(worker)
        if not mine:
            return 1.0
        known = [c for c in self.cycle.values() if c > 0]
        return mine * sum(1.0 / c for c in known) / len(known)

    def on_gradient(self, worker, version, gradient):
        now = self.clock()
        if worker in self.arrived:
            took = now - self.arrived[worker]
            before = self.cycle.get(worker)
            self.cycle[worker] = took if before is None else self.smoothing * before + (1 - self.smoothing) * took
        self.arrived[worker] = now
        compute.sgd(self.w, gradient, self.lr * self.step_scale(worker))
        self.version += 1
        return [worker]

    def on_leave(self, worker):
        self.cycle.pop(worker, None)              # a finished worker no longer weighs in H
        return super().on_leave(worker)


RULES = {rule.name: rule for rule in (Sync, SoftSync, Async, DCASGD, Downpour, Ringmaster, Rescaled)}


def make(name: str, **options) -> Rule:
    """A rule by name (``sync``, ``softsync``, ``async``, ``dcasgd``, ``downpour``, ``ringmaster``, ``rescaled``)."""
    try:
        return RULES[name](**options)
    except KeyError:
        raise ValueError(f"Unrecognized rule: {name!r}; choose from {', '.join(RULES)}") from None
