"""Collective algorithms as plans: which bytes go to and come from which peer, in what order.

A plan is pure bookkeeping over flat byte views of the caller's tensors (no data is copied to
build it, except that non-contiguous tensors get a contiguous staging copy, because UCX would
send a strided buffer's wrong bytes). Host bytes are numpy uint8 arrays — what UCX takes for host
memory, and sliced in a fraction of the time a torch view takes, which counts on the small-message
path; CUDA bytes are torch uint8 tensors. Algorithms:

- AllToAll, pairwise: every receive and every send is posted at once (the transport orders them
  per peer); the rank's own piece is a local copy.
- AllGather, direct: the rank's piece goes to every peer at once, one message each.
- AllGather, ring: n-1 steps; at step s the rank forwards to its right neighbour the piece it
  received at step s-1, chunk by chunk, so the chunks of consecutive steps overlap.

Local argument errors (splits that do not add up, outputs of the wrong size, mixed dtypes) do not
raise here: they go into the plan's signature, so that every rank learns of them (see
``validation``) instead of the other ranks waiting for data that never comes.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from freescale_comm.local_copies import host_copy
from freescale_comm.options import FreescaleOptions
from freescale_comm.transport import MAX_SUB
from freescale_comm.validation import DTYPE_NAME_BYTES, Signature, layout


class DeviceBytes:
    """Flat CUDA bytes by address: what a cached plan (``Template``) hands the IPC path, which
    only needs addresses and lengths (slicing a torch view costs microseconds, this a tuple).
    The call's tensors keep the memory alive (``Plan.keep``)."""

    __slots__ = ("nbytes", "pointer")

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = pointer
        self.nbytes = nbytes

    def data_ptr(self) -> int:
        return self.pointer

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, span: slice) -> DeviceBytes:
        start, stop, _ = span.indices(self.nbytes)
        return DeviceBytes(self.pointer + start, max(0, stop - start))


# Flat contiguous bytes: a numpy uint8 array in host memory, a torch uint8 tensor on CUDA (or
# ``DeviceBytes`` in a cached IPC plan).
Bytes = np.ndarray | torch.Tensor | DeviceBytes


@dataclass(eq=False)
class Transfer:
    """One tagged message of a plan.

    Attributes:
        peer: group rank of the other side.
        buffer: the bytes to send from or receive into (never empty).
        sub: message index inside the collective (goes into the tag; 0 is the header).
        send: True for a send, False for a receive.
        after: a receive that must complete before this send is posted (ring forwarding).
        chunk: index of this message's chunk within its piece (ring), which the staged path
            schedules by (see ``staged``).
    """

    peer: int
    buffer: Bytes
    sub: int
    send: bool
    after: Transfer | None = None
    chunk: int = 0
    request: Any = None
    done: bool = False


@dataclass
class Plan:
    """Everything a collective moves, and the signature that describes it to the peers.

    Attributes:
        signature: this rank's side, checked against every other rank's before data moves.
        transfers: the messages, receives and sends; each peer's in tag (``sub``) order.
        local_copies: (destination, source) bytes copied when the data phase starts.
        copy_back: (user tensor, contiguous staging) pairs copied after the last message.
        result: the collective's output tensors, the value of its future unless ``value``.
        value: the future's value where it is shaped otherwise (Gloo's, for the same call).
        forwarding: some sends wait for a receive (ring): they cannot travel in the header.
        staged: CUDA bytes that move through pinned host memory (``staged``), not UCX directly
            (with ``ipc``: the bytes of the peers IPC does not reach).
        ipc: CUDA bytes that move between the ranks of one host by CUDA IPC (``ipc``), with
            no message but the headers; ``ipc_peers``: the peers reached so (the others take
            the staged path, or UCX device messages: ``direct_peers``).
    """

    signature: Signature
    transfers: list[Transfer] = field(default_factory=list)
    local_copies: list[tuple[Bytes, Bytes]] = field(default_factory=list)
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    result: list[torch.Tensor] = field(default_factory=list)
    value: Any = None
    forwarding: bool = False
    staged: bool = False
    ipc: bool = False
    ipc_peers: frozenset[int] = frozenset()
    direct_peers: bool = False
    template: Template | None = None
    keep: Sequence[torch.Tensor] = ()

    @property
    def on_cuda(self) -> bool:
        # Not "not cpu": a plan that refused another device (meta, ...) is judged like a CPU
        # one, so that its error reaches every rank through the headers.
        return self.signature.device.startswith("cuda")

    @property
    def most_sends_to_one_peer(self) -> int:
        """The largest number of messages this rank sends any one peer (what an IPC header
        must describe)."""
        sends = collections.Counter(t.peer for t in self.transfers if t.send)
        return max(sends.values(), default=0)

    @property
    def gpu_ordered(self) -> bool:
        """CUDA copies wait for the caller's stream on the GPU (no CPU wait for it): not where
        UCX reads device memory itself (the direct path, also for peers IPC does not reach)."""
        return self.staged or (self.ipc and not self.direct_peers)

    @property
    def cuda_index(self) -> int:
        """The CUDA device of the outputs (the current device when there are none)."""
        for tensor in self.result:
            if tensor.is_cuda:
                return tensor.device.index
        return torch.cuda.current_device()


