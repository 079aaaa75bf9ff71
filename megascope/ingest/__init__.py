"""Foreign traces -> megascope run directories.

Role in the data flow: importers that write the same run directory as the collector, from traces
users already have: torch.profiler (Kineto) JSON and NCCL flight-recorder dumps. Every analysis,
export and dashboard page then works on them.

Example::

    from megascope.ingest import ingest_kineto, ingest_flight_recorder
    ingest_kineto("profiler_traces/", "runs/job42")
    ingest_flight_recorder("fr_dumps/", "runs/job42-hang", mesh={"tp": 2, "pp": 2, "dp": 2})
"""

from __future__ import annotations

from megascope.ingest.flight_recorder import ingest_flight_recorder, load_dump
from megascope.ingest.kineto import IngestResult, ingest_kineto

__all__ = ["IngestResult", "ingest_flight_recorder", "ingest_kineto", "load_dump"]
