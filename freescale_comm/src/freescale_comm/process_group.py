"""``ProcessGroupFreescale``: AllGather and AllToAll over UCX, everything else on Gloo / NCCL.

``torch._C._distributed_c10d.Backend`` cannot be subclassed from Python, so the group is a
``dist.ProcessGroup`` subclass that builds a Gloo backend (and an NCCL one where CUDA exists)
from the same store and registers them inside itself: every collective it does not override
runs there by tensor device, also when the caller is C++ (DDP's reducer, functional collectives,
torch.compile). It overrides every AllGather / AllToAll entry point, under both the torch 2.13
names and the torch 2.11 ones (``_allgather_base``, ``alltoall_base``,
``allgather_into_tensor_coalesced``): a name left out silently runs on Gloo / NCCL instead.

The delegated collectives that torch's trampoline for Python process groups (``PyProcessGroup``)
intercepts are overridden too, only to hand them to a plain C++ ``ProcessGroup`` over the same
backends (``_plain``): for a method a Python subclass does not override, that trampoline runs the
C++ base implementation with the GIL still held, and so enters the Gloo backend holding it. Gloo's
worker threads free finished work, whose tensors need the GIL to drop their Python objects, while
holding the lock that every new Gloo collective takes: a rank that issues its next delegated
collective in that instant deadlocks (its peers then time out in that collective).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from freescale_comm import algorithms, directory
from freescale_comm.algorithms import Plan
from freescale_comm.collective import Collective
from freescale_comm.errors import FreescaleError
from freescale_comm.group import GroupContext
from freescale_comm.options import FreescaleOptions
from freescale_comm.point_to_point import AnySourceReceiveWork, GlooBreaker, PointToPointWork
from freescale_comm.work import DelegatedWork, FreescaleWork, aborted_error

BACKEND_NAME = "freescale"


# The backend of this group's own that runs a device's collectives it does not run itself.
_INNER = {"cpu": "gloo", "cuda": "nccl"}


def _elsewhere(group: dist.ProcessGroup) -> frozenset[str]:
    """The devices whose collectives the user gave to another backend in the group's backend
    string (``"cpu:gloo,cuda:freescale"``): c10d hands such a group wholly to this one, which
    runs them on its own Gloo / NCCL backend. Raises where that is not the backend named."""
    try:
        spec = dist.get_backend(group)
    except (ValueError, RuntimeError):  # not made through c10d (a test builds it directly)
        return frozenset()
    devices = set()
    for device, name in BackendConfig(spec).get_device_backend_map().items():
        if name == BACKEND_NAME:
            continue
        if _INNER.get(device) != name:
            raise FreescaleError(
                f"backend {spec!r}: a freescale group runs {device} collectives itself or on "
                f"its own {_INNER.get(device, 'Gloo / NCCL')} backend, not on {name!r}"
            )
        devices.add(device)
    return frozenset(devices)


def _device_type(args: Sequence[Any]) -> str | None:
    """The device type of the first tensor in a collective's arguments (lists nest them)."""
    for arg in args:
        while isinstance(arg, (list, tuple)) and arg:
            arg = arg[0]
        if isinstance(arg, torch.Tensor):
            return arg.device.type
    return None


