"""Accepting connections: every descriptor counted from ``accept()``, the TLS handshake under its
own deadline, and a log line for each kind of refusal.

``asyncio.start_server`` hands a connection over only after its TLS handshake and gives that
handshake 60 s, so sockets that never send a byte hold descriptors that no limit sees. Here each
listener accepts by itself (``loop.sock_accept``) and then does the handshake
(``loop.connect_accepted_socket``):

* a connection holds one of the shared :class:`ConnectionSlots` from ``accept()`` on, handshake
  included;
* a new connection is *opening* until its TLS handshake is done (without TLS: until its first
  byte arrives), for at most ``handshake_timeout`` seconds;
* when every slot is taken, the connection that has been opening longest is closed to make room
  (a client with a certificate finishes its handshake at once, a plain HTTP client sends
  its request at once, so the oldest is a silent socket); when every slot holds a connection
  past that point, the new one is closed at once: with TLS without a word (no HTTP answer is
  possible before the handshake), without TLS after a 503 answer written at once, before its
  request is read, so that it holds its descriptor for no time;
* refused handshakes, timeouts, closed connections and ``accept()`` failing for want of
  descriptors (EMFILE, ENFILE) are logged, one line at most per kind every 10 s; the events held
  back are summed up by reason (who was refused and why), with counts.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import logging
import os
import resource
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .conn import PLAIN_ANSWERS, ConnectionLimits, ErrorAnswers, Handler, Response, serve_connection
from .http_response import format_response
from .peer import peer_address, request_id
from .refusal_log import RefusalLogs
from .tls_refusal import describe_refusal

log = logging.getLogger("tiny_mindie.server")

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

READ_LIMIT = 2 ** 20            # StreamReader buffer limit (bytes)
LISTEN_BACKLOG = 4096           # connections the kernel queues before accept() (it caps this at
                                # net.core.somaxconn); they hold no descriptor of ours
ACCEPT_RETRY_SECONDS = 0.1      # wait before accepting again after EMFILE / ENFILE
FD_SPARE = 32                   # descriptors kept free for the process beside its connections
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class AddressError(Exception):
    """A listen address cannot be resolved; the message is one line naming it."""


class ConnectionSlots:
    """At most ``limit`` connections open at once, counted from ``accept()``; shared by the
    listeners of one server.

    Attributes:
        limit: the number of slots.
        handshaking: the connection tasks still opening (in their TLS handshake, or plain TCP
            ones before their first byte), oldest first, with (peer, accept time).
        established: connections past that point.
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
        """Close the connection that has been opening longest, freeing its slot; returns its
        (peer, seconds waited), or None when no connection is opening."""
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


