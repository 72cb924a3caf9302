"""Checkpoint files and sets: damage anywhere is refused in one line, and a set torn by a stop between its
files' writes resumes from the newest point every file still holds."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed
from mpicoll.base import checkpoint
from mpicoll.channel.checks import load_checkpoint_set
from mpicoll.base.errors import SetupError

IDENTITY = {"method": "test", "ranks": 1}


def test_every_single_byte_flip_is_refused_in_one_line_or_changes_nothing(tmp_path):
    """Flip each byte of a small checkpoint in turn: loading it either raises CheckpointMismatch saying the
    file is damaged, or gives exactly the arrays that were saved (a byte nothing reads, such as a zip
    timestamp); never a raw zip or numpy error, never other arrays, never arrays missing."""
    rng = np.random.default_rng(shared_seed(MPI.COMM_SELF))
    saved = {"params": rng.standard_normal(40).astype(np.float32), "epoch": np.array(3),
             "weights": rng.integers(-9, 9, (3, 5))}
    path = checkpoint.save(tmp_path / "ck.npz", IDENTITY, 3, **saved)
    whole = path.read_bytes()
    refused = accepted = 0
    for position in range(len(whole)):
        damaged = bytearray(whole)
        damaged[position] ^= 0x5A
        path.write_bytes(bytes(damaged))
        try:
            got = checkpoint.load(path, IDENTITY)
        except checkpoint.CheckpointMismatch as error:
            assert "is damaged" in str(error) or "belongs to another run" in str(error), (position, error)
            assert "\n" not in str(error)
            refused += 1
            continue
        assert set(got) == set(saved) and all(np.array_equal(got[k], saved[k]) for k in saved), position
        accepted += 1
    assert refused > len(whole) // 2, (refused, accepted)     # the data, the stamp and most headers


def test_a_full_disk_leaves_the_previous_file_and_no_partial_one(tmp_path, monkeypatch):
    path = checkpoint.save(tmp_path / "ck.npz", IDENTITY, 1, params=np.arange(4.0))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(path, IDENTITY, 2, params=np.arange(4.0) + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.npz"]
    assert np.array_equal(checkpoint.load(path, IDENTITY)["params"], np.arange(4.0))


def test_a_fresh_file_keeps_the_one_it_replaced_and_a_cut_off_rename_is_recovered(tmp_path):
    path = tmp_path / "ck.npz"
    for point in (1, 2, 3):
        checkpoint.save(path, IDENTITY, point, params=np.full(3, float(point)))
    assert sorted(checkpoint.versions(path, IDENTITY)) == [2, 3]
    # a stop between the two renames: the new file is whole but still .partial, the old one moved aside
    os.replace(path, path.with_name("ck.npz.partial"))
    assert sorted(checkpoint.versions(path, IDENTITY)) == [2, 3]
    assert checkpoint.load(path, IDENTITY)["params"][0] == 3.0


def test_files_a_running_writer_renames_while_they_are_read_are_never_called_damaged(tmp_path):
    """A survivor names the last checkpoint while living ranks still write theirs: each read of the files,
    made while a thread saves new points as fast as it can, lists a whole file of the newest point written
    (between the writer's two renames: the finished .partial), never a 'damaged' file (read here without the listing again: about 3 in 100 reads were)."""
    path = tmp_path / "ck.npz"
    checkpoint.save(path, IDENTITY, 0, params=np.zeros(1000))
    written, stop = [0], threading.Event()

    def writer():
        while not stop.is_set():
            checkpoint.save(path, IDENTITY, written[-1] + 1, params=np.full(1000, written[-1] + 1.0))
            written.append(written[-1] + 1)

    thread = threading.Thread(target=writer)
    thread.start()
    reads, ends = [], time.monotonic() + 30        # under a loaded disk's fsync writes come slowly: by count
    try:
        while (written[-1] < 50 or len(reads) < 200) and time.monotonic() < ends:
            newest_before = written[-1]
            found = checkpoint.versions(path, IDENTITY)
            reads.append((newest_before, sorted(found), written[-1]))
    finally:
        stop.set()
        thread.join()
    assert len(reads) >= 200 and written[-1] >= 50, (len(reads), written[-1])
    assert all(before <= max(found) <= after + 1 for before, found, after in reads), \
        [r for r in reads if not r[0] <= max(r[1]) <= r[2] + 1][:5]


@pytest.mark.mpi
def test_a_set_torn_between_its_writes_resumes_from_the_newest_point_every_file_holds(tmp_path_factory):
    """Each rank keeps its own file, saved after points 1 to 4; rank P-1 is 'stopped' before its file of
    point 4 is written (its newest is 3): every rank resumes from point 3 (with one line saying so), each
    from its own file of that point.  With rank P-1's kept file gone too, the files share no point: one
    SetupError on every rank naming each rank's points."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("set")) if RANK == 0 else None)
    identity = {"method": "test", "ranks": P}
    seed = shared_seed()
    mine = checkpoint.path(f"{folder}/job", "rank", RANK)

    def state(point):
        return np.random.default_rng([seed, RANK, point]).standard_normal(7)

    for point in range(1, 5 if RANK < P - 1 else 4):
        checkpoint.save(mine, identity, point, x=state(point))
    WORLD.Barrier()
    got = load_checkpoint_set(WORLD, mine, identity, "epochs")
    everywhere(np.array_equal(got["x"], state(3)), "did not resume from point 3, the newest common one")
    if P > 1:
        if RANK == P - 1:
            os.remove(checkpoint.previous(mine))
            checkpoint.save(mine, identity, 9, x=state(9))      # now it holds 9 and 3; the others 3 and 4
            os.remove(checkpoint.previous(mine))
        WORLD.Barrier()
        with pytest.raises(SetupError, match="hold no epoch in common"):
            load_checkpoint_set(WORLD, mine, identity, "epochs")
    # ranks that keep no file take part and get None
    got = load_checkpoint_set(WORLD, mine if RANK == 0 else None, identity, "epochs")
    everywhere((got is None) == (RANK != 0))
