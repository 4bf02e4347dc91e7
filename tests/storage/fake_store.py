"""Misbehaving S3 endpoints for the tests: real socket servers on 127.0.0.1 and a free port, reached
by the same client code users run (s3fs through :mod:`varlen_cli.storage`).

* :class:`SilentStore`: accepts TCP connections and never answers;
* :class:`FakeS3` ``keeps_nothing``: answers every upload 200 and keeps nothing (a listing is empty,
  an object is 404); ``silent_on_put``: answers reads so, never answers an upload; ``dies_on_put``:
  closes the connection on an upload;
* :class:`Proxy`: forwards TCP to a real server until :meth:`Proxy.kill` (a store that dies).
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EMPTY_LISTING = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                 b'2006-03-01/"><Name>b</Name><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys>'
                 b'<IsTruncated>false</IsTruncated></ListBucketResult>')
NO_SUCH_KEY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code><Message>no</Message></Error>'


class _Server:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class SilentStore(_Server):
    """A socket that accepts connections (the kernel's backlog) and never reads or answers."""

    def __init__(self):
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()


class FakeS3(_Server):
    """An HTTP server speaking just enough S3 to misbehave in ``mode`` (module docstring)."""

    def __init__(self, mode: str):
        stop = threading.Event()
        self._stop = stop

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"d41d8cd98f00b204e9800998ecf8427e"')
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
                self._answer(404)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(200, EMPTY_LISTING) if "list-type=2" in self.path else self._answer(404, NO_SUCH_KEY)

            def do_DELETE(self) -> None:  # noqa: N802
                self._answer(204)

            def do_PUT(self) -> None:  # noqa: N802
                if mode == "dies_on_put":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if mode == "silent_on_put":
                    stop.wait(30)
                    return
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(200)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()


class Proxy(_Server):
    """A TCP forwarder to ``target`` (host, port); :meth:`kill` closes it and every connection."""

    def __init__(self, target: tuple[str, int]):
        self._target = target
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def kill(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way (close alone would not)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for s in self._conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass

    close = kill
