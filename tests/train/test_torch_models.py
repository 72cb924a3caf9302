"""``mpicoll train --framework torch``: torch modules trained by every method; MNIST-1D."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from mpicoll.train import METHODS, Options, train  # noqa: E402
from mpicoll.train.common import batches as _batches  # noqa: E402
from mpicoll.models.dense import CNN  # noqa: E402
from mpicoll.models.modules import TorchModel, make  # noqa: E402
from mpi4py import MPI  # noqa: E402

from tests.support.mpi import P, WORLD, everywhere  # noqa: E402
from tests.support.problems import allreduce_sgd, digits  # noqa: E402

torch.set_num_threads(1)          # as mpicoll train sets it: ranks oversubscribe the cores


def plain_gradient(model: TorchModel, params: np.ndarray, X, y) -> np.ndarray:
    """The gradient by ordinary autograd, on a fresh module holding copies of the parameters."""
    module = model.build().float()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(params.copy()), module.parameters())
    torch.nn.functional.cross_entropy(module(torch.from_numpy(X)), torch.from_numpy(y)).backward()
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).numpy()


@pytest.mark.parametrize("name, shape", [("softmax", ()), ("mlp", ()), ("cnn", (4, 5)), ("cnn", ())])
def test_torch_models_compute_autograds_gradient_on_views_of_the_flat_vector(name, shape):
    rng = np.random.default_rng(4)
    X, y = rng.standard_normal((9, 20)).astype(np.float32), rng.integers(0, 3, 9)
    model = make(name, 20, 3, [8, 6], shape)
    params = model.init(7) + 0.05 * rng.standard_normal(model.size).astype(np.float32)
    assert params.dtype == np.float32 and params.shape == (model.size,)
    assert np.array_equal(model.init(7), model.init(7)) and not np.array_equal(model.init(7), model.init(8))
    loss, grad = model.loss_and_gradient(params, X, y)
    assert np.allclose(grad, plain_gradient(model, params, X, y), rtol=1e-5, atol=1e-6)
    assert model.parameters[0].data_ptr() == params.ctypes.data, "the parameters were copied, not viewed"
    assert model.parameters[0].grad.data_ptr() == grad.ctypes.data, "the gradient was copied, not accumulated"
    again, none = model.loss_and_gradient(params, X, y, gradient=False)
    assert none is None and again == pytest.approx(loss, rel=1e-6)
    frozen = params.copy()
    frozen.flags.writeable = False
    assert np.array_equal(model.predict(frozen, X), model.predict(params, X))
    assert model.predict(params, X).shape == (9,)


@pytest.mark.parametrize("features", [40, 13, 3, 1])
def test_the_numpy_cnn_is_the_torch_cnn(features):
    """Same layout, same parameters: the same loss, gradient and predictions as torch's 1-D CNN (float64),
    down to signals too short to pool."""
    rng = np.random.default_rng(features)
    X, y = rng.standard_normal((9, features)), rng.integers(0, 4, 9)
    ours, theirs = CNN(features, 4, dtype=np.float64), make("cnn", features, 4).module.double()
    assert ours.size == sum(p.numel() for p in theirs.parameters())
    params = ours.init(5)
    torch.nn.utils.vector_to_parameters(torch.from_numpy(params.copy()), theirs.parameters())
    scores = theirs(torch.from_numpy(X))
    expected = torch.nn.functional.cross_entropy(scores, torch.from_numpy(y))
    expected.backward()
    loss, grad = ours.loss_and_gradient(params, X, y)
    assert loss == pytest.approx(expected.item(), rel=1e-9)
    assert np.allclose(grad, torch.cat([p.grad.reshape(-1) for p in theirs.parameters()]).numpy(), atol=1e-12)
    assert np.array_equal(ours.predict(params, X), scores.argmax(dim=1).numpy())


@pytest.mark.parametrize("name", ["softmax", "mlp", "cnn"])
def test_a_torch_models_one_pass_evaluation_is_its_loss_and_its_predictions_accuracy(name):
    rng = np.random.default_rng()
    X, y = rng.standard_normal((37, 12)).astype(np.float32), rng.integers(0, 4, 37)
    model = make(name, 12, 4)
    params = model.init(3)
    loss, _ = model.loss_and_gradient(params, X, y, gradient=False)
    assert model.evaluate(params, X, y) == (loss, float((model.predict(params, X) == y).mean()))


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_a_torch_cnn(method):
    if not METHODS[method].one_rank and P < METHODS[method].min_ranks:
        pytest.skip(f"{method} needs {METHODS[method].min_ranks} ranks (servers, workers, a coordinator)")
    data = digits()
    model = make("cnn", data.features, data.classes, shape=data.shape)
    start_loss, _ = model.evaluate(model.init(3), data.X_test, data.y_test)
    # L-BFGS: 10 full-batch gradients; the others: more ranks take fewer steps per epoch, so more epochs
    epochs = 10 if method == "sandblaster-lbfgs" else max(2, math.ceil(P / 2))
    options = Options(method=method, epochs=epochs, batch=16, lr=0.05, seed=3, progress=False,
                      tau=1 if method == "sgp" else 0)
    alone = METHODS[method].one_rank            # sequential SGD: every rank runs its own
    summary = train(MPI.COMM_SELF if alone else WORLD, options, model, data)
    final = summary if alone else [s for s in WORLD.allgather(summary) if s][0]
    everywhere(final["final_loss"] < 0.8 * start_loss,
               f"{method}: test loss {start_loss:.3f} -> {final['final_loss']:.3f}, not decreasing")


@pytest.mark.mpi(min_size=2)
def test_allreduce_on_a_torch_model_is_single_process_sgd_on_the_combined_batch():
    data = digits()
    model = make("mlp", data.features, data.classes, [16])
    options = Options(method="allreduce-ring", epochs=1, batch=8, lr=0.2, seed=5, progress=False)
    summary = train(WORLD, options, model, data)
    steps = math.ceil(len(data.y) / (P * options.batch))
    params = model.init(5).astype(np.float64)
    shards = [data.shard(r, P) for r in range(P)]
    batches = [_batches(len(shards[r][1]), options.batch, steps, [5, r, 0]) for r in range(P)]
    for step in range(steps):
        grads = [model.loss_and_gradient(params.astype(np.float32), shards[r][0][batches[r][step]],
                                         shards[r][1][batches[r][step]])[1] for r in range(P)]
        params = params - options.lr * np.mean(grads, axis=0)
    expected = model.evaluate(params.astype(np.float32), data.X_test, data.y_test)[0]
    losses = [s["final_loss"] for s in WORLD.allgather(summary) if s]
    everywhere(abs(losses[0] - expected) < 1e-3 * abs(expected),
               f"final loss {losses[0]!r}, single process {expected!r}")


@pytest.mark.mpi
@pytest.mark.parametrize("compression", [None, "bf16", "powersgd"])
def test_the_distributed_optimizer_takes_the_loops_steps(compression):
    """--distributed-optimizer: the torch module's gradients averaged by mpicoll.torch.DistributedOptimizer's
    buckets during backward and torch's SGD step on the flat weights: uncompressed, the same final loss as the
    loop's own allreduce (float32, 1e-5); compressed, near it (PowerSGD with its rank covering every matrix:
    the same, to float32's rounding)."""
    data = digits()
    model = make("mlp", data.features, data.classes, [8])
    options = dict(method="allreduce-auto", epochs=1, batch=8, lr=0.2, seed=5, progress=False)
    plain = train(WORLD, Options(**options), model, data)
    extra = {"compression": compression, "powersgd_rank": 8, "powersgd_start": 1} if compression else {}
    through = train(WORLD, Options(**options, distributed_optimizer=True, **extra), model, data)
    want, got = ([s["final_loss"] for s in WORLD.allgather(summary) if s][0] for summary in (plain, through))
    tolerance = {None: 1e-5, "bf16": 2e-2, "powersgd": 1e-3}[compression]
    everywhere(abs(got - want) <= tolerance * abs(want), f"{compression}: final loss {got!r}, the loop's {want!r}")
    with pytest.raises(ValueError, match="--distributed-optimizer trains torch modules"):
        train(WORLD, Options(**options, distributed_optimizer=True), allreduce_model(data), data)