def descriptors_in_use() -> int | None:
    """Open descriptors of this process, or None when the system does not say (listing
    ``/proc/self/fd`` takes a descriptor: it fails when none is left)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d))
        except OSError:
            continue
    return None


def connection_limit(max_link_num: int) -> int:
    """``maxLinkNum`` capped by the descriptors this process may still open (after raising its
    soft limit to the hard one, less :data:`FD_SPARE`); a warning when the cap bites."""
    nofile = raise_open_files_limit()
    used = descriptors_in_use() or 0
    room = nofile - used - FD_SPARE
    if room < max_link_num:
        log.warning("maxLinkNum %d does not fit the open files limit (%d descriptors, %d in use): "
                    "at most %d connections at once; raise the limit (ulimit -n, LimitNOFILE=) "
                    "to have maxLinkNum", max_link_num, nofile, used, max(1, room))
    return max(1, min(max_link_num, room))


def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening, non-blocking sockets on every address of ``host`` (as ``asyncio.start_server``).

    Raises:
        AddressError: ``host`` cannot be resolved (named in the message).
        OSError: naming the address: it is in use or is not on this machine.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise AddressError(f"cannot listen on {host}:{port}: the address {host!r} cannot be "
                           f"resolved ({exc.strerror})") from None
    except UnicodeError:       # the idna codec (config validation lets no such name through)
        raise AddressError(f"cannot listen on {host!r}: not a valid host name") from None
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
                raise OSError(exc.errno,
                              f"cannot listen on {host}:{port}: {exc.strerror}") from None
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
        busy: ``() -> bytes``: the whole HTTP answer (a 503) written at once to a plain-TCP
            connection that finds every slot past its opening; unused with TLS, where such a
            connection is closed without a word.
        slots: the server's shared :class:`ConnectionSlots`.
        ssl_ctx: the server's TLS context, or None for plain TCP.
        handshake_timeout: seconds a connection has to finish its TLS handshake.
    """

    def __init__(self, socks: list[socket.socket], serve: Serve, busy: Callable[[], bytes], *,
                 slots: ConnectionSlots, ssl_ctx: ssl.SSLContext | None, handshake_timeout: float,
                 logs: RefusalLogs):
        self.sockets = socks
        self.serve, self.busy = serve, busy
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
                        f"{_descriptors_when(exc.errno)}; new connections wait in the listen "
                        f"backlog")
                elif exc.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    log.error("accept() failed: %s", exc)
                else:
                    continue
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            await self._admit(sock, peer_address(peer) or str(peer))

    async def _admit(self, sock: socket.socket, peer: str) -> None:
        slots = self.slots
        if slots.open >= slots.limit:
            # The connections already opening must have started before one is chosen to close
            # (a task cancelled before its first step would never close its socket).
            await asyncio.sleep(0)
            if slots.open >= slots.limit:
                gone = slots.evict_oldest_handshake()
                if gone is None:
                    self._refuse(sock, peer)
                    return
                what = "in its TLS handshake" if self.ssl_ctx else "without sending a byte"
                self.logs.evicted(f"connection limit ({slots.limit}) reached: closed the "
                                  f"connection from {gone[0]} after {gone[1]:.1f} s {what} to "
                                  f"admit {peer}")
        task = asyncio.get_running_loop().create_task(self._connection(sock, peer))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        slots.handshaking[task] = (peer, time.monotonic())

    def _refuse(self, sock: socket.socket, peer: str) -> None:
        """Close a connection that finds every slot past its opening: with TLS at once, without
        TLS after writing the 503 answer (best effort, without waiting for the request)."""
        self.logs.full(f"connection limit ({self.slots.limit}) reached, every connection past its "
                       f"{'handshake' if self.ssl_ctx else 'first byte'}: "
                       f"{'closed' if self.ssl_ctx else 'answered 503 to'} the new connection "
                       f"from {peer}")
        if self.ssl_ctx is None:
            try:
                sock.setblocking(False)
                sock.send(self.busy())           # a few hundred bytes: the socket buffer takes them
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):          # what the client sent already: unread bytes at
                    pass                         # close() would reset the connection, answer lost
            except OSError:                      # BlockingIOError: nothing more to read
                pass
        sock.close()

    async def _connection(self, sock: socket.socket, peer: str) -> None:
        task = asyncio.current_task()
        slots = self.slots
        try:
            if self.ssl_ctx is None:
                await _first_byte(sock, self.handshake_timeout)
            reader, writer = await _open(sock, self.ssl_ctx, self.handshake_timeout)
        except asyncio.CancelledError:
            if task in slots.evicted:      # closed to make room; logged by the acceptor
                slots.evicted.discard(task)
                return
            raise
        except ssl.SSLError as exc:
            why, client = describe_refusal(exc)
            self.logs.refused(f"refused TLS client {peer}: {why}{client}", why + client, why)
            return
        except ConnectionAbortedError as exc:     # the loop's handshake timeout
            self.logs.timed_out(f"closed the connection from {peer}: no TLS handshake within "
                                f"{self.handshake_timeout:g} s ({exc})", "handshake")
            return
        except TimeoutError:              # plain TCP: no first byte in time
            what = "TLS handshake" if self.ssl_ctx else "request"
            self.logs.timed_out(f"closed the connection from {peer}: no {what} within "
                                f"{self.handshake_timeout:g} s", what)
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



