"""Shared fixtures: local multi-process groups reused across the whole test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import LocalGroups


@pytest.fixture(scope="session")
def local_groups() -> Iterator[LocalGroups]:
    """Started groups of local ranks, one per (world size, backend); closed at session end."""
    groups = LocalGroups()
    yield groups
    groups.close()
