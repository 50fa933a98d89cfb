"""Control socket server: one daemon thread on rank 0 of the replica group.

Why stdlib ``selectors`` and not a framework: we need one listener per
transport, newline framing with a hard size cap, and replies posted later
from the training thread. ``socketserver`` would spawn a thread per client
(a flood of clients = a flood of threads) and ``asyncio`` would need the
same cross-thread wake-up plumbing on top of its own loop thread.

Guarantees: sockets are non-blocking, so a slow or hostile client cannot
stall the thread; any failure serving one connection closes that connection
only; nothing here touches training state except through the handler.

Back-pressure: at most ``max_connections`` connections (more are answered
``busy`` and closed); a connection has ``request_timeout_s`` to deliver a
request once it began one (its first: once it connected), then it is answered
``request_timeout`` and closed, so a slow or silent client cannot keep a
slot; a message over :data:`MAX_MESSAGE_BYTES` is answered and closed; the
handler's ``busy`` (too many pending commands) closes too.
"""

from __future__ import annotations

import errno
import functools
import hmac
import logging
import os
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from megascale_omni.config import ConfigError
from megascale_omni.control.protocol import (
    MAX_MESSAGE_BYTES,
    ErrorCode,
    ProtocolError,
    Request,
    encode,
    error_reply,
    parse_request,
)
from megascale_omni.control.state import Post

logger = logging.getLogger(__name__)

Handler = Callable[[Request, Post], Optional[dict]]

#: A client that stops reading its replies is dropped past this backlog, bytes.
MAX_OUTPUT_BYTES = 1 << 20
#: Auth failures are logged at most once per this many seconds (with a count).
AUTH_LOG_INTERVAL_S = 10.0
#: Errors after which a Unix-socket connection is closed too (TCP closes after any error).
CLOSING_CODES = frozenset({ErrorCode.BUSY, ErrorCode.MESSAGE_TOO_LARGE, ErrorCode.REQUEST_TIMEOUT})


@dataclass(eq=False)
class _Conn:
    id: int
    sock: socket.socket
    transport: str  # "unix" | "tcp"
    peer: str
    last_active: float  # server clock, seconds
    #: When the request being received began (at first, when the connection
    #: opened; while closing, when the last reply was queued); None between
    #: requests. Past ``request_timeout_s`` the connection is dropped.
    waiting_since: Optional[float]
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    scanned: int = 0  # bytes of inbuf already searched for a newline
    awaiting: int = 0  # deferred replies not yet sent
    closing: bool = False  # send what is buffered, then close; read nothing more
    served: bool = False  # a complete request has arrived


@dataclass(frozen=True)
class _Listener:
    transport: str


