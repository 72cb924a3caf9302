"""``mpicoll compare`` and ``mpicoll plot``: the report, the plot redrawn from it, a look per method."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.jobs import ROOT, mpiexec


def test_compare_writes_a_report_and_plot_redraws_it(tmp_path):
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    pytest.importorskip("matplotlib")
    folder = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "mpicoll", "compare", "-n", "3", "--algorithms",
                             "allreduce-ring,ps-async,sgp", "--repeats", "2", "--output", str(folder), "--data",
                             "digits", "--model", "softmax", "--epochs", "1", "--quiet"],
                            cwd=ROOT, capture_output=True, text=True, timeout=240, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MPIEXEC": mpiexec()})
    assert result.returncode == 0, result.stderr
    table = (folder / "report.md").read_text()
    assert all(f"| {name} | 3 | 2 |" in table for name in ("allreduce-ring", "ps-async", "sgp")), table
    # the second round runs the methods in reverse order, so drift favours none
    launched = re.findall(r"--method (\S+)", result.stderr)
    assert launched == ["allreduce-ring", "ps-async", "sgp", "sgp", "ps-async", "allreduce-ring"], launched
    redrawn = subprocess.run([sys.executable, "-m", "mpicoll", "plot", *map(str, sorted(folder.glob("*.jsonl"))),
                              "--output", str(tmp_path / "again")], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert redrawn.returncode == 0 and (tmp_path / "again" / "loss_vs_time.png").exists(), redrawn.stderr
    assert (tmp_path / "again" / "report.md").read_text().count("|") == table.count("|")
    best = max(json.loads(log.read_text().splitlines()[-1])["final_accuracy"] for log in folder.glob("*.jsonl"))
    assert f"Target accuracy: {0.9 * best:.1%}, 90% of the best final accuracy." in table, table


def test_compare_gives_every_method_a_look_of_its_own():
    from mpicoll.experiments.compare import _looks
    from mpicoll.train.run import METHODS
    looks = _looks([*METHODS, *(f"more-{i}" for i in range(20 - len(METHODS)))])
    assert len({(look["color"], look["linestyle"]) for look in looks.values()}) == 20
