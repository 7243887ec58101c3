"""Implementations: ``reference`` (PyTorch, imports no Triton), ``naive`` (per-rank loops, for the
benchmark only), and one Triton module per operation family (``index_select``, ``ranged``,
``dedup``, sharing ``jagged_copy``), which import Triton and are loaded only on first use."""
