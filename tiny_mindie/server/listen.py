"""Accepting connections: every descriptor counted from ``accept()``, the TLS handshake under its
own deadline, and a log line for each kind of refusal.

``asyncio.start_server`` hands a connection over only after its TLS handshake and gives that
handshake 60 s, so sockets that never send a byte hold descriptors that no limit sees. Here each
listener accepts by itself (``loop.sock_accept``) and then does the handshake
(``loop.connect_accepted_socket``):

* a connection holds one of the shared :class:`ConnectionSlots` from ``accept()`` on, handshake
  included;
* when every slot is taken, the connection that has waited longest in its TLS handshake is closed
  to make room (a client with a certificate finishes its handshake in milliseconds, so the
  oldest is a silent socket); when every slot holds a connection past its handshake, the new one
  is closed at once (no HTTP answer is possible before the handshake). Without TLS there is no
  handshake: the new connection gets a 503 answer on a connection outside the slots, as before;
* the handshake has ``handshake_timeout`` seconds;
* refused handshakes, handshake timeouts, closed connections and ``accept()`` failing for want of
  descriptors (EMFILE, ENFILE) are logged, one line at most per kind every 10 s, with a count.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import ssl
import time
from typing import Awaitable, Callable

from ..config import ConfigError
from .tls import describe_refusal

log = logging.getLogger("tiny_mindie.server")

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

READ_LIMIT = 2 ** 20            # StreamReader buffer limit (bytes)
LISTEN_BACKLOG = 4096           # connections the kernel queues before accept() (it caps this at
                                # net.core.somaxconn); they hold no descriptor of ours
ACCEPT_RETRY_SECONDS = 0.1      # wait before accepting again after EMFILE / ENFILE
LOG_EVERY_SECONDS = 10.0        # at most one line per kind of refusal this often
FD_SPARE = 32                   # descriptors kept free for the process beside its connections
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class RateLimitedLog:
    """Log one kind of event at most once per ``every`` seconds: the first at once, the others of
    the window as one line with their count when the window ends (called on an event loop)."""

    def __init__(self, level: int, every: float = LOG_EVERY_SECONDS, logger: logging.Logger = log):
        self.level, self.every, self.logger = level, every, logger
        self.window_end = 0.0
        self.held = 0            # events not logged in this window
        self.last = ""
        self.flush_handle: asyncio.TimerHandle | None = None

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now >= self.window_end and not self.held:
            self.window_end = now + self.every
            self.logger.log(self.level, "%s", message)
            return
        self.held += 1
        self.last = message
        if self.flush_handle is None:
            loop = asyncio.get_running_loop()
            self.flush_handle = loop.call_later(max(0.0, self.window_end - now), self._flush)

    def _flush(self) -> None:
        self.flush_handle = None
        if self.held:
            self.logger.log(self.level, "%s (%d like this in the last %g s)", self.last,
                            self.held, self.every)
            self.held = 0
            self.window_end = time.monotonic() + self.every


class ConnectionSlots:
    """At most ``limit`` connections open at once, counted from ``accept()``; shared by the
    listeners of one server.

    Attributes:
        limit: the number of slots.
        handshaking: the connection tasks still in their TLS handshake, oldest first, with
            (peer, accept time).
        established: connections past their handshake (or plain TCP ones).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.handshaking: dict[asyncio.Task, tuple[str, float]] = {}
        self.evicted: set[asyncio.Task] = set()
        self.established = 0

    @property
    def open(self) -> int:
        """Connections holding a slot."""
        return len(self.handshaking) + self.established

    def evict_oldest_handshake(self) -> tuple[str, float] | None:
        """Close the connection that has waited longest in its handshake, freeing its slot;
        returns its (peer, seconds waited), or None when no connection is in its handshake."""
        if not self.handshaking:
            return None
        task, (peer, t0) = next(iter(self.handshaking.items()))
        del self.handshaking[task]
        self.evicted.add(task)
        task.cancel()
        return peer, time.monotonic() - t0


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open descriptors (RLIMIT_NOFILE) to its hard limit,
    logging it; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    target = hard
    if hard == resource.RLIM_INFINITY:      # Linux caps descriptors at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as fh:
                target = int(fh.read())
        except (OSError, ValueError):
            target = 1 << 20
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("open files limit (RLIMIT_NOFILE) raised from %d to %d", soft, target)
            return target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit (RLIMIT_NOFILE) from %d to %d: %s",
                        soft, target, exc)
            return soft
    log.info("open files limit (RLIMIT_NOFILE): %d", soft)
    return soft


