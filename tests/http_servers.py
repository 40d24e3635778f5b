"""A tiny HTTP server on localhost that answers every POST from a script, for clients facing servers that fail."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Scripted(BaseHTTPRequestHandler):
    """Answers each POST with the next (status, body) of the server's script, the last one forever, after its
    delay."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        with self.server.lock:
            self.server.received.append(self.path)
        time.sleep(self.server.delay)
        with self.server.lock:
            status, body = self.server.script.pop(0) if len(self.server.script) > 1 else self.server.script[0]
        with contextlib.suppress(ConnectionError):  # a client that gave up waiting
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def scripted_server(*script: tuple[int, bytes], delay: float = 0.0, received: list[str] | None = None) -> Iterator[str]:
    """A server answering POSTs with `script`'s (status, body) in turn, each `delay` seconds late; yields its URL
    (.../retrieve). `received`, where given, gets the path of every request as it arrives."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.script, server.lock, server.delay = list(script), threading.Lock(), delay
    server.received = received if received is not None else []
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()