async def _first_byte(sock: socket.socket, timeout: float) -> None:
    """Wait until ``sock`` is readable (its first bytes or its end arrived).

    Raises:
        asyncio.TimeoutError: not within ``timeout`` seconds. The socket is closed then, and
            when the wait is cancelled.
    """
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
    except BaseException:
        loop.remove_reader(fd)
        sock.close()
        raise
    loop.remove_reader(fd)


def _descriptors_when(err: int) -> str:
    """How many descriptors are in use, for the log line of an ``accept()`` failing with ``err``
    (EMFILE: all that RLIMIT_NOFILE allows, by definition; counting them would need one)."""
    if err == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return f"every one of the {soft} descriptors the open files limit allows in use"
    used = descriptors_in_use()
    return f"{used if used is not None else 'an unknown number of'} descriptors in use"


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


@dataclass
class Listener:
    """One listening address: which planes it serves, where, and (once started) its sockets."""

    host: str
    port: int
    planes: frozenset[str]
    server: TCPListener | None = None

    @property
    def bound_port(self) -> int:
        return self.server.sockets[0].getsockname()[1] if self.server else self.port

    @property
    def bound_addresses(self) -> list[str]:
        """The addresses its sockets are bound to (a host name resolves to one or more)."""
        return [sock.getsockname()[0] for sock in self.server.sockets] if self.server else []


@dataclass(frozen=True)
class Limits:
    """What every connection of a server may hold.

    Attributes:
        max_connections: connections open at once, counted from ``accept()`` (see
            :func:`connection_limit` for the cap set by the open files limit).
        max_body_bytes: the largest request body, in bytes (413 beyond).
        handshake_timeout: seconds a new connection may take for its TLS handshake (without
            TLS: for its first byte).
        keep_alive_timeout: seconds a kept-alive connection may sit idle between requests.
        header_timeout: seconds a request's header section may take (see
            :func:`~.conn.serve_connection`).
    """

    max_connections: int
    max_body_bytes: int
    handshake_timeout: float
    keep_alive_timeout: float = 65.0
    header_timeout: float = 60.0


async def start_listeners(listeners: list[Listener],
                          handler_for: Callable[[frozenset[str]], Handler],
                          limits: Limits, ssl_ctx: ssl.SSLContext | None,
                          busy: Response, answers: ErrorAnswers = PLAIN_ANSWERS) -> list[Listener]:
    """Bind every listener and start accepting; returns them, their ``server`` set.

    Each listener serves its connections with ``handler_for(listener.planes)``. The listeners
    share ``limits.max_connections`` slots (see the module doc for who is closed when they are
    full); without TLS, a connection beyond the limit gets ``busy`` at once, before its request
    is read, and is closed. ``answers``: the bodies of the error answers each connection writes
    by itself (:class:`~.conn.ErrorAnswers`).

    Raises:
        AddressError: an address cannot be resolved.
        OSError: an address is in use or cannot be bound.
    """
    slots = ConnectionSlots(limits.max_connections)
    logs = RefusalLogs()
    each = ConnectionLimits(max_body_bytes=limits.max_body_bytes,
                            keep_alive_timeout=limits.keep_alive_timeout,
                            header_timeout=limits.header_timeout)

    def busy_answer() -> bytes:
        return format_response(busy.status, [("Date", email.utils.formatdate(usegmt=True)),
                                             ("Server", "tiny_mindie"),
                                             ("X-Request-Id", request_id(None)),
                                             ("Content-Type", busy.content_type),
                                             ("Connection", "close")], busy.body)

    try:
        for lst in listeners:
            handle = handler_for(lst.planes)

            async def serve(reader, writer, handle=handle) -> None:
                await serve_connection(reader, writer, handle, each, answers=answers)

            lst.server = TCPListener(bind(lst.host, lst.port, backlog=LISTEN_BACKLOG),
                                     serve, busy_answer, slots=slots, ssl_ctx=ssl_ctx,
                                     handshake_timeout=limits.handshake_timeout, logs=logs)
    except BaseException:
        for lst in listeners:
            if lst.server:
                lst.server.close()
        raise
    return listeners

