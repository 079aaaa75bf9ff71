"""Forward and backward spans for chosen submodules of any ``nn.Module``, through hooks.

Role in the data flow: part of the in-job collector; it turns a model into spans without editing
its code. Opt-in by name pattern, matched segment by segment on the dotted module name: ``*``
matches one segment (``layers.*`` is ``layers.0`` but not ``layers.0.attn``), ``**`` any number
of segments.

How each span is taken:

* forward: a forward pre-hook opens the span, a forward hook closes it;
* backward: the forward hook registers a pre-hook on the output's ``grad_fn`` (the gradient of
  the output is ready: this module's backward starts) and the pre-hook registers ``input.register_hook`` on the
  first input tensor that requires grad (its gradient is ready: the backward ends). Module
  ``full_backward`` hooks are avoided on purpose: they cost 10-30x more per call and break the
  zero-bubble pipeline schedules of ``torch.distributed.pipelining``.

A backward span carries the step, micro-batch and chunk of its forward. Modules whose inputs need
no gradient (the first stage's token ids) get no backward span; neither does any call made under
``torch.no_grad()``. Activation checkpointing re-runs forwards during backward: those show as extra
forward spans.

Under ``torch.compile``: a module called inside a region Dynamo compiles gets no span from
:func:`instrument_module` (its hooks return at once while Dynamo traces them: timing a layer in the
middle of a graph would split the graph there, at every layer). The whole model's spans
(:func:`time_model`, :class:`OutermostTimer`) run as plain Python outside the graph
(``torch.compiler.disable``): the model's graph then begins after its forward span opens and ends
before it closes. Traced as they are, the collector's bookkeeping split the graph at each stamp
and its spans were counted again (20 forward spans for 8 calls of a compiled DDP model).

Example::

    handles = instrument_module(model, ["layers.*"], collector=col)
    ...
    for h in handles:
        h.remove()
"""

from __future__ import annotations

import fnmatch
import functools
import threading
from collections.abc import Container, Iterable, Sequence
from typing import Any

from megascope.collectors.collector import Collector
from megascope.collectors.contexts import SpanContext

from megascope.schema import SpanKind, Stream

_FORWARD = SpanKind.FORWARD.value
_BACKWARD = SpanKind.BACKWARD.value
_COMPUTE = Stream.COMPUTE.value


def _compiling() -> bool:
    """Whether Dynamo is tracing this call (``torch.compile``); a constant to Dynamo itself."""
    import torch

    return bool(torch.compiler.is_compiling())


def eager(fn: Any) -> Any:
    """``fn`` run as plain Python where ``torch.compile`` traces its caller (a graph break around
    it), or ``fn`` itself on a torch without ``torch.compiler.disable``."""
    try:
        import torch

        return torch.compiler.disable(fn)
    except Exception:
        return fn


def _matches(segments: list[str], pattern: list[str]) -> bool:
    if not pattern:
        return not segments
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(segments[i:], rest) for i in range(len(segments) + 1))
    return bool(segments) and fnmatch.fnmatchcase(segments[0], head) and _matches(segments[1:], rest)


