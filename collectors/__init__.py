"""megascope.collectors: the in-job hook that times every rank without stopping the device.

Role in the data flow: the first stage (collect -> store -> analyze -> present). Inside any PyTorch
training loop, a :class:`Collector` per rank records spans (compute phases, steps, module forward
and backward), communication with each rank's *arrival* time, sequence numbers per group and
enqueue/completion markers, and scalar metrics; a writer thread writes them as Parquet parts of a
run directory (``megascope.schema`` is the contract). Imports torch and pyarrow only, never duckdb,
pandas or dash.

Example::

    from megascope.collectors import Collector, CollectorConfig, instrument_module
    from megascope.schema import SpanKind

    col = Collector(CollectorConfig(run_dir=Path("runs/job")), rank=rank, world_size=world)
    handles = instrument_module(model, ["layers.*"], collector=col)
    for step in range(steps):
        with col.step(step):
            with col.span("forward", kind=SpanKind.FORWARD, microbatch=0):
                loss = model(x)
            loss.backward()
            col.dist.all_reduce(flat_grads)
        col.metric("loss", loss)
    col.close()
"""

from megascope.collectors.collector import Collector
from megascope.collectors.config import CollectorConfig
from megascope.collectors.contexts import NOOP, CommHandle, SpanContext, StepContext
from megascope.collectors.dist import DistMirror, TimedWork
from megascope.collectors.modules import instrument_module, match_modules

__all__ = [
    "NOOP",
    "Collector",
    "CollectorConfig",
    "CommHandle",
    "DistMirror",
    "SpanContext",
    "StepContext",
    "TimedWork",
    "instrument_module",
    "match_modules",
]
