"""``mpicoll train`` as a user runs it: progress, bad data, one log per run, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.support.jobs import ROOT, command, launch


def test_train_shows_progress_and_refuses_a_bad_data_file(tmp_path):
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    result = launch(2, "-m", "mpicoll", "train", "--method", "allreduce-auto", "--epochs", "3",
                    "--output", str(tmp_path / "run.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "epoch   3/3 [####################]" in result.stderr and "test accuracy" in result.stderr
    assert json.loads((tmp_path / "run.jsonl").read_text().splitlines()[-1])["final_accuracy"] > 0.8
    (tmp_path / "bad.npz").write_bytes(b"nonsense")
    result = launch(2, "-m", "mpicoll", "train", "--data", str(tmp_path / "bad.npz"))
    assert result.returncode != 0 and "not an .npz archive" in result.stderr, result.stderr


def test_an_output_log_belongs_to_one_run(tmp_path):
    """A second run onto an existing --output is refused and leaves it as it was; --overwrite replaces it, but
    not while another run holds it (two runs never interleave in one file); --resume appends."""
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    import fcntl
    log = tmp_path / "run.jsonl"
    first = launch(2, "-m", "mpicoll", "train", "--epochs", "2", "--output", str(log), "--checkpoint",
                   str(tmp_path / "ck"))
    assert first.returncode == 0, first.stderr
    before = log.read_bytes()
    again = launch(2, "-m", "mpicoll", "train", "--epochs", "2", "--output", str(log))
    lines = again.stderr.splitlines()
    assert again.returncode != 0 and len(lines) == 1 and "--output" in lines[0] and "--overwrite" in lines[0], lines
    assert log.read_bytes() == before
    with open(log, "a") as held:                  # another run writing it: holds the same lock a run holds
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = launch(2, "-m", "mpicoll", "train", "--epochs", "2", "--output", str(log), "--overwrite")
    assert busy.returncode != 0 and "being written by another run" in busy.stderr, busy.stderr
    assert log.read_bytes() == before
    resumed = launch(2, "-m", "mpicoll", "train", "--epochs", "3", "--output", str(log), "--checkpoint",
                     str(tmp_path / "ck"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert log.read_bytes().startswith(before) and [r.get("epoch") for r in records if "epoch" in r] == [1, 2, 3]
    replaced = launch(2, "-m", "mpicoll", "train", "--epochs", "1", "--output", str(log), "--overwrite")
    assert replaced.returncode == 0 and len(log.read_text().splitlines()) == 2, replaced.stderr


@pytest.mark.parametrize("method", ["allreduce-ring", "ps-async"])
def test_ctrl_c_ends_every_rank_with_one_line_saying_where_training_stopped(tmp_path, method):
    """Ctrl-C in a terminal reaches the launcher and every rank (one process group): the job ends, and of mpicoll
    only the reporting rank speaks, once: the epoch reached and the checkpoint to resume from."""
    import signal
    pytest.importorskip("sklearn", reason="the default data set needs scikit-learn (the data extra)")
    log = tmp_path / "run.jsonl"
    job = subprocess.Popen([*command(2), sys.executable, "-m", "mpicoll", "train", "--method", method, "--epochs",
                            "100000", "--output", str(log), "--checkpoint", str(tmp_path / "ck")], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGINT)
    try:
        errors = job.communicate(timeout=60)[1]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    ours = [line for line in errors.splitlines() if line.startswith("mpicoll") or "Traceback" in line]
    assert job.returncode != 0 and len(ours) == 1, errors[-3000:]
    assert re.fullmatch(rf"mpicoll train: interrupted after epoch \d+ of 100000; --checkpoint {tmp_path / 'ck'} "
                        r"holds the last state saved: the same command with --resume continues from there",
                        ours[0]), ours
