"""Options and helpers shared by the CLI's command modules."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

run_dir_argument = click.argument(
    "run_dir", metavar="RUN", type=click.Path(path_type=Path, file_okay=False)
)

out_run_option = click.option(
    "-o", "--out", "out", required=True, type=click.Path(path_type=Path, file_okay=False),
    help="Run directory to write.",
)

inject_option = click.option(
    "--inject", "injects", multiple=True, metavar="SPEC",
    help="Plant a fault: straggler:rank=R,factor=F | hang:rank=R,step=S | freeze:rank=R,step=S | skew:rank=R,ms=M | crash:rank=R,step=S | kill:rank=R,step=S (train only). Repeatable.",
)

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")


def echo_problems(problems: list[str]) -> None:
    """Warnings met while reading a run go to stderr, one line each."""
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)


def echo_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, default=str, allow_nan=False)
    sys.stdout.write("\n")


def not_built(name: str) -> None:
    raise click.ClickException(f"'megascope {name}' is not available in this version yet")
