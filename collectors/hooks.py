"""Every collective of the job, seen without touching the job's code.

Role in the data flow: part of the in-job collector, installed by ``Collector.from_env`` (or
``Interception(col).install()``). It gives the collective calls that torch itself issues the same
record as ``col.dist``: an ``enqueued`` marker at the call (the rank's arrival), a communication
span, and a ``completed`` marker once the operation is done. Four doors cover what a job issues:

- **torch.distributed functions** (``all_reduce``, ``all_gather_single``/``all_gather_into_tensor``,
  ``reduce_scatter_single``/``reduce_scatter_tensor``, ``all_gather``, ``broadcast``,
  ``all_to_all_single``, ``barrier``): wrapped where torch looks them up (``torch.distributed`` and
  ``torch.distributed.distributed_c10d``). FSDP2 issues its all-gathers, reduce-scatters and HSDP
  all-reduces through them. An asynchronous call ends its span when the work's future completes:
  a callback on ``work.get_future()``, which never waits, so overlap is kept and the caller gets
  torch's own work object back.
- **Functional collectives** (``torch.distributed._functional_collectives``: what DTensor, tensor
  parallelism and ``loss_parallel`` call): the span ends at ``wait_tensor`` on the result, or when
  the result is freed unwaited.
- **DistributedDataParallel's gradient all-reduce**, issued by its C++ reducer and invisible to
  Python: a DDP model that has no communication hook of its own gets, at its first forward, the
  hook torch ships as the default (``default_hooks.allreduce_hook``: divide by the group size,
  ``all_reduce`` asynchronously, hand DDP the future), whose ``all_reduce`` the first door sees.
  DDP keeps its bucketing and its overlap of communication with backward. A job that registers
  its own hook keeps it; a Python hook's ``torch.distributed`` calls are seen, a built-in (C++)
  one's are not. The model DDP wraps also gets top-level ``forward`` and ``backward`` spans
  (:func:`megascope.collectors.modules.time_model`) unless the job times its compute itself: without
  them a rank slow in its compute could not be told from one that pauses outside it. So does an
  FSDP2 model: ``fully_shard`` is wrapped, and the outermost forward of the modules it shards (the
  root's) is timed; and an FSDP1 model: ``FullyShardedDataParallel.forward`` is wrapped, and of
  the nested instances the outermost module's forward is timed.

- **Point-to-point**: ``batch_isend_irecv`` (what pipeline schedules issue), the batches of
  ``torch.distributed.pipelining``'s schedules (``_batch_p2p``, which issues a batch of sends or
  of receives alone op by op), Megatron-core's ``_p2p_ops`` (its schedules' sends and receives
  with ``overlap_p2p_comm``) and the blocking ``send``/``recv``, as send/recv spans with their
  peer's global rank. ``isend``/``irecv`` called on their own are not wrapped: ``P2POp`` checks its ``op`` against
  those very functions, and a job holding the original would then be refused; time such calls with
  ``col.dist``.

A call made through ``col.dist`` is recorded once.

Example::

    col = Collector(CollectorConfig(run_dir=run), rank=rank, world_size=world)
    interception = Interception(col).install()
    ...   # DDP / FSDP2 / DTensor training
    interception.uninstall()            # Collector.close() does this too
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megascope.collectors.contexts import NOOP

from megascope.schema import CollectiveOp, SpanKind

if TYPE_CHECKING:
    from megascope.collectors.collector import Collector

log = logging.getLogger(__name__)

# Set while a collector-issued or already-recorded call runs on this thread: the torch calls it
# makes inside (all_gather_single -> all_gather_into_tensor, col.dist -> torch.distributed) are
# not recorded twice.
_TLS = threading.local()
# The attribute of an FSDP2 parameter group that holds its all-gathers until their wait.
_HELD_ATTR = "_megascope_held"
# FSDP2's reduce-scatters held for a wait at most: more (a model whose groups never wait for
# them) are written as they are.
_MAX_PENDING_REDUCTIONS = 64


def inside() -> bool:
    return getattr(_TLS, "busy", False)



def _call_recorded(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], handle: Any) -> Any:
    """Run the job's call with the recording guard up (no second record of what it calls); a call
    that raises abandons its handle, so no completion is written."""
    _TLS.busy = True
    try:
        return original(*args, **kwargs)
    except BaseException:
        handle.abandon()
        raise
    finally:
        _TLS.busy = False

class _Busy:
    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        self._prev = getattr(_TLS, "busy", False)
        _TLS.busy = True

    def __exit__(self, *exc: object) -> None:
        _TLS.busy = self._prev


busy = _Busy

# torch.distributed function -> (op, index and name of the tensor whose bytes count, index of group,
# index of async_op) in its signature.
_DIST_FUNCS: dict[str, tuple[CollectiveOp, int, str, int, int]] = {
    "all_reduce": (CollectiveOp.ALL_REDUCE, 0, "tensor", 2, 3),
    "all_gather_single": (CollectiveOp.ALL_GATHER, 1, "input", 2, 3),
    "all_gather_into_tensor": (CollectiveOp.ALL_GATHER, 1, "input_tensor", 2, 3),
    "all_gather": (CollectiveOp.ALL_GATHER, 1, "tensor", 2, 3),
    "reduce_scatter_single": (CollectiveOp.REDUCE_SCATTER, 1, "input", 3, 4),
    "reduce_scatter_tensor": (CollectiveOp.REDUCE_SCATTER, 1, "input", 3, 4),
    "reduce_scatter": (CollectiveOp.REDUCE_SCATTER, 0, "output", 3, 4),
    "broadcast": (CollectiveOp.BROADCAST, 0, "tensor", 2, 3),
    "all_to_all_single": (CollectiveOp.ALL_TO_ALL, 1, "input", 4, 5),
    "barrier": (CollectiveOp.BARRIER, -1, "", 0, 1),
}

# Functional collectives -> (op, index of group in the signature; the tensor is always the first).
_FUNCOL_FUNCS: dict[str, tuple[CollectiveOp, int]] = {
    "all_reduce": (CollectiveOp.ALL_REDUCE, 2),
    "all_gather_single": (CollectiveOp.ALL_GATHER, 2),
    "reduce_scatter_single": (CollectiveOp.REDUCE_SCATTER, 2),
    "all_to_all_single": (CollectiveOp.ALL_TO_ALL, 3),
    "broadcast": (CollectiveOp.BROADCAST, 2),
}


# Megatron-core's module of pipeline sends and receives, and the requests its _p2p_ops returns:
# (key: tensor_<key> is the tensor, <key> the request; the keyword of the peer's global rank; a send).
_MEGATRON_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_MEGATRON_P2P_OPS = (("send_next", "next_pipeline_rank", True), ("recv_prev", "prev_pipeline_rank", False),
                     ("send_prev", "prev_pipeline_rank", True), ("recv_next", "next_pipeline_rank", False))


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if 0 <= index < len(args) else default


def _nbytes(tensor: Any) -> int | None:
    try:
        if isinstance(tensor, list | tuple):
            return sum(int(t.numel() * t.element_size()) for t in tensor)
        return int(tensor.numel() * tensor.element_size())
    except Exception:
        return None


def _waits_for_reductions(group: Any) -> bool:
    """Whether this FSDP2 parameter group's ``post_backward`` makes the compute stream wait for the
    reduce-scatters issued before it: where it reduces (``reduce_grads``), and, where a module has
    several groups, in the last of them."""
    if not getattr(group, "reduce_grads", True):
        return False
    index, count = getattr(group, "_param_group_index", None), getattr(group, "_num_param_groups", None)
    return not (isinstance(index, int) and isinstance(count, int) and index != count - 1)


def _issue_holding(keep: Callable[[list[Any]], None], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``; the blocking calls it issues on a stream of their own are held
    (:meth:`Collector.hold`) and handed to ``keep`` once it returns or raises."""
    outer = getattr(_TLS, "held", None)
    held: list[Any] = []
    _TLS.held = held
    try:
        return call(*args, **kwargs)
    finally:
        _TLS.held = outer
        if held:
            keep(held)


