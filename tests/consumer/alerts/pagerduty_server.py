"""A real local HTTP server standing in for PagerDuty's Events API v2 endpoint in tests.

Every request body is checked against the Events API v2 "Send an Alert Event" schema
(:func:`events_v2_violations`, written from PagerDuty's Events API v2 documentation and
its OpenAPI description): a valid event is answered as PagerDuty answers it (202, ``{"status":
"success", "message": "Event processed", "dedup_key": ...}``), an invalid one as PagerDuty
refuses it (400, ``{"status": "invalid event", "message": "Event object is invalid",
"errors": [...]}``), and both are recorded.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

ROUTING_KEY_LENGTH = 32
"""Characters of a routing key ("should be 32 characters")."""
DEDUP_KEY_LIMIT = 255
"""Longest dedup_key (characters)."""
SUMMARY_LIMIT = 1024
"""Longest payload.summary (characters)."""
EVENT_BYTES_LIMIT = 512 * 1024
"""Largest event (bytes)."""
EVENT_ACTIONS = ("trigger", "acknowledge", "resolve")
SEVERITIES = ("critical", "error", "warning", "info")
TOP_LEVEL = {"routing_key", "event_action", "dedup_key", "payload", "client", "client_url",
             "links", "images"}
PAYLOAD_FIELDS = {"summary", "timestamp", "severity", "source", "component", "group",
                  "class", "custom_details"}


def _is_url(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def _is_timestamp(value: Any) -> bool:
    """ISO 8601 with a time zone (``Z`` or an offset)."""
    if not isinstance(value, str):
        return False
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return parsed.tzinfo is not None


def events_v2_violations(raw: bytes) -> list[str]:
    """Everything in ``raw`` (a request body) that breaks the Events API v2 alert event
    schema; empty when the event is valid.

    Checks: a JSON object of known fields; ``routing_key`` a 32-character string;
    ``event_action`` one of trigger / acknowledge / resolve; ``dedup_key`` a non-empty
    string of at most 255 characters, required unless the action is trigger; a trigger's
    ``payload`` an object of known fields with ``summary`` (1..1024 characters),
    ``source`` (non-empty) and ``severity`` (critical / error / warning / info), an ISO
    8601 ``timestamp`` with a zone, string ``component`` / ``group`` / ``class`` and an
    object ``custom_details`` when present; ``client`` a string, ``client_url`` an http(s)
    URL, ``links`` a list of ``{href: URL, text?: string}``, ``images`` a list of
    ``{src: URL, href?: URL, alt?: string}``; the body at most 512 KB.
    """
    errors: list[str] = []
    if len(raw) > EVENT_BYTES_LIMIT:
        errors.append(f"event of {len(raw)} bytes exceeds {EVENT_BYTES_LIMIT}")
    try:
        event = json.loads(raw)
    except ValueError as exc:
        return [*errors, f"JSON parse error: {exc}"]
    if not isinstance(event, dict):
        return [*errors, "the event is not a JSON object"]
    errors += [f"unknown field {k!r}" for k in sorted(set(event) - TOP_LEVEL)]
    key = event.get("routing_key")
    if not isinstance(key, str) or len(key) != ROUTING_KEY_LENGTH:
        errors.append("Length of 'routing_key' is incorrect (should be 32 characters)")
    action = event.get("event_action")
    if action not in EVENT_ACTIONS:
        errors.append(f"'event_action' is invalid: {action!r}")
    if "dedup_key" in event or action != "trigger":
        dedup = event.get("dedup_key")
        if not isinstance(dedup, str) or not 0 < len(dedup) <= DEDUP_KEY_LIMIT:
            errors.append(f"'dedup_key' must be a string of 1..{DEDUP_KEY_LIMIT} characters")
    if action == "trigger":
        payload = event.get("payload")
        if not isinstance(payload, dict):
            errors.append("'payload' is missing or not an object")
        else:
            errors += [f"unknown payload field {k!r}"
                       for k in sorted(set(payload) - PAYLOAD_FIELDS)]
            summary = payload.get("summary")
            if not isinstance(summary, str) or not 0 < len(summary) <= SUMMARY_LIMIT:
                errors.append(f"'payload.summary' must be 1..{SUMMARY_LIMIT} characters")
            if not isinstance(payload.get("source"), str) or not payload["source"]:
                errors.append("'payload.source' is missing")
            if payload.get("severity") not in SEVERITIES:
                errors.append(f"'payload.severity' is invalid: {payload.get('severity')!r}")
            if "timestamp" in payload and not _is_timestamp(payload["timestamp"]):
                errors.append(f"'payload.timestamp' is not ISO 8601: {payload['timestamp']!r}")
            for name in ("component", "group", "class"):
                if name in payload and not isinstance(payload[name], str):
                    errors.append(f"'payload.{name}' is not a string")
            if "custom_details" in payload and not isinstance(payload["custom_details"], dict):
                errors.append("'payload.custom_details' is not an object")
    if "client" in event and not isinstance(event["client"], str):
        errors.append("'client' is not a string")
    if "client_url" in event and not _is_url(event["client_url"]):
        errors.append(f"'client_url' is not a URL: {event['client_url']!r}")
    links, images = event.get("links", []), event.get("images", [])
    if not isinstance(links, list) or not isinstance(images, list):
        return [*errors, "'links' and 'images' must be lists"]
    for link in links:
        if (not isinstance(link, dict) or not _is_url(link.get("href"))
                or not isinstance(link.get("text", ""), str)):
            errors.append(f"invalid link {link!r}")
    for image in images:
        if not isinstance(image, dict) or not _is_url(image.get("src")):
            errors.append(f"invalid image {image!r}")
    return errors


class PagerDutyReceiver:
    """Answers POSTs as PagerDuty's Events API v2 does (see the module docstring).

    Args:
        fail_first: answer HTTP ``fail_status`` to this many requests first (e.g. 429: the
            rate limit PagerDuty asks clients to retry after).
        fail_status: that status.

    Attributes:
        events: every valid event (parsed), in arrival order.
        invalid: ``(body, errors)`` of every refused request.
        url: the endpoint (``http://127.0.0.1:PORT/v2/enqueue``).
    """

    def __init__(self, fail_first: int = 0, fail_status: int = 429) -> None:
        self.events: list[dict[str, Any]] = []
        self.invalid: list[tuple[bytes, list[str]]] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.requests += 1
                    failing = receiver.requests <= fail_first
                if failing:
                    self._answer(fail_status, {"status": "throttled", "message": "retry"})
                    return
                errors = events_v2_violations(body)
                if self.path != "/v2/enqueue":
                    errors.append(f"POST to {self.path}, not /v2/enqueue")
                if self.headers.get("Content-Type") != "application/json":
                    errors.append(f"Content-Type {self.headers.get('Content-Type')!r}")
                if errors:
                    receiver.invalid.append((body, errors))
                    self._answer(400, {"status": "invalid event",
                                       "message": "Event object is invalid", "errors": errors})
                    return
                event = json.loads(body)
                receiver.events.append(event)
                self._answer(202, {"status": "success", "message": "Event processed",
                                   "dedup_key": event.get("dedup_key", "")})

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v2/enqueue"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, count: int, timeout: float) -> bool:
        """True once ``count`` valid events arrived (within ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.events) >= count:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Stop the server."""
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> PagerDutyReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
