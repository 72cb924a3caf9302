"""accelerate's MPI launch (``accelerate launch --cpu --num_processes N --mpirun_hostfile H``) of a program that
adds one line, ``dist.init_process_group("mpicoll")`` before ``Accelerator()``: it trains as the same program
over gloo does, weights bit for bit.  Skipped where accelerate is not installed (the test extra installs it)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")
from tests.support.jobs import free_port, script_env  # noqa: E402

PROGRAM = """
import sys, torch, torch.distributed as dist
import mpicoll.torch
dist.init_process_group(sys.argv[1])            # the line added to the accelerate program
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(64, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for (x,) in loader:
    optimizer.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(model(x), x[:, :3]))
    optimizer.step()
ranks = accelerator.reduce(torch.tensor([float(accelerator.process_index)]), reduction="sum")
weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
if accelerator.is_main_process:
    print("result", accelerator.num_processes, ranks.item(), weights.tolist(), flush=True)
accelerator.end_training()
if dist.is_initialized():       # torch's advice before exit (gloo's threads, left running, once aborted the exit)
    dist.destroy_process_group()
"""


def test_accelerates_mpi_launch_trains_as_over_gloo(tmp_path):
    (tmp_path / "train.py").write_text(PROGRAM)
    (tmp_path / "hosts").write_text("localhost\n")
    results = {}
    for backend in ("gloo", "mpicoll"):
        run = subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--cpu",
                              "--num_processes", "2", "--num_machines", "1", "--mpirun_hostfile", "hosts",
                              "--main_process_port", str(free_port()),
                              "train.py", backend], cwd=tmp_path, env=script_env(MPICOLL_TIMEOUT="30"),
                             capture_output=True, text=True, timeout=240)
        results[backend] = re.findall(r"^result .*$", run.stdout, re.MULTILINE)
        assert run.returncode == 0 and len(results[backend]) == 1, f"{backend}: {run.stdout[-2000:]}" \
                                                                    f"{run.stderr[-3000:]}"
    assert results["mpicoll"] == results["gloo"] and results["gloo"][0].startswith("result 2 1.0 ["), results
