"""A door into a network namespace: a Unix socket on this machine's file system whose connections
are relayed to a TCP address inside the namespace (``python -m varuna.testing.forward PATH HOST
PORT``, started inside it by :meth:`varuna.testing.netns.NetHosts.door`).

Why: the hosts of :mod:`varuna.testing.netns` have addresses only inside their namespaces, by
design; a test that runs ``varuna-manager`` in the set's control namespace still has to talk to it
(status, events) from its own process. A Unix socket is reachable from every network namespace
(its name lives in the file system), so a gRPC client dials ``unix:PATH`` and this relay, running
in the control namespace, connects to the manager there. It dies with the process that started it.

Example::

    door = net.door(tmp_path / "manager.sock", None, 7878)  # the manager in the control namespace
    client = ManagerClient(ClientConfig(address=f"unix:{tmp_path / 'manager.sock'}", token=token))
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import sys
import threading

__all__ = ["main"]


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def main(argv: list[str] | None = None) -> int:
    path, host, port = (argv if argv is not None else sys.argv[1:])[:3]
    from varuna.core.process import PR_SET_PDEATHSIG, libc_prctl

    prctl = libc_prctl()
    if prctl is not None:  # a test killed with SIGKILL takes its door with it
        prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)

    class Relay(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            try:
                upstream = socket.create_connection((host, int(port)), timeout=10)
            except OSError:
                return
            upstream.settimeout(None)
            back = threading.Thread(target=_pump, args=(upstream, self.request), daemon=True)
            back.start()
            _pump(self.request, upstream)
            back.join()
            upstream.close()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    socketserver.ThreadingUnixStreamServer.daemon_threads = True
    with socketserver.ThreadingUnixStreamServer(path, Relay) as server:
        print("ready", flush=True)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
