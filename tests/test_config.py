"""mpicoll.config: settings from the environment."""

from __future__ import annotations

import pytest

from mpicoll.config import parse_bytes


@pytest.mark.parametrize("text, value", [("4096", 4096), ("256K", 262144), ("16M", 16 << 20), ("1GiB", 1 << 30)])
def test_byte_counts(text, value):
    assert parse_bytes(text) == value


def test_settings_that_do_not_parse_name_their_variable(monkeypatch):
    from mpicoll import config
    for variable, value, words in [("MPICOLL_TIMEOUT", "abc", "MPICOLL_TIMEOUT must be a number"),
                                   ("MPICOLL_TIMEOUT", "-1", "MPICOLL_TIMEOUT must be >= 0"),
                                   ("MPICOLL_CHANNEL", "wires", "MPICOLL_CHANNEL must be"),
                                   ("MPICOLL_TRANSPORT", "p2p", "now called MPICOLL_CHANNEL"),
                                   ("MPICOLL_END_BROKEN_JOBS", "yes", "MPICOLL_END_BROKEN_JOBS must be 0 or 1")]:
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=words):
            config.timeout(), config.channel(), config.end_broken_jobs()
        monkeypatch.delenv(variable)
