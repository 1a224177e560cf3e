"""A real local HTTP server standing in for a webhook receiver (Slack or other) in tests."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookReceiver:
    """Records every JSON body POSTed to it.

    Args:
        fail_first: answer HTTP ``fail_status`` to this many requests before succeeding.
        fail_status: the failing status code.
        hang: hold every request open until :meth:`close` (a webhook that hangs).
    """

    def __init__(self, fail_first: int = 0, fail_status: int = 500, hang: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.requests = 0
        self.arrivals: list[float] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                receiver.requests += 1
                if hang:
                    receiver.release.wait(60)
                    return
                if receiver.requests <= fail_first:
                    self.send_response(fail_status)
                    self.end_headers()
                    return
                receiver.bodies.append(json.loads(body))
                receiver.arrivals.append(time.monotonic())
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, count: int, timeout: float) -> bool:
        """True once ``count`` bodies arrived (within ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.bodies) >= count:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Release hanging requests and stop the server."""
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
