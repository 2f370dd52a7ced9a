"""The connections to a dataset origin: to checked addresses only.

Only public addresses (``OriginPolicy``): every connection resolves its host here (``resolve``,
or the resolver given), checks every address it resolves to, and connects to a checked one
(never resolving again, so a name cannot pass the check and then lead elsewhere: DNS
rebinding); TLS still names the host (SNI, the certificate check). No proxy is ever used: one
would connect on the agent's behalf to wherever the name leads from there, past the check. No
cookie is kept (``NoCookies``): origins of different submitters share one client.
"""

from __future__ import annotations

import http.cookiejar
import logging
import socket
import ssl
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import httpcore
import httpx

from flashnode.coordinator.datasets import OriginPolicy

log = logging.getLogger(__name__)


class Refused(Exception):
    """A host resolved to an address the policy refuses (the message says what kind)."""

    def __init__(self, host: str, problem: str) -> None:
        super().__init__(f"{host} resolves to {problem}")


Resolver = Callable[[str, int], Sequence[str]]


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system's resolver), in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class CheckedBackend(httpcore.NetworkBackend):
    """httpcore's sockets, to checked addresses only (see the module docstring)."""

    def __init__(self, policy: Callable[[], OriginPolicy], resolver: Resolver) -> None:
        self._policy = policy
        self._resolve = resolver
        self._sockets = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = self._resolve(host, port)
        except OSError:
            raise httpcore.ConnectError("cannot resolve the host") from None
        if not addresses:
            raise httpcore.ConnectError("the host resolves to no address")
        policy = self._policy()
        for address in addresses:
            problem = policy.problem(address)
            if problem:
                log.info("dataset origin %s refused: %s is %s", host, address, problem)
                raise Refused(host, problem)
        failed: httpcore.ConnectError | httpcore.ConnectTimeout | None = None
        for address in addresses:
            try:
                return self._sockets.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc
        assert failed is not None
        raise failed

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("no data origin is a unix socket")

    def sleep(self, seconds: float) -> None:
        self._sockets.sleep(seconds)


class CheckedTransport(httpx.HTTPTransport):
    """httpx's transport (its request and error mapping), its connections made by
    ``CheckedBackend``."""

    def __init__(self, verify: ssl.SSLContext | bool, backend: CheckedBackend) -> None:
        # The pool httpx makes here (its ``_pool``, which its request handling uses) is replaced
        # at once: verify=False spares loading a trust store for it; the pool used verifies. Were
        # httpx to keep it elsewhere, the tests' refused origins would be fetched, and fail.
        super().__init__(verify=False, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=backend,
        )


class NoCookies(http.cookiejar.DefaultCookiePolicy):
    """Origins of different submitters share this client: nothing one sets reaches another."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False
