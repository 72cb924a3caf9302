"""Model parallelism: one layered model split into consecutive stages, one stage per rank (DistBelief, GPipe).

A :class:`Pipeline` cuts the dense layers of an mpicoll MLP or softmax model
(:mod:`mpicoll.models.dense`) into K stages over the K ranks of a
communicator.  Each rank holds only its stage's parameters (its slice of the
model's flat vector); a forward pass sends only the activations that cross a
stage boundary to the next rank, and the backward pass only their gradients
to the previous one, both nonblocking point to point.

A batch is cut into micro-batches run in GPipe's fill-drain order: every
stage runs all its forwards, then all its backwards in reverse order.  Stage
k works on micro-batch m while stage k+1 works on m-1, so the stages overlap
once the pipe is full; fill-drain keeps every micro-batch's activations until
its backward (1F1B would keep fewer), which is the simpler schedule to check
against the unpartitioned model, and equal in time per batch.

    pipe = Pipeline(comm, MLP(64, 10, [128, 128]), micro_batches=4)
    w = pipe.init(seed)                       # this stage's parameters only
    loss, g = pipe.loss_and_gradient(w, X, y) # every stage gets the batch; the first reads X, the last y
    w -= lr * g

The gradient of each stage is its slice of the unpartitioned model's
gradient for the whole batch (the loss is the batch mean, so micro-batches
are weighted by their sizes); the loss is known on every stage.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .channel.context import Context
from .base.tags import Tag
from .models.dense import softmax_cross_entropy, dense_backward, dense_forward, dense_layers

__all__ = ["Pipeline", "TorchPipeline", "TorchStage", "stage", "stage_init", "layer_sizes", "split"]


def split(sizes: list[int], stages: int) -> list[tuple[int, int]]:
    """Cut the layers (``sizes``: parameters per layer) into ``stages`` consecutive, non-empty ranges with
    parameter counts as even as the order allows; returns (first layer, one past the last) per stage."""
    if not 1 <= stages <= len(sizes):
        raise ValueError(f"{len(sizes)} layer(s) cannot make {stages} stage(s): each stage needs a layer")
    total, bounds, start = sum(sizes), [], 0
    for stage in range(stages - 1):
        target = total * (stage + 1) / stages
        end, running = start + 1, sum(sizes[:start + 1])
        # grow while the next layer brings the cut closer to the target and leaves a layer per later stage
        while end < len(sizes) - (stages - 1 - stage) and abs(running + sizes[end] - target) < abs(running - target):
            running += sizes[end]
            end += 1
        bounds.append((start, end))
        start = end
    return bounds + [(start, len(sizes))]


class Pipeline:
    """Stage ``comm.rank`` of a model cut into ``comm.size`` stages (collective to create).

    ``model``: an mpicoll dense model (``shapes`` of its layers, ``init``);
    ``bounds``: (first layer, end) per stage, default :func:`split` by
    parameter count; ``micro_batches``: how many pieces a batch is cut into.
    """

    def __init__(self, comm: MPI.Intracomm, model, *, bounds: list[tuple[int, int]] | None = None,
                 micro_batches: int = 1):
        self.model, self.stage, self.stages = model, comm.Get_rank(), comm.Get_size()
        layers = [a * b + b for a, b in model.shapes]
        self.bounds = bounds or split(layers, self.stages)
        if len(self.bounds) != self.stages or [b[0] for b in self.bounds[1:]] != [b[1] for b in self.bounds[:-1]] \
                or self.bounds[0][0] != 0 or self.bounds[-1][1] != len(layers) or any(a >= b for a, b in self.bounds):
            raise ValueError(f"bounds {self.bounds} must cut layers 0..{len(layers)} into {self.stages} consecutive "
                             "non-empty ranges")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self.ctx = Context(comm, "model-parallel")      # once the arguments hold: a refusal leaves nothing behind
        first, end = self.bounds[self.stage]
        offsets = np.cumsum([0, *layers])
        self.slice = slice(int(offsets[first]), int(offsets[end]))     # this stage's part of the flat vector
        self.shapes = model.shapes[first:end]
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1

    def init(self, seed: int):
        """This stage's slice of the whole model's starting vector (the same on any number of stages),
        made without making the whole vector."""
        return self.model.init_layers(seed, *self.bounds[self.stage])

    def _receive(self, shape, source: int, dtype):
        buffer = np.empty(shape, dtype)
        self.ctx.wait(self.ctx.irecv(buffer, source, Tag.MODEL_PARALLEL), source)
        return buffer

    def _forward(self, layers, X, rows: int, dtype):
        """Fill: every micro-batch's forward through this stage; (the pieces, their activations)."""
        xp, ctx = self.model.xp, self.ctx
        pieces = [piece for piece in np.array_split(np.arange(rows), self.micro_batches) if len(piece)]
        kept, sends = [], []
        for piece in pieces:
            a = xp.asarray(X[piece], dtype=dtype) if self.first else \
                self._receive((len(piece), self.shapes[0][0]), self.stage - 1, dtype)
            activations = dense_forward(xp, layers, a, linear_last=self.last)
            if not self.last:
                sends.append(ctx.isend(np.ascontiguousarray(activations[-1]), self.stage + 1, Tag.MODEL_PARALLEL))
            kept.append(activations)
        ctx.waitall(sends, self.stage + 1)
        return pieces, kept

    def evaluate(self, params, X, y) -> tuple[float, float]:
        """(mean loss, accuracy) on a data set, through the pipeline (forward only), known on every stage:
        no rank ever holds the whole model, as it would to evaluate it alone."""
        rows = len(y)
        pieces, kept = self._forward(dense_layers(params, self.shapes), X, rows, np.asarray(params).dtype)
        total = np.zeros(2)
        if self.last:
            for piece, activations in zip(pieces, kept):
                part, _ = softmax_cross_entropy(self.model.xp, activations[-1], y[piece])
                total += [float(part) * len(piece) / rows, float((activations[-1].argmax(axis=1) == y[piece]).sum())]
        self.ctx.comm.Bcast(total, root=self.stages - 1)
        return float(total[0]), float(total[1] / rows)

    def loss_and_gradient(self, params, X, y, gradient: bool = True):
        """(batch-mean loss, this stage's gradient) for the batch (X, y), over the pipeline."""
        xp, ctx = self.model.xp, self.ctx
        layers, rows = dense_layers(params, self.shapes), len(y)
        dtype = np.asarray(params).dtype
        pieces, kept = self._forward(layers, X, rows, dtype)
        loss, sends, grad = 0.0, [], xp.zeros_like(params) if gradient else None
        deltas = []
        if self.last:
            for piece, activations in zip(pieces, kept):
                part, delta = softmax_cross_entropy(xp, activations[-1], y[piece])
                loss += float(part) * len(piece) / rows
                deltas.append(delta * len(piece) / rows)        # the batch mean: pieces weighted by size
        total = np.array([loss])
        ctx.comm.Bcast(total, root=self.stages - 1)                # every stage learns the loss
        if not gradient:
            return float(total[0]), None
        grads = dense_layers(grad, self.shapes)
        for number in range(len(pieces) - 1, -1, -1):             # drain: every backward, in reverse
            piece, activations = pieces[number], kept[number]
            delta = deltas[number] if self.last else \
                self._receive((len(piece), self.shapes[-1][1]), self.stage + 1, dtype)
            delta = dense_backward(layers, activations, delta, grads, input_grad=not self.first)
            if not self.first:
                sends.append(ctx.isend(np.ascontiguousarray(delta), self.stage - 1, Tag.MODEL_PARALLEL))
        ctx.waitall(sends, self.stage - 1)
        return float(total[0]), grad

    def close(self) -> None:
        self.ctx.free()


