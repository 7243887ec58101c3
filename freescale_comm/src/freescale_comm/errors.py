"""Exceptions raised by the freescale backend."""

from __future__ import annotations


class FreescaleError(RuntimeError):
    """A collective of the freescale backend failed."""


class FreescaleValidationError(FreescaleError, ValueError):
    """Inputs of a collective disagree across ranks or with its outputs; no byte was moved."""


class FreescaleTimeoutError(FreescaleError, TimeoutError):
    """A collective did not finish within the group's timeout."""


class FreescalePeerError(FreescaleError):
    """A peer died, stopped answering, or aborted the collective."""
