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
    if token is not None and len(token) < 8:
        raise ConfigError("--token must be at least 8 characters")
    if not is_loopback(host) and not token:
        raise ConfigError(f"--host {host} is not loopback: pass --token so that only people who have it can see the run")


def _matches(candidate: str | None, token: str) -> bool:
    return candidate is not None and hmac.compare_digest(candidate.encode(), token.encode())


def install_token_guard(server: flask.Flask, token: str) -> None:
    """Reject every request without the token (403, one line of text)."""

    @server.before_request
    def _require_token() -> WerkzeugResponse | None:
        req = flask.request
        auth = req.headers.get("Authorization", "")
        bearer = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
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
