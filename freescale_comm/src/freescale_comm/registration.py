"""Makes ``backend="freescale"`` known to ``torch.distributed``.

Kept apart and light: torch imports it at its own import through the ``torch.backends`` entry
point, so it must not import ucxx, numpy or the backend itself (the creator imports those when
the first group is made), and must never raise.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "freescale"


def _create(backend_options: Any, pg_options: Any) -> Any:
    from freescale_comm.process_group import create_process_group

    return create_process_group(backend_options, pg_options)


def register() -> None:
    """Registers the ``freescale`` backend with ``torch.distributed`` (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def autoload() -> None:
    """The ``torch.backends`` entry point: registers, and never lets an error escape.

    An exception here would make ``import torch`` itself fail for everyone who has this
    package installed, so a failure is logged instead.
    """
    try:
        register()
    except Exception as err:
        logger.warning("freescale_comm: could not register the freescale backend: %s", err)
