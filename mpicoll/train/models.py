"""Models over one flat parameter vector, written against an array namespace (numpy or CuPy).

A model is anything with ``size`` (parameters), ``init(seed)`` (a starting
vector), ``loss_and_gradient(params, X, y)`` (mean cross-entropy and its
gradient, both over the batch) and ``predict(params, X)`` (class indices).
Every algorithm in ``mpicoll train`` moves only the flat vector, so a user's
own model needs nothing else; pass it to :func:`mpicoll.train.run.train`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Model", "SoftmaxRegression", "MLP", "make"]


class Model:
    size: int

    def __init__(self, xp=np):
        self.xp = xp

    def init(self, seed: int):
        raise NotImplementedError

    def loss_and_gradient(self, params, X, y):
        raise NotImplementedError

    def predict(self, params, X):
        raise NotImplementedError

    def evaluate(self, params, X, y) -> tuple[float, float]:
        """(mean loss, accuracy) on a data set."""
        loss, _ = self.loss_and_gradient(params, X, y, gradient=False)
        accuracy = float((self.predict(params, X) == y).mean())
        return float(loss), accuracy


def _softmax_cross_entropy(xp, logits, y):
    """Mean cross-entropy of integer labels ``y``, and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    probabilities = exp / exp.sum(axis=1, keepdims=True)
    rows = xp.arange(len(y))
    loss = -xp.log(probabilities[rows, y] + 1e-12).mean()
    probabilities[rows, y] -= 1
    return loss, probabilities / len(y)


class _Layers(Model):
    """A stack of dense layers (ReLU between them) over one flat vector."""

    def __init__(self, sizes: list[int], xp=np, dtype=np.float32):
        super().__init__(xp)
        self.sizes, self.dtype = sizes, np.dtype(dtype)
        self.shapes = [(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        self.size = sum(a * b + b for a, b in self.shapes)

    def _unpack(self, params):
        layers, start = [], 0
        for a, b in self.shapes:
            W = params[start:start + a * b].reshape(a, b)
            start += a * b
            layers.append((W, params[start:start + b]))
            start += b
        return layers

    def init(self, seed: int):
        rng = np.random.default_rng(seed)
        parts = []
        for a, b in self.shapes:
            parts += [rng.standard_normal(a * b) * np.sqrt(2.0 / a) * (len(self.shapes) > 1), np.zeros(b)]
        return self.xp.asarray(np.concatenate(parts).astype(self.dtype))

    def _forward(self, params, X):
        activations = [X]
        layers = self._unpack(params)
        for index, (W, b) in enumerate(layers):
            out = activations[-1] @ W + b
            activations.append(self.xp.maximum(out, 0) if index < len(layers) - 1 else out)
        return layers, activations

    def loss_and_gradient(self, params, X, y, gradient: bool = True):
        xp = self.xp
        layers, activations = self._forward(params, X)
        loss, delta = _softmax_cross_entropy(xp, activations[-1], y)
        if not gradient:
            return loss, None
        grad = xp.empty_like(params)
        grads = self._unpack(grad)
        for index in range(len(layers) - 1, -1, -1):
            W, _ = layers[index]
            gW, gb = grads[index]
            gW[...] = activations[index].T @ delta
            gb[...] = delta.sum(axis=0)
            if index:
                delta = (delta @ W.T) * (activations[index] > 0)
        return loss, grad

    def predict(self, params, X):
        return self._forward(params, X)[1][-1].argmax(axis=1)


class SoftmaxRegression(_Layers):
    """Multinomial logistic regression: one dense layer."""

    def __init__(self, features: int, classes: int, xp=np, dtype=np.float32):
        super().__init__([features, classes], xp, dtype)


class MLP(_Layers):
    """Dense layers of the given hidden sizes, ReLU between them."""

    def __init__(self, features: int, classes: int, hidden: list[int], xp=np, dtype=np.float32):
        if not hidden or any(h < 1 for h in hidden):
            raise ValueError(f"an MLP needs positive hidden sizes, got {hidden}")
        super().__init__([features, *hidden, classes], xp, dtype)


def make(name: str, features: int, classes: int, hidden: list[int] | None = None, xp=np) -> Model:
    if name == "softmax":
        return SoftmaxRegression(features, classes, xp)
    if name == "mlp":
        return MLP(features, classes, hidden or [64], xp)
    raise ValueError(f"Unrecognized model: {name!r}; choose softmax or mlp")