class TorchPipeline:
    """Stage ``comm.rank`` of a torch ``nn.Sequential`` cut into ``comm.size`` stages (collective to create).

    The same scheme as :class:`Pipeline` for torch modules: ``bounds`` cuts the
    sequence of modules (default: even by parameter count, every stage at least
    one module); this rank keeps ``self.module``, its stage, and
    :meth:`forward_backward` leaves the whole batch's gradient of the mean loss
    in its parameters' ``.grad`` (accumulated, as ``loss.backward()`` would), so
    any torch optimizer over ``self.module.parameters()`` steps it.  A boundary
    message carries its shape first (modules may reshape), then the tensor.

        pipe = TorchPipeline(comm, nn.Sequential(...), micro_batches=4)
        optimizer = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
        optimizer.zero_grad(); loss = pipe.forward_backward(X, y); optimizer.step()
    """

    _HEADER = 8                                  # a boundary tensor's dtype, then up to 7 dimensions
    _DTYPES = [np.dtype(t) for t in (np.float32, np.float64, np.float16, np.int64)]

    def __init__(self, comm: MPI.Intracomm, model, *, bounds: list[tuple[int, int]] | None = None,
                 micro_batches: int = 1):
        import torch
        self.torch = torch
        self.ctx = Context(comm, "model-parallel")
        self.stage, self.stages = self.ctx.rank, self.ctx.size
        modules = list(model)
        self.bounds = bounds or split([1 + sum(p.numel() for p in m.parameters()) for m in modules], self.stages)
        if len(self.bounds) != self.stages:
            raise ValueError(f"bounds {self.bounds}: one (first, end) per stage, {self.stages} stages")
        first, end = self.bounds[self.stage]
        self.module = torch.nn.Sequential(*modules[first:end])
        self.micro_batches = max(1, micro_batches)
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1

    def _send(self, tensor, dest: int) -> list:
        array = np.ascontiguousarray(tensor.detach().numpy())
        if array.dtype not in self._DTYPES or array.ndim >= self._HEADER:
            raise TypeError(f"stage {self.stage}: a boundary tensor of {array.dtype} and {array.ndim} dimensions "
                            f"cannot cross (float16/32/64 or int64, at most {self._HEADER - 1} dimensions)")
        header = np.full(self._HEADER, -1, np.int64)
        header[0] = self._DTYPES.index(array.dtype)
        header[1:1 + array.ndim] = array.shape
        return [self.ctx.isend(header, dest, Tag.MODEL_PARALLEL), self.ctx.isend(array, dest, Tag.MODEL_PARALLEL)]

    def _receive(self, source: int):
        header = np.empty(self._HEADER, np.int64)
        self.ctx.wait(self.ctx.irecv(header, source, Tag.MODEL_PARALLEL), source)
        array = np.empty(tuple(int(d) for d in header[1:] if d >= 0), self._DTYPES[int(header[0])])
        self.ctx.wait(self.ctx.irecv(array, source, Tag.MODEL_PARALLEL), source)
        return self.torch.from_numpy(array)

    def forward_backward(self, X, y, loss_fn=None) -> float:
        """Run the batch through every stage and back; returns the batch-mean loss (on every stage)."""
        torch = self.torch
        loss_fn = loss_fn or torch.nn.functional.cross_entropy
        rows = len(y)
        pieces = [p for p in np.array_split(np.arange(rows), self.micro_batches) if len(p)]
        kept, sends, total = [], [], 0.0
        for piece in pieces:                                     # fill: every forward
            inputs = X[piece] if self.first else self._receive(self.stage - 1).requires_grad_(True)
            outputs = self.module(inputs)
            if self.last:
                outputs = loss_fn(outputs, y[piece]) * (len(piece) / rows)      # the batch mean
                total += float(outputs.detach())
            else:
                sends += self._send(outputs, self.stage + 1)
            kept.append((inputs, outputs))
        self.ctx.waitall(sends, self.stage + 1)
        sends = []
        for inputs, outputs in reversed(kept):                   # drain: every backward, in reverse
            outputs.backward(None if self.last else self._receive(self.stage + 1))
            if not self.first:
                sends += self._send(inputs.grad, self.stage - 1)
        self.ctx.waitall(sends, self.stage - 1)
        loss = np.array([total])
        self.ctx.comm.Bcast(loss, root=self.stages - 1)
        return float(loss[0])

    def evaluate(self, X, y, loss_fn=None) -> tuple[float, float]:
        """(mean loss, accuracy) on a data set, forward only through every stage; known on every stage."""
        torch = self.torch
        loss_fn = loss_fn or torch.nn.functional.cross_entropy
        rows, total, sends = len(y), np.zeros(2), []
        with torch.no_grad():
            for piece in [p for p in np.array_split(np.arange(rows), self.micro_batches) if len(p)]:
                outputs = self.module(X[piece] if self.first else self._receive(self.stage - 1))
                if self.last:
                    total += [float(loss_fn(outputs, y[piece])) * len(piece) / rows,
                              float((outputs.argmax(dim=1) == y[piece]).sum())]
                else:
                    sends += self._send(outputs, self.stage + 1)
        self.ctx.waitall(sends, self.stage + 1)
        self.ctx.comm.Bcast(total, root=self.stages - 1)
        return float(total[0]), float(total[1] / rows)

    def close(self) -> None:
        self.ctx.free()


