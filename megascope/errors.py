"""One exception hierarchy for megascope.

The CLI turns every ``MegascopeError`` into a one-line message on stderr and a non-zero exit; any
other exception escaping a command is a bug.
"""

from __future__ import annotations


class MegascopeError(Exception):
    """Base class: a problem the user can act on, with a message that says what and where."""


class RunDirError(MegascopeError):
    """A run directory is missing, empty, or unreadable as a whole."""


class SchemaVersionError(RunDirError):
    """``run.json`` names a schema version this megascope does not read."""


class ConfigError(MegascopeError):
    """Bad arguments: mesh sizes, inject specs, options."""


class IngestError(MegascopeError):
    """A foreign trace (Kineto JSON, flight-recorder dump) could not be read."""


class ExportError(MegascopeError):
    """An export could not be written."""


class OutputError(MegascopeError):
    """An output path would overwrite, or write into, data that is already there (a run, a file)."""