def allreduce_model(data):
    from mpicoll.models.dense import MLP
    return MLP(data.features, data.classes, [8])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("method", ["allreduce-ring", "downpour"])
def test_model_parallel_trains_a_torch_sequential(method):
    """--framework torch --model-parallel K: allreduce over P/K replicas of K stages ends where allreduce
    SGD over P/K ranks does (computed here in one process, float32); downpour (a server per stage) at 4 ranks
    (one replica) where single-process Adagrad does."""
    k = 3 if P == 3 and method != "downpour" else 2
    if method == "downpour" and P != 4:
        pytest.skip("one replica of 2 stages and a server per stage: 4 ranks")
    if P % k:
        pytest.skip(f"{P} ranks make no whole replicas of {k} stages")
    data = digits()
    model = make("mlp", data.features, data.classes, [16, 12])
    options = Options(method=method, epochs=1, batch=8, lr=0.2 if method != "downpour" else 0.05, seed=5,
                      progress=False, model_parallel=k)
    summary = train(WORLD, options, model, data)
    if method == "downpour":
        params, history = model.init(options.seed).astype(np.float64), np.zeros(model.size)
        for batch in _batches(len(data.y), options.batch, math.ceil(len(data.y) / options.batch), [5, 0, 0]):
            g = model.loss_and_gradient(params.astype(np.float32), data.X[batch], data.y[batch])[1]
            history += g * g
            params -= options.lr * g / (np.sqrt(history) + 1e-8)
        expected = model.evaluate(params.astype(np.float32), data.X_test, data.y_test)[0]
    else:
        expected = allreduce_sgd(model, data, options, P // k)
    losses = [s["final_loss"] for s in WORLD.allgather(summary) if s]
    everywhere(len(losses) == 1 and abs(losses[0] - expected) < 1e-3 * abs(expected),
               f"final loss {losses}, single process {expected!r}")


@pytest.mark.parametrize("chosen", [None, "OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_train_gives_torch_the_ranks_share_of_the_cores_unless_the_environment_chose(monkeypatch, chosen):
    """``mpicoll train``'s torch models follow ``import mpicoll.torch``'s rule (one rule,
    :func:`mpicoll.compute.share_torch_threads`): where the user set a thread variable, torch keeps what it made of it."""
    from types import SimpleNamespace
    from mpicoll import compute
    from mpicoll.train import _torch_model
    before = torch.get_num_threads()
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(variable, raising=False)
    if chosen:
        monkeypatch.setenv(chosen, "7")
    try:
        torch.set_num_threads(7)                    # what torch made of the variable (or a program chose)
        _torch_model(SimpleNamespace(model="mlp"), SimpleNamespace(features=4, classes=2, shape=()), [3], np)
        assert torch.get_num_threads() == (7 if chosen else compute.share_of_cores()), chosen
    finally:
        torch.set_num_threads(before)
