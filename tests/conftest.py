"""The whole test session's environment: no test reaches a real model hub.

`grpolora validate` asks the hub about spec.model by default (grpolora/model_check.py), and many tests run it
in-process; a worker that downloads would ask it too. huggingface_hub reads HF_ENDPOINT once, when first imported,
so it is set here, before any test module imports it: a loopback port bound and never listened on, where a
connection is refused at once (no DNS, no timeout), in this process and in every child that inherits the
environment. Tests that play a hub start their own on loopback (tests/workers/hubserver.py) and name it in the
child's environment; validate then says it could not reach the session's endpoint, the same with internet or without.
"""

from __future__ import annotations

import os
import socket
import sys

# Held for the session: while bound, no other socket takes the port, and unlistened it refuses every connection.
_REFUSING = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
_REFUSING.bind(("127.0.0.1", 0))
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{_REFUSING.getsockname()[1]}"
assert "huggingface_hub" not in sys.modules, "huggingface_hub was imported before HF_ENDPOINT was set"
