"""Trainer rank 0's HTTP endpoint: GET /status (the TrainerStatus JSON contract, docs/status.md), GET /metrics
(Prometheus), GET /health. Read-only and free of secrets, so it needs no token; the job's NetworkPolicy admits
only the job's pods and the operator. Other trainer ranks serve /health only (their readiness probe)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from grpolora.api.status import TrainerStatus
from grpolora.workers.trainer import metrics


class StatusBoard:
    """The current TrainerStatus, updated by the controller and read by HTTP threads."""

    def __init__(self, initial: TrainerStatus):
        self._lock = threading.Lock()
        self._status = initial

    def get(self) -> TrainerStatus:
        with self._lock:
            return self._status

    def update(self, **changes) -> TrainerStatus:
        with self._lock:
            self._status = self._status.model_copy(update=changes)
            return self._status


def start_status_server(board: StatusBoard | None, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"ok", "text/plain")
            elif self.path == "/status" and board is not None:
                self._send(200, json.dumps(board.get().to_wire()).encode(), "application/json")
            elif self.path == "/metrics" and board is not None:
                self._send(200, generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            pass  # probes and the operator poll every few seconds: keep the trainer's log for training

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="status-server", daemon=True).start()
    return server
