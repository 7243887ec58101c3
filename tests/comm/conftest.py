"""Fixtures of the freescale backend tests: started groups of real local ranks over UCX."""

from __future__ import annotations

import pytest

pytest.importorskip("ucxx", reason="the freescale backend needs ucxx (pip install ucxx-cu12)")

# Short liveness bounds so that a killed peer is reported within seconds, not the default 10 s.
FAST_FAILURE_ENV = {"FREESCALE_HEARTBEAT_S": "0.5", "FREESCALE_DEAD_AFTER_S": "3"}
SETUP = "freescale_comm:register"


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def fs_group(request, local_groups):
    """A started freescale group of 2 or 4 ranks, shared by every test that asks for it."""
    return local_groups.get(request.param, backend="freescale", setup=SETUP, init_timeout_s=60)


@pytest.fixture
def fs_group4(local_groups):
    return local_groups.get(4, backend="freescale", setup=SETUP, init_timeout_s=60)
