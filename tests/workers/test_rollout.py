"""The rollout client against replicas that fail as replicas do: an engine error (a 500 with the server's
reason, from a plain HTTP server on loopback) and a replica that is gone (connection refused). The other cases
are in test_rollout_client.py, against the real inference API."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpolora.workers.trainer.rollout import RolloutClient, RolloutError, Sampling
from tests.workers.syncfakes import free_port

SAMPLING = Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=4)


def replica(status: int, detail: str) -> Iterator[str]:
    """A server that answers every generate request with `status`; 200 gives two samples per prompt."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if status == 200:
                sample = {"token_ids": [5], "logprobs": [-0.5], "text": "x", "finish_reason": "length"}
                results = [{"prompt_token_ids": p, "samples": [sample, sample]} for p in body["prompt_token_ids"]]
                payload = {"adapter_version": body["adapter_version"], "results": results}
            else:
                payload = {"detail": detail}
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def broken():
    yield from replica(500, "EngineDeadError: engine core died")


def test_every_replica_failing_names_each_replica_and_its_error(broken):
    gone = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([broken, gone], "t", timeout_seconds=5)
    with pytest.raises(RolloutError) as raised:
        client.generate([[1, 2], [3, 4], [5, 6]], SAMPLING, version=0, replicas=[0, 1])
    message = str(raised.value)
    assert "every replica failed to generate" in message
    assert f"replica 0 ({broken}): 500 EngineDeadError: engine core died" in message
    assert f"replica 1 ({gone}): ConnectError" in message
    client.close()
