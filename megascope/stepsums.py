"""Per-(rank, step, collective group) sums of a batch of spans: what every writer of spans writes
beside them (the ``step_sums`` table), so that the analysis need not aggregate every span again.

Role in the data flow: the writers' side of the analysis' per-rank-step time split. Each writer of a
``spans`` part (the collector's writer thread, ``megascope synth``, the importers, compaction) passes
the part's rows to :func:`step_sums` and writes the result as the part's twin
(:func:`megascope.layout.write_spans_part`). The analysis (``sql/base.sql``, statement
``rank_step``) combines the twins of the spans it reads (SUM of sums and counts, MIN of minimums,
MAX of maximums) and aggregates the spans only of parts without one: the same numbers either way,
however the spans were cut into parts.

Each output row is one (rank, step, group) of the batch, with ``group`` the group of collective
spans and NULL for every other span (and for collectives without a group). Spans without a step
are left out. A sum or extreme over no span of its kind is NULL, a count 0, as SQL's ``FILTER``
gives them. Pure pyarrow (one hash aggregation in C++), no per-row Python: cheap enough for the
collector's writer thread.

Example::

    from megascope.stepsums import step_sums
    sums = step_sums(spans_table)     # schema.STEP_SUMS
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from megascope.schema import DEVICE_STREAM_PREFIX, STEP_SUMS, WAIT_SUFFIX, CollectiveOp, SpanKind

_KEYS = ["rank", "step", "group"]
# Output column -> the span kind whose durations it sums.
_BY_KIND = {
    "forward_ns": SpanKind.FORWARD,
    "backward_ns": SpanKind.BACKWARD,
    "optimizer_ns": SpanKind.OPTIMIZER,
    "compute_ns": SpanKind.COMPUTE,
    "data_ns": SpanKind.DATA,
    "host_ns": SpanKind.HOST,
    "other_ns": SpanKind.OTHER,
    "coll_ns": SpanKind.COLLECTIVE,
    "recv_ns": SpanKind.RECV,
    "send_ns": SpanKind.SEND,
}
# Top-level compute: spans named after their kind; module spans ("layers.3") nest inside them.
_TOP_NAMES = (SpanKind.FORWARD.value, SpanKind.BACKWARD.value)
# Gradient reductions: the collectives a data-parallel job's backward issues and waits for at its end.
_REDUCE_OPS = (CollectiveOp.ALL_REDUCE.value, CollectiveOp.REDUCE_SCATTER.value)


def step_sums(spans: pa.Table) -> pa.Table:
    """The partial per-(rank, step, group) aggregates of ``spans`` (the ``spans`` table's schema),
    as ``schema.STEP_SUMS``: rows of one (rank, step, group) from several batches combine by SUM,
    MIN and MAX into what the same aggregation gives over all their spans at once."""
    spans = spans.filter(pc.is_valid(spans.column("step")))
    if spans.num_rows == 0:
        return STEP_SUMS.empty_table()
    kind = spans.column("kind")
    name = spans.column("name")
    start = spans.column("start_ns").cast(pa.int64())
    dur = spans.column("dur_ns").cast(pa.int64())
    is_kind = {k: pc.equal(kind, k.value) for k in SpanKind}
    coll = is_kind[SpanKind.COLLECTIVE]
    # Built here, not at import: converting Python values loads pandas into pyarrow, and the
    # marker agent, which imports this module's package, stays small (no pandas).
    int64_null = pa.scalar(None, pa.int64())

    def only(mask: pa.ChunkedArray, values: pa.ChunkedArray) -> pa.ChunkedArray:
        return pc.if_else(mask, values, int64_null)

    # Arrivals are summed relative to a base (the batch's first start), so that the sums fit in
    # 64 bits; made relative to each row's own first start below.
    base = pc.min(start)
    end = pc.add(start, dur)
    top_backward = pc.and_(is_kind[SpanKind.BACKWARD], pc.equal(name, SpanKind.BACKWARD.value))
    reduce = pc.fill_null(pc.and_(coll, pc.is_in(spans.column("op"), value_set=pa.array(_REDUCE_OPS))), False)
    columns = {
        "rank": spans.column("rank"),
        "step": spans.column("step"),
        "group": pc.if_else(coll, spans.column("group"), pa.scalar(None, pa.string())),
        "step_dur": only(is_kind[SpanKind.STEP], dur),
        "step_start": only(is_kind[SpanKind.STEP], start),
        "start": start,
        "end": end,
        "top": only(pc.and_(pc.or_(is_kind[SpanKind.FORWARD], is_kind[SpanKind.BACKWARD]),
                            pc.is_in(name, value_set=pa.array(_TOP_NAMES))), dur),
        "gc": only(pc.and_(is_kind[SpanKind.HOST], pc.starts_with(name, "gc.")), dur),
        "arrival": only(coll, pc.subtract(start, base)),
        "reduce": only(reduce, start),
        "reduce_side": only(pc.and_(reduce, pc.starts_with(spans.column("stream"), DEVICE_STREAM_PREFIX)), start),
        "reduce_arrival": only(reduce, pc.subtract(start, base)),
        "reduce_end": only(reduce, end),
        # Waits for gradient reductions issued on the caller's stream alone: FSDP2's all-gathers
        # and reduce-scatters, on streams of their own, have waits of their own on GPU.
        "wait": only(pc.fill_null(pc.and_(pc.and_(pc.and_(is_kind[SpanKind.OTHER], pc.ends_with(name, WAIT_SUFFIX)),
                                                  pc.is_in(spans.column("op"), value_set=pa.array(_REDUCE_OPS))),
                                          pc.invert(pc.starts_with(spans.column("stream"), DEVICE_STREAM_PREFIX))),
                                  False),
                     start),
        "bwd_start": only(top_backward, start),
        "bwd_end": only(top_backward, end),
    }
    for column, k in _BY_KIND.items():
        columns[column] = only(is_kind[k], dur)
    aggregations = [("step_dur", "max"), ("step_start", "min"), ("start", "min"), ("end", "max"),
                    ("top", "sum"), ("gc", "sum"), ("arrival", "sum"), ("arrival", "count"), ("start", "count"),
                    ("reduce", "count"), ("wait", "count"), ("bwd_start", "min"), ("bwd_end", "max"),
                    ("reduce_side", "count"), ("reduce_arrival", "sum"), ("reduce", "min"), ("reduce_end", "max")]
    aggregations += [(column, "sum") for column in _BY_KIND]
    grouped = pa.table(columns).group_by(_KEYS, use_threads=False).aggregate(aggregations)
    first = grouped.column("start_min")
    coll_spans = grouped.column("arrival_count")
    # sum(arrival - base) - n * (first - base) = sum(arrival - first): what the analysis adds to
    # n * first_start_ns (in 128 bits) to get the raw arrival sum.
    arrival_rel = pc.subtract(grouped.column("arrival_sum"), pc.multiply(coll_spans, pc.subtract(first, base)))
    out = {
        "rank": grouped.column("rank"),
        "step": grouped.column("step"),
        "group": grouped.column("group"),
        "step_ns": grouped.column("step_dur_max"),
        "step_start_ns": grouped.column("step_start_min"),
        "first_start_ns": first,
        "last_end_ns": grouped.column("end_max"),
        **{column: grouped.column(f"{column}_sum") for column in _BY_KIND},
        "top_compute_ns": grouped.column("top_sum"),
        "gc_ns": grouped.column("gc_sum"),
        "arrival_rel_ns": arrival_rel,
        "coll_spans": coll_spans,
        "spans": grouped.column("start_count"),
        "reduce_spans": grouped.column("reduce_count"),
        "wait_spans": grouped.column("wait_count"),
        "backward_start_ns": grouped.column("bwd_start_min"),
        "backward_end_ns": grouped.column("bwd_end_max"),
        "reduce_side_spans": grouped.column("reduce_side_count"),
        # Relative to the row's first start, as arrival_rel_ns.
        "reduce_arrival_rel_ns": pc.subtract(grouped.column("reduce_arrival_sum"),
                                             pc.multiply(grouped.column("reduce_count"), pc.subtract(first, base))),
        "reduce_first_ns": grouped.column("reduce_min"),
        "reduce_last_ns": grouped.column("reduce_end_max"),
    }
    return pa.table(out).select(STEP_SUMS.names).cast(STEP_SUMS)
