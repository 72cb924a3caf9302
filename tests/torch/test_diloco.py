"""mpicoll.torch.DiLoCo around a torch model and optimizer, at every rank count, against a single-process
simulation in float64 built from torch's own parts: a copy of the model per replica with its own optimizer, and
the outer step taken by torch.optim.SGD (Nesterov) on an anchor model whose .grad is the average
pseudo-gradient, as torchft's DiLoCo does.  Over mpicoll's allreduce (COMM_WORLD), over a gloo group and over
the "mpicoll" process group; local SGD; resuming from state_dict to the bit."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
import torch.distributed as dist  # noqa: E402

import mpicoll.torch as mt  # noqa: E402
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed  # noqa: E402

pytestmark = pytest.mark.mpi


def model_and_data(seed: int, replica: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()
    rng = np.random.default_rng([seed, replica])
    x, y = torch.tensor(rng.standard_normal((40, 5))), torch.tensor(rng.standard_normal((40, 3)))
    return model, [(x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]


def inner_of(model, kind: str):
    return (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=0.01))


def one_step(model, optimizer, batch) -> None:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()


def simulated(seed: int, steps: int, H: int, inner: str, outer_lr: float, momentum: float, nesterov: bool):
    """Every replica in one process; at every H-th step and at the end, the anchor's grad = the mean of (anchor -
    replica), torch's SGD steps the anchor, every replica takes the anchor's weights."""
    replicas = [model_and_data(seed, r) for r in range(P)]
    optimizers = [inner_of(m, inner) for m, _ in replicas]
    anchor = copy.deepcopy(replicas[0][0])
    outer = torch.optim.SGD(anchor.parameters(), lr=outer_lr, momentum=momentum, nesterov=nesterov)

    def meet():
        with torch.no_grad():
            for i, a in enumerate(anchor.parameters()):
                a.grad = torch.stack([a - list(m.parameters())[i] for m, _ in replicas]).mean(0)
            outer.step()
            for m, _ in replicas:
                for p, a in zip(m.parameters(), anchor.parameters()):
                    p.copy_(a)

    for t in range(1, steps + 1):
        for (m, data), o in zip(replicas, optimizers):
            one_step(m, o, data[(t - 1) % len(data)])
        if t % H == 0:
            meet()
    if steps % H:
        meet()
    return [p.detach().clone() for p in anchor.parameters()]


def trained(seed: int, steps: int, H: int, inner: str, stop_at=None, local=False, **options):
    model, data = model_and_data(seed, RANK)
    optimizer = inner_of(model, inner)
    wrap = (lambda m, o: mt.local_sgd(m, o, sync_every=H, **options)) if local else \
        (lambda m, o: mt.DiLoCo(m, o, sync_every=H, **options))
    outer = wrap(model, optimizer)
    for t in range(1, steps + 1):
        if t - 1 == stop_at:                       # saved, and continued by fresh objects from what was saved
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), outer.state_dict())
            model, _ = model_and_data(seed, RANK)
            model.load_state_dict(saved[0])
            optimizer = inner_of(model, inner)
            optimizer.load_state_dict(saved[1])
            outer = wrap(model, optimizer)
            outer.load_state_dict(saved[2])
        one_step(model, optimizer, data[(t - 1) % len(data)])
    outer.finish()
    return [p.detach().clone() for p in model.parameters()], outer


@pytest.fixture(scope="module")
def groups():
    """The default process group ("mpicoll") and a gloo group over the same ranks."""
    dist.init_process_group("mpicoll")
    gloo = dist.new_group(backend="gloo")
    yield {"mpicoll": None, "gloo": gloo}
    dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["comm", "gloo", "mpicoll"])
@pytest.mark.parametrize("inner,outer_lr,momentum,nesterov", [("sgd", 0.7, 0.9, True), ("adamw", 0.5, 0.8, False)])
def test_replicas_end_where_torchs_own_parts_simulated_in_one_process(groups, transport, inner, outer_lr, momentum,
                                                                     nesterov):
    seed, steps, H = shared_seed(), 11, 4
    how = {"comm": WORLD} if transport == "comm" else {"group": groups[transport]}
    got, outer = trained(seed, steps, H, inner, outer_lr=outer_lr, outer_momentum=momentum, nesterov=nesterov, **how)
    expected = simulated(seed, steps, H, inner, outer_lr, momentum, nesterov)
    worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
    everywhere(worst < 1e-12, f"{transport} {inner}: off the simulation by {worst:.3g}")
    everywhere(outer.meetings == steps // H + 1, f"{outer.meetings} meetings")


def test_local_sgd_and_a_resumed_run(groups):
    """Local SGD is the simulation with outer lr 1 and no momentum; a run saved after 6 steps and continued by
    fresh objects (model, optimizer, DiLoCo from their state_dicts) ends on the uninterrupted run's bits."""
    seed = shared_seed()
    got, _ = trained(seed, 10, 3, "sgd", local=True, comm=WORLD)
    expected = simulated(seed, 10, 3, "sgd", 1.0, 0.0, False)
    worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
    everywhere(worst < 1e-12, f"local SGD off the simulation by {worst:.3g}")
    whole, _ = trained(seed, 13, 4, "adamw", comm=WORLD, compression="bf16")
    resumed, _ = trained(seed, 13, 4, "adamw", stop_at=6, comm=WORLD, compression="bf16")
    everywhere(all(torch.equal(a, b) for a, b in zip(whole, resumed)), "the resumed run differs")


def test_what_it_cannot_take_is_refused_in_one_line(groups):
    model, _ = model_and_data(0, RANK)
    optimizer = inner_of(model, "sgd")
    with pytest.raises(ValueError, match="compression= goes through mpicoll's allreduce"):
        mt.DiLoCo(model, optimizer, sync_every=2, compression="fp16", group=groups["gloo"])
    with pytest.raises(ValueError, match="comm= or group="):
        mt.DiLoCo(model, optimizer, sync_every=2, comm=WORLD, group=groups["gloo"])
    with pytest.raises(ValueError, match="no parameters"):
        mt.DiLoCo(torch.nn.Tanh(), optimizer, sync_every=2, comm=WORLD)
