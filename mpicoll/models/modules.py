"""PyTorch modules as ``mpicoll train`` models, so every training method trains them unchanged.

Every method moves one flat parameter vector (:mod:`.models`).
:class:`TorchModel` runs any ``torch.nn.Module`` on such a vector without
copying it: before each call the module's parameters are pointed at views
of the vector, and their ``.grad`` at views of a fresh flat gradient, into
which backward accumulates in place.  So allreduce, the parameter servers
and SGP hand torch their arrays and get torch's gradient back as one array.

    model = TorchModel(lambda: torch.nn.Sequential(torch.nn.Linear(64, 10)), name="mine")
    train(comm, Options(method="sgp"), model, data)

Built-in modules (``mpicoll train --framework torch --model ...``): ``softmax``
(one linear layer), ``mlp`` (ReLU between hidden layers) and ``cnn`` (two
convolution + max-pool blocks and a linear layer: 2-D for samples with an
image shape such as the digits' 8x8, 1-D along the features otherwise, as for
MNIST-1D's 40-point signals).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from .dense import Model

__all__ = ["TorchModel", "make", "point_at"]


def point_at(parameters: list[torch.Tensor], flat: torch.Tensor, flat_grad: torch.Tensor | None = None) -> None:
    """Make ``parameters`` views of consecutive slices of ``flat`` (and their ``.grad`` of ``flat_grad``): no copy.

    Backward then accumulates into ``flat_grad`` in place, and whatever writes
    ``flat`` (a parameter server's answer, a gossip step) is the module's weights.
    """
    offset = 0
    for p in parameters:
        end = offset + p.numel()
        p.data = flat[offset:end].view(p.shape)
        p.grad = None if flat_grad is None else flat_grad[offset:end].view(p.shape)
        offset = end


class TorchModel(Model):
    """A module over one flat float32 vector: ``init``, ``loss_and_gradient``, ``predict`` as :class:`.models.Model`.

    ``build`` makes the module (called once per ``init(seed)`` under
    ``torch.manual_seed(seed)``, so every rank starts from the same weights);
    it takes flat samples (``features`` numbers) and returns class scores.
    """

    dtype = np.dtype(np.float32)

    def __init__(self, build: Callable[[], nn.Module], name: str = "torch", xp=np):
        super().__init__(xp)
        self.build, self.name = build, name
        self.module = build().float()
        self.parameters = list(self.module.parameters())
        self.size = sum(p.numel() for p in self.parameters)

    def parameter_shapes(self) -> list[tuple]:
        return [tuple(p.shape) for p in self.parameters]

    def init(self, seed: int):
        torch.manual_seed(seed)
        fresh = self.build().float()
        return self.xp.asarray(torch.cat([p.detach().reshape(-1) for p in fresh.parameters()]).numpy())

    def _point_at(self, params, grad=None) -> None:
        """Make the module's parameters (and gradients) views of the flat arrays: no copy."""
        point_at(self.parameters, torch.as_tensor(params), None if grad is None else torch.as_tensor(grad))

    def _tensor(self, array) -> torch.Tensor:
        if isinstance(array, np.ndarray) and not array.flags.writeable:
            array = array.copy()             # torch will not view read-only memory
        return torch.as_tensor(array)

    def _ready(self, params):
        """``params`` as torch may view them (a copy of read-only memory)."""
        if isinstance(params, np.ndarray) and not params.flags.writeable:
            params = params.copy()
        return params

    def loss_and_gradient(self, params, X, y, gradient: bool = True):
        if not gradient:
            return float(functional.cross_entropy(self._scores(params, X), self._tensor(y))), None
        params = self._ready(params)
        grad = self.xp.zeros_like(params)
        self._point_at(params, grad)
        loss = functional.cross_entropy(self.module(self._tensor(X)), self._tensor(y))
        loss.backward()                      # accumulates into the views of ``grad``
        return float(loss.detach()), grad

    def predict(self, params, X):
        predicted = self._scores(params, X).argmax(dim=1)
        return predicted.numpy() if self.xp is np else self.xp.asarray(predicted)

    def evaluate(self, params, X, y) -> tuple[float, float]:
        """(mean loss, accuracy) from one forward pass."""
        scores, y = self._scores(params, X), self._tensor(y)
        return float(functional.cross_entropy(scores, y)), float((scores.argmax(dim=1) == y).double().mean())

    def _scores(self, params, X) -> torch.Tensor:
        """The class scores of ``X``, without a graph for gradients."""
        params = self._ready(params)
        with torch.no_grad():
            self._point_at(params)
            return self.module(self._tensor(X))


def _mlp(features: int, classes: int, hidden: list[int]) -> nn.Module:
    widths, layers = [features, *hidden], []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], classes))


def _cnn(features: int, classes: int, shape: tuple, channels: tuple[int, int] = (16, 32)) -> nn.Module:
    """Two blocks of 3-wide (2-D) or 5-wide (1-D) convolution, ReLU and 2x max-pooling, then a linear layer."""
    image = len(shape) == 2 and math.prod(shape) == features
    conv, pool, width = (nn.Conv2d, nn.MaxPool2d, 3) if image else (nn.Conv1d, nn.MaxPool1d, 5)
    sample = (1, *shape) if image else (1, features)
    layers: list[nn.Module] = [nn.Unflatten(1, sample)]
    inputs, size = 1, list(sample[1:])
    for outputs in channels:
        short = min(size) < 2                                 # nothing to pool (a signal of one point)
        layers += [conv(inputs, outputs, width, padding=width // 2), nn.ReLU(), nn.Identity() if short else pool(2)]
        inputs, size = outputs, [s if short else s // 2 for s in size]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(inputs * math.prod(size), classes))


def make(name: str, features: int, classes: int, hidden: list[int] | None = None, shape: tuple = (),
         xp=np) -> TorchModel:
    """The built-in torch model ``name`` (softmax, mlp or cnn) for this data."""
    if name == "softmax":
        return TorchModel(lambda: nn.Linear(features, classes), "torch-softmax", xp)
    if name == "mlp":
        hidden = hidden or [64]
        if any(h < 1 for h in hidden):
            raise ValueError(f"an MLP needs positive hidden sizes, got {hidden}")
        return TorchModel(lambda: _mlp(features, classes, hidden), "torch-mlp", xp)
    if name == "cnn":
        return TorchModel(lambda: _cnn(features, classes, shape), "torch-cnn", xp)
    raise ValueError(f"Unrecognized model: {name!r}; choose softmax, mlp or cnn")