@dataclass(eq=False)
class Template:
    """What a plan of one call shape always is, kept so that the next call of that shape does
    not build it again (``PlanCache``): the signature and its encoded header, and every message
    and local copy as (tensor index, byte range) of the call's tensors. Collectives keep beside
    it what they derive from the plan alone (which messages fold into headers, tables of
    headers already judged consistent)."""

    signature: Signature
    header: np.ndarray
    # (peer, tensor, lo, hi, sub, send, index of the receive it forwards or -1, chunk)
    messages: list[tuple[int, int, int, int, int, bool, int, int]]
    copies: list[tuple[int, int, int, int, int, int]]  # (dst tensor, lo, hi, src tensor, lo, hi)
    forwarding: bool
    # Per tensor: the ctypes array type of its bytes (CPU), its byte count (CUDA), None: empty.
    views: list[Any]
    derived: dict[Any, Any] = field(default_factory=dict)
    # The last call's buffers: its tensors' addresses, each message's bytes, each local
    # copy's. A training loop calls a shape with the same tensors, or the allocator's same
    # blocks, again and again: their views are reused instead of made again.
    last_buffers: tuple[tuple[int, ...], list[Bytes], list[tuple[Bytes, Bytes]]] | None = None

    def plan(self, tensors: Sequence[torch.Tensor], result: list[torch.Tensor]) -> Plan:
        """The plan of this shape over the call's own (contiguous) tensors."""
        addresses = tuple(t.data_ptr() for t in tensors)
        last = self.last_buffers
        if last is None or last[0] != addresses:
            last = self.last_buffers = (addresses, *self._buffers(tensors))
        _, buffers, copies = last
        transfers: list[Transfer] = []
        append = transfers.append
        for (peer, _, _, _, sub, send, after, chunk), buffer in zip(
            self.messages, buffers, strict=True
        ):
            append(
                Transfer(peer, buffer, sub, send, transfers[after] if after >= 0 else None, chunk)
            )
        return Plan(
            self.signature,
            transfers,
            list(copies),
            result=result,
            forwarding=self.forwarding,
            template=self,
            keep=tensors,
        )

    def _buffers(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[list[Bytes], list[tuple[Bytes, Bytes]]]:
        """The bytes of each message and of each local copy, over ``tensors``."""
        flats = [
            _EMPTY
            if view is None
            else DeviceBytes(t.data_ptr(), view)
            if isinstance(view, int)
            else np.frombuffer(view.from_address(t.data_ptr()), dtype=np.uint8)
            for view, t in zip(self.views, tensors, strict=True)
        ]
        # One view per byte range: an AllGather's sends to every peer share their buffer, which
        # the outboxes then write once.
        views: dict[tuple[int, int, int], Bytes] = {}
        buffers = []
        for _, which, lo, hi, *_ in self.messages:
            view = views.get((which, lo, hi))
            if view is None:
                view = views[which, lo, hi] = flats[which][lo:hi]
            buffers.append(view)
        copies = [(flats[d][a:b], flats[s][c:e]) for d, a, b, s, c, e in self.copies]
        return buffers, copies


_EMPTY = np.empty(0, dtype=np.uint8)
_CACHE_ENTRIES = 256


class PlanCache:
    """A group's templates by call shape (op, the tensors' shapes and dtypes, splits).

    Only calls whose tensors are all contiguous, on the CPU (or on CUDA where the group moves
    CUDA bytes by IPC to every peer, if IPC can carry the plan: ``ipc_fits``, what an IPC
    header has room to describe) and without overlapping memory are cached
    (a strided tensor needs a staging copy per call; an in-place AllGather skips a copy that
    another call of the same shapes needs), and only from a shape's second call: building a
    template costs more than the plan it saves once, and uneven AllToAlls whose splits change
    every step (embedding lookups) would pay it on every call. Bounded: cleared when full.
    """

    def __init__(self, ipc_fits: Callable[[Plan], bool] | None = None) -> None:
        self._templates: dict[Any, Template | None] = {}
        self._seen_once: set[Any] = set()
        self._ipc_fits = ipc_fits  # None: CUDA calls are not cached

    def key(self, op: str, tensors: Sequence[torch.Tensor], extra: Any) -> Any:
        """The call's shape, or None when it must not be cached."""
        spans = []
        for t in tensors:
            if (
                t.layout != torch.strided  # first: other layouts have no is_contiguous
                or t.is_nested
                or not (t.is_cpu or (self._ipc_fits is not None and t.is_cuda))
                or not t.is_contiguous()
                or _unreadable(t)  # sent from a resolved copy (an output is refused)
            ):
                return None
            span = _own_span(t)
            if span is None:  # refused by the builder (a template would use its address)
                return None
            if span[1] > span[0]:
                spans.append(span)
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                return None
        return (op, extra, *((t.shape, t.dtype, t.is_cuda) for t in tensors))

    def get(self, key: Any) -> Template | None:
        return self._templates.get(key) if key is not None else None

    def remember(self, key: Any, plan: Plan, tensors: Sequence[torch.Tensor], n: int) -> None:
        """Keeps ``plan`` (built over ``tensors``) as the template of ``key``, if it maps."""
        if key is None or plan.signature.error or plan.copy_back:
            return
        if plan.on_cuda and (plan.forwarding or not self._ipc_fits(plan)):
            return  # not IPC (a ring, descriptors past a header's room): it needs tensors
        if key not in self._seen_once:
            if len(self._seen_once) >= _CACHE_ENTRIES:
                self._seen_once.clear()
            self._seen_once.add(key)
            return
        if len(self._templates) >= _CACHE_ENTRIES:
            self._templates.clear()
        spans = [(t.data_ptr(), t.nbytes) for t in tensors]

        def locate(buffer: np.ndarray) -> tuple[int, int, int]:
            start = address(buffer)
            found = [
                (k, start - base, start - base + len(buffer))
                for k, (base, size) in enumerate(spans)
                if size and base <= start and start + len(buffer) <= base + size
            ]
            if len(found) != 1:
                raise LookupError
            return found[0]

        try:
            index = {id(t): k for k, t in enumerate(plan.transfers)}
            messages = [
                (
                    t.peer,
                    *locate(t.buffer),
                    t.sub,
                    t.send,
                    index[id(t.after)] if t.after is not None else -1,
                    t.chunk,
                )
                for t in plan.transfers
            ]
            copies = [(*locate(dst), *locate(src)) for dst, src in plan.local_copies]
        except LookupError:  # a buffer outside the call's tensors (a staging copy)
            self._templates[key] = None
            return
        views = [
            (size if t.is_cuda else ctypes.c_uint8 * size) if size else None
            for t, (_, size) in zip(tensors, spans, strict=True)
        ]
        self._templates[key] = Template(
            plan.signature, plan.signature.encode(n), messages, copies, plan.forwarding, views
        )
        plan.template = self._templates[key]
        plan.keep = tensors


def _planned(
    cache: PlanCache | None,
    op: str,
    tensors: Sequence[torch.Tensor],
    extra: Any,
    result: list[torch.Tensor],
    world_size: int,
    build: Callable[[], Plan],
) -> Plan:
    """The call's plan: from its cached template, or built (and remembered when it may be)."""
    key = None if cache is None else cache.key(op, tensors, extra)
    template = None if cache is None else cache.get(key)
    if template is not None:
        return template.plan(tensors, result)
    try:
        plan = build()
    except Exception as err:  # every rank must hear of it, not only this one
        problem = f"cannot read its tensors: {type(err).__name__}: {err}"
        b = _Builder(op, world_size, tensors, problem=problem)
        return Plan(b.signature(len(tensors), [], []), result=result)
    if cache is not None and key is not None:
        cache.remember(key, plan, tensors, world_size)
    return plan


def flat_bytes(tensor: torch.Tensor) -> Bytes:
    """A contiguous tensor's storage as flat bytes (any dtype, no copy): numpy on the host."""
    # Not ``reshape(-1)``: a one-element tensor is contiguous whatever its stride, which
    # reshape keeps, and a view as bytes needs stride 1.
    flat = tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8)
    # Not ``flat.numpy()``: torch marks a storage shared with numpy as never resizable again,
    # and FSDP frees its AllGather's output by resizing the storage to 0.
    return flat if flat.is_cuda else np.asarray(_HeldBytes(flat))