class ControlServer:
    """Serve the control protocol on a Unix socket and/or loopback TCP.

    ``handler(request, post)`` returns the reply now, or None and calls
    ``post(reply)`` later from any thread. ``clock`` (seconds, monotonic)
    times the request and idle deadlines. TCP requests must carry ``token``
    (compared in constant time); the Unix socket is guarded by its file mode
    (0600, owner only).
    """

    def __init__(
        self,
        handler: Handler,
        unix_path: Optional[str],
        tcp: Optional[tuple[str, int]] = None,
        token: Optional[str] = None,
        max_connections: int = 16,
        idle_timeout_s: float = 300.0,
        request_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if tcp is not None and not token:
            raise ValueError("TCP control requires a token")
        self._handler = handler
        self._unix_path = unix_path
        self._tcp = tcp
        self._token = token.encode("utf-8") if token else None
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._request_timeout_s = request_timeout_s
        self._clock = clock
        # Deadlines are checked once per loop turn: often enough to honour them within a quarter.
        self._poll_s = max(0.01, min(1.0, request_timeout_s / 4))
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0
        self._outbox: queue.SimpleQueue[tuple[int, dict]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._listeners: list[socket.socket] = []
        self._unix_ino: Optional[int] = None
        self._auth_failures = 0
        self._auth_logged_at = float("-inf")
        self.addresses: dict[str, Optional[str]] = {"unix": None, "tcp": None}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bind the listeners and start the thread. Raises ConfigError when an
        address cannot be used (with the fix)."""
        if self._unix_path is not None:
            self._listen(self._bind_unix(self._unix_path), "unix")
        if self._tcp is not None:
            host, port = self._tcp
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                sock.close()
                raise ConfigError(
                    "control.tcp_port", port, f"cannot listen on {host}:{port} ({e.strerror}); pick a free port or 0"
                ) from None
            bound = sock.getsockname()
            self.addresses["tcp"] = f"{host}:{bound[1]}"
            if host not in ("127.0.0.1", "::1", "localhost"):
                logger.warning("control: TCP listening on %s, reachable beyond this host (token required)", host)
            self._listen(sock, "tcp")
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="omni-control-server", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued (best effort), close every socket, remove the
        Unix socket file. Safe to call twice."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake()
        self._thread.join(timeout_s)
        self._thread = None

    def post(self, conn_id: int, message: dict) -> None:
        """Queue a reply for connection ``conn_id`` (any thread; never blocks)."""
        self._outbox.put((conn_id, message))
        self._wake()

    # -------------------------------------------------------------- binding
    def _bind_unix(self, path: str) -> socket.socket:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.lexists(path):
            self._remove_stale(path)
        # Bind under a private name, restrict the mode, then move into place:
        # there is no moment at which the final path accepts other users.
        tmp = f"{path}.{os.getpid()}.tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except OSError as e:
            sock.close()
            raise ConfigError("control.socket_path", path, f"cannot create the socket ({e.strerror})") from None
        self._unix_ino = os.stat(path).st_ino
        self.addresses["unix"] = path
        return sock

    @staticmethod
    def _remove_stale(path: str) -> None:
        import stat

        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(
                "control.socket_path", path, "exists and is not a socket; remove it or choose another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ConfigError("control.socket_path", path, f"cannot probe existing socket ({e.strerror})") from None
            os.unlink(path)  # left over by a job that died: nobody listens
            return
        finally:
            probe.close()
        raise ConfigError(
            "control.socket_path", path,
            "another job is serving this socket; stop it, or use another logging.output_dir or control.socket_path",
        )

    def _listen(self, sock: socket.socket, transport: str) -> None:
        sock.listen(64)
        sock.setblocking(False)
        self._listeners.append(sock)
        self._sel.register(sock, selectors.EVENT_READ, _Listener(transport))

    # ----------------------------------------------------------------- loop
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, mask in self._sel.select(timeout=self._poll_s):
                    self._dispatch(key, mask)
                self._deliver_outbox()
                self._expire_idle()
            self._deliver_outbox()
            self._flush_all_blocking(deadline=time.monotonic() + 1.0)
        except Exception:  # never reached by client input; a bug here must not kill training
            logger.exception("control: server loop failed; the control socket is closed, training continues")
        finally:
            self._close_everything()

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        data = key.data
        if data == "wake":
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
            return
        if isinstance(data, _Listener):
            self._accept(key.fileobj, data.transport)  # type: ignore[arg-type]
            return
        conn: _Conn = data
        try:
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and conn.id in self._conns:
                self._flush(conn)
        except Exception:
            logger.exception("control: dropping connection %d after an internal error", conn.id)
            self._close(conn)

    def _accept(self, listener: socket.socket, transport: str) -> None:
        try:
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # EMFILE etc.: keep serving existing clients
            logger.warning("control: accept failed: %s", e.strerror)
            return
        sock.setblocking(False)
        peer = f"{addr[0]}:{addr[1]}" if transport == "tcp" else "unix"
        self._next_id += 1
        now = self._clock()
        conn = _Conn(self._next_id, sock, transport, peer, last_active=now, waiting_since=now)
        self._conns[conn.id] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)
        if len(self._conns) > self._max_connections:
            self._fatal(conn, error_reply(None, ErrorCode.BUSY, f"more than {self._max_connections} connections"))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # peer went away; a partial line is discarded unread
            self._close(conn)
            return
        if conn.closing:
            return
        now = conn.last_active = self._clock()
        conn.inbuf += data
        while not conn.closing:
            nl = conn.inbuf.find(b"\n", conn.scanned)
            if nl < 0:
                conn.scanned = len(conn.inbuf)
                if conn.inbuf and conn.waiting_since is None:
                    conn.waiting_since = now  # a request began: its deadline runs
                if len(conn.inbuf) > MAX_MESSAGE_BYTES:
                    self._too_large(conn)
                return
            line = bytes(conn.inbuf[:nl]).rstrip(b"\r")
            del conn.inbuf[: nl + 1]
            conn.scanned = 0
            conn.served, conn.waiting_since = True, None
            if len(line) > MAX_MESSAGE_BYTES:
                self._too_large(conn)
                return
            if line.strip():
                self._serve_line(conn, line)

    def _serve_line(self, conn: _Conn, line: bytes) -> None:
        request_id = None
        try:
            request = parse_request(line)
            request_id = request.id
            if conn.transport == "tcp" and not self._token_ok(request.token):
                self._auth_failed(conn, request_id)
                return
            reply = self._handler(request, functools.partial(self._post_deferred, conn.id))
        except ProtocolError as e:
            if conn.transport == "tcp" or e.code in CLOSING_CODES:
                # TCP: unauthenticated peers get one answer per connection.
                # busy: closing is the back-pressure (the client backs off).
                self._fatal(conn, e.reply())
                return
            reply = e.reply()
        except Exception:
            # The request itself is not logged: it may carry the token.
            logger.exception("control: internal error serving a request")
            reply = error_reply(request_id, ErrorCode.INTERNAL, "internal error; see the job's log")
        if reply is None:
            conn.awaiting += 1
        else:
            self._send(conn, reply)

    def _token_ok(self, token: Optional[str]) -> bool:
        assert self._token is not None
        supplied = token.encode("utf-8") if isinstance(token, str) else b""
        return hmac.compare_digest(supplied, self._token)

    def _auth_failed(self, conn: _Conn, request_id) -> None:
        self._auth_failures += 1
        now = time.monotonic()
        if now - self._auth_logged_at >= AUTH_LOG_INTERVAL_S:
            logger.warning(
                "control: rejected %d TCP request(s) with a missing or wrong token (latest from %s)",
                self._auth_failures, conn.peer,
            )
            self._auth_failures = 0
            self._auth_logged_at = now
        self._fatal(conn, error_reply(request_id, ErrorCode.UNAUTHORIZED, "missing or wrong token"))

    def _too_large(self, conn: _Conn) -> None:
        self._fatal(
            conn,
            error_reply(None, ErrorCode.MESSAGE_TOO_LARGE, f"message exceeds {MAX_MESSAGE_BYTES} bytes; closing"),
        )

    # --------------------------------------------------------------- output
    def _post_deferred(self, conn_id: int, message: dict) -> None:
        self.post(conn_id, message)

    def _deliver_outbox(self) -> None:
        while True:
            try:
                conn_id, message = self._outbox.get_nowait()
            except queue.Empty:
                return
            conn = self._conns.get(conn_id)
            if conn is None:
                continue  # the client left; the command was applied regardless
            conn.awaiting = max(0, conn.awaiting - 1)
            self._send(conn, message)

    def _send(self, conn: _Conn, message: dict) -> None:
        conn.outbuf += encode(message)
        if len(conn.outbuf) > MAX_OUTPUT_BYTES:
            self._close(conn)  # not reading its replies
            return
        self._flush(conn)

    def _fatal(self, conn: _Conn, message: dict) -> None:
        conn.closing = True
        conn.waiting_since = self._clock()  # a peer that does not read this gets request_timeout_s
        conn.inbuf.clear()
        self._send(conn, message)

    def _flush(self, conn: _Conn) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)
                return
        if not conn.outbuf and conn.closing:
            self._close(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self._sel.modify(conn.sock, events, conn)

    def _expire_idle(self) -> None:
        """Drop connections past their request deadline or idle timeout (server thread)."""
        now = self._clock()
        for conn in list(self._conns.values()):
            late = conn.waiting_since is not None and now - conn.waiting_since >= self._request_timeout_s
            if late and conn.closing:
                self._close(conn)  # its last reply could not be sent in time
            elif late:
                what = "request incomplete" if conn.served or conn.inbuf else "nothing sent since connecting"
                self._fatal(conn, error_reply(
                    None, ErrorCode.REQUEST_TIMEOUT,
                    f"{what} after {self._request_timeout_s:g} s (control.request_timeout_s); closing",
                ))
            elif now - conn.last_active >= self._idle_timeout_s and not conn.awaiting:
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.id, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _flush_all_blocking(self, deadline: float) -> None:
        for conn in list(self._conns.values()):
            if not conn.outbuf:
                continue
            try:
                conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
                conn.sock.sendall(conn.outbuf)
            except OSError:
                pass

    def _close_everything(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        for sock in self._listeners:
            sock.close()
        self._listeners.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        path = self._unix_path
        try:
            if path and self._unix_ino is not None and os.stat(path).st_ino == self._unix_ino:
                os.unlink(path)  # only our own socket, never a successor's
        except OSError:
            pass

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, InterruptedError, OSError):
            pass  # already pending a wake-up, or closed
