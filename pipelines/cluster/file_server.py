"""A static file server on 127.0.0.1 (ephemeral port) in a background thread, counting requests per path.

Used by the bundled digits (served to img2dataset like any web host), the download tests and the
download benchmark. Never binds anything but loopback.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOLD_S = 600.0  # the longest a request held past `serve_first` stays unanswered


class _Handler(SimpleHTTPRequestHandler):
    site: "LoopbackServer"

    def do_GET(self):  # noqa: N802 (http.server naming)
        if self.site.answers(self.path):
            super().do_GET()

    def log_message(self, format, *args):  # noqa: A002 - quiet: one line per image would flood logs
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # many img2dataset threads connect at once


class LoopbackServer:
    """`with LoopbackServer(folder) as srv:` serves folder at srv.base_url; srv.requests counts GETs by path.
    `serve_first`: only that many GETs are answered, the later ones are held, never answered, until `open()`; from
    then on every GET is (tests: a download held part way whatever the machine's speed, killed, then resumed; the
    killed download's held requests stay held, so a process of it that outlives the kill asks for nothing more)."""

    def __init__(self, folder: str | Path, delay_s: float = 0.0, serve_first: int | None = None):
        self.folder, self.delay_s, self.serve_first = str(folder), delay_s, serve_first
        self.opened, self.stopped = threading.Event(), threading.Event()
        self.requests: Counter = Counter()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def answers(self, path: str) -> bool:
        """A GET of `path` counted; False where it is held (never answered: its client is gone, killed, by the time
        the test lets the server go on), True after `delay_s` otherwise."""
        with self._lock:
            self.requests[path] += 1
            held = (self.serve_first is not None and not self.opened.is_set()
                    and sum(self.requests.values()) > self.serve_first)
        if held:
            self.stopped.wait(HOLD_S)
            return False
        if self.delay_s:
            time.sleep(self.delay_s)
        return True

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, name: str) -> str:
        return f"{self.base_url}/{name}"

    def start(self) -> "LoopbackServer":
        handler = type("Handler", (_Handler,), {"site": self})
        self._server = _Server(("127.0.0.1", 0), partial(handler, directory=self.folder))
        self._thread = threading.Thread(target=self._server.serve_forever, name="loopback-http", daemon=True)
        self._thread.start()
        return self

    def open(self) -> None:
        """Every GET from now on answered (those held stay so)."""
        self.opened.set()

    def stop(self) -> None:
        self.stopped.set()  # the held requests' threads end, unanswered
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "LoopbackServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