class _HeldBytes:
    """A 1-D uint8 tensor's bytes as numpy takes them (``__array_interface__``); the array's
    base, so the tensor lives as long as the array."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, flat: torch.Tensor) -> None:
        self.tensor = flat
        self.__array_interface__ = {
            "data": (flat.data_ptr(), False),
            "shape": (flat.numel(),),
            "typestr": "|u1",
            "version": 3,
        }


def address(buffer: Bytes) -> int:
    """The first byte's address of host (numpy) or CUDA (torch, ``DeviceBytes``) bytes."""
    return buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()


def _copy_own(plan: Plan, dst: Bytes, src: Bytes) -> None:
    """Queues the copy of this rank's own piece, unless it is already in place (an AllGather
    whose input is its slot of the output, as FSDP calls it): on a GPU that copy would be an
    HBM-bound DtoD copy beside the compute the collective overlaps."""
    if len(dst) != len(src) or address(dst) != address(src):
        plan.local_copies.append((dst, src))


def _own_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The addresses [first, end) of a dense tensor's element bytes ((0, 0) if it has none),
    or None where they do not all lie in memory of its own storage: a wrapper subclass
    without storage (DTensor, float8 wrappers; its address is 0 or refused) or a storage
    resized below it. Its address would read or write bytes that are not it."""
    nbytes = tensor.nbytes
    if nbytes == 0:
        return (0, 0)
    try:
        storage = tensor.untyped_storage()
        start, base = tensor.data_ptr(), storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if not tensor.is_contiguous():  # its elements span from the first to the last one
        sizes_and_strides = zip(tensor.shape, tensor.stride(), strict=True)
        extent = sum((size - 1) * stride for size, stride in sizes_and_strides)
        nbytes = (extent + 1) * tensor.element_size()
    if start == 0 or start < base or start + nbytes > base + storage.nbytes():
        return None
    return (start, start + nbytes)


def _unreadable(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes are not its values (a lazy negation or conjugation)."""
    return tensor.is_neg() or tensor.is_conj()


