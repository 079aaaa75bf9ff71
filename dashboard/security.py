"""Who may talk to the dashboard: loopback by default, a token for anything else.

Role in the data flow: guards the Flask server under the Dash app. A dashboard bound to a
non-loopback address shows a training job's hosts and timings to the network, so
``megascope serve --host 0.0.0.0`` refuses to start without ``--token``. With a token, every
request must carry it once: ``?token=...`` in the first URL (answered with an HttpOnly cookie so
later requests and Dash's own callbacks carry it), an ``Authorization: Bearer ...`` header
(Prometheus' ``authorization`` setting), or the cookie.

Example::

    check_bind("0.0.0.0", token=None)        # raises ConfigError
    install_token_guard(app.server, "s3cret")
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from urllib.parse import urlencode

import flask
from werkzeug.wrappers import Response as WerkzeugResponse

from megascope.errors import ConfigError

log = logging.getLogger(__name__)

COOKIE = "megascope_token"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; anything else may be reachable from outside."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: may resolve to anything


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve beyond loopback without a token (and refuse a token too short to matter)."""
    if token is not None and (len(token.strip()) < 8 or token != token.strip()):
        raise ConfigError("--token must be at least 8 characters, not counting spaces, with no spaces at either end")
    if not is_loopback(host) and not token:
        raise ConfigError(f"--host {host} is not loopback: pass --token so that only people who have it can see the run")


def _matches(candidate: str | None, token: str) -> bool:
    return candidate is not None and hmac.compare_digest(candidate.encode(), token.encode())


def install_token_guard(server: flask.Flask, token: str) -> None:
    """Reject every request without the token (403, one line of text)."""

    @server.before_request
    def _require_token() -> WerkzeugResponse | None:
        req = flask.request
        scheme, _, credentials = req.headers.get("Authorization", "").strip().partition(" ")
        bearer = credentials.strip() if scheme.lower() == "bearer" else None  # schemes are case-insensitive
        if _matches(req.cookies.get(COOKIE), token) or _matches(bearer, token):
            return None
        if _matches(req.args.get("token"), token):
            # Drop the token from the address bar (and from history) once the cookie is set.
            query = urlencode([(k, v) for k, v in req.args.items(multi=True) if k != "token"])
            response = flask.redirect(req.path + (f"?{query}" if query else ""), code=302)
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
            return response
        log.info("refused %s %s from %s: no valid token", req.method, req.path, req.remote_addr)
        return flask.Response("megascope: a valid token is required (open the URL with ?token=...)\n",
                              status=403, mimetype="text/plain")


def host_name(header: str) -> str:
    """The name part of a ``Host`` header: ``[::1]:8050`` -> ``::1``, ``LocalHost:80`` -> ``localhost``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def install_host_guard(server: flask.Flask, host: str) -> None:
    """Answer only requests addressed to a loopback name or to ``host`` (403 otherwise).

    A dashboard without a token trusts whoever can reach it, which on loopback means this machine.
    A web page elsewhere can still make the browser reach it under the page's own name (DNS
    rebinding: attacker.example resolving to 127.0.0.1), so the name the request was sent to must
    be one of this machine's.
    """
    allowed = {host_name(host)}

    @server.before_request
    def _require_local_host() -> WerkzeugResponse | None:
        name = host_name(flask.request.headers.get("Host", ""))
        if name in allowed or is_loopback(name):
            return None
        log.info("refused %s %s addressed to %r: not a loopback name", flask.request.method, flask.request.path, name)
        return flask.Response("megascope: this dashboard answers to localhost only (serve with --host and --token "
                              "to share it)\n", status=403, mimetype="text/plain")


def install_not_found_for_bad_assets(server: flask.Flask) -> None:
    """A request for a script Dash does not have is a 404, not a 500 with a traceback in the log."""
    from dash.exceptions import DependencyException

    @server.errorhandler(DependencyException)
    def _missing_dependency(exc: Exception) -> WerkzeugResponse:
        log.info("no such dashboard asset: %s", flask.request.path)
        return flask.Response("megascope: no such file\n", status=404, mimetype="text/plain")


def install_guards(server: flask.Flask, *, host: str, token: str | None) -> None:
    """Every rule of this module on ``server``: the token where one is set, else loopback names only."""
    if token:
        install_token_guard(server, token)
    else:
        install_host_guard(server, host)
    install_not_found_for_bad_assets(server)
