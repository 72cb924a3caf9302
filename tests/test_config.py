"""mpicoll.config: settings from the environment."""

from __future__ import annotations

import pytest

from mpicoll.config import parse_bytes


@pytest.mark.parametrize("text, value", [("4096", 4096), ("256K", 262144), ("16M", 16 << 20), ("1GiB", 1 << 30)])
def test_byte_counts(text, value):
    assert parse_bytes(text) == value