def _resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a copy holding its values where its bytes are not them."""
    return tensor.resolve_conj().resolve_neg() if _unreadable(tensor) else tensor


class _Builder:
    """Collects a plan's pieces and the first local argument error (``tensors``: every tensor
    of the call; ``outputs``: those written; ``dtypes_by_input``: the inputs of a coalesced
    AllGather, which may each have a dtype of their own, as NCCL allows: then the signature
    names their dtypes in order, and each input's outputs must have its dtype; ``problem``: an
    error found before, reported ahead of any the checks here find)."""

    def __init__(
        self,
        op: str,
        world_size: int,
        tensors: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] = (),
        dtypes_by_input: Sequence[torch.Tensor] = (),
        problem: str = "",
    ) -> None:
        self.op = op
        self.n = world_size
        self.error = f"{op} {problem}" if problem else ""
        self.copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        first = tensors[0] if tensors else None
        self.dtype = first.dtype if first is not None else torch.uint8
        self.device = first.device if first is not None else torch.device("cpu")
        self.dtype_name = _dtypes_name(dtypes_by_input) or str(self.dtype)
        for tensor in tensors:
            if tensor.dtype != self.dtype and not dtypes_by_input:
                self.fail(f"mixes dtypes {self.dtype} and {tensor.dtype}")
            elif tensor.device != self.device:
                self.fail(f"mixes devices {self.device} and {tensor.device}")
            elif tensor.is_nested:
                self.fail("got a nested tensor; only dense tensors are supported")
            elif tensor.is_sparse or tensor.layout != torch.strided:
                self.fail(f"got a {tensor.layout} tensor; only dense tensors are supported")
            elif tensor.device.type in ("cpu", "cuda") and _own_span(tensor) is None:
                self.fail(
                    f"got a {type(tensor).__name__} whose elements are not in memory of its own "
                    "(a wrapper subclass such as DTensor, or a storage resized below the "
                    "tensor); pass the plain tensor it holds (DTensor: to_local())"
                )
            elif _unreadable(tensor) and any(tensor is output for output in outputs):
                # An input is sent from a resolved copy (``source``); an output's bytes would
                # have to be written negated or conjugated.
                self.fail(
                    "got a negative or conjugate view as an output; resolve_neg() / "
                    "resolve_conj() it"
                )
        if self.device.type not in ("cpu", "cuda"):
            self.fail(f"got a tensor on {self.device}; the backend handles cpu and cuda")
        if any(_shares_elements(t) for t in outputs):
            self.fail("got an output whose elements share memory (an expand()ed view)")

    def fail(self, message: str) -> None:
        if not self.error:
            self.error = f"{self.op} {message}"

    def source(self, tensor: torch.Tensor) -> Bytes:
        """Flat bytes of an input (a contiguous copy first if it is strided, a resolved one if
        it is a lazily negated or conjugated view, whose bytes are not its values)."""
        tensor = _resolved(tensor)
        return flat_bytes(tensor if tensor.is_contiguous() else tensor.contiguous())

    def private_source(self, tensor: torch.Tensor) -> Bytes:
        """Flat bytes of a copy of an input that shares memory with an output (on CUDA a
        device-to-device copy on the caller's stream, so before the collective's ready point;
        on the host one memcpy on this thread, ``host_copy``)."""
        tensor = _resolved(tensor)
        if tensor.is_cuda:
            return flat_bytes(tensor.clone(memory_format=torch.contiguous_format))
        copy = flat_bytes(torch.empty(tensor.shape, dtype=tensor.dtype))
        host_copy(copy, self.source(tensor))
        return copy

    def target(self, tensor: torch.Tensor) -> Bytes:
        """Flat bytes to receive an output into (staged and copied back if it is strided)."""
        if tensor.is_contiguous():
            return flat_bytes(tensor)
        staging = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        self.copy_back.append((tensor, staging))
        return flat_bytes(staging)

    def signature(
        self,
        count: int,
        send: Sequence[int],
        recv: Sequence[int],
        send_layout: int = 0,
        recv_layouts: Sequence[int] = (),
    ) -> Signature:
        if self.error:
            send = recv = [0] * self.n
            send_layout, recv_layouts = 0, ()
        return Signature(
            op=self.op,
            dtype=self.dtype_name,
            device=self.device.type,
            count=count,
            send_bytes=list(send),
            recv_bytes=list(recv),
            error=self.error,
            send_layout=send_layout,
            recv_layouts=list(recv_layouts),
        )


def _dtypes_name(inputs: Sequence[torch.Tensor]) -> str:
    """The signature's dtype of a coalesced AllGather whose inputs mix dtypes: theirs in order,
    e.g. ``int64+float16``, or a digest of that where it does not fit the signature's field
    ("" if they share one: its own name is used)."""
    names = [str(t.dtype).removeprefix("torch.") for t in inputs]
    if len(set(names)) < 2:
        return ""
    joined = "+".join(names)
    if len(joined) <= DTYPE_NAME_BYTES:
        return joined
    return "mixed " + hashlib.blake2b(joined.encode(), digest_size=8).hexdigest()


def _check_output_dtypes(
    b: _Builder, inputs: Sequence[torch.Tensor], outputs: Sequence[Sequence[torch.Tensor]]
) -> None:
    """Each input's outputs must have its dtype (``outputs[k]``: input ``k``'s)."""
    for k, (tensor, slots) in enumerate(zip(inputs, outputs, strict=False)):
        which = f"input {k}" if len(inputs) > 1 else "the input"
        for output in slots:
            if output.dtype != tensor.dtype:
                b.fail(f"{which} has dtype {tensor.dtype} but an output for it {output.dtype}")


def _shares_elements(tensor: torch.Tensor) -> bool:
    """Whether several elements of a dense ``tensor`` are one memory location (a stride of 0
    over more than one element): no result could be written into it. Other layouts, refused
    before, have no strides; an empty tensor receives nothing."""
    if tensor.layout != torch.strided or tensor.is_nested or tensor.numel() == 0:
        return False
    sizes_and_strides = zip(tensor.shape, tensor.stride(), strict=True)
    return any(stride == 0 and size > 1 for size, stride in sizes_and_strides)


def _pieces(data: Bytes, sizes: Sequence[int]) -> list[Bytes]:
    pieces, offset = [], 0
    for size in sizes:
        pieces.append(data[offset : offset + size])
        offset += size
    return pieces


def _may_overlap(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> bool:
    """Whether the bytes of a contiguous tensor of ``inputs`` overlap those of one of
    ``outputs`` (cheap: what ``_clashing`` then checks piece by piece; a strided tensor is sent
    from, or received into, a copy). Sorted, not pairwise: a coalesced call may pass thousands.
    """

    def spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        return sorted(
            (t.data_ptr(), t.data_ptr() + t.nbytes)
            for t in tensors
            if t.nbytes and t.is_contiguous()
        )

    a, b = spans(inputs), spans(outputs)
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        # The span that ends first overlaps no later one of the other list (they start later).
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def _clashing(
    sources: Sequence[Bytes], targets: Sequence[Bytes], own: set[tuple[int, int]]
) -> set[int]:
    """Indices of the sources whose bytes overlap a target's: a peer would read them while this
    rank writes what it receives there. Exempt is this rank's own piece in place (a pair
    (source, target) of ``own`` that is the very same bytes: never written, as FSDP calls its
    AllGather)."""
    spans = sorted(
        (address(buffer), address(buffer) + len(buffer), is_target, k)
        for is_target, buffers in ((False, sources), (True, targets))
        for k, buffer in enumerate(buffers)
        if len(buffer)
    )
    clashing: set[int] = set()
    open_spans: list[tuple[int, bool, int]] = []  # (end, is_target, index), sorted by start
    for start, end, is_target, k in spans:
        open_spans = [span for span in open_spans if span[0] > start]
        for _, other_is_target, other in open_spans:
            if other_is_target == is_target:
                continue
            i, j = (other, k) if is_target else (k, other)
            in_place = (
                (i, j) in own
                and len(sources[i]) == len(targets[j])
                and (address(sources[i]) == address(targets[j]))
            )
            if not in_place:
                clashing.add(i)
        open_spans.append((end, is_target, k))
    return clashing


def _exchange(
    plan: Plan,
    rank: int,
    send: Sequence[Bytes],
    recv: Sequence[Bytes],
    sub: int,
) -> None:
    """Adds the pairwise messages of one send/receive piece per peer (own piece copied)."""
    n = len(send)
    for step in range(1, n):
        # Pairwise order: at step s send to r+s and receive from r-s, spreading the load.
        dst, src = (rank + step) % n, (rank - step) % n
        if len(recv[src]):
            plan.transfers.append(Transfer(src, recv[src], sub, send=False))
        if len(send[dst]):
            plan.transfers.append(Transfer(dst, send[dst], sub, send=True))
    if len(send[rank]):
        _copy_own(plan, recv[rank], send[rank])


def _build_all_to_all_single(
    op: str,
    rank: int,
    world_size: int,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
) -> Plan:
    """Plan of ``all_to_all_single``: rows of dim 0 split by peer (empty splits: even)."""
    b = _Builder(op, world_size, [output, input], [output])
    splits = []
    for name, tensor, given in (
        ("input", input, input_split_sizes),
        ("output", output, output_split_sizes),
    ):
        if tensor.dim() == 0:
            b.fail(f"{name} must have at least one dimension (rows are split along dim 0)")
            splits.append([0] * world_size)
            continue
        rows = tensor.size(0)
        try:
            given = [operator.index(s) for s in given]
        except TypeError:
            b.fail(f"{name} split sizes {list(given)} are not all integers")
            splits.append([0] * world_size)
            continue
        if not given:
            if rows % world_size:
                b.fail(f"{name}.size(0)={rows} is not divisible by the world size {world_size}")
            given = [rows // world_size] * world_size
        elif len(given) != world_size:
            b.fail(f"got {len(given)} {name} split sizes for a group of {world_size} ranks")
        elif min(given) < 0:
            b.fail(f"{name} split sizes contain a negative size: {given}")
        elif sum(given) != rows:
            b.fail(f"{name} split sizes add up to {sum(given)}, not {name}.size(0)={rows}: {given}")
        splits.append(given if len(given) == world_size else [0] * world_size)
    in_row = input.element_size() * math.prod(input.shape[1:])
    out_row = output.element_size() * math.prod(output.shape[1:])
    send_bytes = [s * in_row for s in splits[0]]
    recv_bytes = [s * out_row for s in splits[1]]
    if send_bytes[rank] != recv_bytes[rank]:
        b.fail(f"sends {send_bytes[rank]} bytes to itself but expects {recv_bytes[rank]}")
    plan = Plan(b.signature(1, send_bytes, recv_bytes), result=[output])
    if b.error:
        return plan
    send = _pieces(b.source(input), send_bytes)
    recv = _pieces(b.target(output), recv_bytes)
    if _may_overlap([input], [output]) and _clashing(send, recv, {(rank, rank)}):  # in place
        send = _pieces(b.private_source(input), send_bytes)
    _exchange(plan, rank, send, recv, sub=1)
    plan.copy_back = b.copy_back
    return plan


def _build_all_to_all(
    op: str,
    rank: int,
    world_size: int,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> Plan:
    """Plan of ``all_to_all`` (lists): ``inputs[p]`` goes to peer p, ``outputs[p]`` from it."""
    b = _Builder(op, world_size, [*outputs, *inputs], outputs)
    if len(outputs) != world_size or len(inputs) != world_size:
        b.fail(f"needs {world_size} inputs and outputs, got {len(inputs)} and {len(outputs)}")
        return Plan(b.signature(1, [], []), result=list(outputs))
    send_bytes = [t.numel() * t.element_size() for t in inputs]
    recv_bytes = [t.numel() * t.element_size() for t in outputs]
    if send_bytes[rank] != recv_bytes[rank]:
        b.fail(f"sends {send_bytes[rank]} bytes to itself but expects {recv_bytes[rank]}")
    plan = Plan(b.signature(1, send_bytes, recv_bytes), result=list(outputs))
    if b.error:
        return plan
    send = [b.source(t) for t in inputs]
    recv = [b.target(t) for t in outputs]
    for p in _clashing(send, recv, {(rank, rank)}):
        send[p] = b.private_source(inputs[p])
    _exchange(plan, rank, send, recv, sub=1)
    plan.copy_back = b.copy_back
    return plan


def _build_all_gather(
    op: str,
    rank: int,
    world_size: int,
    outputs: Sequence[Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    options: FreescaleOptions,
    problem: str | None = None,
) -> Plan:
    """Plan of one or more list AllGathers: ``outputs[k][p]`` receives rank p's ``inputs[k]``."""
    result = [t for slots in outputs for t in slots]
    b = _Builder(op, world_size, [*inputs, *result], result, inputs)
    if problem:
        b.fail(problem)
    _check_output_dtypes(b, inputs, outputs)
    if len(outputs) != len(inputs):
        b.fail(f"got {len(inputs)} inputs but {len(outputs)} output lists")
    for slots in outputs:
        if len(slots) != world_size:
            b.fail(f"needs {world_size} outputs per input, got {len(slots)}")
    if b.error:
        return Plan(b.signature(len(inputs), [], []), result=result)
    slot_bytes = [[t.numel() * t.element_size() for t in slots] for slots in outputs]
    return _gather(
        b, rank, inputs, slot_bytes, result, options, lambda k: [b.target(t) for t in outputs[k]]
    )


