"""The HTTP server's listening sockets. Rank 0 binds them before the model loads (an address it cannot have is said
then, not minutes later) and holds them, not listening, until it hands them to each front-end process (uvicorn serves
the sockets it is given, and listens on them): several front ends (--api-server-count) share one address, the kernel
giving each new connection to one of them."""

from __future__ import annotations

import errno
import os
import socket

from tpgraph.errors import ConfigError
from tpgraph.server.options import check_unix_socket

UDS_MODE = 0o666  # (uvicorn's for a socket file it binds: the umask's would refuse other users' connections)


def front_end_sockets(host: str, port: int, uds: str | None, count: int) -> list[list[socket.socket]]:
    """Each of `count` front ends' sockets (bind_sockets'). Over TCP, several front ends get a set each, bound with
    SO_REUSEPORT, among which the kernel spreads new connections: one socket shared let the front end that woke first
    take a whole burst of connections (asyncio accepts up to its backlog at a wake-up; 64 streams at once all went to
    one of two, bench/bench_api_servers.py). A Unix socket has no SO_REUSEPORT: its one socket is shared."""
    if uds is not None or count == 1:
        return [bind_sockets(host, port, uds)] * count
    # (first as a lone server: refused where a server listens, also one of ours with SO_REUSEPORT, which the copies
    # below would join, splitting the connections with it)
    lone = bind_sockets(host, port)
    port = lone[0].getsockname()[1]  # (port 0: the one the kernel chose, for every copy)
    close_sockets(lone)
    copies: list[list[socket.socket]] = []
    try:
        for _ in range(count):
            copies.append(bind_sockets(host, port, reuse_port=True))
    except ConfigError:
        close_sockets([sock for each in copies for sock in each])
        raise
    return copies


def bind_sockets(host: str, port: int, uds: str | None = None, reuse_port: bool = False) -> list[socket.socket]:
    """Every address the server listens on, bound (not listening: a connection before a front end serves is refused,
    not left waiting): each address `host` resolves to (an empty host: every interface, as uvicorn's asyncio server
    binds it), else the Unix socket `uds` (a stopped server's socket file there is taken over, as asyncio does; a live
    one's is refused); reuse_port: with SO_REUSEPORT, beside this process's other such sockets there. Raises
    ConfigError naming the address where it cannot."""
    if uds is not None:
        return [_bind_unix(uds)]
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        bound: list[socket.socket] = []
        unusable: list[OSError] = []
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                bound.append(_bind(family, kind, proto, address, reuse_port))
            except OSError as exc:  # (asyncio passes over an address of a family this host has not enabled)
                if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    close_sockets(bound)
                    raise
                unusable.append(exc)
        if not bound:  # (none to listen on: not this host's address)
            raise unusable[0]
        return bound
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host or '*'}:{port}: {exc.strerror or exc}") from None


def _bind(family: int, kind: int, proto: int, address: tuple, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:  # (as asyncio binds it: beside the IPv4 socket, not over it)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _bind_unix(path: str) -> socket.socket:
    check_unix_socket(path)  # (a live server's socket, or no socket, or no directory: refused, saying which)
    # (as uvicorn leaves it: 0o666, so that a proxy running as another user connects, or a stale socket file's mode)
    mode = UDS_MODE
    if os.path.exists(path):  # a stopped server's socket file: taken over
        mode = os.stat(path).st_mode
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on --uds {path}: {exc.strerror or exc}") from None
    return sock


class ListenPoints:
    """Where several front ends' SO_REUSEPORT sockets listen, and which sockets are theirs, to find another server's
    among them: one of ours started on the port while this one loaded binds there too (neither yet listens, and
    SO_REUSEADDR lets both bind), and once both listen the kernel splits the connections between the two servers,
    where a lone server's listen would fail. Taken from rank 0's copies before they are handed over (Linux's
    /proc/net/tcp and tcp6 list every listening socket, by address and inode)."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self.addresses = {_point(sock.family, sock.getsockname()) for sock in sockets}
        self.inodes = {os.fstat(sock.fileno()).st_ino for sock in sockets}

    def others(self, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> list[str]:
        """Other sockets listening where ours do (as host:port), from the kernel's tables (none where unreadable)."""
        found = []
        for table in tables:
            try:
                with open(table) as rows:
                    lines = rows.readlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if len(fields) < 10 or fields[3] != _LISTEN or int(fields[9]) in self.inodes:
                    continue
                address, port = _proc_address(fields[1])
                # (ours on every interface: one listening on any address of the family takes that address's share)
                if (address, port) in self.addresses or (bytes(len(address)), port) in self.addresses:
                    family = socket.AF_INET if len(address) == 4 else socket.AF_INET6
                    found.append(f"{socket.inet_ntop(family, address)}:{port}")
        return list(dict.fromkeys(found))  # (each address once, however many sockets listen there)


_LISTEN = "0A"  # (TCP_LISTEN's state in /proc/net/tcp)


def _point(family: int, name: tuple) -> tuple[bytes, int]:
    return socket.inet_pton(family, name[0].partition("%")[0]), name[1]


def _proc_address(text: str) -> tuple[bytes, int]:
    """/proc/net/tcp's local_address ("0100007F:1F90": the address's 32-bit words each in host order, little-endian
    here) as packed bytes and a port."""
    hex_address, _, hex_port = text.partition(":")
    raw = bytes.fromhex(hex_address)
    return b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)), int(hex_port, 16)


def private_socket_path(scratch: str) -> str:
    """Front end 0's Unix socket for the other front ends' Responses API relays, in their shared directory."""
    return os.path.join(scratch, "responses.sock")


def bind_private(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:  # (a temporary directory deep enough to pass the kernel's 108 bytes: TMPDIR)
        sock.close()
        raise ConfigError(f"cannot make the front ends' private socket {path} for the Responses API: "
                          f"{exc.strerror or exc} (set TMPDIR to a shorter directory)") from None
    return sock


def check_private_socket(scratch: str) -> None:
    """Refuse a shared directory where front end 0's private socket cannot be bound (said before the model loads)."""
    path = private_socket_path(scratch)
    bind_private(path).close()
    os.unlink(path)


def close_sockets(sockets: list[socket.socket]) -> None:
    """Close this process's copies (a front end's own stay open)."""
    for sock in sockets:
        sock.close()
