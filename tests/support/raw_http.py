"""HTTP/1.1 requests written by hand on a socket, for what clients will not send: a Content-Length
that the body never fills, a chunked body that never ends."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def post(url: str, headers: dict[str, str], body: Iterable[bytes] = (), timeout_s: float = 30.0) -> RawResponse:
    """Send the request line, `headers` and the pieces of `body` as they are, then read the response
    without finishing the body (the server must answer before the end, or time runs out)."""
    parts = urlsplit(url)
    head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
            *(f"{name}: {value}" for name, value in headers.items())]
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        for piece in body:
            sock.sendall(piece)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return RawResponse(response.status, response.read())


def chunked(pieces: Iterable[bytes]) -> Iterable[bytes]:
    """`pieces` as chunks of a Transfer-Encoding: chunked body, without the closing empty chunk."""
    for piece in pieces:
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
