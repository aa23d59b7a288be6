"""``HOST:PORT`` addresses as every setting and the pool write them
(``[IPV6]:PORT`` in brackets), and which hosts are loopback. Imports nothing
of kvd: the settings' rules, the pool's spec and the daemon's listeners all
read addresses here."""

from __future__ import annotations

import ipaddress


def parse_address(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` or ``[IPV6]:PORT``; port 0 asks the kernel for one."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, as [::1]:7070")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{text!r}: port {port} is above 65535")
    if not host:
        raise ValueError(f"{text!r} has no host")
    return host, port


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback IPs; any other name could resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