def _waiting_for(held: list[Any], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, which makes the caller's stream wait for the ``held`` calls: their
    waits stamped before it, their spans written after."""
    for handle in held:
        handle.waiting()
    try:
        return call(*args, **kwargs)
    finally:
        for handle in held:
            _end_quietly(handle)


def _end_quietly(handle: Any) -> None:
    try:
        handle.end()
    except Exception:
        log.debug("megascope: ending an intercepted call's span failed", exc_info=True)


def _end_on_future(handle: Any, fut: Any) -> None:
    """A future's callback: the call completed, or failed (a timeout, an abort), which is no
    completion: the lone ``enqueued`` marker is then the trail."""
    try:
        fut.value()  # ready: returns at once, or raises the operation's error
    except BaseException:
        handle.abandon()
        return
    _end_quietly(handle)


def _like(wrapper: Callable[..., Any], original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``wrapper`` dressed as the torch function it stands in for (name, doc, ``__wrapped__``)."""
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(original, "__name__", name)
    wrapper.__doc__ = original.__doc__
    return wrapper


def _global_peer(peer: Any, group: Any, group_peer: Any) -> int | None:
    """The global rank of a point-to-point peer given as a global rank or as a rank in ``group``."""
    if peer is not None:
        return int(peer)
    if group_peer is None:
        return None
    import torch.distributed as dist

    return int(dist.get_global_rank(group, group_peer))


class _Together:
    """The handles of one batch of point-to-point calls that a single work completes (or that one
    failing call abandons)."""

    __slots__ = ("_handles",)

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def end(self) -> None:
        for h in self._handles:
            _end_quietly(h)

    def abandon(self) -> None:
        for h in self._handles:
            h.abandon()


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` outside any graph ``torch.compile`` traces (see megascope.collectors.modules)."""
    from megascope.collectors.modules import eager

    return eager(fn)  # type: ignore[no-any-return]


class Interception:
    """Wraps torch's collective entry points for one collector; ``install()`` / ``uninstall()``."""

    def __init__(self, collector: Collector) -> None:
        self._col = weakref.ref(collector)
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
        self._funcol_groups: dict[Any, str] = {}
        self._pending: Any = None  # result tensor of a functional collective -> its handle
        self.installed = False
        self.ddp_hooks = 0  # DDP models given the recording all-reduce hook
        self._model_hooks: list[Any] = []  # forward hooks timing the models DDP and FSDP wrap
        self._fsdp_timer: Any = None  # one timer for every module FSDP (1 or 2) shards
        self.no_future = 0  # asynchronous calls whose work had no future: ended at launch
        self._ddp_register: Callable[..., Any] = lambda *args: None
        self._megatron = False  # Megatron-core's data-parallel wrappers looked for
        self._pipelining = False  # torch.distributed.pipelining's schedules looked for
        self._megatron_p2p = False  # Megatron-core's pipeline sends and receives looked for

    # ------------------------------------------------------------------ install
    def install(self) -> Interception:
        if self.installed:
            return self
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, spec in _DIST_FUNCS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap_dist(original, name, spec)
            for owner in (dist, c10d):
                if getattr(owner, name, None) is original:
                    self._patch(owner, name, wrapped)
        for name, is_send in (("send", True), ("recv", False)):
            original = getattr(c10d, name, None)
            if original is not None:
                wrapped = self._wrap_p2p(original, is_send)
                for owner in (dist, c10d):
                    if getattr(owner, name, None) is original:
                        self._patch(owner, name, wrapped)
        original = getattr(c10d, "batch_isend_irecv", None)
        if original is not None:
            wrapped = self._wrap_batch_p2p(original, dist)
            for owner in (dist, c10d):
                if getattr(owner, "batch_isend_irecv", None) is original:
                    self._patch(owner, "batch_isend_irecv", wrapped)
        self._install_funcol()
        self._install_ddp()
        self._install_fsdp()
        self._install_fsdp_waits()
        self._install_fsdp1()
        self.install_late()
        self._rebind_copies(dist, c10d)
        self.installed = True
        return self

    def install_late(self) -> None:
        """What can only be wrapped once the job has imported it (the collector never imports a
        training library itself): called at install and again at the first step."""
        if not self._megatron and "megatron.core" in sys.modules:
            self._megatron = True
            self._install_megatron()
        if not self._megatron_p2p and _MEGATRON_P2P in sys.modules:
            self._megatron_p2p = True
            self._install_megatron_p2p()
        if not self._pipelining and "torch.distributed.pipelining.schedules" in sys.modules:
            self._pipelining = True
            self._install_pipelining()

    def _rebind_copies(self, *doors: Any, torch_too: bool = True) -> None:
        """Point the copies other modules took of the wrapped functions at the wrappers.

        A library may bind a collective once at import (Megatron's tensor-parallel mappings and
        gradient buffers keep ``torch.distributed.all_gather_into_tensor`` and
        ``reduce_scatter_tensor`` in module variables); imported before the collector, its calls
        would bypass the doors above. Every loaded module's variables that hold one of the
        originals now hold its wrapper (restored by ``uninstall``). Modules imported later look
        the function up in torch.distributed and get the wrapper anyway. ``torch_too=False``
        leaves torch's own modules their binding.
        """
        wrapped: dict[int, Any] = {}
        for owner, name, original in self._saved:
            if owner in doors:
                wrapped[id(original)] = getattr(owner, name)
        if not wrapped:
            return
        skip = {id(d) for d in doors}
        for key, module in list(sys.modules.items()):
            if module is None or id(module) in skip or key.startswith("megascope"):
                continue
            if not torch_too and key.split(".", 1)[0] == "torch":  # torchtitan's are rebound
                continue
            try:
                items = [(k, v) for k, v in vars(module).items() if id(v) in wrapped]
            except Exception:  # an object in sys.modules without a plain __dict__
                continue
            for name, value in items:
                if value is not wrapped[id(value)]:
                    self._patch(module, name, wrapped[id(value)])

    def uninstall(self) -> None:
        self._megatron = self._pipelining = self._megatron_p2p = False
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        for handle in self._model_hooks:
            handle.remove()
        self._model_hooks.clear()
        self.installed = False

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # ------------------------------------------------------------------ torch.distributed
    def _wrap_dist(self, original: Callable[..., Any], name: str,
                   spec: tuple[CollectiveOp, int, str, int, int]) -> Callable[..., Any]:
        op, t_index, t_name, g_index, a_index = spec
        col_ref = self._col
        interception = self

        def recorded(*args: Any, **kwargs: Any) -> Any:
            col = col_ref()
            if col is None or not col._active or getattr(_TLS, "busy", False):
                return original(*args, **kwargs)
            handle: Any = NOOP
            async_op = False
            try:
                async_op = bool(_arg(args, kwargs, a_index, "async_op", False))
                group = _arg(args, kwargs, g_index, "group")
                nbytes = 0 if t_index < 0 else _nbytes(_arg(args, kwargs, t_index, t_name))
                handle = col.comm_begin(op=op, group=col.group_id(group), bytes=nbytes, name=f"{name}")
            except Exception:
                col._internal_error("intercepted call")
            result = _call_recorded(original, args, kwargs, handle)
            if async_op and result is not None:
                interception._end_on_completion(result, handle)
            else:
                held = getattr(_TLS, "held", None)
                if held is not None and col.hold(handle):
                    held.append(handle)
                else:
                    handle.end()
            return result

        return _like(recorded, original, name)

    # ------------------------------------------------------------------ point-to-point
    def _wrap_p2p(self, original: Callable[..., Any], is_send: bool) -> Callable[..., Any]:
        """Blocking ``send(tensor, dst, group, tag, group_dst)`` / ``recv(tensor, src, ...)``. A
        receive from any source (no ``src``) is not recorded: its peer is known only afterwards."""
        col_ref = self._col
        key, group_key = ("dst", "group_dst") if is_send else ("src", "group_src")

        def recorded(*args: Any, **kwargs: Any) -> Any:
            col = col_ref()
            if col is None or not col._active or getattr(_TLS, "busy", False):
                return original(*args, **kwargs)
            handle: Any = NOOP
            try:
                group = _arg(args, kwargs, 2, "group")
                peer = _global_peer(_arg(args, kwargs, 1, key), group, _arg(args, kwargs, 4, group_key))
                if peer is not None:
                    handle = col.comm_begin(op=CollectiveOp.SEND if is_send else CollectiveOp.RECV,
                                            group=col.group_id(group), bytes=_nbytes(_arg(args, kwargs, 0, "tensor")),
                                            kind=SpanKind.SEND if is_send else SpanKind.RECV, peer=peer)
            except Exception:
                col._internal_error("intercepted point-to-point call")
            result = _call_recorded(original, args, kwargs, handle)
            handle.end()
            return result

        return _like(recorded, original, "send" if is_send else "recv")

    def _wrap_batch_p2p(self, original: Callable[..., Any], dist: Any) -> Callable[..., Any]:
        """``batch_isend_irecv(ops)``, what pipeline schedules issue: a send or recv span per op, all
        arriving at the call, each ended when its work completes (one work for the whole batch, as
        NCCL's coalesced batch returns, ends them all)."""
        col_ref = self._col
        interception = self

        def recorded(p2p_op_list: Any, *args: Any, **kwargs: Any) -> Any:
            col = col_ref()
            if col is None or not col._active or getattr(_TLS, "busy", False):
                return original(p2p_op_list, *args, **kwargs)
            handles: list[Any] = []
            try:
                for p2p in p2p_op_list:
                    is_send = p2p.op in (dist.isend, dist.send) or getattr(p2p.op, "__name__", "") in ("isend", "send")
                    peer = _global_peer(p2p.peer, p2p.group, getattr(p2p, "group_peer", None))
                    handles.append(col.comm_begin(
                        op=CollectiveOp.SEND if is_send else CollectiveOp.RECV, group=col.group_id(p2p.group),
                        bytes=_nbytes(p2p.tensor), kind=SpanKind.SEND if is_send else SpanKind.RECV, peer=peer))
            except Exception:
                col._internal_error("intercepted batch_isend_irecv")
                for h in handles:
                    h.abandon()
                handles = []
            works = _call_recorded(original, (p2p_op_list, *args), kwargs, _Together(handles))
            if handles:
                if works is not None and len(works) == len(handles):
                    for work, handle in zip(works, handles, strict=True):
                        interception._end_on_completion(work, handle)
                elif works:
                    interception._end_on_completion(works[-1], _Together(handles))
                else:
                    for h in handles:
                        h.end()
            return works

        return _like(recorded, original, "batch_isend_irecv")

    def _install_pipelining(self) -> None:
        """``torch.distributed.pipelining``'s schedules send and receive through ``_batch_p2p``, which
        (in torch 2.13) issues a batch of sends alone or of receives alone op by op, through
        ``isend``/``irecv`` (not wrapped, see the module's notes), and a mixed batch through
        ``batch_isend_irecv``. It is wrapped as ``batch_isend_irecv`` is, so that every op gets its
        span once: without it a later stage's wait for its first activations, and a stage's last
        sends, were not recorded, and that wait read as the stage's own time."""
        import torch.distributed as dist

        schedules = sys.modules.get("torch.distributed.pipelining.schedules")
        original = getattr(schedules, "_batch_p2p", None)
        if schedules is None or not callable(original):
            return
        self._patch(schedules, "_batch_p2p", self._wrap_batch_p2p(original, dist))

    def _end_on_completion(self, work: Any, handle: Any) -> None:
        """End the span when the work completes, without waiting: a callback on its future.

        On gloo the callback runs on the backend's thread when the operation finishes; on NCCL the
        future is ready at launch and the callback runs on a stream that waits for the operation,
        so the end stamp (a device event) is its completion.
        """
        if handle is NOOP:
            return
        try:
            work.get_future().then(lambda fut: _end_on_future(handle, fut))
        except Exception:
            # A work without a future: its completion cannot be seen without waiting. Ending now
            # keeps the trail honest about arrival; its duration is the launch only.
            self.no_future += 1
            handle.end()

    # ------------------------------------------------------------------ functional collectives
    def _install_funcol(self) -> None:
        try:
            import torch.distributed._functional_collectives as funcol
            from torch.utils.weak import WeakIdKeyDictionary
        except ImportError:
            return
        self._pending = WeakIdKeyDictionary()
        for name, (op, g_index) in _FUNCOL_FUNCS.items():
            original = getattr(funcol, name, None)
            if original is not None:
                self._patch(funcol, name, self._wrap_funcol(original, name, op, g_index))
        original_wait = getattr(funcol, "wait_tensor", None)
        if original_wait is not None:
            self._patch(funcol, "wait_tensor", self._wrap_wait(original_wait))

    def _funcol_group(self, col: Collector, group: Any) -> str:
        try:
            key: Any = group if not isinstance(group, list) else tuple(group)
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._funcol_groups:
            return self._funcol_groups[key]
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        name = str(funcol._resolve_group_name(group))
        known = col._groups_by_name.get(name)
        if known is not None:
            gid = known.id
        else:
            gid = col.group_id(c10d._resolve_process_group(name))  # type: ignore[arg-type]
        if key is not None and len(self._funcol_groups) < 1024:
            self._funcol_groups[key] = gid
        return gid

    def _wrap_funcol(self, original: Callable[..., Any], name: str, op: CollectiveOp,
                     g_index: int) -> Callable[..., Any]:
        col_ref = self._col
        interception = self

        def recorded(*args: Any, **kwargs: Any) -> Any:
            col = col_ref()
            if col is None or not col._active or getattr(_TLS, "busy", False):
                return original(*args, **kwargs)
            handle: Any = NOOP
            try:
                tensor = args[0] if args else kwargs.get("self")
                group = _arg(args, kwargs, g_index, "group")
                handle = col.comm_begin(op=op, group=interception._funcol_group(col, group), bytes=_nbytes(tensor),
                                        name=f"funcol.{name}")
            except Exception:
                col._internal_error("intercepted functional collective")
            result = _call_recorded(original, args, kwargs, handle)
            interception._pend(result, handle)
            return result

        return _like(recorded, original, name)

    def _pend(self, result: Any, handle: Any) -> None:
        if handle is NOOP:
            return
        elem = getattr(result, "elem", None)  # an AsyncCollectiveTensor: waited at first use
        if elem is None or self._pending is None:
            handle.end()  # already waited (tracing, or torch waited itself)
            return
        try:
            self._pending[elem] = handle
            # A result dropped unwaited never blocks anyone: end its span rather than leave a
            # call that looks entered and never completed.
            # (The wrapper, not its tensor: torch's registry of unwaited work keeps the tensor.)
            weakref.finalize(result, _end_quietly, handle)
        except Exception:
            handle.end()

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        interception = self

        def wait_tensor(tensor: Any) -> Any:
            pending = interception._pending
            handle = pending.pop(tensor, None) if pending is not None else None
            if handle is not None:
                handle.waiting()
            result = original(tensor)
            if handle is not None:
                _end_quietly(handle)
            return result

        wait_tensor.__wrapped__ = original  # type: ignore[attr-defined]
        wait_tensor.__doc__ = original.__doc__
        return wait_tensor

    # ------------------------------------------------------------------ DDP
    def _install_ddp(self) -> None:
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
        except ImportError:
            return
        original_forward = DDP.forward
        original_register = DDP.register_comm_hook
        original_builtin = DDP._register_builtin_comm_hook
        self._ddp_register = original_register

        first = _eager(self._ddp_first_forward)

        def forward(model: Any, *inputs: Any, **kwargs: Any) -> Any:
            # An attribute, which Dynamo guards where torch.compile traces this: once it is set,
            # the compiled forward calls nothing of ours.
            if getattr(model, "_megascope_ready", False) is not True:
                first(model)
            return original_forward(model, *inputs, **kwargs)

        def register_comm_hook(model: Any, state: object, hook: Callable[..., Any]) -> None:
            model.__dict__["_megascope_seen"] = True  # the job's own hook: keep it
            return original_register(model, state, hook)

        def register_builtin_comm_hook(model: Any, comm_hook_type: Any) -> None:
            model.__dict__["_megascope_seen"] = True
            return original_builtin(model, comm_hook_type)

        forward.__wrapped__ = original_forward  # type: ignore[attr-defined]
        register_comm_hook.__wrapped__ = original_register  # type: ignore[attr-defined]
        register_comm_hook.__doc__ = original_register.__doc__
        self._patch(DDP, "forward", forward)
        self._patch(DDP, "register_comm_hook", register_comm_hook)
        self._patch(DDP, "_register_builtin_comm_hook", register_builtin_comm_hook)

    def _ddp_first_forward(self, model: Any) -> None:
        """At a DDP model's first forward: its spans and its recording all-reduce hook."""
        self._time_ddp(model)
        self._hook_ddp(model)
        model.__dict__["_megascope_ready"] = True

    def _time_ddp(self, model: Any) -> None:
        """Forward and backward spans of the model DDP wraps (megascope.collectors.modules.time_model),
        from its first forward; DDP's own work around it (buffer broadcasts) stays outside them.
        Once a model: where ``torch.compile`` traces DDP's forward, Dynamo does not keep the check
        before the call, which then comes at every forward."""
        if "_megascope_timed" in model.__dict__:
            return
        model.__dict__["_megascope_timed"] = True
        self._attach_model_timer(model.module, shared=False, what="DDP model spans")

    # ------------------------------------------------------------------ FSDP2
    def _install_fsdp(self) -> None:
        """``fully_shard`` wrapped where torch exports it, and in the job's modules that imported it
        before the collector (``from torch.distributed.fsdp import fully_shard``): every module it
        shards gets the hooks of one shared timer, which times the outermost forward (the root's:
        FSDP2 models are sharded layer by layer, then as a whole) as :func:`time_model` does.
        torch's own modules keep their binding; ``fully_shard``'s attributes (``state``) are kept."""
        owners = []
        for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
            try:
                owners.append(importlib.import_module(name))
            except Exception:  # an older torch, or a build without distributed
                continue
        original = next((o.fully_shard for o in owners if callable(getattr(o, "fully_shard", None))), None)
        if original is None:
            return
        interception = self

        def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(module, *args, **kwargs)
            interception._time_fsdp(module)
            return result

        functools.update_wrapper(fully_shard, original)
        doors = [owner for owner in owners if getattr(owner, "fully_shard", None) is original]
        for owner in doors:
            self._patch(owner, "fully_shard", fully_shard)
        self._rebind_copies(*doors, torch_too=False)

    def _install_fsdp_waits(self) -> None:
        """FSDP2 gathers a layer's parameters on a stream of its own, without waiting (the calls
        block that stream alone), often a layer ahead (prefetching), and makes the compute stream
        wait for them where the layer's hook needs them (``FSDPParamGroup.wait_for_unshard``). On
        GPU each such all-gather gets a ``<name>:wait`` span there, as an asynchronous call's
        wait: from where the compute stream came to need it to its completion. Without it, the
        gap from one all-gather to the next on their own stream read as the rank's own work and the
        compute the gathers overlapped was lost: on 2x H200 FSDP2 jobs whose rank paused 50 ms,
        the what-if said 23.4 ms a step where the healthy runs took 26.3 ms."""
        cls = None
        for name in ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                     "torch.distributed._composable.fsdp._fsdp_param_group"):
            try:
                cls = getattr(importlib.import_module(name), "FSDPParamGroup", None)
            except Exception:  # an older torch, or a build without distributed
                continue
            if cls is not None:
                break
        if cls is not None and callable(getattr(cls, "unshard", None)) and callable(
                getattr(cls, "wait_for_unshard", None)):
            self.hold_until_waited(cls, "unshard", "wait_for_unshard")
        if cls is not None and callable(getattr(cls, "post_backward", None)) and callable(
                getattr(cls, "finalize_backward", None)):
            self.hold_reductions(cls)

    def hold_until_waited(self, cls: Any, issue: str, wait: str) -> None:
        """``cls.<issue>`` issues blocking calls on a stream of their own, ``cls.<wait>`` makes the
        caller's stream wait for them: the calls' spans are held from the one to the other
        (:meth:`Collector.hold`), and the wait stamped where the second begins."""
        col_ref = self._col
        original_issue, original_wait = getattr(cls, issue), getattr(cls, wait)

        def issued(owner: Any, *args: Any, **kwargs: Any) -> Any:
            col = col_ref()
            if col is None or not col._active:
                return original_issue(owner, *args, **kwargs)
            return _issue_holding(lambda held: owner.__dict__.setdefault(_HELD_ATTR, []).extend(held),
                                  original_issue, owner, *args, **kwargs)

        def waited(owner: Any, *args: Any, **kwargs: Any) -> Any:
            held = owner.__dict__.pop(_HELD_ATTR, None)
            if not held:
                return original_wait(owner, *args, **kwargs)
            return _waiting_for(held, original_wait, owner, *args, **kwargs)

        functools.update_wrapper(issued, original_issue)
        functools.update_wrapper(waited, original_wait)
        self._patch(cls, issue, issued)
        self._patch(cls, wait, waited)

    def hold_reductions(self, cls: Any) -> None:
        """FSDP2 reduce-scatters a layer's gradients on a stream of its own in ``post_backward``, and
        makes the compute stream wait for the reduce-scatters issued before at the next layer's
        ``post_backward`` (to reuse their memory) and for the last ones in ``finalize_backward``. On
        GPU each such reduce-scatter gets a ``<name>:wait`` span there, as the gathers do: beside a
        slow rank these waits stall its peers' backward, and without the span read as their own
        work.

        The reduce-scatters are held from ``post_backward`` (the calls it issues) to the next
        ``post_backward`` that waits for them (one that reduces: not under ``no_sync``-like
        accumulation, and the last of a module's groups where it has several) or to
        ``finalize_backward``; other calls it issues (HSDP's all-reduce, waited elsewhere) are
        written as they were."""
        col_ref = self._col
        pending: list[Any] = []  # issued, not yet waited for: shared by every group of the model
        original_post, original_final = cls.post_backward, cls.finalize_backward

        def keep(held: list[Any]) -> None:
            for handle in held:
                if handle.op == CollectiveOp.REDUCE_SCATTER.value and len(pending) < _MAX_PENDING_REDUCTIONS:
                    pending.append(handle)
                else:
                    _end_quietly(handle)

        def post_backward(owner: Any, *args: Any, **kwargs: Any) -> Any:
            col = col_ref()
            if col is None or not col._active:
                return original_post(owner, *args, **kwargs)
            waited: list[Any] = []
            if pending and _waits_for_reductions(owner):
                waited, pending[:] = pending[:], []
            return _waiting_for(waited, _issue_holding, keep, original_post, owner, *args, **kwargs)

        def finalize_backward(owner: Any, *args: Any, **kwargs: Any) -> Any:
            waited, pending[:] = pending[:], []
            return _waiting_for(waited, original_final, owner, *args, **kwargs)

        functools.update_wrapper(post_backward, original_post)
        functools.update_wrapper(finalize_backward, original_final)
        self._patch(cls, "post_backward", post_backward)
        self._patch(cls, "finalize_backward", finalize_backward)

    # ------------------------------------------------------------------ FSDP1
    def _install_fsdp1(self) -> None:
        """``FullyShardedDataParallel`` (FSDP1): at each instance's first forward, the module it wraps
        gets the hooks of the timer FSDP2 uses, so of the nested instances (an auto-wrap policy wraps
        layer by layer inside the root) only the outermost forward, the root's, is timed, with the
        layers' all-gathers inside it. The root's own all-gather, before its module runs, is not."""
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        except ImportError:
            return
        self._time_inner_at_first_forward(FSDP, "_fsdp_wrapped_module", "FSDP model spans")

    def _time_inner_at_first_forward(self, cls: Any, inner: str, what: str) -> None:
        """``cls.forward`` wrapped: at each instance's first forward, the module it wraps (its
        attribute ``inner``) gets the hooks of the timer shared by every module FSDP shards, once an
        instance. The check before the call is an attribute, as DDP's, so that a forward
        ``torch.compile`` traced calls nothing of ours once it is set."""
        original_forward = cls.forward

        def at_first(model: Any) -> None:
            if "_megascope_timed" in model.__dict__:  # once a model, as _time_ddp
                return
            model.__dict__["_megascope_timed"] = True
            module = getattr(model, inner, None)
            if module is not None:
                self._attach_model_timer(module, shared=True, what=what)

        first = _eager(at_first)

        def forward(model: Any, *inputs: Any, **kwargs: Any) -> Any:
            if getattr(model, "_megascope_timed", False) is not True:
                first(model)
            return original_forward(model, *inputs, **kwargs)

        functools.update_wrapper(forward, original_forward)
        self._patch(cls, "forward", forward)

    # ------------------------------------------------------------------ Megatron-core
    def _install_megatron(self) -> None:
        """Megatron-core's data-parallel wrappers (``DistributedDataParallel``,
        ``TorchFullyShardedDataParallel``, its FSDP adapter) share one ``forward``, which calls the
        wrapped model: at each wrapper's first forward, that model gets the hooks of the timer FSDP
        uses. With a pipeline's virtual stages each model chunk is timed on its own; a chunk that
        ``fully_shard`` also wraps gets one span, not two (the timer times the outermost forward).
        Megatron's gradient buffers reduce from their own hooks, whose collectives are recorded as
        any others."""
        try:
            base = importlib.import_module("megatron.core.distributed.data_parallel_base")._BaseDataParallel
        except Exception:  # another Megatron layout: no model spans, the rest as before
            return
        self._time_inner_at_first_forward(base, "module", "Megatron model spans")

    def _install_megatron_p2p(self) -> None:
        """Megatron-core's pipeline schedules send and receive through ``batch_isend_irecv`` by
        default (recorded), and with ``overlap_p2p_comm`` (``batch_p2p_comm=False``) through
        ``_p2p_ops``, which calls ``isend``/``irecv`` one by one (not wrapped, see the module's
        notes): ``_p2p_ops`` is wrapped, each tensor it sends or receives a span ended when its
        request completes."""
        module = sys.modules.get(_MEGATRON_P2P)
        original = getattr(module, "_p2p_ops", None)
        if module is None or not callable(original):
            return
        col_ref = self._col
        interception = self

        def _p2p_ops(**kwargs: Any) -> Any:
            col = col_ref()
            if col is None or not col._active or getattr(_TLS, "busy", False):
                return original(**kwargs)
            handles: dict[str, Any] = {}
            try:
                group = col.group_id(kwargs.get("group"))
                for key, peer_key, is_send in _MEGATRON_P2P_OPS:
                    tensor = kwargs.get("tensor_" + key)
                    if tensor is not None:
                        handles[key] = col.comm_begin(
                            op=CollectiveOp.SEND if is_send else CollectiveOp.RECV, group=group,
                            bytes=_nbytes(tensor), kind=SpanKind.SEND if is_send else SpanKind.RECV,
                            peer=kwargs.get(peer_key))
            except Exception:
                col._internal_error("intercepted Megatron point-to-point call")
                for h in handles.values():
                    h.abandon()
                handles = {}
            reqs = _call_recorded(original, (), kwargs, _Together(list(handles.values())))
            for key, handle in handles.items():
                work = reqs.get(key) if isinstance(reqs, dict) else None
                if work is not None:
                    interception._end_on_completion(work, handle)
                else:  # an older Megatron's list of requests: in no fixed order, so ended now
                    handle.end()
            return reqs

        functools.update_wrapper(_p2p_ops, original)
        self._patch(module, "_p2p_ops", _p2p_ops)

    def _time_fsdp(self, module: Any) -> None:
        self._attach_model_timer(module, shared=True, what="FSDP model spans")

    def _attach_model_timer(self, module: Any, *, shared: bool, what: str) -> None:
        """The model-span hooks on ``module`` (or each of a list of modules): a timer of its own
        (megascope.collectors.modules.time_model), or, ``shared``, the one timer of every module
        FSDP shards, which times the outermost forward under way."""
        col = self._col()
        if col is None or not col._active or not col.config.model_spans:
            return
        try:
            from megascope.collectors.modules import OutermostTimer, time_model

            if not shared:
                self._model_hooks.extend(time_model(module, col))
                return
            if self._fsdp_timer is None:
                self._fsdp_timer = OutermostTimer(col)
            for m in module if isinstance(module, list | tuple) else [module]:
                self._model_hooks.extend(self._fsdp_timer.attach(m))
        except Exception:
            col._internal_error(what)

    def _hook_ddp(self, model: Any) -> None:
        if "_megascope_seen" in model.__dict__:  # once a model, as _time_ddp
            return
        model.__dict__["_megascope_seen"] = True
        col = self._col()
        if col is None or not col._active:
            return
        try:
            if getattr(model, "_comm_hooks", None):  # registered before the collector was installed
                return
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            # torch's own registration: the job's later register_comm_hook would then fail as it
            # does on any DDP model that has a hook, so this runs only at the first forward.
            self._ddp_register(model, model.process_group, allreduce_hook)
            self.ddp_hooks += 1
        except Exception:
            col._internal_error("DDP comm hook")