def match_modules(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The names matching any of ``patterns`` (dotted, ``*`` = within one segment, ``**`` = any segments)."""
    split = [p.split(".") for p in patterns]
    return [n for n in names if n and any(_matches(n.split("."), p) for p in split)]


def _first_grad_tensor(value: Any) -> Any:
    """The first tensor that requires grad in a (nested) tuple/list/dict of module inputs or outputs."""
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, list | tuple):
        for item in value:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    elif isinstance(value, dict):
        for item in value.values():
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


class _ModuleTimer:
    """The hooks of one module: a stack of open forward spans (a module may be re-entered)."""

    __slots__ = ("col", "name", "microbatches", "_open")

    def __init__(self, col: Collector, name: str, microbatches: Container[int] | None = None) -> None:
        self.col = col
        self.name = name
        self.microbatches = microbatches
        self._open: list[tuple[Any, Any]] = []  # (forward span, backward span or None)

    def _timed(self, microbatch: int | None) -> bool:
        # The micro-batch is the same at both hooks of one call: the caller sets it around the call.
        return self.microbatches is None or microbatch is None or microbatch in self.microbatches

    def pre(self, module: Any, args: Any) -> None:
        col = self.col
        if not col._active or not self._timed(col._microbatch) or _compiling():
            return
        try:
            forward = col.span(self.name, kind=_FORWARD)
            backward = None
            grad_input = _first_grad_tensor(args)
            if grad_input is not None:
                backward = _BackwardSpan(col, self.name)
                # A hook on a leaf tensor outlives the graph: remove it once it has fired.
                backward.input_hook = grad_input.register_hook(backward.on_input_grad)
            forward.__enter__()
            self._open.append((forward, backward))
        except Exception:
            col._internal_error("module forward pre-hook")

    def post(self, module: Any, args: Any, output: Any) -> None:
        if not self._open or not self._timed(self.col._microbatch):  # (none open where Dynamo traces)
            return
        forward, backward = self._open.pop()
        try:
            forward.__exit__(None, None, None)
            if backward is not None:
                grad_output = _first_grad_tensor(output)
                if grad_output is not None:
                    # A pre-hook of the output's grad_fn runs after every tensor hook on the output,
                    # among them the next module's "backward ended" hook: the spans then never overlap.
                    if grad_output.grad_fn is not None:
                        grad_output.grad_fn.register_prehook(backward.on_output_grad)
                    else:
                        backward.output_hook = grad_output.register_hook(backward.on_output_grad)
        except Exception:
            self.col._internal_error("module forward hook")


class _BackwardSpan:
    """One module call's backward: opened by the output-gradient hook, closed by the input-gradient one.

    It stamps the timer directly instead of entering a span context: autograd may run these hooks
    on its own thread, in an order that need not nest, so they must not touch the collector's
    current step or micro-batch. Those come from the forward.
    """

    __slots__ = ("col", "name", "step", "microbatch", "chunk", "_token", "_anchor", "input_hook", "output_hook")

    def __init__(self, col: Collector, name: str) -> None:
        self.col = col
        self.name = name
        self.step = col._step
        self.microbatch = col._microbatch
        self.chunk = col._chunk
        self._token: Any = None
        self._anchor: Any = None
        self.input_hook: Any = None
        self.output_hook: Any = None

    def on_output_grad(self, grad: Any) -> None:
        col = self.col
        if self.output_hook is not None:
            self.output_hook.remove()
            self.output_hook = None
        if self._token is not None or not col._active:
            return
        try:
            self._anchor = col._timer.anchor_ref
            self._token = col._timer.stamp(None)
        except Exception:
            col._internal_error("module backward hook")

    def on_input_grad(self, grad: Any) -> None:
        if self.input_hook is not None:
            self.input_hook.remove()
            self.input_hook = None
        token, self._token = self._token, None
        col = self.col
        if token is None or not col._active:
            return
        col._close_span(token, self._anchor, None, self.step, self.name, _BACKWARD, _COMPUTE,
                        self.microbatch, self.chunk, None, None, None, None, None)


def instrument_module(model: Any, patterns: Sequence[str], collector: Collector, kind_prefix: str = "",
                      microbatches: Container[int] | None = None) -> list[Any]:
    """Forward/backward spans for every submodule of ``model`` whose name matches ``patterns``.

    Span names are ``kind_prefix + module name`` (e.g. ``"stage1." + "layers.3"``). Returns the
    hook handles; ``handle.remove()`` undoes the instrumentation. A disabled collector adds no hooks.
    ``microbatches``: time only the calls made inside these micro-batches (the collector's current
    one; calls outside any micro-batch are always timed). Every span costs device time (a timing
    event stops the stream for ~2 us), so a job with many micro-batches may time its layers in
    one of them: ``microbatches={0}``.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not collector._active:
        return []
    modules = dict(model.named_modules())
    handles = []
    for name in match_modules(modules, patterns):
        timer = _ModuleTimer(collector, kind_prefix + name, microbatches)
        handles.append(modules[name].register_forward_pre_hook(timer.pre))
        handles.append(modules[name].register_forward_hook(timer.post))
    return handles


def _in_backward() -> bool:
    """Whether this thread is running an autograd backward pass: activation checkpointing runs
    forwards again there, which are part of the backward, not forwards of their own."""
    import torch

    try:
        return bool(torch._C._current_graph_task_id() != -1)
    except Exception:  # a torch without it: no recomputation is told apart
        return False


class _ModelTimer:
    """A whole model's forward and backward as top-level ``forward`` and ``backward`` spans, for a
    job that times none of its compute itself (see :func:`time_model`). A forward run again inside
    a backward (activation checkpointing) opens no span."""

    __slots__ = ("col", "_open")

    def __init__(self, col: Collector) -> None:
        self.col = col
        self._open: list[SpanContext] = []

    def attach(self, module: Any) -> list[Any]:
        """The hooks on ``module``, outside any graph ``torch.compile`` makes of it; returns their
        handles."""
        return [module.register_forward_pre_hook(eager(self.pre)),
                module.register_forward_hook(eager(self.post), always_call=True)]

    def pre(self, module: Any, args: Any) -> None:
        if not _in_backward():
            self._start()

    def post(self, module: Any, args: Any, output: Any) -> None:
        if not _in_backward():
            self._end(output)

    def _start(self) -> None:
        col = self.col
        if not col._active or col._times_compute:
            return
        try:
            span = col._span(_FORWARD, _FORWARD)
            span.__enter__()
            self._open.append(span)
        except Exception:
            col._internal_error("model forward pre-hook")

    def _end(self, output: Any) -> None:
        if not self._open:
            return
        span = self._open.pop()
        if output is None:  # the forward raised (this hook runs anyway): its span is dropped
            return
        try:
            span.__exit__(None, None, None)
            grad_output = _first_grad_tensor(output)
            if grad_output is not None and grad_output.grad_fn is not None and self.col._active:
                backward = _BackwardSpan(self.col, _BACKWARD)
                grad_output.grad_fn.register_prehook(functools.partial(_backward_started, backward))
        except Exception:
            self.col._internal_error("model forward hook")


def _backward_started(backward: _BackwardSpan, grad_outputs: Any) -> None:
    """The output's gradient is ready: the model's backward starts here and ends when the autograd
    engine finishes this backward pass (a callback it runs before ``backward()`` returns)."""
    backward.on_output_grad(None)
    try:
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(functools.partial(backward.on_input_grad, None))
    except Exception:
        backward.col._internal_error("model backward hook")


def time_model(model: Any, collector: Collector) -> list[Any]:
    """Top-level ``forward`` and ``backward`` spans of every call of ``model``, what the analysis
    needs to tell a rank slow in its compute from one that pauses outside it, for a job that
    records only its steps and collectives. The backward span runs from the gradient of the
    model's output to the end of that backward pass. Calls under ``torch.no_grad()`` get no
    backward span. Once the job opens a forward or backward span of its own (``col.span`` or
    :func:`instrument_module`), these spans stand aside. Returns the hook handles."""
    if not collector._active:
        return []
    return _ModelTimer(collector).attach(model)


class OutermostTimer(_ModelTimer):
    """:class:`_ModelTimer` over several modules that call each other (an FSDP2 model's layers and
    its root): only the outermost forward under way on a thread is timed."""

    __slots__ = ("_depth",)

    def __init__(self, col: Collector) -> None:
        super().__init__(col)
        self._depth = threading.local()

    def pre(self, module: Any, args: Any) -> None:
        if _in_backward():
            return
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if depth == 0:
            self._start()

    def post(self, module: Any, args: Any, output: Any) -> None:
        if _in_backward():
            return
        depth = max(getattr(self._depth, "n", 1) - 1, 0)
        self._depth.n = depth
        if depth == 0:
            self._end(output)
