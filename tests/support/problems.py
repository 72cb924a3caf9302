"""Toy problems on fresh random data, and the single-process references the methods are held to."""

from __future__ import annotations

import math

import numpy as np
import pytest

__all__ = ["least_squares", "digits", "allreduce_sgd"]


def least_squares(seed, rows: int = 240, dims: int = 12):
    """(X, y, the least-squares optimum) of a random well-posed problem with a little noise."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, dims))
    y = X @ rng.standard_normal(dims) + 0.01 * rng.standard_normal(rows)
    return X, y, np.linalg.lstsq(X, y, rcond=None)[0]


def digits():
    """The default data set of ``mpicoll train`` (scikit-learn's digits), or skip without the data extra."""
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    from mpicoll.train.data import load
    return load(None, seed=0)


def allreduce_sgd(model, data, options, ranks: int, params=None, epoch: int = 0) -> float:
    """The test loss after one epoch (number ``epoch``, from ``params``; default: the first, from the model's
    initial parameters) of allreduce SGD over ``ranks`` ranks, computed in this process."""
    from mpicoll.train.common import batches
    steps = math.ceil(len(data.y) / (ranks * options.batch))
    params = model.init(options.seed) if params is None else params
    shards = [data.shard(r, ranks) for r in range(ranks)]
    picks = [batches(len(shards[r][1]), options.batch, steps, [options.seed, r, epoch]) for r in range(ranks)]
    for step in range(steps):
        grads = [model.loss_and_gradient(params, shards[r][0][picks[r][step]], shards[r][1][picks[r][step]])[1]
                 for r in range(ranks)]
        params = params - options.lr * np.mean(grads, axis=0)
    return model.evaluate(params, data.X_test, data.y_test)[0]
