"""Models over one flat parameter vector, written against an array namespace (numpy or CuPy).

A model is anything with ``size`` (parameters), ``init(seed)`` (a starting
vector), ``loss_and_gradient(params, X, y)`` (mean cross-entropy and its
gradient, both over the batch) and ``predict(params, X)`` (class indices);
with ``logits(params, X)`` (class scores) too, an evaluation takes one forward
pass instead of two.  Every algorithm in ``mpicoll train`` moves only the flat
vector, so a user's own model needs nothing else; pass it to
:func:`mpicoll.train.run.train`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Model", "SoftmaxRegression", "MLP", "CNN", "make", "softmax_cross_entropy", "dense_layers",
           "dense_forward", "dense_backward"]


class Model:
    size: int

    def __init__(self, xp=np):
        self.xp = xp

    def parameter_shapes(self) -> list[tuple]:
        """The shapes of the tensors laid end to end in the flat parameter vector, in order (what PowerSGD
        compresses matrix by matrix)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its flat vector is laid out")

    def init(self, seed: int):
        raise NotImplementedError

    def loss_and_gradient(self, params, X, y):
        raise NotImplementedError

    def predict(self, params, X):
        raise NotImplementedError

    def evaluate(self, params, X, y) -> tuple[float, float]:
        """(mean loss, accuracy) on a data set.

        One forward pass where the model gives its class scores (``logits``, as
        mpicoll's own models do), else two (``loss_and_gradient`` and ``predict``):
        on rank 0 of a training run every epoch, the evaluation holds the others up.
        """
        if hasattr(self, "logits"):
            scores = self.logits(params, X)
            loss, _ = softmax_cross_entropy(self.xp, scores, y)
            return float(loss), float((scores.argmax(axis=1) == y).mean())
        loss, _ = self.loss_and_gradient(params, X, y, gradient=False)
        accuracy = float((self.predict(params, X) == y).mean())
        return float(loss), accuracy


def unpack(params, shapes) -> list:
    """Views of consecutive slices of the flat ``params``, one per shape in ``shapes``, in order."""
    parts, start = [], 0
    for shape in shapes:
        count = int(np.prod(shape))
        parts.append(params[start:start + count].reshape(shape))
        start += count
    return parts


def dense_layers(params, shapes) -> list:
    """(W, b) per dense layer of ``shapes`` ((inputs, outputs) each), laid end to end in ``params``."""
    parts = unpack(params, [shape for a, b in shapes for shape in ((a, b), (b,))])
    return list(zip(parts[::2], parts[1::2]))


def dense_forward(xp, layers, a, linear_last: bool = True) -> list:
    """Every activation of dense ``layers`` ((W, b) each) from input ``a``: ReLU after each layer but
    the last (after it too when not ``linear_last``: a stage that feeds another)."""
    activations = [a]
    for index, (W, b) in enumerate(layers):
        out = activations[-1] @ W + b
        activations.append(out if linear_last and index == len(layers) - 1 else xp.maximum(out, 0))
    return activations


def dense_backward(layers, activations, delta, grads, input_grad: bool = False):
    """Add each layer's gradient to ``grads`` ((gW, gb) each), given ``delta``, the loss's gradient at the
    last layer's pre-activation; returns the gradient at the pre-activation of whatever fed the first
    layer (through the ReLU it applied) when ``input_grad``, else None."""
    for index in range(len(layers) - 1, -1, -1):
        W, _ = layers[index]
        gW, gb = grads[index]
        gW += activations[index].T @ delta
        gb += delta.sum(axis=0)
        delta = (delta @ W.T) * (activations[index] > 0) if index or input_grad else None
    return delta


