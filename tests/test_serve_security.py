"""Who the dashboard answers: loopback names only without a token (no DNS rebinding), tokens that
mean something, any capitalisation of ``Bearer``, clean 404s, and a busy port in one line."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
from conftest import Synth
from megascope.dashboard.app import create_app
from megascope.dashboard.security import check_bind
from safety import assert_one_line_error, megascope

from megascope.errors import ConfigError


@pytest.fixture(scope="module")
def run_dir(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("serve") / "run", ranks=4, steps=3, tp=2, seed=2)


@pytest.mark.parametrize("host_header,allowed", [
    ("127.0.0.1:8050", True),
    ("localhost:8050", True),
    ("LOCALHOST", True),
    ("[::1]:8050", True),
    ("127.3.4.5", True),
    ("attacker.example:8050", False),
    ("attacker.example", False),
    ("127.0.0.1.attacker.example", False),
    ("10.0.0.7:8050", False),
])
def test_loopback_dashboard_answers_loopback_names_only(run_dir: Path, host_header: str, allowed: bool) -> None:
    app = create_app([run_dir], start_watcher=False)
    client = app.server.test_client()
    for path in ("/", "/metrics", "/_dash-layout"):
        status = client.get(path, headers={"Host": host_header}).status_code
        assert (status == 200) == allowed, (path, host_header, status)
        if not allowed:
            assert status == 403


def test_the_configured_host_name_is_accepted(run_dir: Path) -> None:
    app = create_app([run_dir], host="127.0.0.1", start_watcher=False)
    assert app.server.test_client().get("/metrics", headers={"Host": "127.0.0.1:9000"}).status_code == 200
    named = create_app([run_dir], host="dash.internal", token="a-long-token", start_watcher=False)
    client = named.server.test_client()
    auth = {"Authorization": "Bearer a-long-token"}
    assert client.get("/metrics", headers={"Host": "dash.internal:8050", **auth}).status_code == 200


@pytest.mark.parametrize("token", ["        ", " abcdefg ", "\t\t\t\t\t\t\t\t", "short", ""])
def test_tokens_that_mean_nothing_are_refused(token: str) -> None:
    with pytest.raises(ConfigError, match="--token"):
        check_bind("0.0.0.0", token)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_in_any_case(run_dir: Path, scheme: str) -> None:
    app = create_app([run_dir], host="0.0.0.0", token="s3cret-token", start_watcher=False)
    client = app.server.test_client()
    assert client.get("/metrics", headers={"Authorization": f"{scheme} s3cret-token"}).status_code == 200
    assert client.get("/metrics", headers={"Authorization": f"{scheme} wrong-token"}).status_code == 403


@pytest.mark.parametrize("path", [
    "/_dash-component-suites/no_such_package/x.js",
    "/_dash-component-suites/dash/../../../../etc/passwd",
    "/_dash-component-suites/dash/no-such-file.v9_9_9m1.js",
])
def test_bad_component_suite_paths_are_404_without_a_traceback(run_dir: Path, path: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    app = create_app([run_dir], start_watcher=False)
    client = app.server.test_client()
    with caplog.at_level(logging.DEBUG):
        status = client.get(path).status_code
    assert status == 404
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_port_in_use_is_one_line(run_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = megascope("serve", run_dir, "--port", str(port), timeout=120)
    assert_one_line_error(proc, mentions=str(port))
