"""``megascope demo``: a CPU training job with a planted straggler, and the dashboard showing it live.

Role in the data flow: glue. It starts the bundled trainer (``megascope train --nproc 8 --tp 2
--pp 2 --dp 2 --inject straggler:...``) in its own process group, writing a run directory, and
serves that directory while it grows. Where the trainer is not available (a build without it),
it writes a synthetic run of the same shape step by step instead and says so. Ctrl-C stops the
server, then the job (SIGINT, then SIGTERM, then SIGKILL), and leaves the run directory behind.

Example::

    run_demo(Path("runs/demo"), host="127.0.0.1", port=8050)
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import megascope
from megascope import layout
from megascope.errors import ConfigError

log = logging.getLogger(__name__)

DEMO_MESH = {"tp": 2, "pp": 2, "dp": 2}
DEMO_STRAGGLER = "straggler:rank=5,factor=1.6"


def bundled_sample_runs() -> list[Path]:
    """The run directories under the repository's ``sample_traces/`` (served when no RUN is given)."""
    root = Path(megascope.__file__).resolve().parent.parent / "sample_traces"
    runs = sorted(p for p in root.glob("*") if (p / layout.RUN_JSON).is_file()) if root.is_dir() else []
    if not runs:
        raise ConfigError(f"no RUN given and no bundled sample runs under {root}; pass a run directory")
    return runs


def trainer_command(out: Path, *, steps: int, inject: str) -> list[str]:
    return [
        sys.executable, "-m", "megascope", "train", "--nproc", "8",
        *(a for axis, size in DEMO_MESH.items() for a in (f"--{axis}", str(size))),
        "--steps", str(steps), "--inject", inject, "-o", str(out),
    ]


@dataclass
class DemoJob:
    """The writer behind a demo run: the trainer process, or a replay thread as a fallback."""

    out: Path
    process: subprocess.Popen[bytes] | None = None
    thread: threading.Thread | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    description: str = ""
    log_path: Path | None = None

    def watch_end(self, echo: Callable[[str], None]) -> threading.Thread | None:
        """Say in one line when the trainer ends by itself (not stopped by :meth:`stop`): finished,
        or failed with the launcher's own line, while the dashboard keeps showing the run."""
        process = self.process
        if process is None:
            return None

        def wait() -> None:
            code = process.wait()
            if self.stop_event.is_set():
                return
            if code == 0:
                echo("demo: the training finished; the dashboard keeps showing the run (Ctrl-C stops it)")
                return
            said = _last_error(self.log_path) or f"exit code {code}"
            echo(f"demo: {said}; the dashboard shows the run as it stopped (Ctrl-C stops it)")

        thread = threading.Thread(target=wait, name="megascope-demo-end", daemon=True)
        thread.start()
        return thread

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        if self.process is not None:
            # The job runs in its own process group: signal the launcher and every rank, and
            # escalate until the whole group is gone (a launcher may exit before its ranks do).
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                if _group_gone(self.process, timeout_s / 3):
                    break
            self.process.wait(timeout_s)
        if self.thread is not None:
            self.thread.join(timeout_s)


def _last_error(log_path: Path | None) -> str | None:
    """The trainer's one line of failure (``Error: ...``, its last), without the prefix."""
    if log_path is None or not log_path.is_file():
        return None
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith("Error: ")]
    return lines[-1][len("Error: "):] if lines else None


def _group_gone(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        process.poll()  # reap the launcher, else it lingers as a zombie member of its group
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def start_trainer(out: Path, *, steps: int, inject: str, probe_s: float = 4.0) -> DemoJob | None:
    """Start the bundled trainer; None if it is not available (it exits at once without a run)."""
    # Beside the run, not in it: the trainer may want its output directory to itself.
    log_path = out.parent / f"{out.name}.train.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(trainer_command(out, steps=steps, inject=inject), stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = process.wait(probe_s)
    except subprocess.TimeoutExpired:
        return DemoJob(out=out, process=process, description=f"bundled trainer (log: {log_path})", log_path=log_path)
    if (out / layout.RUN_JSON).exists():
        # It ran: finished already, or failed as planted (a crash at its first step), which the
        # dashboard shows; not a trainer that is missing.
        how = "finished" if code == 0 else f"ended: {_last_error(log_path) or f'exit code {code}'}"
        return DemoJob(out=out, process=process, description=f"bundled trainer ({how}; log: {log_path})",
                       log_path=log_path)
    last_line = (log_path.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
    log.warning("the bundled trainer is not available (%s); writing a synthetic run step by step instead", last_line)
    return None


def start_synthetic(out: Path, *, steps: int, inject: str, step_interval_s: float) -> DemoJob:
    """Fallback: a synthetic 2x2x2 run with the same straggler, replayed one step per interval."""
    from megascope.dashboard.replay import replay_run

    from megascope.inject import parse_injects
    from megascope.synth import SynthConfig, synth_run

    source = Path(tempfile.mkdtemp(prefix="megascope-demo-src-")) / "run"
    synth_run(source, SynthConfig(ranks=8, steps=steps, tp=DEMO_MESH["tp"], pp=DEMO_MESH["pp"],
                                  gpus_per_host=4, faults=parse_injects([inject])))
    job = DemoJob(out=out, description="synthetic run replayed step by step (bundled trainer not available)")

    def write() -> None:
        try:
            replay_run(source, out, step_interval_s=step_interval_s, stop=job.stop_event)
        except Exception:  # noqa: BLE001 - the server keeps showing what was written
            log.exception("demo replay failed")

    job.thread = threading.Thread(target=write, name="megascope-demo-replay", daemon=True)
    job.thread.start()
    return job


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(out: Path | None, *, host: str = "127.0.0.1", port: int = 8050, steps: int = 60,
             inject: str = DEMO_STRAGGLER, step_interval_s: float = 1.0, use_trainer: bool = True,
             echo: Callable[[str], None] = log.warning) -> Path:
    """Run the job and the dashboard until Ctrl-C; return the run directory (kept)."""
    from megascope.dashboard.app import create_app, registry_of

    if out is None:
        out = Path(tempfile.mkdtemp(prefix="megascope-demo-")) / "run"
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: already exists and is not empty; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    job = start_trainer(out, steps=steps, inject=inject) if use_trainer else None
    if job is None:
        job = start_synthetic(out, steps=steps, inject=inject, step_interval_s=step_interval_s)
    app = create_app([out], host=host, wait=True, poll_interval_s=1.0)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C must stop the demo even when started with SIGINT ignored (a background job of a
        # script), and a plain `kill` must stop it the same clean way.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _interrupt)
    echo(f"demo: {job.description}, writing {out}")
    echo(f"demo: dashboard at http://{host}:{port}/ (Ctrl-C stops both)")
    if job.process is not None and job.process.poll() is None:
        job.watch_end(echo)
    try:
        app.run(host=host, port=port, debug=False)
    finally:
        registry_of(app).stop()
        job.stop()
        echo(f"demo: stopped; the run stays in {out}")
    return out
