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


class RetrievalServerWithOutage:
    """The shipped retrieval server (`serve`, a real HTTP server on localhost) over `retriever`, which goes away after
    answering its `after`-th request: its port then refuses connections, until `outage` seconds later it serves again
    on the same port (None: never). `url` is its endpoint; `requests` counts the requests answered."""

    def __init__(self, retriever, *, after: int, outage: float | None) -> None:
        self.retriever, self.after, self.outage = retriever, after, outage
        self.requests, self.stopped, self.restarted = 0, threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._server = self._start(0)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/retrieve"

    def _answer(self, queries, k):
        with self._lock:
            self.requests += 1
            last = self.requests == self.after
        if last:  # the server goes away before this answer is sent: later requests find the port closed
            self._server.shutdown()  # from this handler's thread: serve_forever runs in another one
            self._server.server_close()
            self.stopped.set()
            if self.outage is not None:
                threading.Timer(self.outage, self.come_back).start()
        return self.retriever(queries, k)

    def _start(self, port: int):
        from gigpo_trl.environments.retrieval import serve  # noqa: PLC0415

        server = serve(self._answer, port=port)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server

    def come_back(self) -> None:
        """Serve again on the same port."""
        self._server = self._start(self.port)
        self.restarted.set()

    def close(self) -> None:
        if not self.stopped.is_set() or self.restarted.is_set():
            self._server.shutdown()
            self._server.server_close()


class OpenEnvServer:
    """A real OpenEnv server (openenv's FastAPI app under uvicorn) serving `env_cls` on localhost, which can be stopped
    and started again on the same port."""

    def __init__(self, env_cls, action_cls, observation_cls, state_cls, *, max_concurrent_envs: int = 8) -> None:
        from openenv.core import create_fastapi_app  # noqa: PLC0415 (an optional package)

        self.app = create_fastapi_app(env_cls, action_cls, observation_cls, max_concurrent_envs=max_concurrent_envs,
                                      state_cls=state_cls)
        self.port = 0
        self.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import socket  # noqa: PLC0415

        import uvicorn  # noqa: PLC0415 (openenv's dependency)

        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", self.port))
        self.port = self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="critical"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop serving: open sessions are closed, and the port refuses connections."""
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
