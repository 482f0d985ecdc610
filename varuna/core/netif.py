"""Which local address and network interface reach a given host (Note [Interface towards a host]).

Note [Interface towards a host]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
gloo binds every rank's sockets to one interface: ``GLOO_SOCKET_IFNAME`` if set, else the address
this machine's *host name* resolves to. Many images map the host name to a loopback address
(``127.0.1.1``, or ``127.0.0.1`` as in containers), so a rank on another host is told to connect to
its own loopback and the job fails seconds later with the cause only inside a traceback. The
kernel already knows the right answer: a UDP socket *connected* to the rendezvous address (no
packet is sent) gets the source address the routing table would use (:func:`source_address`);
the interface holding that address (``getifaddrs``, :func:`interface_of`) is the one gloo must
bind to. On the host that holds the address itself the route is local, but the source address is
the address itself, so its interface (not ``lo``) is found the same way.

Example::

    >>> source_address("127.0.0.1")
    '127.0.0.1'
    >>> interface_of("127.0.0.1")
    'lo'
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket

__all__ = ["interface_of", "interface_towards", "source_address"]


def source_address(host: str, port: int = 9) -> str:
    """The local address this machine sends from to reach ``host`` (a name or an address);
    ``OSError`` when there is no route (no packet is sent: a connected UDP socket only asks the
    routing table).

    Example::

        >>> source_address("localhost") in ("127.0.0.1", "::1")
        True
    """
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.connect(where)
        return str(sock.getsockname()[0]).split("%", 1)[0]


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("broadaddr", ctypes.POINTER(_SockAddr)),
    ("data", ctypes.c_void_p),
]


def _addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` for every IPv4/IPv6 address of this machine (``getifaddrs``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr:
                family = entry.addr.contents.family
                raw = bytes(entry.addr.contents.data)
                # sockaddr_in: port (2 bytes), then the address; sockaddr_in6: port, flowinfo (4), address.
                if family == socket.AF_INET:
                    found.append((entry.name.decode(), str(ipaddress.IPv4Address(raw[2:6]))))
                elif family == socket.AF_INET6:
                    found.append((entry.name.decode(), str(ipaddress.IPv6Address(raw[6:22]))))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found


def interface_of(address: str) -> str | None:
    """The interface that holds ``address`` on this machine, or None.

    Example::

        >>> interface_of("198.51.100.254") is None     # TEST-NET-2: nobody's address
        True
    """
    want = ipaddress.ip_address(address)
    for name, addr in _addresses():
        if ipaddress.ip_address(addr) == want:
            return name
    return None


def interface_towards(host: str) -> tuple[str, str]:
    """``(interface, source address)`` this machine uses to reach ``host``; ``OSError`` naming
    the reason when there is no route or no interface holds the source address.

    Example::

        >>> interface_towards("127.0.0.1")
        ('lo', '127.0.0.1')
    """
    source = source_address(host)
    name = interface_of(source)
    if name is None:
        raise OSError(f"no interface holds {source}, the source address of the route to {host}")
    return name, source
