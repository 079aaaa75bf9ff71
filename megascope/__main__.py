"""``python -m megascope`` runs the CLI."""

from megascope.cli import main

main()
