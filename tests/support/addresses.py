"""Network addresses of the machine the tests run on."""

from __future__ import annotations

import socket


def outward_address() -> str | None:
    """This machine's IPv4 address on a non-loopback interface (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address
