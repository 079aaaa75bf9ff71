"""``col.dist``: torch.distributed calls that time themselves.

Role in the data flow: part of the in-job collector. Each call records the rank's arrival (and an
``enqueued`` marker) just before launching the real torch.distributed call, and its completion when
the call returns (blocking form) or when the returned work's ``wait()`` returns (``async_op=True``,
``isend``/``irecv``, ``batch_isend_irecv``); an asynchronous call also gets a ``<name>:wait`` span
from the ``wait()`` call to completion, the part of it that compute did not hide. Return values are
those of torch.distributed, with work objects wrapped so that ``wait()`` also ends the span. The
megascope group id comes from :meth:`Collector.register_group`; bytes are what this rank
contributes.

Example::

    col.register_group(tp_pg, Group("tp:0", "tp", (0, 1)))
    col.dist.all_reduce(t, group=tp_pg)                       # blocking, timed
    work = col.dist.reduce_scatter_single(out, inp, group=dp_pg, async_op=True)
    ...
    work.wait()                                               # ends the span
    reqs = col.dist.batch_isend_irecv([P2POp(dist.isend, x, 1), P2POp(dist.irecv, y, 1)])

``all_gather_single`` / ``reduce_scatter_single`` call the torch 2.13 names where they exist and
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on older torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megascope.collectors.hooks import busy

from megascope.schema import CollectiveOp, SpanKind

if TYPE_CHECKING:
    from megascope.collectors.collector import Collector


def _nbytes(tensor: Any) -> int | None:
    try:
        return int(tensor.numel() * tensor.element_size())
    except Exception:
        return None


class TimedWork:
    """A torch ``Work`` whose ``wait()`` also ends the collector's span; everything else passes through."""

    __slots__ = ("_work", "_handle")

    def __init__(self, work: Any, handle: Any) -> None:
        self._work = work
        self._handle = handle

    def wait(self, timeout: Any = None) -> Any:
        """``Work.wait``, ``timeout`` passed on only when given (a timeout makes some backends, NCCL
        among them, block the calling thread until the operation completes)."""
        self._handle.waiting()
        result = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._handle.end()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class DistMirror:
    """The timed subset of torch.distributed a trainer issues (see the module docstring)."""

    def __init__(self, collector: Collector) -> None:
        import torch.distributed as dist

        self._col = collector
        self._dist = dist
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    # ------------------------------------------------------------------ plumbing
    def _run(self, op: CollectiveOp, group: Any, nbytes: int | None, async_op: bool,
             call: Callable[[], Any], *, kind: SpanKind = SpanKind.COLLECTIVE, peer: int | None = None) -> Any:
        col = self._col
        if not col._active:
            return call()
        handle = col.comm_begin(op=op, group=col.group_id(group), bytes=nbytes, kind=kind, peer=peer)
        try:
            with busy():  # recorded here: an interception of the torch call inside records nothing
                result = call()
        except BaseException:
            handle.abandon()
            raise
        if async_op:
            return TimedWork(result, handle) if result is not None else result
        handle.end()
        return result

    def _global_peer(self, peer: int | None, group: Any, group_peer: int | None) -> int | None:
        if peer is None and group_peer is not None:
            return int(self._dist.get_global_rank(group, group_peer))
        return peer

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        op = self._dist.ReduceOp.SUM if op is None else op
        return self._run(CollectiveOp.ALL_REDUCE, group, _nbytes(tensor), async_op,
                         lambda: self._dist.all_reduce(tensor, op=op, group=group, async_op=async_op))

    def all_gather_single(self, output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
        return self._run(CollectiveOp.ALL_GATHER, group, _nbytes(input), async_op,
                         lambda: self._all_gather(output, input, group=group, async_op=async_op))

    def reduce_scatter_single(self, output: Any, input: Any, group: Any = None, op: Any = None,
                              async_op: bool = False) -> Any:
        op = self._dist.ReduceOp.SUM if op is None else op
        return self._run(CollectiveOp.REDUCE_SCATTER, group, _nbytes(input), async_op,
                         lambda: self._reduce_scatter(output, input, op=op, group=group, async_op=async_op))

    def broadcast(self, tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False,
                  group_src: int | None = None) -> Any:
        kwargs: dict[str, Any] = {"group": group, "async_op": async_op}
        if group_src is not None:
            kwargs["group_src"] = group_src
        else:
            kwargs["src"] = src
        return self._run(CollectiveOp.BROADCAST, group, _nbytes(tensor), async_op,
                         lambda: self._dist.broadcast(tensor, **kwargs))

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
        return self._run(CollectiveOp.ALL_TO_ALL, group, _nbytes(input), async_op,
                         lambda: self._dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                              group=group, async_op=async_op))

    def barrier(self, group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
        kwargs: dict[str, Any] = {"group": group, "async_op": async_op}
        if device_ids is not None:
            kwargs["device_ids"] = device_ids
        return self._run(CollectiveOp.BARRIER, group, 0, async_op, lambda: self._dist.barrier(**kwargs))

    # ------------------------------------------------------------------ point to point
    def isend(self, tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
              group_dst: int | None = None) -> Any:
        peer = self._global_peer(dst, group, group_dst)
        return self._run(CollectiveOp.SEND, group, _nbytes(tensor), True,
                         lambda: self._dist.isend(tensor, peer, group=group, tag=tag),
                         kind=SpanKind.SEND, peer=peer)

    def irecv(self, tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
              group_src: int | None = None) -> Any:
        peer = self._global_peer(src, group, group_src)
        return self._run(CollectiveOp.RECV, group, _nbytes(tensor), True,
                         lambda: self._dist.irecv(tensor, peer, group=group, tag=tag),
                         kind=SpanKind.RECV, peer=peer)

    def send(self, tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
             group_dst: int | None = None) -> None:
        peer = self._global_peer(dst, group, group_dst)
        self._run(CollectiveOp.SEND, group, _nbytes(tensor), False,
                  lambda: self._dist.send(tensor, peer, group=group, tag=tag), kind=SpanKind.SEND, peer=peer)

    def recv(self, tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
             group_src: int | None = None) -> Any:
        peer = self._global_peer(src, group, group_src)
        return self._run(CollectiveOp.RECV, group, _nbytes(tensor), False,
                         lambda: self._dist.recv(tensor, peer, group=group, tag=tag), kind=SpanKind.RECV, peer=peer)

    def batch_isend_irecv(self, p2p_op_list: list[Any]) -> list[Any]:
        """One send or recv span per op, all arriving at this call; each work's ``wait()`` ends its own."""
        col = self._col
        if not col._active:
            return list(self._dist.batch_isend_irecv(p2p_op_list))
        handles = []
        for p2p in p2p_op_list:
            is_send = p2p.op in (self._dist.isend, self._dist.send) or getattr(p2p.op, "__name__", "") in (
                "isend", "send")
            peer = self._global_peer(p2p.peer, p2p.group, getattr(p2p, "group_peer", None))
            handles.append(col.comm_begin(
                op=CollectiveOp.SEND if is_send else CollectiveOp.RECV, group=col.group_id(p2p.group),
                bytes=_nbytes(p2p.tensor), kind=SpanKind.SEND if is_send else SpanKind.RECV, peer=peer,
            ))
        try:
            with busy():
                works = self._dist.batch_isend_irecv(p2p_op_list)
        except BaseException:
            for h in handles:
                h.abandon()
            raise
        if len(works) != len(handles):
            # A backend that returns one work for the whole batch: it ends every span.
            return [_BatchWork(w, handles) for w in works]
        return [TimedWork(w, h) for w, h in zip(works, handles, strict=True)]


class _BatchWork(TimedWork):
    __slots__ = ()

    def wait(self, timeout: Any = None) -> Any:
        result = self._work.wait() if timeout is None else self._work.wait(timeout)
        for h in self._handle:
            h.end()
        return result