def _own_unless_elsewhere(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs one of the group's own collectives, or under the same name on its Gloo / NCCL
    backend where the backend string gives its tensors' device to that backend."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: ProcessGroupFreescale, *args: Any, **kwargs: Any) -> Any:
        elsewhere = self._elsewhere
        if elsewhere is None:  # the first call: c10d knows the group's string only now
            elsewhere = self._elsewhere = _elsewhere(self)
        if elsewhere and _device_type(args) in elsewhere:
            return getattr(self._plain, name)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return run


class ProcessGroupFreescale(dist.ProcessGroup):
    """A process group whose AllGather and AllToAll never run on Gloo / NCCL (see module doc).

    Args:
        store: the group's c10d store (already prefixed by c10d for this group).
        rank: this process's rank in the group.
        size: number of ranks in the group.
        timeout: bound on every collective of the group.
        options: how data moves (``FreescaleOptions``).
        invalid_options: why this rank's options were refused, if they were (``options`` are
            then the defaults): the set-up fails on every rank, naming this one.
        world_ranks: the world rank of each of the group's ranks (empty for the world group),
            which its errors name.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        options: FreescaleOptions,
        invalid_options: str | None = None,
        world_ranks: Sequence[int] = (),
    ) -> None:
        super().__init__(rank, size)
        self.options = options
        self.timeout = timeout
        backend_type = dist.ProcessGroup.BackendType
        # This incarnation's keys, the delegates' too: a group made again under the same c10d
        # prefix (init_process_group after destroy, torchrun's restarts) must not read the
        # previous one's addresses.
        keys = directory.incarnation_keys(store, rank, size, timeout)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("freescale/gloo", keys), rank, size, timeout)
        backends: list[tuple[torch.device, Any, Any]] = [
            (torch.device("cpu"), backend_type.GLOO, gloo)
        ]
        default = backend_type.GLOO
        if torch.cuda.is_available() and dist.is_nccl_available():
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            nccl = dist.ProcessGroupNCCL(
                dist.PrefixStore("freescale/nccl", keys), rank, size, nccl_options
            )
            backends.append((torch.device("cuda"), backend_type.NCCL, nccl))
            default = backend_type.NCCL
        self._delegates: list[Any] = [backend for _, _, backend in backends]
        # The same backends also behind a process group that is not a Python subclass: its
        # bindings release the GIL and no trampoline takes it back, so the delegated collectives
        # (``_DELEGATED``) reach Gloo / NCCL without the GIL (see the module docstring).
        self._plain = dist.ProcessGroup(rank, size)
        for group in (self, self._plain):
            for device, kind, backend in backends:
                group._register_backend(device, kind, backend)
            group._set_default_backend(default)
        try:
            self._ctx = GroupContext(
                store, keys, rank, size, timeout, options, invalid_options, world_ranks
            )
        except BaseException:
            for delegate in self._delegates:  # their threads would outlive the failed set-up
                delegate.shutdown()
            raise
        # torch's _set_pg_timeout sets the timeout on the backends it knows (Gloo, NCCL),
        # which every one of them holds: the group's own collectives take it from there.
        if isinstance(getattr(getattr(gloo, "options", None), "_timeout", None), timedelta):
            self._ctx.follow_timeout(lambda: gloo.options._timeout)
        self._rank_size = (rank, size)
        contexts = len(getattr(getattr(gloo, "options", None), "_devices", ())) or 1
        self._gloo_breaker = GlooBreaker(self._plain, contexts, self._ctx)  # ``_point_to_point``
        # The paths of CUDA bytes and the AllGather algorithm for them are the group's, fixed
        # at its creation: decided once here, not on every call.
        ctx = self._ctx
        self._cuda_path = ctx.cuda_path()
        self._ipc_reaches_all = self._cuda_path == "ipc" and len(ctx.ipc_peers) == size - 1
        # On the staging rings or the IPC path with every peer on this host, and in a group
        # spanning hosts where CUDA IPC may carry it (unless allgather="ring": the same choice
        # on every rank, whoever shares its host), the direct algorithm, whose messages each
        # leave with the headers (IPC: every rank reads each piece from its owner); a ring
        # forward would have to wait for its receive's copy.
        self._cuda_gathers_direct = (
            self._cuda_path in ("staged", "ipc") and ctx.all_on_staging_rings
        ) or (options.cuda_path in ("ipc", "auto") and options.allgather != "ring")
        # Host bytes between ranks of one host move through shared memory (the rings, or UCX's
        # cross-memory attach), where a ring's forwarding only serializes the steps: under
        # auto, a group on one host gathers them directly
        # (benchmarks/results/comm_cpu/allgather_one_host/).
        self._host_gathers_direct = options.allgather == "auto" and ctx.one_host
        # Plans by call shape: a call of a shape seen before skips building its plan.
        # (CUDA calls too where CUDA bytes move by IPC to every peer, which takes plans of
        # plain addresses; UCX needs tensors.)
        self._plans = algorithms.PlanCache(ctx.ipc_fits if self._ipc_reaches_all else None)
        self._direct_gather = dataclasses.replace(options, allgather="direct")
        self._elsewhere: frozenset[str] | None = None  # ``_own_unless_elsewhere``

    def name(self) -> str:
        return BACKEND_NAME

    def split_group(self, ranks: Sequence[int], *args: Any, **kwargs: Any) -> None:
        """``dist.split_group`` (``init_device_mesh`` on a group bound to a device calls it):
        refused. The base class would split the inner Gloo / NCCL into a group that runs every
        collective there, and on a group without a store of its own it crashed the process."""
        raise FreescaleError(
            f"freescale group (rank {self.rank()} of {self.size()}): split_group is not "
            "supported; make the subgroup with dist.new_group(ranks, backend='freescale') "
            "(init_device_mesh splits only where init_process_group was given device_id)"
        )

    def _rs(self) -> tuple[int, int]:
        return self._rank_size

    def _gather_options(self, tensors: Sequence[torch.Tensor]) -> FreescaleOptions:
        """The options an AllGather of ``tensors`` is planned with: the direct algorithm where
        ``__init__`` says, for CUDA and for host tensors apart."""
        if tensors and (
            self._cuda_gathers_direct if tensors[0].is_cuda else self._host_gathers_direct
        ):
            return self._direct_gather
        return self.options

    def _own(self, plan: Plan, opts: Any) -> FreescaleWork:
        """Starts ``plan`` (CUDA tensors on the configured path)."""
        device = plan.signature.device
        ctx = self._ctx
        path = self._cuda_path if device == "cuda" else device
        if path == "ipc" and (plan.forwarding or not ctx.ipc_fits(plan)):
            # A ring (allgather="ring"), or descriptors past a header's room: the path of the
            # peers IPC does not reach, with every peer, the same on every rank (their plans
            # agree, and the remote path does not depend on the peers this rank reaches).
            path = ctx.remote_cuda_path()
        if path == "ipc":
            self._to_ipc(plan)
        elif path.startswith("cuda-ipc"):  # a cached plan, made IPC at its template's first use
            plan.ipc, plan.ipc_peers = True, ctx.ipc_peers
        elif path == "staged":
            plan.staged = True
            plan.signature = dataclasses.replace(plan.signature, device="cuda-staged")
        # Written in place, as by an in-place op: autograd must see that saved tensors changed
        # (Gloo's outputs get the same bump; a backward through a stale one raises).
        torch.autograd.graph.increment_version(plan.result)
        # A timeout in the call's options (C++ and ProcessGroup callers; unset: negative)
        # bounds this collective, as on Gloo.
        timeout = getattr(opts, "timeout", None)
        own_s = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
        op = Collective(self._ctx, plan.signature.op, plan, own_s if own_s > 0 else None)
        # c10d sets asyncOp=False when it will wait at once; C++ callers leave the default.
        self._ctx.launch(op, caller_waits=not getattr(opts, "asyncOp", True))
        return FreescaleWork(op)

    def _to_ipc(self, plan: Plan) -> None:
        """Makes ``plan`` an IPC plan, and its template's later plans too (a template is made
        for one group, whose CUDA calls of one shape always take the same path). The bytes of
        the peers IPC does not reach (on other hosts, or of this host without rings) take the
        remote path. The signature names IPC and that remote path whoever this rank reaches:
        the label depends on the options (and under ``auto`` on whether UCX has CUDA), not on
        the peers reached, so ranks with different ``cuda_path`` fail validation rather than
        hang, while ranks that reach different peers by IPC (a rank alone on its host, a pair
        whose rings did not fit in ``/dev/shm``) still agree."""
        ctx = self._ctx
        plan.ipc_peers = ctx.ipc_peers
        remote = ctx.remote_cuda_path()
        plan.signature = dataclasses.replace(plan.signature, device=f"cuda-ipc+{remote}")
        if not self._ipc_reaches_all:
            plan.ipc = bool(plan.ipc_peers)
            plan.staged = remote == "staged"
            plan.direct_peers = plan.ipc and remote == "direct"
            return
        plan.ipc = True
        template = plan.template
        if template is not None:
            template.signature = plan.signature
            template.header = plan.signature.encode(self._rank_size[1])

    # ----------------------------------------------------------------- AllGather
    @_own_unless_elsewhere
    def allgather(
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> FreescaleWork:
        """``dist.all_gather``: ``output_tensors[0][p]`` receives rank p's ``input_tensors[0]``."""
        return self._own(
            algorithms.all_gather(
                "all_gather",
                *self._rs(),
                output_tensors,
                input_tensors,
                self._gather_options(input_tensors),
                self._plans,
            ),
            opts,
        )

    @_own_unless_elsewhere
    def allgather_coalesced(
        self,
        output_lists: Sequence[Sequence[torch.Tensor]],
        input_list: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> FreescaleWork:
        """``dist.all_gather_coalesced``: one list AllGather per input, in one collective;
        ``output_lists[p][k]`` receives rank p's ``input_list[k]``."""
        size, count = self.size(), len(input_list)
        problem = None
        if len(output_lists) == size and all(len(row) == count for row in output_lists):
            by_input = [[output_lists[p][k] for p in range(size)] for k in range(count)]
        else:
            by_input = [list(row) for row in output_lists]
            lengths = sorted({len(row) for row in output_lists})
            problem = (
                f"needs one output list per rank ({size}) of one tensor per input ({count}), "
                f"got {len(output_lists)} list(s) of {' or '.join(map(str, lengths[:4]))}"
                f"{' or more' if len(lengths) > 4 else ''} tensor(s)"
            )
        plan = algorithms.all_gather(
            "all_gather_coalesced",
            *self._rs(),
            by_input,
            input_list,
            self._gather_options(input_list),
            self._plans,
            problem,
        )
        # As Gloo's future: one list per rank, [rank][input]; alone, the list by input.
        plan.value = list(output_lists[0]) if size == 1 else [list(row) for row in output_lists]
        return self._own(plan, opts)

    @_own_unless_elsewhere
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> FreescaleWork:
        """``dist.all_gather_into_tensor`` (torch 2.13 name)."""
        plan = algorithms.all_gather_into_tensor(
            "all_gather_into_tensor",
            *self._rs(),
            [output],
            [input],
            self._gather_options([input]),
            self._plans,
        )
        # (Not for a call whose arguments were refused: every rank must hear of it, nothing
        # may raise here first.)
        accepted = not plan.signature.error and output.dim() > 0
        if getattr(opts, "asyncOp", True) and not output.is_cuda and accepted:
            # Gloo's future and result hold the ranks' pieces (NCCL's the output), made at the
            # call as Gloo makes them; a call torch waits for at once hands out neither.
            plan.value = list(output.chunk(self.size()))
        return self._own(plan, opts)

    @_own_unless_elsewhere
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> FreescaleWork:
        """``dist.all_gather_into_tensor`` (torch 2.11 name)."""
        return self.all_gather_single(output, input, opts)

    @_own_unless_elsewhere
    def all_gather_single_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> FreescaleWork:
        """Coalesced ``all_gather_into_tensor`` (functional collectives, torch.compile)."""
        return self._own(
            algorithms.all_gather_into_tensor(
                "all_gather_into_tensor_coalesced",
                *self._rs(),
                list(outputs),
                list(inputs),
                self._gather_options(inputs),
                self._plans,
            ),
            opts,
        )

    @_own_unless_elsewhere
    def allgather_into_tensor_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> FreescaleWork:
        """Coalesced ``all_gather_into_tensor`` (torch 2.11 name, and 2.13's fallback)."""
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    # ----------------------------------------------------------------- AllToAll
    @_own_unless_elsewhere
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> FreescaleWork:
        """``dist.all_to_all_single``; empty split lists mean even splits (torch 2.13 name)."""
        return self._own(
            algorithms.all_to_all_single(
                "all_to_all_single",
                *self._rs(),
                output,
                input,
                output_split_sizes,
                input_split_sizes,
                self._plans,
            ),
            opts,
        )

    @_own_unless_elsewhere
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> FreescaleWork:
        """``dist.all_to_all_single`` (torch 2.11 name)."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    @_own_unless_elsewhere
    def alltoall(
        self,
        output_tensors: Sequence[torch.Tensor],
        input_tensors: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> FreescaleWork:
        """``dist.all_to_all`` (lists): ``input_tensors[p]`` goes to rank p."""
        return self._own(
            algorithms.all_to_all(
                "all_to_all", *self._rs(), list(output_tensors), list(input_tensors), self._plans
            ),
            opts,
        )

    def paths(self) -> list[dict[str, Any]]:
        """Per peer: how host bytes travel to it (shared-memory ring or UCX) and why."""
        return self._ctx.paths()

    def barrier(self, opts: Any = None) -> Any:
        """``barrier`` on the Gloo backend (entered without the GIL), once the group's own
        collectives started before it have finished: as Gloo's barrier waits for the work
        before it, an asynchronous AllGather / AllToAll's output is written when it returns.
        Their errors are their handles' to raise. A barrier in a callback does not wait for
        them: on the engine thread nothing else would progress them, and a future's callback
        runs at once on one rank (its future was done) and behind later calls on another.

        A barrier for a CUDA device (``dist.barrier`` asks for one wherever CUDA exists) first
        waits on the CPU for the work queued on that device's current stream (as a synchronous
        NCCL barrier does; an asynchronous one waits too), then runs on Gloo as well: NCCL's
        would not end when a peer stops (only at its watchdog's timeout) and would set up NCCL
        on a GPU the ranks may share."""
        ctx = self._ctx
        if not (ctx.engine.is_engine_thread() or ctx.callbacks.running_here()):
            ctx.await_inflight()
        opts = opts if opts is not None else dist.BarrierOptions()
        device = opts.device
        if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.current_stream(device).synchronize()
        opts.device = torch.device("cpu")  # without one, c10d would pick NCCL where it exists
        return self._bounded("barrier", True, self._plain.barrier, opts=opts)

    def _bounded(
        self, name: str, on_gloo: bool, call: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``call(*args, **kwargs)``; where it runs on Gloo, raises at once in an aborted group
        and hands back a handle whose waits end once the group is aborted (Gloo's last until
        its timeout where a peer stopped) or a peer destroyed the group without running it.
        NCCL's handles are NCCL's: its own watchdog bounds them."""
        if not on_gloo:
            return call(*args, **kwargs)
        error = aborted_error(self._ctx, name, before_call=True)
        if error is not None:
            raise error
        return self._ctx.gloo_call(
            lambda: call(*args, **kwargs),
            name,
            lambda work, number: DelegatedWork(work, self._ctx, name, number),
        )

    # ----------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Lets the collectives in flight finish (``GroupContext.close``), then releases the
        UCX worker and threads."""
        self._gloo_breaker.close()
        self._ctx.close()
        for delegate in self._delegates:
            # The Gloo / NCCL backends built here are c10d's to shut down only through us.
            delegate.shutdown()

    def abort(self) -> None:
        """Tells every rank the group is aborted, then shuts down like ``shutdown``."""
        self._ctx.abort(f"rank {self.rank()}: abort() was called")
        self._gloo_breaker.close()
        self._ctx.close(wait_for_callbacks=False)


# The delegated collectives that ``PyProcessGroup`` (torch's trampoline) intercepts, under their
# torch 2.13 and 2.11 names: each must be overridden here, or it enters Gloo / NCCL holding the
# GIL (module docstring); and those that Python callers reach by name (``dist.reduce`` ...),
# which C++ callers reach on the backend directly: overridden so that a wait for them on Gloo
# ends once the group is aborted (``work.DelegatedWork``).
_DELEGATED = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter_single",
    "_reduce_scatter_base",
)
# Their Gloo handles cannot be waited on in steps, as ``work.DelegatedWork``'s are
# (``point_to_point``); ``recv_anysource`` is reached by name (``dist.recv`` from any source).
_POINT_TO_POINT = ("send", "recv", "recv_anysource")


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a collective's arguments (tensors, lists of them, lists of lists)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _delegated(name: str) -> Any:
    """A method that runs ``name`` on the group's plain twin (``_plain``), GIL released; on
    Gloo (CPU tensors), its handle's waits end once the group is aborted, and a group aborted
    before the call raises at once."""

    def method(self: ProcessGroupFreescale, *args: Any, **kwargs: Any) -> Any:
        tensor = _first_tensor(args)
        on_gloo = tensor is not None and tensor.device.type == "cpu"
        return self._bounded(name, on_gloo, getattr(self._plain, name), *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}`` on the Gloo / NCCL backend, entered without the GIL."
    return method


def _point_to_point(name: str) -> Any:
    """A method that runs ``name`` on the group's plain twin (``_plain``), GIL released; on
    Gloo (CPU tensors), its handle's wait ends once the group is aborted. Posted before
    anything else: on a host whose cores are busy, microseconds more before a receive is posted
    made Gloo's round trips 30-50% slower."""
    peered = name != "recv_anysource"

    def method(self: ProcessGroupFreescale, *args: Any, **kwargs: Any) -> Any:
        if peered:  # c10d checks a subgroup's ranks, not the world's; Gloo crashes on them
            peer = args[1] if len(args) > 1 else kwargs.get("dstRank", kwargs.get("srcRank"))
            size = self._ctx.size
            if not 0 <= peer < size:
                raise ValueError(
                    f"{self._ctx.who}: {name} {'to' if name == 'send' else 'from'} rank "
                    f"{peer}: the group's ranks are 0 to {size - 1}"
                )
        try:
            work = getattr(self._plain, name)(*args, **kwargs)
        except RuntimeError as err:  # Gloo's pairs, failed by an abort (``point_to_point``)
            error = aborted_error(self._ctx, name, err)
            if error is None:
                raise
            raise error from err
        # (tensors, peer, tag), as c10d passes them: each line here costs microseconds per call
        # on a busy host (``_first_tensor`` is for the collectives' shapes).
        tensors = args[0] if args else kwargs["tensors"]
        if not tensors[0].is_cpu:
            return work
        handle = AnySourceReceiveWork if name == "recv_anysource" else PointToPointWork
        return handle(work, self._ctx, name)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}`` on the Gloo / NCCL backend, entered without the GIL."
    return method


