"""Every Python example in the README and in docs/ runs as shown and prints what it claims.

Each example's first line says how to run it (``# mpiexec -n N python example.py`` or ``# python example.py``);
the test runs it that way, from a file, with the checkout on the path, and checks that it ends cleanly and
prints on every rank it says prints (a True check where it prints one).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.support.jobs import ROOT, launch

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HOW = re.compile(r"# (?:mpiexec -n (\d+) )?python example\.py")


def examples() -> list:
    found = []
    for page in PAGES:
        for number, block in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S), 1):
            found.append(pytest.param(block, id=f"{page.name}-{number}"))
    return found


@pytest.mark.parametrize("code", examples())
def test_the_example_runs_and_shows_that_it_worked(tmp_path, code):
    how = HOW.match(code)
    assert how, f"the example does not say how to run it ('# mpiexec -n N python example.py'):\n{code[:300]}"
    if "torch" in code and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the torch extra)")
    script = tmp_path / "example.py"
    script.write_text(code)
    if how.group(1):
        result = launch(int(how.group(1)), str(script), timeout=180)
    else:
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    shown = result.stdout.strip().splitlines()
    assert shown, f"the example printed nothing:\n{result.stderr[-2000:]}"
    assert "False" not in result.stdout and "Warning" not in result.stderr, result.stdout + result.stderr
