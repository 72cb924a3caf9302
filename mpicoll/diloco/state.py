"""State dicts of several parts as one flat dict (what a checkpoint's ``.npz`` holds): each part's names under
a prefix of its own, and taken back out from under it."""

from __future__ import annotations

__all__ = ["under", "taken_from"]


def under(prefix: str, state: dict) -> dict:
    """``state`` with every name put under ``prefix`` (e.g. "outer.")."""
    return {f"{prefix}{name}": value for name, value in state.items()}


def taken_from(prefix: str, state: dict) -> dict:
    """The names of ``state`` under ``prefix``, without it: what :func:`under` put there."""
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
