"""mpicoll.modelparallel: a model cut into stages over ranks computes what the whole model computes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpicoll.modelparallel import Pipeline, split
from mpicoll.models.dense import MLP, SoftmaxRegression
from tests.support.jobs import launch
from tests.support.mpi import P, WORLD, everywhere, shared_seed


@pytest.mark.parametrize("sizes, stages, expected", [
    ([10, 10, 10, 10], 2, [(0, 2), (2, 4)]),
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),
    ([1, 1, 1, 100], 3, [(0, 2), (2, 3), (3, 4)]),
    ([5], 1, [(0, 1)]),
    ([3, 3, 3], 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_split_cuts_consecutive_nonempty_stages_by_parameter_count(sizes, stages, expected):
    assert split(sizes, stages) == expected


def test_split_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="2 layer.s. cannot make 3 stage"):
        split([4, 4], 3)


def _cases():
    if P == 1:
        return [None]
    if P == 2:
        return [None, [(0, 1), (1, 4)], [(0, 3), (3, 4)]]
    if P == 3:
        return [None, [(0, 2), (2, 3), (3, 4)], [(0, 1), (1, 2), (2, 4)]]
    return [None]


@pytest.mark.mpi
@pytest.mark.parametrize("micro_batches", [1, 3, 20])
@pytest.mark.parametrize("case", range(3))
def test_a_pipeline_computes_the_whole_models_loss_and_gradient(micro_batches, case):
    """float64, 1e-12: the stages' gradients laid end to end are the unpartitioned MLP's, whatever the cut
    and however the batch is cut into micro-batches (20 > rows: some micro-batches would be empty)."""
    cases = _cases()
    if case >= len(cases) or P > 4:
        pytest.skip("no such cut at this rank count (the test model has 4 layers)")
    seed = shared_seed()
    rng = np.random.default_rng(seed)
    model = MLP(9, 4, [7, 5, 6], dtype=np.float64)
    X, y = rng.standard_normal((10, 9)), rng.integers(0, 4, 10)
    whole = model.init(seed % 1000) + 0.1 * rng.standard_normal(model.size)
    pipe = Pipeline(WORLD, model, bounds=cases[case], micro_batches=micro_batches)
    loss, grad = pipe.loss_and_gradient(whole[pipe.slice].copy(), X, y)
    expected_loss, expected = model.loss_and_gradient(whole, X, y)
    gathered = np.concatenate(WORLD.allgather(grad))
    everywhere(abs(loss - expected_loss) < 1e-12 and np.abs(gathered - expected).max() < 1e-12,
               f"seed {seed}, cut {pipe.bounds}: loss {loss} vs {expected_loss}, "
               f"gradient off by {np.abs(gathered - expected).max():.2e}")
    value, none = pipe.loss_and_gradient(whole[pipe.slice].copy(), X, y, gradient=False)
    everywhere(none is None and abs(value - expected_loss) < 1e-12, f"loss only: {value}")
    everywhere(np.array_equal(pipe.init(3), model.init(3)[pipe.slice]), "init is not the whole model's slice")
    score, expected_score = pipe.evaluate(whole[pipe.slice].copy(), X, y), model.evaluate(whole, X, y)
    everywhere(abs(score[0] - expected_score[0]) < 1e-12 and score[1] == expected_score[1],
               f"evaluated through the pipeline {score}, whole {expected_score}")
    pipe.close()


def test_a_stage_is_made_without_making_the_whole_model(monkeypatch):
    """init_layers skips earlier layers' random draws in pieces: equal to the whole init's slice, also when
    a layer is longer than a piece."""
    from mpicoll.models import dense as models
    monkeypatch.setattr(models, "_SKIP_PIECE", 100)
    model = MLP(30, 4, [17, 9], dtype=np.float64)
    whole, offsets = model.init(5), np.cumsum([0] + [a * b + b for a, b in model.shapes])
    for first, end in [(0, 1), (1, 2), (2, 3), (1, 3), (0, 3)]:
        assert np.array_equal(model.init_layers(5, first, end), whole[offsets[first]:offsets[end]]), (first, end)


@pytest.mark.mpi(min_size=2)
def test_a_pipeline_trains_like_the_whole_model():
    """Ten steps of SGD, each stage on its own slice, end where the unpartitioned model does."""
    rng = np.random.default_rng(7)
    model = SoftmaxRegression(6, 3, dtype=np.float64) if P == 1 else MLP(6, 3, [5] * (P - 1), dtype=np.float64)
    pipe = Pipeline(WORLD, model, micro_batches=2)
    mine, whole = pipe.init(1), model.init(1)
    for _ in range(10):
        X, y = rng.standard_normal((8, 6)), rng.integers(0, 3, 8)
        mine -= 0.3 * pipe.loss_and_gradient(mine, X, y)[1]
        whole -= 0.3 * model.loss_and_gradient(whole, X, y)[1]
    everywhere(np.abs(mine - whole[pipe.slice]).max() < 1e-12, "pipelined SGD drifted from the whole model's")
    pipe.close()


@pytest.mark.mpi(min_size=2)
def test_bad_cuts_are_refused():
    with pytest.raises(ValueError, match="consecutive"):
        Pipeline(WORLD, MLP(4, 2, [3] * P, dtype=np.float64), bounds=[(0, 1)] * P)


def deep_torch_model(seed: int):
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(9, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 5), nn.ReLU(),
                         nn.Linear(5, 4)).double()


@pytest.mark.mpi
def test_a_torch_stage_is_the_whole_modules_slice_on_a_flat_vector():
    """TorchStage (what mpicoll train cuts a torch model with): its loss and gradient laid end to end, and
    its evaluation, are the whole TorchModel's on the same flat vector."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    from mpicoll.modelparallel import TorchStage
    from mpicoll.models.modules import TorchModel
    torch.set_default_dtype(torch.float64)
    try:
        model = TorchModel(lambda: torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5),
                                                       torch.nn.Tanh(), torch.nn.Linear(5, 4)))
        model.module.double()
        for p in model.parameters:
            p.data = p.data.double()
        rng = np.random.default_rng(shared_seed())
        X, y = rng.standard_normal((10, 9)), rng.integers(0, 4, 10)
        whole = rng.standard_normal(model.size)
        pipe = TorchStage(WORLD, model, micro_batches=3)
        loss, grad = pipe.loss_and_gradient(whole[pipe.slice].copy(), X, y)
        expected_loss, expected = model.loss_and_gradient(whole.copy(), X, y)
        gathered = np.concatenate(WORLD.allgather(grad))
        score, expected_score = pipe.evaluate(whole[pipe.slice].copy(), X, y), model.evaluate(whole.copy(), X, y)
        everywhere(abs(loss - expected_loss) < 1e-12 and np.abs(gathered - expected).max() < 1e-12,
                   f"loss {loss} vs {expected_loss}, gradient off by {np.abs(gathered - expected).max():.2e}")
        everywhere(abs(score[0] - expected_score[0]) < 1e-12 and score[1] == expected_score[1],
                   f"evaluation {score} vs {expected_score}")
        pipe.close()
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.mpi
@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("uneven", [False, True])
def test_a_torch_pipeline_leaves_the_whole_models_gradients(micro_batches, uneven):
    """float64: each stage's .grad equals autograd's on the whole Sequential, the loss is the whole batch's."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    from mpicoll.modelparallel import TorchPipeline
    if uneven and P == 1:
        pytest.skip("one stage has one cut")
    bounds = None
    if uneven:
        cuts = [0, 5, 6, 7][:P] + [7] if P <= 3 else None
        bounds = list(zip(cuts, cuts[1:])) if cuts else None
    seed = shared_seed()
    rng = np.random.default_rng(seed)
    X, y = torch.from_numpy(rng.standard_normal((10, 9))), torch.from_numpy(rng.integers(0, 4, 10))
    pipe = TorchPipeline(WORLD, deep_torch_model(seed % 1000), bounds=bounds, micro_batches=micro_batches)
    loss = pipe.forward_backward(X, y)
    whole = deep_torch_model(seed % 1000)
    expected = torch.nn.functional.cross_entropy(whole(X), y)
    expected.backward()
    first, end = pipe.bounds[pipe.stage]
    theirs = [p.grad for m in list(whole)[first:end] for p in m.parameters()]
    ours = [p.grad for p in pipe.module.parameters()]
    worst = max([float((a - b).abs().max()) for a, b in zip(ours, theirs)], default=0.0)
    everywhere(len(ours) == len(theirs) and worst < 1e-12 and abs(loss - expected.item()) < 1e-12,
               f"seed {seed}, cut {pipe.bounds}: gradients off by {worst:.2e}, loss {loss} vs {expected.item()}")
    pipe.close()


@pytest.mark.watchdog(200)
def test_a_model_over_the_memory_budget_trains_only_cut_into_stages(tmp_path):
    """--max-rank-memory between what a stage and the whole model need: refused whole, in one line naming
    the --model-parallel that fits; trained with it (2 ranks: one replica of 2 stages)."""
    pytest.importorskip("sklearn", reason="the digits need scikit-learn (the data extra)")
    model = MLP(64, 10, [256, 256, 256])
    layers = [a * b + b for a, b in model.shapes]
    whole, stage = model.state_bytes(32), max(model.state_bytes(32, a, b) for a, b in split(layers, 2))
    budget = str((whole + stage) // 2)
    common = ["-m", "mpicoll", "train", "--model", "mlp", "--hidden", "256,256,256", "--max-rank-memory", budget,
              "--epochs", "2", "--quiet"]
    refused = launch(2, *common, timeout=60)
    assert refused.returncode == 2 and refused.stderr.count("--model-parallel 2 would fit") == 1, refused.stderr
    log = tmp_path / "run.jsonl"
    trained = launch(2, *common, "--model-parallel", "2", "--output", str(log), timeout=120)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert json.loads(log.read_text().splitlines()[-1])["final_accuracy"] > 0.8


@pytest.mark.watchdog(200)
def test_downpour_trains_replicas_cut_into_stages_from_the_command_line(tmp_path):
    """mpiexec -n 6 mpicoll train --method downpour --model-parallel 2: a server per stage and two replicas
    of two stages, asynchronous, to >= 90% on the digits."""
    pytest.importorskip("sklearn", reason="the digits need scikit-learn (the data extra)")
    log = tmp_path / "run.jsonl"
    result = launch(6, "-m", "mpicoll", "train", "--method", "downpour", "--model", "mlp", "--model-parallel", "2",
                    "--lr", "0.05", "--quiet", "--output", str(log), env={"OPENBLAS_NUM_THREADS": "1"}, timeout=150)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["ranks"] == 6 and summary["final_accuracy"] >= 0.9, summary