for _name in _DELEGATED:
    # A name this torch lacks is one its trampoline cannot call either.
    if hasattr(dist.ProcessGroup, _name):
        setattr(ProcessGroupFreescale, _name, _delegated(_name))
for _name in _POINT_TO_POINT:
    if hasattr(dist.ProcessGroup, _name):
        setattr(ProcessGroupFreescale, _name, _point_to_point(_name))


def create_process_group(backend_options: Any, pg_options: Any) -> ProcessGroupFreescale:
    """The creator c10d calls (``extended_api=True``) for every group of this backend.

    Args:
        backend_options: c10d's ``_DistributedBackendOptions`` (store, group rank and size,
            timeout, the group's world ranks).
        pg_options: the ``pg_options`` given to ``init_process_group`` / ``new_group``: None or a
            ``FreescaleOptions``.
    """
    # Options refused here, raised on this rank alone, would leave the others waiting for it in
    # the set-up until the group timeout: the set-up goes on with the defaults and fails on
    # every rank, naming this one (``GroupContext``).
    options, invalid = FreescaleOptions(), None
    if pg_options is not None and not isinstance(pg_options, FreescaleOptions):
        invalid = (
            f"TypeError: pg_options of the freescale backend must be a FreescaleOptions, got "
            f"{pg_options!r}"
        )
    else:
        try:
            options = FreescaleOptions.from_env(pg_options)
        except ValueError as err:
            invalid = f"ValueError: {err}"
    return ProcessGroupFreescale(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout,
        options,
        invalid,
        getattr(backend_options, "global_ranks_in_group", ()),
    )