def _build_all_gather_into_tensor(
    op: str,
    rank: int,
    world_size: int,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    options: FreescaleOptions,
) -> Plan:
    """Plan of one or more AllGathers into single tensors of ``world_size`` times the input."""
    b = _Builder(op, world_size, [*inputs, *outputs], outputs, inputs)
    if len(outputs) != len(inputs):
        b.fail(f"got {len(inputs)} inputs but {len(outputs)} outputs")
    _check_output_dtypes(b, inputs, [[output] for output in outputs])
    for output, tensor in zip(outputs, inputs, strict=False):
        if output.numel() != world_size * tensor.numel():
            b.fail(
                f"output has {output.numel()} elements, expected world size {world_size} x "
                f"input's {tensor.numel()}"
            )
    if b.error:
        return Plan(b.signature(len(inputs), [], []), result=list(outputs))
    slot_bytes = [[t.numel() * t.element_size()] * world_size for t in inputs]
    return _gather(
        b,
        rank,
        inputs,
        slot_bytes,
        list(outputs),
        options,
        lambda k: _even_slices(b.target(outputs[k]), world_size),
    )


def _even_slices(flat: Bytes, parts: int) -> list[Bytes]:
    return _pieces(flat, [len(flat) // parts] * parts)


def _gather(
    b: _Builder,
    rank: int,
    inputs: Sequence[torch.Tensor],
    slot_bytes: Sequence[Sequence[int]],
    result: list[torch.Tensor],
    options: FreescaleOptions,
    targets_of: Callable[[int], list[Bytes]],
) -> Plan:
    n = b.n
    in_bytes = [t.numel() * t.element_size() for t in inputs]
    send_bytes = [sum(in_bytes)] * n
    recv_bytes = [sum(slots[p] for slots in slot_bytes) for p in range(n)]
    for k, slots in enumerate(slot_bytes):
        if slots[rank] != in_bytes[k]:
            b.fail(f"output slot {rank} holds {slots[rank]} bytes but the input has {in_bytes[k]}")
    send_layout, recv_layouts = 0, []
    if len(inputs) > 1:  # one message per peer carries every input: check how it splits
        send_layout = layout(in_bytes)
        recv_layouts = [layout([slots[p] for slots in slot_bytes]) for p in range(n)]
    # The ring needs every rank's piece of one size. Decided from the whole table of sizes (the
    # output slots), not this rank's input, so ranks whose calls agree decide alike; the
    # signature names it, so ranks whose options differ fail validation together.
    ring = (
        not b.error
        and len(inputs) == 1
        and n > 2
        and len(set(slot_bytes[0])) == 1
        and (
            options.allgather == "ring"
            or (options.allgather == "auto" and in_bytes[0] >= options.ring_threshold_bytes)
        )
    )
    if ring:
        b.op = f"{b.op} (ring)"
    plan = Plan(
        b.signature(len(inputs), send_bytes, recv_bytes, send_layout, recv_layouts), result=result
    )
    if b.error:
        return plan
    sources = [b.source(tensor) for tensor in inputs]
    targets_per_input = [targets_of(k) for k in range(len(inputs))]
    every_target = [t for slots in targets_per_input for t in slots]
    own = {(k, k * n + rank) for k in range(len(inputs))}
    overlaps = _may_overlap(inputs, result)
    for k in _clashing(sources, every_target, own) if overlaps else ():
        sources[k] = b.private_source(inputs[k])
    for k, (source, targets) in enumerate(zip(sources, targets_per_input, strict=True)):
        if ring:
            _ring(plan, rank, source, targets, options.chunk_bytes)
        else:
            _exchange(plan, rank, [source] * n, targets, sub=1 + k)
    plan.copy_back = b.copy_back
    return plan


def _ring(
    plan: Plan,
    rank: int,
    source: Bytes,
    targets: Sequence[Bytes],
    chunk_bytes: int,
) -> None:
    n = len(targets)
    size = len(source)
    if size:
        _copy_own(plan, targets[rank], source)
    if n == 1 or size == 0:
        return
    chunks = max(1, min(math.ceil(size / chunk_bytes), (MAX_SUB - 1) // (n - 1)))
    bounds = [size * c // chunks for c in range(chunks + 1)]
    left, right = (rank - 1) % n, (rank + 1) % n
    plan.forwarding = True
    previous: list[Transfer] = []
    for step in range(n - 1):
        recv_piece, send_piece = (rank - step - 1) % n, (rank - step) % n
        current = []
        for c in range(chunks):
            lo, hi = bounds[c], bounds[c + 1]
            sub = 1 + step * chunks + c
            receive = Transfer(left, targets[recv_piece][lo:hi], sub, send=False, chunk=c)
            plan.transfers.append(receive)
            current.append(receive)
            forward = source if step == 0 else targets[send_piece]
            after = previous[c] if step else None
            plan.transfers.append(
                Transfer(right, forward[lo:hi], sub, send=True, after=after, chunk=c)
            )
        previous = current


def all_to_all_single(
    op: str,
    rank: int,
    world_size: int,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    cache: PlanCache | None = None,
) -> Plan:
    """Plan of ``all_to_all_single``: rows of dim 0 split by peer (empty splits: even)."""
    tensors = (input, output)
    try:  # as ints: 1.0 == 1 in a key, and a float split is refused (by the builder)
        extra = (
            tuple(map(operator.index, output_split_sizes)),
            tuple(map(operator.index, input_split_sizes)),
        )
    except TypeError:
        extra, cache = None, None
    return _planned(
        cache,
        op,
        tensors,
        extra,
        [output],
        world_size,
        lambda: _build_all_to_all_single(
            op, rank, world_size, output, input, output_split_sizes, input_split_sizes
        ),
    )


def all_to_all(
    op: str,
    rank: int,
    world_size: int,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    cache: PlanCache | None = None,
) -> Plan:
    """Plan of ``all_to_all`` (lists): ``inputs[p]`` goes to peer p, ``outputs[p]`` from it."""
    tensors = (*inputs, *outputs)
    return _planned(
        cache,
        op,
        tensors,
        len(inputs),
        list(outputs),
        world_size,
        lambda: _build_all_to_all(op, rank, world_size, outputs, inputs),
    )


def all_gather(
    op: str,
    rank: int,
    world_size: int,
    outputs: Sequence[Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    options: FreescaleOptions,
    cache: PlanCache | None = None,
    problem: str | None = None,
) -> Plan:
    """Plan of one or more list AllGathers: ``outputs[k][p]`` receives rank p's ``inputs[k]``;
    ``problem``: what the caller found wrong with the call (every rank raises it)."""
    result = [t for slots in outputs for t in slots]
    tensors = (*inputs, *result)
    return _planned(
        None if problem else cache,
        op,
        tensors,
        tuple(len(s) for s in outputs),
        result,
        world_size,
        lambda: _build_all_gather(op, rank, world_size, outputs, inputs, options, problem),
    )


def all_gather_into_tensor(
    op: str,
    rank: int,
    world_size: int,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    options: FreescaleOptions,
    cache: PlanCache | None = None,
) -> Plan:
    """Plan of one or more AllGathers into single tensors of ``world_size`` times the input."""
    tensors = (*inputs, *outputs)
    return _planned(
        cache,
        op,
        tensors,
        len(inputs),
        list(outputs),
        world_size,
        lambda: _build_all_gather_into_tensor(op, rank, world_size, outputs, inputs, options),
    )
