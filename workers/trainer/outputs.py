"""The results a job leaves: the final adapter (a standard peft folder that names its base model and revision, with
a model card) in the output folder, and its push to an S3-compatible store and/or a Hugging Face Hub model
repository (spec.output.push): at the end, and with `everySteps` during training as well.

S3: a push uploads the folder under `.tmp-<name>` first and moves it to `<name>` (`final-adapter`, or
`step-000010` during training) only once the whole upload succeeded, so an interrupted upload never leaves a partial
`<name>/`. Hub: every push is one commit of the folder to the repository's root on the branch (as TRL's
hub_strategy="every_save" does): the branch head is always the newest adapter, every pushed step stays reachable by
its commit, and a commit is atomic.

Pushes during training run in a background thread (`Pusher`), one at a time; they never fail the job (errors go to
metrics.jsonl and the status). A failed final push fails the job, with the adapter still in the output folder.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpolora.api.spec import GRPOLoraJobSpec, HubPushSpec, S3PushSpec
from grpolora.workers import adapter as adapter_io
from grpolora.workers.secrets import SecretError, export_secret, secret_values
from grpolora.workers.trainer import metrics

log = logging.getLogger(__name__)

# A Hub model id, with or without its owner (`gpt2`, `Qwen/Qwen3-0.6B`), as opposed to a path or an `offline:` name.
HUB_MODEL_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")

FINAL_ADAPTER = "final-adapter"
CARD_FILE = "README.md"


class PushError(RuntimeError):
    """The adapter could not be copied to spec.output.push (the message names it)."""


def adapter_config(config: dict[str, Any], spec: GRPOLoraJobSpec) -> dict[str, Any]:
    """peft's config with the base model as the job names it (hub id and revision), not the trainer's local copy."""
    return config | {"base_model_name_or_path": spec.model.name, "revision": spec.model.revision}


def model_card(spec: GRPOLoraJobSpec, step: int, job_name: str) -> str:
    revision = spec.model.revision or "(default branch)"
    # The Hub refuses card metadata whose base_model is no model id: a local path is named in the text only.
    hub_id = HUB_MODEL_ID.fullmatch(spec.model.name) is not None
    lines = [
        "---",
        "library_name: peft",
        *([f"base_model: {spec.model.name}"] if hub_id else []),
        "tags: [grpo, lora, grpolora]",
        "---",
        f"# {job_name}: LoRA adapter trained with GRPO",
        "",
        f"- base model: `{spec.model.name}`, revision `{revision}`",
        f"- LoRA rank {spec.lora.rank}, alpha {spec.lora.alpha}, target modules {spec.lora.target_modules}",
        f"- steps: {step}, {spec.grpo.prompts_per_step} prompts x {spec.grpo.generations_per_prompt} completions "
        f"per step, learning rate {spec.grpo.learning_rate}, KL coefficient {spec.grpo.kl_coef}",
        "",
    ]
    return "\n".join(lines)


def save_adapter(
    folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], spec: GRPOLoraJobSpec, *, step: int,
    job_name: str,
) -> Path:  # fmt: skip
    """Write a peft adapter folder with its card; returns the folder."""
    adapter_io.save_adapter(folder, tensors, adapter_config(config, spec))
    (folder / CARD_FILE).write_text(model_card(spec, step, job_name))
    return folder


def step_name(step: int) -> str:
    """Name of the adapter of a step during training (S3: the folder under the push URL)."""
    return f"step-{step:06d}"


def push(folder: Path, spec: GRPOLoraJobSpec, *, step: int, final: bool, job_name: str) -> list[str]:
    """Copy the adapter `folder` of `step` to every destination of spec.output.push; returns where it went (one
    entry per destination; [] when no push is set). Raises PushError naming the field of each that failed."""
    target = spec.output.push if spec.output else None
    if target is None:
        return []
    pushed: list[str] = []
    errors: list[str] = []
    name = FINAL_ADAPTER if final else step_name(step)
    message = f"grpolora {job_name}: " + (f"final adapter after step {step}" if final else f"adapter at step {step}")
    for destination, send in (
        (target.s3, lambda: push_s3(folder, target.s3, name)),
        (target.hub, lambda: push_hub(folder, target.hub, message)),
    ):
        if destination is None:
            continue
        try:
            pushed.append(send())
        except (PushError, SecretError) as err:
            errors.append(str(err))
    if errors:
        raise PushError("; ".join(errors + [f"pushed to {p}" for p in pushed]))
    return pushed


def push_s3(folder: Path, s3: S3PushSpec, name: str) -> str:
    import s3fs

    export_secret(s3.secret_name, "spec.output.push.s3.secretName")
    destination = f"{s3.url.rstrip('/')}/{name}"
    staging = f"{s3.url.rstrip('/')}/.tmp-{name}"
    try:
        fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint_url) if s3.endpoint_url else s3fs.S3FileSystem()
        bucket = s3.url.removeprefix("s3://").split("/", 1)[0]
        if not fs.exists(bucket):  # s3fs would create it: a typo must not make a new bucket
            raise FileNotFoundError(f"bucket {bucket!r} does not exist (or these credentials cannot see it)")
        if fs.exists(staging):
            fs.rm(staging, recursive=True)
        fs.put(str(folder).rstrip("/") + "/", staging + "/", recursive=True)
        if fs.exists(destination):
            fs.rm(destination, recursive=True)
        # S3 has no rename: copy each uploaded object into place, then drop the staging prefix.
        staged = fs._strip_protocol(staging)
        for source in fs.find(staged):
            fs.copy(source, fs._strip_protocol(destination) + source[len(staged) :])
        fs.rm(staged, recursive=True)
    except Exception as err:
        raise PushError(
            f"spec.output.push.s3: cannot copy the adapter to {destination}: {type(err).__name__}: {err}"
        ) from err
    log.info("adapter pushed to %s", destination)
    return destination


HUB_TOKEN_KEY = "HF_TOKEN"
HUB_ENDPOINT_KEY = "HF_ENDPOINT"


def push_hub(folder: Path, hub: HubPushSpec, message: str) -> str:
    """Commit `folder` to the root of hub.repo on hub.branch (repository and branch created if missing); returns
    the commit's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    field = "spec.output.push.hub.secretName"
    token = None
    values = secret_values(hub.secret_name, field) if hub.secret_name else {}
    if hub.secret_name:
        token = values.get(HUB_TOKEN_KEY)
        if not token:
            raise PushError(f"{field}: Secret {hub.secret_name!r} has no key {HUB_TOKEN_KEY} (it has: "
                            f"{', '.join(values) or 'no keys'}); put a Hub write token there")  # fmt: skip
    endpoint = (hub.endpoint or values.get(HUB_ENDPOINT_KEY) or os.environ.get(HUB_ENDPOINT_KEY) or "").rstrip("/")
    api = HfApi(endpoint=endpoint or None, token=token)
    where = f"{api.endpoint}/{hub.repo}"
    try:
        api.create_repo(hub.repo, repo_type="model", private=hub.private, exist_ok=True)
        if hub.branch != "main":
            api.create_branch(hub.repo, branch=hub.branch, repo_type="model", exist_ok=True)
        commit = api.upload_folder(
            repo_id=hub.repo, folder_path=folder, repo_type="model", revision=hub.branch, commit_message=message
        )
    except HfHubHTTPError as err:
        code = err.response.status_code if err.response is not None else None
        if code in (401, 403):
            source = f"in Secret {hub.secret_name!r}, key {HUB_TOKEN_KEY}" if hub.secret_name else "(HF_TOKEN)"
            raise PushError(f"{field}: the Hub at {api.endpoint} refused the token {source} ({code} "
                            f"{err.response.reason_phrase}); it needs write access to {hub.repo}") from err  # fmt: skip
        raise PushError(f"spec.output.push.hub: cannot push the adapter to {where} (branch {hub.branch}): "
                        f"{_first_line(err)}") from err  # fmt: skip
    except Exception as err:
        raise PushError(f"spec.output.push.hub: cannot push the adapter to {where} (branch {hub.branch}): "
                        f"{type(err).__name__}: {_first_line(err)}") from err  # fmt: skip
    log.info("adapter pushed to %s (%s)", commit.commit_url, message)
    return commit.commit_url


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


