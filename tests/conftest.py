"""Session-wide test setup: Triton's interpreter on CPU-only machines, shared local groups."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Triton reads TRITON_INTERPRET when it first decorates a kernel, and other test modules (torch
# compile cases, for one) import Triton during collection: so it is set here, before any of them.
# On a CUDA machine the kernels compile for the GPU instead and the same tests run on CUDA tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.harness import LocalGroups

# Which test process runs the tests that share started groups (see the module).
pytest_plugins = ["tests.xdist_groups"]


@pytest.fixture(scope="session")
def local_groups() -> Iterator[LocalGroups]:
    """Started groups of local ranks, one per (world size, backend); closed at session end."""
    groups = LocalGroups()
    yield groups
    groups.close()
