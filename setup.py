"""Build hook for the optional compiled Kineto scanner (everything else is in pyproject.toml).

``megascope.ingest._kscan`` is plain C on the CPython API, with no dependency: where it cannot be
built (no compiler, no Python headers) the install goes on without it and the Kineto importer
takes its pure-Python path.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("megascope.ingest._kscan", ["megascope/ingest/_kscan.c"], optional=True)])
