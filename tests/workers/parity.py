"""Helpers of the tests that sync adapters into real inference servers and check what vLLM serves against HF +
peft (tests/workers/test_inference_sync.py for a job's own servers, test_pool_server.py for a pool's)."""

from __future__ import annotations

import socket
import time

import httpx
import torch

from grpolora.testing.servers import TOKEN, generate

PROMPT = "The quick brown fox"


def peft_policy(model_dir):
    """HF + peft with the tests' LoRA config (rank 8, alpha 16, all linear layers); B starts at zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def randomize_adapter(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


def tokens(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


def hf_logprobs(model, prompt: list[int], completion: list[int], *, adapter: bool = True) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        if adapter:
            logits = model(ids).logits[0]
        else:
            with model.disable_adapter():
                logits = model(ids).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def wait_live(url: str, version: int, seconds: float = 30.0, token: str = TOKEN) -> None:
    """Until the server's adapter for `token`'s job is at `version` (GET /v1/adapter answers for the caller's job)."""
    deadline = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {token}"}
    while httpx.get(f"{url}/v1/adapter", headers=headers).json()["live_version"] < version:
        assert time.monotonic() < deadline, f"{url} never served version {version}"
        time.sleep(0.05)


def greedy(url: str, prompt: list[int], version: int | None, max_tokens: int = 12, token: str = TOKEN) -> dict:
    response = generate(
        url,
        {"prompt_token_ids": [prompt], "temperature": 0.0, "max_tokens": max_tokens, "adapter_version": version},
        token=token,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return {"version": body["adapter_version"], **body["results"][0]["samples"][0]}


def raw_request(url: str, head: str, body: bytes = b"", wait: float = 10.0) -> str:
    """One HTTP/1.1 request on a plain socket: the status line comes back even if the body was never sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as conn:
        conn.sendall(head.encode() + b"\r\n\r\n" + body)
        try:
            return conn.recv(65536).decode(errors="replace")
        except TimeoutError:
            return "(no answer)"
