"""Servers as the gateway names them: `ip:port`.

Agents register the URL the router reaches them at; in a cluster that is the pod's DNS name under the
pool's headless Service, while the gateway forwards to (and hints subsets of) pod IPs. So the picker
resolves every registered host to its address, off the request path: `refresh` runs once per
registry poll, and a request only reads the cache. A server whose host does not resolve yet is not
offered to the gateway.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

from loraplex.routing.records import ServerRecord

log = logging.getLogger("loraplex.router")


class Endpoints:
    def __init__(self) -> None:
        self._addresses: dict[str, str] = {}  # registered host -> its IP address

    def of(self, server: ServerRecord) -> str | None:
        """The server's `ip:port` (`[ip]:port` for IPv6), None while its host is unresolved."""
        parts = urlsplit(server.url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        if not host:
            return None
        address = host if _is_ip(host) else self._addresses.get(host)
        if address is None:
            return None
        return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"

    def table(self, servers: Mapping[str, ServerRecord]) -> dict[str, str]:
        """Server id -> endpoint, for the servers whose endpoint is known."""
        return {sid: ep for sid, s in servers.items() if (ep := self.of(s)) is not None}

    async def refresh(self, servers: Mapping[str, ServerRecord]) -> None:
        """Resolves the registered hosts again; a host that fails keeps its last address."""
        hosts = {h for s in servers.values() if (h := urlsplit(s.url).hostname) and not _is_ip(h)}
        loop = asyncio.get_running_loop()
        resolved = await asyncio.gather(*(loop.getaddrinfo(h, None, type=socket.SOCK_STREAM) for h in hosts),
                                        return_exceptions=True)
        addresses = {}
        for host, result in zip(hosts, resolved, strict=True):
            if isinstance(result, BaseException) or not result:
                log.debug("cannot resolve server host %s: %r", host, result)
                if host in self._addresses:
                    addresses[host] = self._addresses[host]
                continue
            addresses[host] = str(result[0][4][0])
        self._addresses = addresses


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