def softmax_cross_entropy(xp, logits, y):
    """Mean cross-entropy of integer labels ``y``, and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    probabilities = exp / exp.sum(axis=1, keepdims=True)
    rows = xp.arange(len(y))
    loss = -xp.log(probabilities[rows, y] + 1e-12).mean()
    probabilities[rows, y] -= 1
    return loss, probabilities / len(y)


_SKIP_PIECE = 1 << 20      # random draws made and dropped at a time when skipping layers


class _Layers(Model):
    """A stack of dense layers (ReLU between them) over one flat vector."""

    def __init__(self, sizes: list[int], xp=np, dtype=np.float32):
        super().__init__(xp)
        self.sizes, self.dtype = sizes, np.dtype(dtype)
        self.shapes = [(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        self.size = sum(a * b + b for a, b in self.shapes)

    def _unpack(self, params):
        return dense_layers(params, self.shapes)

    def parameter_shapes(self) -> list[tuple]:
        return [shape for a, b in self.shapes for shape in ((a, b), (b,))]

    def init(self, seed: int):
        return self.init_layers(seed, 0, len(self.shapes))

    def init_layers(self, seed: int, first: int, end: int):
        """Layers [first, end) of :meth:`init`'s vector, made without making the others: the random stream
        is advanced past earlier layers in bounded pieces (a model stage that is all a rank can hold)."""
        rng = np.random.default_rng(seed)
        for a, b in self.shapes[:first]:
            for done in range(0, a * b, _SKIP_PIECE):
                rng.standard_normal(min(_SKIP_PIECE, a * b - done))
        parts = []
        for a, b in self.shapes[first:end]:
            parts += [(rng.standard_normal(a * b) * np.sqrt(2.0 / a) * (len(self.shapes) > 1)).astype(self.dtype),
                      np.zeros(b, self.dtype)]
        return self.xp.asarray(np.concatenate(parts))

    def state_bytes(self, batch: int, first: int = 0, end: int | None = None) -> int:
        """Bytes one rank holds to train layers [first, end) by allreduce SGD on ``batch`` rows: the
        parameters, their gradient and the allreduce's result (three vectors), and the activations a
        batch keeps for the backward pass (its input and every layer's output)."""
        shapes = self.shapes[first:end]
        parameters = sum(a * b + b for a, b in shapes)
        widths = shapes[0][0] + sum(b for _, b in shapes)
        return self.dtype.itemsize * (3 * parameters + batch * widths)

    def _forward(self, params, X):
        layers = self._unpack(params)
        return layers, dense_forward(self.xp, layers, X)

    def loss_and_gradient(self, params, X, y, gradient: bool = True):
        xp = self.xp
        layers, activations = self._forward(params, X)
        loss, delta = softmax_cross_entropy(xp, activations[-1], y)
        if not gradient:
            return loss, None
        grad = xp.zeros_like(params)
        dense_backward(layers, activations, delta, self._unpack(grad))
        return loss, grad

    def logits(self, params, X):
        return self._forward(params, X)[1][-1]

    def predict(self, params, X):
        return self.logits(params, X).argmax(axis=1)


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


class CNN(Model):
    """A small 1-D convolutional network over each sample's features, as a signal of one channel.

    Two blocks of convolution (width 5, zero padding 2), ReLU and max-pooling
    by 2, then a dense layer: the same network as the torch ``cnn`` model
    (:mod:`.torch_models`) takes on 1-D data such as MNIST-1D, with the same
    parameter layout (so the two can be checked against each other), in numpy
    or CuPy.  Convolutions run as one matrix product over the windows of every
    position (``sliding_window_view``).  Images are taken row after row.
    """

    width = 5

    def __init__(self, features: int, classes: int, channels: tuple[int, ...] = (16, 32), xp=np, dtype=np.float32):
        super().__init__(xp)
        self.dtype = np.dtype(dtype)
        self.lengths = [features]
        for _ in channels:
            self.lengths.append(max(1, self.lengths[-1] // 2))
        self.convs = list(zip((1, *channels[:-1]), channels))             # (inputs, outputs) per block
        self.dense = (channels[-1] * self.lengths[-1], classes)
        self.shapes = [shape for c_in, c_out in self.convs for shape in ((c_out, c_in, self.width), (c_out,))]
        self.shapes += [(self.dense[1], self.dense[0]), (self.dense[1],)]      # torch's Linear: (out, in)
        self.size = sum(int(np.prod(shape)) for shape in self.shapes)

    def _unpack(self, params):
        return unpack(params, self.shapes)

    def parameter_shapes(self) -> list[tuple]:
        return list(self.shapes)

    def init(self, seed: int):
        rng = np.random.default_rng(seed)
        parts = []
        for shape in self.shapes:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
            parts.append(rng.standard_normal(int(np.prod(shape))) * np.sqrt(2.0 / fan_in) if fan_in
                         else np.zeros(shape[0]))
        return self.xp.asarray(np.concatenate(parts).astype(self.dtype))

    def _windows(self, A):
        """Every position's window of every channel, as rows: (N * L, C * width)."""
        pad = self.width // 2
        padded = self.xp.pad(A, ((0, 0), (0, 0), (pad, pad)))
        windows = self.xp.lib.stride_tricks.sliding_window_view(padded, self.width, axis=2)   # N, C, L, width
        n, c, length, _ = windows.shape
        return windows.transpose(0, 2, 1, 3).reshape(n * length, c * self.width)

    def _forward(self, params, X):
        xp, parts = self.xp, self._unpack(params)
        A, saved = X.reshape(len(X), 1, -1), []
        for block in range(len(self.convs)):
            W, b = parts[2 * block], parts[2 * block + 1]
            n, _, length = A.shape
            columns = self._windows(A)
            pre = (columns @ W.reshape(len(W), -1).T + b).reshape(n, length, len(W)).transpose(0, 2, 1)
            relu = xp.maximum(pre, 0)
            half = max(1, length // 2)
            pairs = relu[:, :, :2 * half].reshape(n, len(W), half, 2) if length > 1 else relu[..., None]
            A = pairs.max(axis=3)
            saved.append((columns, pre, pairs, length))
        flat = A.reshape(len(X), -1)
        return parts, saved, flat, flat @ parts[-2].T + parts[-1]

    def loss_and_gradient(self, params, X, y, gradient: bool = True):
        xp = self.xp
        parts, saved, flat, logits = self._forward(params, X)
        loss, delta = softmax_cross_entropy(xp, logits, y)
        if not gradient:
            return loss, None
        grad = xp.empty_like(params)
        grads = self._unpack(grad)
        grads[-2][...] = delta.T @ flat
        grads[-1][...] = delta.sum(axis=0)
        d = (delta @ parts[-2]).reshape(len(X), *saved[-1][2].shape[1:3])
        for block in range(len(self.convs) - 1, -1, -1):
            columns, pre, pairs, length = saved[block]
            W = parts[2 * block]
            n, channels = pre.shape[:2]
            chosen = pairs == pairs.max(axis=3, keepdims=True)                       # the max of each pair
            chosen &= xp.cumsum(chosen, axis=3) == 1                                 # (the first, on ties)
            d_relu = xp.zeros_like(pre)
            d_relu[:, :, :pairs.shape[2] * pairs.shape[3]] = (chosen * d[..., None]).reshape(n, channels, -1)
            d_pre = (d_relu * (pre > 0)).transpose(0, 2, 1).reshape(n * length, channels)
            grads[2 * block][...] = (d_pre.T @ columns).reshape(W.shape)
            grads[2 * block + 1][...] = d_pre.sum(axis=0)
            if block:
                d_columns = (d_pre @ W.reshape(channels, -1)).reshape(n, length, W.shape[1], self.width)
                pad = self.width // 2
                d_in = xp.zeros((n, W.shape[1], length + 2 * pad), dtype=d_pre.dtype)
                for j in range(self.width):
                    d_in[:, :, j:j + length] += d_columns[:, :, :, j].transpose(0, 2, 1)
                d = d_in[:, :, pad:pad + length]
        return loss, grad

    def logits(self, params, X):
        return self._forward(params, X)[3]

    def predict(self, params, X):
        return self.logits(params, X).argmax(axis=1)


def make(name: str, features: int, classes: int, hidden: list[int] | None = None, xp=np) -> Model:
    if name == "softmax":
        return SoftmaxRegression(features, classes, xp)
    if name == "mlp":
        return MLP(features, classes, hidden or [64], xp)
    if name == "cnn":
        return CNN(features, classes, xp=xp)
    raise ValueError(f"Unrecognized model: {name!r}; choose softmax, mlp or cnn")
