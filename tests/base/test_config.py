"""mpicoll.base.config: settings from the environment."""

from __future__ import annotations

import pytest

from mpicoll.base.config import parse_bytes


@pytest.mark.parametrize("text, value", [("4096", 4096), ("256K", 262144), ("16M", 16 << 20), ("1GiB", 1 << 30)])
def test_byte_counts(text, value):
    assert parse_bytes(text) == value


def test_settings_that_do_not_parse_name_their_variable(monkeypatch):
    from mpicoll.base import config
    for variable, value, words in [("MPICOLL_TIMEOUT", "abc", "MPICOLL_TIMEOUT must be a number"),
                                   ("MPICOLL_TIMEOUT", "-1", "MPICOLL_TIMEOUT must be >= 0"),
                                   ("MPICOLL_CHANNEL", "wires", "MPICOLL_CHANNEL must be"),
                                   ("MPICOLL_TRANSPORT", "p2p", "now called MPICOLL_CHANNEL"),
                                   ("MPICOLL_END_BROKEN_JOBS", "sometimes", "MPICOLL_END_BROKEN_JOBS must be 1 or 0"),
                                   ("MPICOLL_DEBUG", "2", "MPICOLL_DEBUG must be 1 or 0"),
                                   ("MPICOLL_SEGMENT", "inf", "MPICOLL_SEGMENT: not a byte count"),
                                   ("MPICOLL_SEGMENT", "0", "MPICOLL_SEGMENT must be a byte count from 1 to 1G"),
                                   ("MPICOLL_SEGMENT", "1e30", "MPICOLL_SEGMENT must be a byte count from 1 to 1G"),
                                   ("MPICOLL_KERNELS", "bogus", "MPICOLL_KERNELS must be"),
                                   ("MPICOLL_CUDA_AWARE", "maybe", "MPICOLL_CUDA_AWARE must be 1 or 0"),
                                   ("MPICOLL_UCX_DEFAULTS", "x", "MPICOLL_UCX_DEFAULTS must be 1 or 0"),
                                   ("MPICOLL_JOIN_JOBS", "perhaps", "MPICOLL_JOIN_JOBS must be 1 or 0"),
                                   ("MPICOLL_SHM_STORES", "uncached", "MPICOLL_SHM_STORES must be"),
                                   ("MPICOLL_SHM_THREADS", "0", "MPICOLL_SHM_THREADS must be a count"),
                                   ("MPICOLL_SHM_THREADS", "two", "MPICOLL_SHM_THREADS must be a count")]:
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=words):
            config.check_all()
        monkeypatch.delenv(variable)


@pytest.mark.parametrize("text, value", [("1", True), ("yes", True), ("On", True), ("0", False), ("no", False),
                                         ("false", False), ("", True)])
def test_switches_take_the_usual_spellings(monkeypatch, text, value):
    from mpicoll.base import config
    monkeypatch.setenv("MPICOLL_END_BROKEN_JOBS", text)
    assert config.end_broken_jobs() is value


def _settings_after(code: str, names, **environment) -> dict:
    """The environment variables ``names`` as a fresh interpreter sees them after ``code`` (mpicoll's own and
    UCX's TCP settings removed from this environment first)."""
    import json
    import os
    import subprocess
    import sys
    theirs = ("UCX_TCP_", "MPICOLL_UCX", "MPIR_CVAR_CH4_NETMOD", "TORCHELASTIC_RUN_ID", "MPICOLL_JOIN_JOBS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(theirs)}
    probe = f"{code}\nimport json, os\nprint(json.dumps({{k: os.environ.get(k) for k in {list(names)!r}}}))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env={**env, **environment})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _ucx_settings_after(code: str, **environment) -> dict:
    """UCX's TCP segment settings as a fresh interpreter sees them after ``code``."""
    from mpicoll.base.ucx import DEFAULTS
    return _settings_after(code, DEFAULTS, **environment)


def test_ucx_tcp_segments_are_raised_only_before_mpi_starts_and_only_when_unset():
    from mpicoll.base.ucx import DEFAULTS
    assert _ucx_settings_after("import mpicoll") == DEFAULTS
    unset = dict.fromkeys(DEFAULTS)
    assert _ucx_settings_after("from mpi4py import MPI\nimport mpicoll") == unset      # MPI started first
    assert _ucx_settings_after("import mpicoll", MPICOLL_UCX_DEFAULTS="0") == unset
    # one of the pair set by the user: neither is touched (UCX refuses a receive segment below the send one)
    assert _ucx_settings_after("import mpicoll", UCX_TCP_RX_SEG_SIZE="1m") == {**unset, "UCX_TCP_RX_SEG_SIZE": "1m"}


def test_mpichs_ofi_netmod_is_chosen_only_for_torchruns_workers_asked_to_join():
    """MPICH's UCX netmod crashed far more often than OFI in connect/accept (mpicoll.torch.joining): OFI is chosen
    where torchrun started the process and MPICOLL_JOIN_JOBS=1 asks for the join, and only where the user chose
    no netmod."""
    def netmod(**environment):
        return _settings_after("import mpicoll", ["MPIR_CVAR_CH4_NETMOD"], **environment)["MPIR_CVAR_CH4_NETMOD"]

    assert netmod(TORCHELASTIC_RUN_ID="r", MPICOLL_JOIN_JOBS="1") == "ofi"
    assert netmod(TORCHELASTIC_RUN_ID="r") is None and netmod(MPICOLL_JOIN_JOBS="1") is None
    assert netmod(TORCHELASTIC_RUN_ID="r", MPICOLL_JOIN_JOBS="1", MPIR_CVAR_CH4_NETMOD="ucx") == "ucx"
