"""What the ranks of a job that is torn down leave behind: each survivor's outcome in a file of its own.

A job that lost a rank ends with ``MPI_Abort`` (stdout may be lost then), and the first survivor to abort ends
the others: so each survivor writes its outcome, then waits, boundedly, until every survivor's is there."""

from __future__ import annotations

import os
import time


def leave_outcome(folder: str, rank: int, outcome: str, survivors=(0, 1), patience: float = 60.0) -> None:
    """Write ``outcome`` to ``folder``/rank{rank}.txt (whole or not at all), then wait up to ``patience`` s for
    the other ``survivors``' files, so that an abort that follows loses none of them."""
    path = os.path.join(folder, f"rank{rank}.txt")
    with open(path + ".part", "w") as handle:
        handle.write(outcome)
    os.replace(path + ".part", path)
    wait_for_outcomes(folder, survivors, patience)


def wait_for_outcomes(folder: str, survivors=(0, 1), patience: float = 60.0) -> None:
    """Wait up to ``patience`` s until every one of ``survivors`` has left its outcome in ``folder``."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(folder, f"rank{rank}.txt")) for rank in survivors):
        time.sleep(0.05)
