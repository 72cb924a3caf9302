"""FSDP2 (torch's ``fully_shard``) and DTensor over the "mpicoll" backend on CPU: training equal to one process on
the whole batch (float64), a distributed checkpoint (DCP) saved and loaded back exactly; at 1 to 4 ranks."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
import torch.distributed as dist  # noqa: E402

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

import mpicoll.torch  # noqa: E402,F401  (registers the backend)
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed  # noqa: E402

pytestmark = pytest.mark.mpi

BATCH = 12 * P          # samples per step, split evenly over the ranks
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("mpicoll")
    yield
    dist.destroy_process_group()


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # odd widths: parameters whose first dimension does not divide by the rank count (FSDP2 pads their shards)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3 + P),
                               torch.nn.Tanh(), torch.nn.Linear(3 + P, 2)).double()


def batches(seed: int):
    rng = np.random.default_rng(seed)
    return [(torch.from_numpy(rng.standard_normal((BATCH, 5))), torch.from_numpy(rng.standard_normal((BATCH, 2))))
            for _ in range(STEPS)]


def train(net: torch.nn.Module, data, part: slice) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[part]), y[part]).backward()
        optimizer.step()


def sharded(seed: int) -> torch.nn.Module:
    net = model(seed)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer)
    fsdp.fully_shard(net)
    return net


def full(net: torch.nn.Module) -> dict:
    """The whole parameters of a sharded model (its DTensors gathered), by name."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in net.named_parameters()}


def test_fully_shard_trains_as_one_process_on_the_whole_batch():
    """FSDP2 all-gathers each layer's parameters in place and reduce-scatters its gradients in place, averaged
    over the ranks (each rank's loss is the mean of its share: their average is the whole batch's)."""
    seed = shared_seed()
    data = batches(seed)
    reference = model(seed)
    train(reference, data, slice(None))
    net = sharded(seed)
    share = BATCH // P
    train(net, data, slice(RANK * share, (RANK + 1) * share))
    got, want = full(net), dict(reference.named_parameters())
    worst = max(float((got[name] - want[name]).abs().max()) for name in want)
    everywhere(worst < 1e-5, f"seed {seed}: largest difference from one process {worst:.3g}")


def test_a_distributed_checkpoint_of_a_sharded_model_loads_back_exactly():
    seed = shared_seed()
    net = sharded(seed)
    share = BATCH // P
    train(net, batches(seed), slice(RANK * share, (RANK + 1) * share))
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="mpicoll-dcp-") if RANK == 0 else None)
    try:
        dcp.save({"model": net.state_dict()}, checkpoint_id=folder)
        other = sharded(seed + 1)            # other weights, sharded alike
        state = {"model": other.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        other.load_state_dict(state["model"])
        saved, loaded = full(net), full(other)
        same = all(torch.equal(saved[name], loaded[name]) for name in saved)
        everywhere(same, "a parameter loaded from the checkpoint differs from the one saved")
    finally:
        WORLD.Barrier()
        if RANK == 0:
            shutil.rmtree(folder, ignore_errors=True)


def test_a_dtensor_redistributed_over_the_mesh_is_the_whole_tensor():
    """DTensor's collectives (scatter by shards, all-gather back) on a one-dimensional CPU mesh."""
    mesh = init_device_mesh("cpu", (P,))
    rng = np.random.default_rng(shared_seed())
    whole = torch.from_numpy(rng.standard_normal((2 * P + 1, 3)))
    tensor = distribute_tensor(whole, mesh, [Shard(0)])
    summed = (tensor * 2).sum(dim=1).full_tensor()
    everywhere(torch.equal(tensor.full_tensor(), whole) and torch.allclose(summed, (whole * 2).sum(1)),
               "the DTensor gathered back differs from the whole tensor")
