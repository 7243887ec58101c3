"""Causal self-attention within each sample of a jagged batch (no attention across samples).

``q``, ``k`` and ``v`` are ``[T, heads, head_dim]`` over the concatenated samples, ``offsets``
is int64 ``[B + 1]`` (sample ``b`` is tokens ``offsets[b] .. offsets[b+1] - 1``). Two paths
with the same signature: plain PyTorch (any device, cost quadratic in each sample's own length)
and CUDA's variable-length flash attention; ``jagged_causal_attention`` picks one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def jagged_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_length: int
) -> torch.Tensor:
    """Causal attention per sample: the varlen path for CUDA tensors when torch has it, else
    the PyTorch path.

    Args:
        q: queries ``[T, heads, head_dim]``.
        k: keys, like ``q``.
        v: values, like ``q``.
        offsets: int64 ``[B + 1]`` sample boundaries, ``offsets[-1] == T``.
        max_length: the longest sample, ``max(offsets[1:] - offsets[:-1])``.

    Returns:
        ``[T, heads, head_dim]``, in ``q``'s dtype.
    """
    if q.is_cuda and _varlen_attn() is not None:
        return jagged_causal_attention_varlen(q, k, v, offsets, max_length)
    return jagged_causal_attention_torch(q, k, v, offsets, max_length)


def jagged_causal_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_length: int
) -> torch.Tensor:
    """The PyTorch path: one ``scaled_dot_product_attention`` per sample, in ``q``'s dtype.

    A sample's output depends on its own tokens only, computed the same way whatever else is
    in the batch. ``max_length`` is not needed here (the signature is shared with the varlen
    path).
    """
    sizes = (offsets[1:] - offsets[:-1]).tolist()
    # split, not slicing: each slice's backward would fill a zero tensor of the whole batch.
    # [L, heads, dim] -> [1, heads, L, dim]: with a batch dimension the CPU build takes its
    # fused (flash) kernel, 4x faster than the unbatched math path at L = 800.
    outputs = [
        F.scaled_dot_product_attention(
            *(x.unsqueeze(0).transpose(1, 2) for x in parts), is_causal=True
        )[0].transpose(0, 1)
        for parts in zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True)
        if parts[0].shape[0]
    ]
    return torch.cat(outputs) if outputs else torch.empty_like(q)


def jagged_causal_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_length: int
) -> torch.Tensor:
    """The CUDA path: ``torch.nn.attention.varlen.varlen_attn`` in bfloat16 (flash attention
    takes half precision only), the result cast back to ``q``'s dtype.

    Raises:
        RuntimeError: if this torch has no ``varlen_attn``.
    """
    attention = _varlen_attn()
    if attention is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
    cumulative = offsets.to(device=q.device, dtype=torch.int32)
    out = attention(
        *(x.to(torch.bfloat16).contiguous() for x in (q, k, v)),
        cumulative,
        cumulative,
        max_length,
        max_length,
        **_varlen_options(attention),
    )
    return out.to(q.dtype)


@functools.cache
def _varlen_attn() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_options(attention: Callable[..., torch.Tensor]) -> dict[str, Any]:
    parameters = inspect.signature(attention).parameters
    # torch 2.13 spells causal as a (left, right) window; earlier releases had is_causal.
    options: dict[str, Any] = (
        {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    )
    if "num_splits" in parameters:
        # Split-KV picks its split from the batch's longest sample, which would make a
        # sample's output depend on the rest of the batch.
        options["num_splits"] = 1
    return options