class TorchStage:
    """A :class:`TorchPipeline` behind :class:`Pipeline`'s flat-vector interface (``slice``, ``init``,
    ``loss_and_gradient``, ``evaluate``), so the training methods that cut a model into stages train
    an ``mpicoll.train`` torch model (``--framework torch``; its module an ``nn.Sequential``) unchanged.
    The stage's parameters and gradient are views of flat vectors (``mpicoll.models.modules.point_at``)."""

    def __init__(self, comm: MPI.Intracomm, model, *, micro_batches: int = 1):
        import torch
        from .models.modules import point_at
        self.torch, self.point_at, self.model = torch, point_at, model
        self.pipe = TorchPipeline(comm, model.module, micro_batches=micro_batches)
        self.parameters = list(self.pipe.module.parameters())
        self.slice = _modules_slice(model, *self.pipe.bounds[self.pipe.stage])   # its part of the flat vector

    def init(self, seed: int):
        """This stage's slice of the whole module's start (torch makes the whole module to draw it)."""
        return stage_init(self.model, self.pipe.stages, self.pipe.stage, seed)

    def _tensors(self, X, y):
        return self.torch.as_tensor(np.asarray(X)), self.torch.as_tensor(np.asarray(y))

    def loss_and_gradient(self, params, X, y):
        X, y = self._tensors(X, y)
        grad = np.zeros_like(params)
        self.point_at(self.parameters, self.torch.as_tensor(params), self.torch.as_tensor(grad))
        return self.pipe.forward_backward(X, y), grad

    def evaluate(self, params, X, y) -> tuple[float, float]:
        X, y = self._tensors(X, y)
        self.point_at(self.parameters, self.torch.as_tensor(params))
        return self.pipe.evaluate(X, y)

    def close(self) -> None:
        self.pipe.close()


