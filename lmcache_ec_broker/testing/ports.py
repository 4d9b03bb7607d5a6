"""Free TCP ports on 127.0.0.1 for the tests' and benchmarks' servers."""

from __future__ import annotations

import socket


def free_ports(n: int) -> int:
    """A base port p with p .. p+n-1 all free on 127.0.0.1 now (servers that take
    consecutive ports: the events' PUB p, ROUTER p+1, lookup p+2)."""
    for _ in range(500):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65000:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")
