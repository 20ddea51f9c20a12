"""What the gateway's HTTP front allows one connection and one request (``HttpLimits``); enforced by
``gateway/http_connections.py`` (connections) and ``gateway/http.py`` (requests). Kept apart so
that the command line reads the defaults without importing the server."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

REQUEST_TIMEOUT_HEADER = "X-Request-Timeout"  # seconds a client gives its request (at most the maximum)


@dataclass(frozen=True)
class HttpLimits:
    """Time limits in seconds. A client that exceeds one is answered 408 (504 for the deadline) and,
    for the head, the body and idleness, its connection is closed."""

    # From a request's first byte until its head (request line and headers) is complete.
    header_timeout_s: float = 10.0
    # From a complete head until the body is read (a body the front does not read, after a refusal,
    # is drained for at most as long before the connection closes).
    body_timeout_s: float = 30.0
    # An open connection without a complete request head this long after it opened or after its
    # previous response is closed.
    keepalive_timeout_s: float = 15.0
    # Connections open at once; one opened past it is answered 503 and closed.
    max_connections: int = 1024
    # A request's deadline, from its head: the generation ends with 504 past it. A client may ask
    # for less (or, up to max_request_timeout_s, more) in the X-Request-Timeout header.
    request_timeout_s: float = 600.0
    max_request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"HTTP limit {f.name} must be a positive number, not {value!r}")
        if self.max_request_timeout_s < self.request_timeout_s:
            raise ValueError(f"HTTP limits: the maximum request timeout ({self.max_request_timeout_s:g} s) is below "
                             f"the default ({self.request_timeout_s:g} s)")

    def request_timeout(self, asked: float | None) -> float:
        """The deadline (seconds) of a request whose client asked for ``asked`` (None: the default)."""
        return self.request_timeout_s if asked is None else min(asked, self.max_request_timeout_s)


# flag -> (HttpLimits field, type, help)
_FLAGS = {
    "--http-header-timeout": ("header_timeout_s", float,
                              "HTTP: seconds from a request's first byte to its complete head (else 408, closed)"),
    "--http-body-timeout": ("body_timeout_s", float,
                            "HTTP: seconds from a request's head to its whole body (else 408, closed)"),
    "--http-keepalive-timeout": ("keepalive_timeout_s", float,
                                 "HTTP: close a connection with no request this long after it opened or after "
                                 "its previous response (seconds)"),
    "--http-max-connections": ("max_connections", int, "HTTP: connections open at once (past it: 503 and closed)"),
    "--http-request-timeout": ("request_timeout_s", float,
                               "HTTP: a request's deadline in seconds (past it: 504); clients may ask for another "
                               f"in the {REQUEST_TIMEOUT_HEADER} header"),
    "--http-max-request-timeout": ("max_request_timeout_s", float,
                                   f"HTTP: the longest deadline a client may ask for in {REQUEST_TIMEOUT_HEADER}"),
}


def add_http_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags for ``HttpLimits`` (defaults: the dataclass's)."""
    defaults = HttpLimits()
    for flag, (name, kind, help_text) in _FLAGS.items():
        parser.add_argument(flag, type=kind, default=getattr(defaults, name), help=help_text)


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """``HttpLimits`` from the flags; ``SystemExit`` naming what is wrong."""
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _, _) in _FLAGS.items()}
    try:
        return HttpLimits(**values)
    except ValueError as exc:
        raise SystemExit(f"gateway: {exc}") from exc
