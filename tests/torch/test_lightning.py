"""Lightning over the "mpicoll" backend with one changed line (``process_group_backend``): a Trainer with
DDPStrategy and MPIEnvironment under mpiexec, ``self.log(..., sync_dist=True, on_epoch=True)`` (the epoch's
aggregate carries an int64 batch-size counter, which Lightning averages with AVG on every backend not named gloo,
as NCCL takes it: refused, it ended the job), its weights and logged values bit-identical to the same run over
gloo; and a Fabric program likewise.  Skipped where Lightning is not installed (the test extra installs it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
lightning = pytest.importorskip("lightning", reason="Lightning is not installed (pip install lightning)")

from tests.support.jobs import ROOT, launch  # noqa: E402

# the ranks import Lightning from where this process does
PATH = os.pathsep.join([str(ROOT), str(Path(lightning.__file__).parent.parent)])

TRAIN = """
import sys, hashlib, torch
import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from lightning.fabric.plugins.environments import MPIEnvironment
import mpicoll.torch


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log("seen", torch.tensor(len(x)), sync_dist=True)      # an int64, averaged over the ranks
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
x = torch.randn(256, 6)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
L.seed_everything(0, verbose=False)
model = Net()
trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    strategy=DDPStrategy(process_group_backend=sys.argv[1], cluster_environment=MPIEnvironment()))
trainer.fit(model, data)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
# one write a line (print writes the end apart, and mpiexec interleaved the two ranks' lines between them)
sys.stdout.write(f"rank {trainer.global_rank}: {digest} {trainer.callback_metrics['seen'].item()}\\n")
sys.stdout.flush()
if torch.distributed.is_initialized():   # torch's advice before exit (gloo's threads, left running, once aborted the exit)
    torch.distributed.destroy_process_group()
"""


def over_gloo_and_mpicoll(program: str, printed: str) -> dict[str, list]:
    """{backend: each rank's ``printed`` groups, in rank order} of ``program`` run at 2 ranks over each."""
    runs = {}
    for backend in ("gloo", "mpicoll"):
        result = launch(2, "-c", program, backend, timeout=240, env={"PYTHONPATH": PATH})
        assert result.returncode == 0, f"{backend}: {result.stderr[-3000:]}"
        runs[backend] = sorted(re.findall(printed, result.stdout))
        assert len(runs[backend]) == 2, result.stdout
    return runs


def test_a_lightning_trainer_with_sync_dist_trains_as_over_gloo():
    runs = over_gloo_and_mpicoll(TRAIN, r"rank (\d): ([0-9a-f]{64}) (\S+)")
    assert runs["mpicoll"] == runs["gloo"], runs


FABRIC = """
import sys, hashlib, torch
import lightning as L
from lightning.fabric.plugins.environments import MPIEnvironment
from lightning.fabric.strategies import DDPStrategy
import mpicoll.torch

fabric = L.Fabric(accelerator="cpu", devices=2,
                  strategy=DDPStrategy(process_group_backend=sys.argv[1], cluster_environment=MPIEnvironment()))
fabric.launch()
fabric.seed_everything(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
x = torch.randn(256, 6)
data = fabric.setup_dataloaders(torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16))
for epoch in range(2):
    for inputs, target in data:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), target)
        fabric.backward(loss)
        optimizer.step()
seen = fabric.all_reduce(torch.tensor(len(x) // 2), reduce_op="mean")     # an int64 averaged, as Lightning does
fabric.barrier()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
sys.stdout.write(f"rank {fabric.global_rank}: {digest} {seen.item()} {fabric.world_size}\\n")   # one write a line
sys.stdout.flush()
if torch.distributed.is_initialized():   # torch's advice before exit (gloo's threads, left running, once aborted the exit)
    torch.distributed.destroy_process_group()
"""


def test_a_fabric_program_trains_as_over_gloo():
    """Fabric with one changed argument (``process_group_backend``): weights, an averaged int64 and the world
    size bit-identical to the same run over gloo."""
    runs = over_gloo_and_mpicoll(FABRIC, r"rank (\d): ([0-9a-f]{64}) (\S+) (\d)")
    assert runs["mpicoll"] == runs["gloo"] and runs["gloo"][0][2:] == ("128", "2"), runs