@dataclass
class PushResult:
    step: int
    seconds: float
    pushed: list[str]
    error: str | None = None


class Pusher:
    """spec.output.push for one job: the adapters of every `everySteps` steps in a background thread, and the final
    one at the end.

    At most one push runs at a time. One that comes due while another runs is queued; a newer one replaces a queued
    one (that step is skipped, logged and counted in metrics): training never waits for the store, the queue never
    grows, and the newest adapter always goes out. Errors are reported (metrics.jsonl `push_error`, status
    `pushError`, `grpolora_trainer_push_failures_total`), never raised, until the final push.
    """

    def __init__(self, spec: GRPOLoraJobSpec, output_dir: Path, *, job_name: str):
        self.spec = spec
        self.output_dir = output_dir
        self.job_name = job_name
        target = spec.output.push if spec.output else None
        self.every = target.every_steps if target is not None else None
        self._lock = threading.Condition()
        self._queued: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None
        self._running: int | None = None
        self._worker: threading.Thread | None = None
        self._finished: list[PushResult] = []
        self._skipped = 0
        self._last_ok: PushResult | None = None
        self._last_error: str | None = None

    def due(self, step: int) -> bool:
        """Push the adapter of `step` during training? (The last step's adapter is the final push.)"""
        return self.every is not None and step % self.every == 0 and step < self.spec.grpo.steps

    @property
    def in_flight(self) -> int:
        with self._lock:
            return int(self._running is not None)

    def submit(self, step: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Push the adapter of `step` in the background; returns at once (after copying the tensors: the next
        optimizer step changes the live ones)."""
        snapshot = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        with self._lock:
            if self._queued is not None:
                self._skipped += 1
                log.warning("push of step %d skipped: step %d replaces it while step %s is still being pushed",
                            self._queued[0], step, self._running)  # fmt: skip
            self._queued = (step, snapshot, config)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="push", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._queued is None:
                    self._worker = None
                    self._lock.notify_all()
                    return
                step, tensors, config = self._queued
                self._queued, self._running = None, step
            result = self._push_step(step, tensors, config)
            with self._lock:
                self._running = None
                self._record(result)

    def _push_step(self, step: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> PushResult:
        started = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix=".push-", dir=self.output_dir) as staging:
                folder = save_adapter(Path(staging) / step_name(step), tensors, config, self.spec, step=step,
                                      job_name=self.job_name)  # fmt: skip
                pushed = push(folder, self.spec, step=step, final=False, job_name=self.job_name)
            return PushResult(step, time.perf_counter() - started, pushed)
        except Exception as err:  # never let a push stop training
            log.error("push of step %d failed: %s", step, err)
            return PushResult(step, time.perf_counter() - started, [], f"{err}" if isinstance(err, PushError)
                              else f"spec.output.push: {type(err).__name__}: {err}")  # fmt: skip

    def _record(self, result: PushResult) -> None:
        self._finished.append(result)
        if result.error is None:
            self._last_ok, self._last_error = result, None
        else:
            self._last_error = result.error
            metrics.PUSH_FAILURES.inc()

    def wait(self) -> None:
        """Until no push runs or waits."""
        with self._lock:
            while self._worker is not None:
                self._lock.wait()

    def report(self) -> dict[str, Any]:
        """Fields for metrics.jsonl about the pushes finished since the last call ({} when none)."""
        with self._lock:
            finished, self._finished = self._finished, []
            skipped, self._skipped = self._skipped, 0
        if not finished:
            return {}
        newest = finished[-1]
        errors = [r.error for r in finished if r.error]
        fields: dict[str, Any] = {
            "push": {"step": newest.step, "seconds": newest.seconds, "failed": len(errors), "skipped": skipped}
        }
        if errors:
            fields["push_error"] = errors[-1]
        return fields

    def status(self) -> dict[str, Any]:
        """TrainerStatus fields: where the newest adapter went, and why the last push failed (if it did)."""
        with self._lock:
            ok = self._last_ok
            return {
                "last_push": ok.pushed[-1] if ok and ok.pushed else None,
                "last_push_step": ok.step if ok else None,
                "push_error": self._last_error,
            }

    def finish(self, folder: Path, *, step: int) -> list[str]:
        """After the last step: wait for the pushes under way, then push the final adapter `folder`; raises
        PushError (the adapter stays in `folder`) if that fails."""
        self.wait()
        started = time.perf_counter()
        try:
            pushed = push(folder, self.spec, step=step, final=True, job_name=self.job_name)
        except PushError as err:
            with self._lock:
                self._record(PushResult(step, time.perf_counter() - started, [], str(err)))
            raise PushError(f"{err}; the adapter is in {folder}") from err
        if pushed:
            with self._lock:
                self._record(PushResult(step, time.perf_counter() - started, pushed))
        return pushed