def stage(comm: MPI.Intracomm, model, *, micro_batches: int = 1):
    """This rank's stage of ``model`` cut over ``comm``: a :class:`Pipeline` for mpicoll's dense models, a
    :class:`TorchStage` for torch ones."""
    if hasattr(model, "shapes"):
        return Pipeline(comm, model, micro_batches=micro_batches)
    return TorchStage(comm, model, micro_batches=micro_batches)


def stage_init(model, stages: int, stage: int, seed: int):
    """Stage ``stage`` of ``stages``'s slice of ``model.init(seed)`` (the default cut), e.g. for a parameter
    server that holds that stage: a dense model makes only those layers; torch makes the whole module."""
    first, end = split(layer_sizes(model), stages)[stage]
    if hasattr(model, "init_layers"):
        return model.init_layers(seed, first, end)
    return model.init(seed)[_modules_slice(model, first, end)].copy()


def _modules_slice(model, first: int, end: int) -> slice:
    """Where modules [first, end) of a torch model's Sequential sit in its flat parameter vector."""
    offsets = np.cumsum([0, *(sum(p.numel() for p in m.parameters()) for m in model.module)])
    return slice(int(offsets[first]), int(offsets[end]))


def layer_sizes(model) -> list[int]:
    """What :func:`split` balances for ``model``: parameters per dense layer, or per module (plus one, so a
    parameter-free module still counts) of a torch Sequential."""
    if hasattr(model, "shapes"):
        return [a * b + b for a, b in model.shapes]
    return [1 + sum(p.numel() for p in m.parameters()) for m in model.module]
