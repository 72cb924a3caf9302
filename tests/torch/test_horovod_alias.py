"""The opt-in ``horovod`` alias (``python -m mpicoll.torch.horovod script.py``): a Horovod program, its
imports unchanged, trains as it does with ``import mpicoll.torch.horovod as hvd``; a real Horovod is never
shadowed.  (Horovod's own examples run this way: docs/torch.md, "Coming from Horovod".)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
from tests.support.jobs import ROOT, launch, script_env  # noqa: E402

# A Horovod program as Horovod's examples are written: `import horovod` beside `import horovod.torch`, a part
# of horovod.torch imported by its own name.  {imports} is replaced by the two ways of running it.
_PROGRAM = """
import sys, torch
{imports}
hvd.init()
torch.manual_seed(1 + hvd.rank())
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(4):
    data = torch.randn(8, 6, dtype=torch.float64)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(data), data[:, :3]).backward()
    optimizer.step()
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
if hvd.rank() == 0:
    print("weights", weights.tolist(), "argv", sys.argv[1:], "state", TorchState.__name__)
"""


def _run(tmp_path, imports: str, *command: str):
    script = tmp_path / "program.py"
    script.write_text(_PROGRAM.format(imports=imports))
    result = launch(2, *command, str(script), "--epochs", "1", env={"MPICOLL_TIMEOUT": "30"}, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if line.startswith("weights")]


def test_a_horovod_program_unchanged_trains_as_with_the_changed_import(tmp_path):
    """Horovod's imports under the alias; mpicoll's import without it: the same weights, bit for bit."""
    aliased = _run(tmp_path, "import horovod\nimport horovod.torch as hvd\nfrom horovod.torch.elastic import "
                   "TorchState\nassert horovod.torch is hvd", "-m", "mpicoll.torch.horovod")
    direct = _run(tmp_path, "import mpicoll.torch.horovod as hvd\nfrom mpicoll.torch.horovod.elastic import "
                  "TorchState")
    assert aliased and aliased == direct, (aliased, direct)
    assert "argv ['--epochs', '1']" in aliased[0]


def _python(code: str, tmp_path, pythonpath: str = str(ROOT)) -> subprocess.CompletedProcess:
    env = script_env(PYTHONPATH=pythonpath)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_what_the_alias_does_not_have_says_so(tmp_path):
    """``horovod.run`` (Horovod starting ranks itself) says how to launch instead; Horovod's other frameworks
    and parts mpicoll lacks are not found, naming the module."""
    result = _python("""
        from mpicoll.torch.horovod.alias import install
        assert install()
        import horovod
        for name in ("horovod.tensorflow", "horovod.torch.no_such_part"):
            try:
                __import__(name)
            except ModuleNotFoundError as error:
                print("missing", error.name)
        try:
            horovod.run(print, np=2)
        except RuntimeError as error:
            print("run:", error)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "missing horovod.tensorflow\nmissing horovod.torch.no_such_part\n" in result.stdout, result.stdout
    assert "run: horovod.run" in result.stdout and "mpiexec -n N python -m mpicoll.torch.horovod" in result.stdout


def test_a_real_horovod_is_never_shadowed(tmp_path):
    """With a Horovod importable, installing the alias warns and changes nothing: ``import horovod`` is it."""
    real = tmp_path / "site" / "horovod"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    result = _python("""
        import warnings
        from mpicoll.torch.horovod.alias import install, installed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("installed:", install(), installed())
        import horovod
        print("real:", getattr(horovod, "REAL", False), "|", caught[0].message)
    """, tmp_path, pythonpath=f"{tmp_path / 'site'}:{ROOT}")
    assert result.returncode == 0, result.stderr
    assert "installed: False False" in result.stdout and "real: True | mpicoll: a real Horovod" in result.stdout, \
        result.stdout


def test_the_runner_without_a_program_says_how_to_use_it():
    result = subprocess.run([sys.executable, "-m", "mpicoll.torch.horovod"], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "usage: python -m mpicoll.torch.horovod script.py" in result.stderr
