"""The HTTP server's guards: per-connection deadlines and a connection cap
(`guarded_protocol`, uvicorn's h11 protocol), and `AccessGuard` (Host check on a loopback
address, the API key, JSON bodies only)."""

from __future__ import annotations

import json

from medusa_jax.serving.errors import APIError, error_body

# ----------------------------------------------------------------------------- connections


def _raw_error(status: int, reason: str, message: str, type_: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for a connection whose
    request never reached the app (so h11's state machine cannot answer it)."""
    body = json.dumps(error_body(message, type_, None, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def guarded_protocol(request_timeout: float, max_connections: int):
    """uvicorn's h11 protocol with a deadline on each request's arrival and a cap on open
    connections (uvicorn has neither: a connection that never finishes its headers holds
    its descriptor for ever, and `limit_concurrency` only answers 503 once headers are in).

    - A request's headers and body must have arrived `request_timeout` seconds after the
      connection opened or its previous answer was sent; else a 408 (nothing if it sent
      nothing) and the connection closes.
    - Past `max_connections` open connections, a new one closes the oldest connection
      that is not running a request (one idle, or still sending its request: that one
      gets a 503), so a new client (a /health probe) always gets in while the descriptors
      last; when every connection runs a request, the new one gets the 503 instead."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting = (h11.IDLE, h11.SEND_BODY)  # a request's headers or body still to come
    busy = _raw_error(503, "Service Unavailable", f"too many open connections (the limit is "
                      f"{max_connections}, --max-connections)", "server_error",
                      "too_many_connections")
    late = _raw_error(408, "Request Timeout", f"the request did not arrive within "
                      f"{request_timeout:g} s (--request-timeout)", "invalid_request_error",
                      "request_timeout")
    opened: dict[H11Protocol, None] = {}  # open connections, oldest first

    class Guarded(H11Protocol):
        _deadline = None
        _got = False  # bytes of the awaited request have arrived

        def connection_made(self, transport):
            super().connection_made(transport)
            opened[self] = None
            if len(opened) > max_connections:
                idle = next((c for c in opened if c is not self and c._idle()), None)
                if idle is None:
                    self._close(busy)
                    return
                # an idle kept-alive connection closes silently: its client would read a
                # 503 written there as the answer to its next request
                idle._close(busy if idle._got else b"")
            self._watch()

        def connection_lost(self, exc):
            opened.pop(self, None)
            self._unarm()
            super().connection_lost(exc)

        def data_received(self, data):
            self._got = True
            super().data_received(data)
            self._watch()

        def on_response_complete(self):
            super().on_response_complete()
            self._got = False
            self._unarm()  # the next request's time starts now
            self._watch()

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _watch(self):
            """The deadline runs while a request is awaited, and stops once it is in."""
            if self.transport.is_closing() or self.conn.their_state not in waiting:
                self._unarm()
            elif self._deadline is None:
                self._deadline = self.loop.call_later(request_timeout, self._expire)

        def _unarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self):
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state not in waiting:
                return
            answered = self.cycle is not None and not self.cycle.response_complete and \
                self.cycle.response_started
            self._close(late if self._got and not answered else b"")

        def _close(self, response: bytes):
            """Answer `response` (if any) and close; a request the app is reading hears
            that its client is gone."""
            if self.cycle is not None and not self.cycle.response_complete:
                if response:
                    self.cycle.response_started = self.cycle.response_complete = True
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            if response and not self.transport.is_closing():
                self.transport.write(response)
            self.transport.close()
            opened.pop(self, None)
            self._unarm()

    return Guarded


# ----------------------------------------------------------------------------- access


def loopback_hosts(host: str) -> frozenset[str] | None:
    """The Host header names a server bound to `host` answers to when `host` is a loopback
    address (a page on another site can reach a local server through DNS rebinding, but
    its requests carry that site's name); None when `host` is not loopback (no check)."""
    import ipaddress

    try:
        address = ipaddress.ip_address(host)
        # ::ffff:127.0.0.1 is 127.0.0.1 (Python 3.11's is_loopback says no to the IPv6 form)
        loopback = (getattr(address, "ipv4_mapped", None) or address).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return None
    return frozenset({"localhost", "127.0.0.1", "[::1]", host if ":" not in host
                      else f"[{host}]"})


def _host_name(value: str) -> str:
    """A Host header's name without its port ("[::1]:8000" -> "[::1]")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[:value.find("]") + 1]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class AccessGuard:
    """ASGI middleware in front of the app: a Host check on a loopback-bound server, the
    API key on /v1/ (`Authorization: Bearer KEY`, as OpenAI's clients send it; /health and
    /metrics stay open to probes and scrapers), and JSON bodies only on POST (a browser
    page may send text/plain, form and multipart bodies to any site without asking first,
    JSON only after a CORS preflight this server never grants)."""

    def __init__(self, app, api_key: str | None = None,
                 allowed_hosts: frozenset[str] | None = None):
        self.app, self.allowed_hosts = app, allowed_hosts
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal.response()(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        import hmac

        headers = dict(scope["headers"])  # names arrive lower-cased
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host and _host_name(host) not in self.allowed_hosts:
                return APIError(403, f"Host {host[:100]!r} is not this server's: bound to a "
                                     f"loopback address, it answers only to "
                                     f"{', '.join(sorted(self.allowed_hosts))}",
                                type_="permission_error", code="invalid_host")
        if not scope["path"].startswith("/v1/"):
            return None
        if self.api_key is not None:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(),
                                                                      self.api_key):
                return APIError(401, "Incorrect or missing API key: send it as "
                                     "'Authorization: Bearer KEY' (--api-key)",
                                type_="invalid_request_error", code="invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                shown = kind.decode("latin-1")[:100] or "none"
                return APIError(415, f"the body must be JSON with Content-Type "
                                     f"application/json (got {shown})",
                                code="unsupported_media_type")
        return None
