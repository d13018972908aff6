"""The messages between a sync member's two ends (member_link.py in the HTTP process, member_host.py in vLLM's
worker): JSON over a Connection, and the sync errors that cross it by name."""

from __future__ import annotations

import json
from multiprocessing.connection import Connection

from grpolora.workers.sync.control import REFUSALS, SyncError

CONTROL_TIMEOUT_SECONDS = 10.0
ERRORS: dict[str, type[SyncError]] = REFUSALS


def send(connection: Connection, message: dict) -> None:
    connection.send_bytes(json.dumps(message).encode())


def receive(connection: Connection, timeout: float | None = None) -> dict:
    if timeout is not None and not connection.poll(timeout):
        raise TimeoutError(f"no answer within {timeout:g}s")
    return json.loads(connection.recv_bytes())
