"""megascope: see inside large-scale LLM training.

Per-rank timing from inside a TP/PP/DP PyTorch job goes to Parquet (``megascope.collectors``);
DuckDB turns a run directory into straggler heat-maps, hang localization and MFU
(``megascope.analysis``), Perfetto traces (``megascope.export``) and a live Dash dashboard
(``megascope.dashboard``).

Importing ``megascope`` is cheap: no torch, duckdb or pandas at import time.
"""

__version__ = "0.1.0"