def descriptors_in_use() -> int:
    """Open descriptors of this process (0 when the system does not say)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d))
        except OSError:
            continue
    return 0


def connection_limit(max_link_num: int) -> int:
    """``maxLinkNum`` capped by the descriptors this process may still open (after raising its
    soft limit to the hard one, less :data:`FD_SPARE`); a warning when the cap bites."""
    nofile = raise_open_files_limit()
    room = nofile - descriptors_in_use() - FD_SPARE
    if room < max_link_num:
        log.warning("maxLinkNum %d does not fit the open files limit (%d descriptors, %d in use): "
                    "at most %d connections at once; raise the limit (ulimit -n, LimitNOFILE=) "
                    "to have maxLinkNum", max_link_num, nofile, descriptors_in_use(), max(1, room))
    return max(1, min(max_link_num, room))


def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening, non-blocking sockets on every address of ``host`` (as ``asyncio.start_server``).

    Raises:
        ConfigError: ``host`` cannot be resolved (named in the message).
        OSError: naming the address: it is in use or is not on this machine.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: the address {host!r} cannot be "
                          f"resolved ({exc.strerror})") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class TCPListener:
    """Accepts on the sockets of one address and serves each connection (see the module doc).

    Args:
        socks: listening sockets from :func:`bind`.
        serve: ``async (reader, writer)``: serves a connection until it closes.
        refuse: ``async (reader, writer)``: answers a plain-TCP connection that finds no free
            slot (a 503); unused with TLS, where such a connection is closed at once.
        slots: the server's shared :class:`ConnectionSlots`.
        ssl_ctx: the server's TLS context, or None for plain TCP.
        handshake_timeout: seconds a connection has to finish its TLS handshake.
    """

    def __init__(self, socks: list[socket.socket], serve: Serve, refuse: Serve, *,
                 slots: ConnectionSlots, ssl_ctx: ssl.SSLContext | None, handshake_timeout: float,
                 logs: "RefusalLogs"):
        self.sockets = socks
        self.serve, self.refuse = serve, refuse
        self.slots, self.ssl_ctx, self.handshake_timeout = slots, ssl_ctx, handshake_timeout
        self.logs = logs
        self.tasks: set[asyncio.Task] = set()
        self.accepting = [asyncio.get_running_loop().create_task(self._accept(s)) for s in socks]

    def close(self) -> None:
        """Stop accepting and close the listening sockets (open connections go on)."""
        for task in self.accepting:
            task.cancel()
        for sock in self.sockets:
            sock.close()

    async def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(lsock)
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    code = errno.errorcode.get(exc.errno, exc.errno)
                    self.logs.exhausted(
                        f"accept() failed: {exc.strerror} ({code}) with {self.slots.open} "
                        f"connections open (limit {self.slots.limit}) and "
                        f"{descriptors_in_use()} descriptors in use; new connections wait in "
                        f"the listen backlog")
                elif exc.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    log.error("accept() failed: %s", exc)
                else:
                    continue
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            await self._admit(sock, _peer(peer))

    async def _admit(self, sock: socket.socket, peer: str) -> None:
        slots = self.slots
        if slots.open >= slots.limit and self.ssl_ctx is not None:
            # The handshakes already started must have their transports before one is chosen
            # to close (a task cancelled before its first step would never close its socket).
            await asyncio.sleep(0)
            if slots.open >= slots.limit:
                gone = slots.evict_oldest_handshake()
                if gone is None:
                    self.logs.full(f"connection limit ({slots.limit}) reached, every connection "
                                   f"past its handshake: closed the new connection from {peer}")
                    sock.close()
                    return
                self.logs.evicted(f"connection limit ({slots.limit}) reached: closed the "
                                  f"connection from {gone[0]} after {gone[1]:.1f} s in its TLS "
                                  f"handshake to admit {peer}")
        over = slots.open >= slots.limit           # plain TCP only: answered with a 503
        task = asyncio.get_running_loop().create_task(self._connection(sock, peer, over))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if over:
            return
        if self.ssl_ctx is None:
            slots.established += 1
        else:
            slots.handshaking[task] = (peer, time.monotonic())

    async def _connection(self, sock: socket.socket, peer: str, over: bool) -> None:
        task = asyncio.current_task()
        slots = self.slots
        if self.ssl_ctx is None:
            try:
                reader, writer = await _open(sock, None, 0)
                await (self.refuse if over else self.serve)(reader, writer)
            finally:
                if not over:
                    slots.established -= 1
            return
        try:
            reader, writer = await _open(sock, self.ssl_ctx, self.handshake_timeout)
        except asyncio.CancelledError:
            if task in slots.evicted:      # closed to make room; logged by the acceptor
                slots.evicted.discard(task)
                return
            raise
        except ssl.SSLError as exc:
            self.logs.refused(f"refused TLS client {peer}: {describe_refusal(exc)}")
            return
        except ConnectionAbortedError as exc:     # the loop's handshake timeout
            self.logs.timed_out(f"closed the connection from {peer}: no TLS handshake within "
                                f"{self.handshake_timeout:g} s ({exc})")
            return
        except OSError as exc:                    # the client went away
            log.debug("TLS handshake with %s ended: %r", peer, exc)
            return
        finally:
            slots.handshaking.pop(task, None)
        slots.established += 1
        try:
            await self.serve(reader, writer)
        finally:
            slots.established -= 1


class RefusalLogs:
    """The rate-limited log lines of a server's listeners, one per kind."""

    def __init__(self, every: float = LOG_EVERY_SECONDS):
        self.refused = RateLimitedLog(logging.WARNING, every)
        self.timed_out = RateLimitedLog(logging.WARNING, every)
        self.evicted = RateLimitedLog(logging.WARNING, every)
        self.full = RateLimitedLog(logging.WARNING, every)
        self.exhausted = RateLimitedLog(logging.ERROR, every)


async def _open(sock: socket.socket, ssl_ctx: ssl.SSLContext | None,
                handshake_timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Stream reader and writer of an accepted socket, after the TLS handshake when ``ssl_ctx``;
    the socket is closed when the handshake fails or the task is cancelled."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    protocol = asyncio.StreamReaderProtocol(reader)
    tls = {"ssl": ssl_ctx, "ssl_handshake_timeout": handshake_timeout} if ssl_ctx else {}
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock, **tls)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


def _peer(addr) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"
    return str(addr)
