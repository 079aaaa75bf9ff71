"""Pure figure builders: ``(DataFrame, ...) -> plotly Figure``, shared by the dashboard, the CLI and tests.

Each module builds one kind of figure from an analysis frame and imports plotly itself, so that
nothing else in megascope pays for plotly at import time.
"""
