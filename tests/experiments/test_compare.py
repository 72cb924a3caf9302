"""``mpicoll compare`` and ``mpicoll plot``: the report, the plot redrawn from it, a look per method."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mpicoll.experiments.compare import COMPRESSIONS, label
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


def test_compare_trains_each_allreduce_method_compressed_and_times_them_to_the_first_runs_accuracy(tmp_path):
    """--compressions: a row per (allreduce method, compression), the others uncompressed only; --seeds: one run
    per seed; --target first: each run timed to the final accuracy of the first row's run of its seed."""
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    pytest.importorskip("matplotlib")
    folder = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "mpicoll", "compare", "-n", "2", "--methods",
                             "allreduce-auto,ps-async", "--compressions", "none,powersgd", "--seeds", "3,4",
                             "--target", "first", "--output", str(folder), "--data", "digits", "--model", "mlp",
                             "--hidden", "16", "--epochs", "2", "--powersgd-start", "1", "--quiet"],
                            cwd=ROOT, capture_output=True, text=True, timeout=240, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MPIEXEC": mpiexec()})
    assert result.returncode == 0, result.stderr
    table = (folder / "report.md").read_text()
    rows = re.findall(r"^\| (\S+) \| 2 \| 2 \|", table, re.MULTILINE)
    assert rows == ["allreduce-auto", "allreduce-auto+powersgd-r2", "ps-async"], table
    assert sorted(re.findall(r"--seed (\d)", result.stderr)) == ["3"] * 3 + ["4"] * 3, result.stderr
    logs = {log.name: json.loads(log.read_text().splitlines()[-1]) for log in folder.glob("*.jsonl")}
    firsts = {s["options"]["seed"]: s["final_accuracy"] for name, s in logs.items() if name.startswith("allreduce-auto.")}
    assert "time to allreduce-auto's final accuracy (s)" in table and (folder / "time_to_target.png").exists()
    assert f"(mean {sum(firsts.values()) / 2:.1%})" in table, table
    # the uncompressed runs reach their own final accuracy: their cell has no "of 2 runs"
    assert re.search(r"^\| allreduce-auto \| 2 \| 2 \| [^|]+ \| [\d.]+ ± [\d.]+ \|", table, re.MULTILINE), table
    assert all(s["options"]["compression"] == ("powersgd" if "powersgd" in name else None) for name, s in logs.items())
    assert "fp16+ef" in COMPRESSIONS and label({"method": "allreduce-auto", "options": {
        "compression": "fp16", "error_feedback": True}}) == "allreduce-auto+fp16+ef"
