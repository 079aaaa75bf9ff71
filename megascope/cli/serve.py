"""``megascope serve`` and ``megascope demo``: the Dash dashboard."""

from __future__ import annotations

import logging
from pathlib import Path

import click


def check_port(host: str, port: int) -> None:
    """A one-line error now if ``host:port`` cannot be listened on (in use, not an address here)."""
    import socket

    from megascope.errors import ConfigError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # The same option the server sets, so that a port in TIME_WAIT is not refused here.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                              "choose another --port") from None


def _quiet_request_log() -> None:
    """One log line per HTTP request only with -v: the server's own output is for problems."""
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)


@click.command()
@click.argument("run_dirs", metavar="[RUN]...", nargs=-1, type=click.Path(path_type=Path, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback requires --token.")
@click.option("--port", type=click.IntRange(1, 65535), default=8050, show_default=True)
@click.option("--token", default=None, envvar="MEGASCOPE_TOKEN",
              help="Secret every request must carry (open the URL once with ?token=...). Env: MEGASCOPE_TOKEN.")
@click.option("--poll", "poll_s", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Seconds between looks for new data of a live run.")
@click.option("--compact", "compact_every_s", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="Compact each served run this often (megascope compact's live pass: parts older than a minute, "
                   "never a rank's newest). Off by default: it writes into the run directories.")
def serve(run_dirs: tuple[Path, ...], host: str, port: int, token: str | None, poll_s: float,
          compact_every_s: float | None) -> None:
    """Serve the dashboard for RUN directories (the bundled sample runs when none is given).

    Only the directories given are ever read; pages name runs by id, never by path.
    /metrics answers in Prometheus' text format.
    """
    check_port(host, port)
    _quiet_request_log()
    from megascope.dashboard.app import create_app, registry_of
    from megascope.dashboard.demo import bundled_sample_runs

    dirs = list(run_dirs) or bundled_sample_runs()
    app = create_app(dirs, host=host, token=token, poll_interval_s=poll_s, compact_every_s=compact_every_s)
    registry = registry_of(app)
    shown_host = f"[{host}]" if ":" in host else host
    click.echo(f"megascope: serving {len(registry)} run(s) ({', '.join(registry.ids)}) at "
               f"http://{shown_host}:{port}/" + ("?token=..." if token else ""), err=True)
    try:
        app.run(host=host, port=port, debug=False)
    finally:
        registry.stop()


@click.command()
@click.option("-o", "--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Run directory to write (default: a new temporary directory).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8050, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=60, show_default=True)
@click.option("--inject", default="straggler:rank=5,factor=1.6", show_default=True, metavar="SPEC",
              help="The fault to plant (the --inject grammar).")
def demo(out: Path | None, host: str, port: int, steps: int, inject: str) -> None:
    """Train on CPU (8 ranks, 2x2x2) with a planted straggler while the dashboard shows it live.

    Ctrl-C stops both. Where the bundled trainer is not available, a synthetic run of the same
    shape is written step by step instead.
    """
    from megascope.dashboard.demo import run_demo
    from megascope.dashboard.security import check_bind
    from megascope.inject import parse_inject

    check_bind(host, None)
    if out is not None:
        from megascope import layout

        layout.check_new_run_dir(out)  # the demo's job writes a new run: never into an existing one
    check_port(host, port)
    _quiet_request_log()
    parse_inject(inject)  # a bad spec fails here, in one line, before anything starts
    run_demo(out, host=host, port=port, steps=steps, inject=inject, echo=lambda line: click.echo(line, err=True))


def register(group: click.Group) -> None:
    group.add_command(serve)
    group.add_command(demo)
