"""The two optimizers low-communication training steps with, over lists of host arrays, in torch's formulas.

:class:`SGD` (momentum, Nesterov, weight decay: ``torch.optim.SGD``) is DiLoCo's outer optimizer, stepping
the replicas' shared weights along the averaged pseudo-gradient, and, in ``mpicoll train``, the inner
optimizer of plain local SGD; :class:`AdamW` (``torch.optim.AdamW``) is DiLoCo's inner optimizer for
transformers.  A torch program brings its own inner optimizer (:class:`mpicoll.torch.DiLoCo`); these are the
numpy twins for ``mpicoll train``'s models over one flat vector and for the outer step everywhere.

Each keeps its state per array (the same list order every step) and gives it as ``state_dict()`` arrays, so
a checkpoint resumes it to the bit.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SGD", "AdamW", "make"]


class SGD:
    """``torch.optim.SGD``'s step (dampening 0): ``g += weight_decay * p``; ``v = momentum * v + g``;
    ``p -= lr * (g + momentum * v if nesterov else v)`` (plain ``p -= lr * g`` without momentum)."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or (nesterov and momentum == 0):
            raise ValueError(f"SGD(lr={lr}, momentum={momentum}, nesterov={nesterov}, weight_decay={weight_decay}): "
                             "lr > 0, 0 <= momentum < 1, weight_decay >= 0, and Nesterov needs a momentum")
        self.lr, self.momentum, self.nesterov, self.weight_decay = lr, momentum, nesterov, weight_decay
        self.velocity: list[np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"SGD(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov})"

    def step(self, params: list, grads: list, lr: float | None = None) -> None:
        """``params`` (updated in place) one step along ``grads`` (left as they were), at ``lr`` (default the
        optimizer's)."""
        lr = self.lr if lr is None else lr
        if self.momentum and self.velocity is None:
            self.velocity = [np.zeros_like(p) for p in params]
        for i, (p, g) in enumerate(zip(params, grads)):
            if self.weight_decay:
                g = g + self.weight_decay * p
            if not self.momentum:
                p -= lr * g
                continue
            v = self.velocity[i]
            v *= self.momentum
            v += g
            p -= lr * (g + self.momentum * v if self.nesterov else v)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {f"velocity{i}": v for i, v in enumerate(self.velocity or [])}

    def load_state_dict(self, state: dict) -> None:
        found = sorted((k for k in state if k.startswith("velocity")), key=lambda k: int(k[len("velocity"):]))
        self.velocity = [np.array(state[k]) for k in found] or None


class AdamW:
    """``torch.optim.AdamW``'s step: ``p *= 1 - lr * weight_decay``; ``m``, ``v`` the moving averages of ``g``
    and ``g**2``; ``p -= lr * m_hat / (sqrt(v_hat) + eps)`` with the bias corrections of step ``t``."""

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or eps <= 0 or weight_decay < 0:
            raise ValueError(f"AdamW(lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}): lr > 0, "
                             "0 <= betas < 1, eps > 0, weight_decay >= 0")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.t = 0
        self.m: list[np.ndarray] | None = None
        self.v: list[np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"AdamW(lr={self.lr}, betas={self.betas}, weight_decay={self.weight_decay})"

    def step(self, params: list, grads: list, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        if self.m is None:
            self.m = [np.zeros_like(p) for p in params]
            self.v = [np.zeros_like(p) for p in params]
        self.t += 1
        b1, b2 = self.betas
        first, second = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p, g, m, v in zip(params, grads, self.m, self.v):
            p *= 1 - lr * self.weight_decay
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= (lr / first) * m / (np.sqrt(v / second) + self.eps)

    def state_dict(self) -> dict[str, np.ndarray]:
        state = {"t": np.array(self.t)}
        for i, (m, v) in enumerate(zip(self.m or [], self.v or [])):
            state[f"m{i}"], state[f"v{i}"] = m, v
        return state

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        count = sum(1 for k in state if k.startswith("m"))
        self.m = [np.array(state[f"m{i}"]) for i in range(count)] or None
        self.v = [np.array(state[f"v{i}"]) for i in range(count)] or None


def make(name: str, lr: float, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0):
    """The inner optimizer ``mpicoll train`` names: "sgd" (with ``momentum``, Nesterov) or "adamw"."""
    if name == "sgd":
        return SGD(lr, momentum, nesterov, weight_decay)
    if name == "adamw":
        return AdamW(lr, weight_decay=weight_decay)
    raise ValueError(f"inner optimizer {name!r}: sgd or adamw")
