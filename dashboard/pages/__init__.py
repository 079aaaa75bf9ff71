"""The dashboard's pages: each module has ``layout(served, query)`` and ``register(app, registry)``."""
