"""`grpolora validate`: the model before the GPUs. Asks the hub whether `spec.model` exists (its revision too) and,
for a gated model, whether the token the pods will have can read it, so that a typo or a missing grant is found on the
laptop rather than after GPU nodes are up and the image is pulled (the pods would exit 78 with the same words).

Run by the CLI process (light install: huggingface_hub is the workers extra's, so it may be absent, and that is said).
The questions are huggingface_hub's HfApi.model_info (with its `timeout`) and HfApi.auth_check's request (sent here
with a timeout, which auth_check does not take), at the endpoint the user's environment names (HF_ENDPOINT, read by
huggingface_hub); its errors are read as the pods read
them (grpolora.workers.models.hub_refusal: one wording for both). HF_HUB_OFFLINE, no connection or a failing hub:
not checked, and said so.

The token asked with is the pods' one: none without `tokenFrom` (the pods would be anonymous), the Secret's value
with `--cluster`; without it, the user's own token stands in for the Secret's, and what that cannot tell (a gated
model the Secret's token may or may not read) is said as not checked, not as an error.
"""

from __future__ import annotations

import dataclasses

from grpolora.api import constants as c
from grpolora.api.load import Problem
from grpolora.api.spec import ModelSpec
from grpolora.cluster_check import Findings

MISSING_CLIENT = "huggingface_hub not installed"
_UNREACHABLE: dict[str, str] = {}  # endpoint -> why it could not be reached: asked once per run, not once per job


@dataclasses.dataclass(frozen=True)
class HubToken:
    """What the pods' token is, as far as `validate` knows it."""

    value: str | bool | None  # False: none (anonymous); None: the user's own (huggingface_hub's login or HF_TOKEN)
    stands_in_for: str | None = None  # the Secret (namespace/name) whose token the user's own stands in for


def from_hub(model: ModelSpec) -> bool:
    """Whether the pods download `model` from a hub (not an offline build, a volume or a path). A name is a path to
    the pods when it exists in the pod (workers/models.py resolve_model), which this machine cannot see: only an
    explicit one (/, ./, ../, ~) is taken for a path here."""
    name = model.name
    if model.source is not None or name.startswith(c.OFFLINE_MODEL_PREFIX):
        return False
    return not name.startswith(("/", "./", "../", "~"))


def check_model(model: ModelSpec, token: HubToken, *, timeout: float) -> Findings:
    """What the hub says of `model` (paths under spec.model); nothing for a model that comes from no hub."""
    found = Findings()
    if not from_hub(model):
        return found
    name, revision = model.name, model.revision
    try:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        from grpolora.workers.models import hub_refusal
    except ImportError:
        found.not_checked.append(Problem("spec.model.name", f"model {name!r} on the hub (could not check: "
                                         f"{MISSING_CLIENT})"))  # fmt: skip
        return found
    hub, api = constants.ENDPOINT, HfApi()
    secret = token.stands_in_for
    if hub in _UNREACHABLE:
        found.not_checked.append(Problem("spec.model.name", f"model {name!r} on the hub (could not check: "
                                         f"{_UNREACHABLE[hub]})"))  # fmt: skip
        return found
    try:
        info = api.model_info(name, revision=revision, token=token.value, timeout=timeout)
        if info.gated:
            _auth_check(api.endpoint, name, token.value, timeout)
    except OfflineModeIsEnabled:
        found.not_checked.append(Problem("spec.model.name", f"model {name!r} on the hub (could not check: "
                                         "HF_HUB_OFFLINE is set)"))  # fmt: skip
        return found
    except HFValidationError as exc:  # refused before any request: the hub was not asked (the pod may read a path)
        found.not_checked.append(Problem("spec.model.name", f"model {name!r} on the hub (could not check: not a "
                                         f"hub model id ({_short(exc)}))"))  # fmt: skip
        return found
    except Exception as exc:  # the hub's refusals and the transport's errors come in many types
        refused = hub_refusal(exc, name, revision)
        if refused is None:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if isinstance(exc, HfHubHTTPError) and status:
                why = f"{hub} answered {status}"
            else:
                why = _UNREACHABLE[hub] = f"{hub} could not be reached ({type(exc).__name__}: {_short(exc)})"
            found.not_checked.append(Problem("spec.model.name", f"model {name!r} on the hub (could not check: {why})"))
            return found
        path, _, message = refused.partition(": ")
        if secret is None or isinstance(exc, RevisionNotFoundError):
            found.errors.append(Problem(path, message))
        elif isinstance(exc, GatedRepoError):
            found.not_checked.append(Problem("spec.model.tokenFrom", f"whether Secret {secret}'s token can read "
                                             f"model {name!r} (gated; your own hub token cannot read it either; "
                                             "--cluster reads the Secret)"))  # fmt: skip
        elif isinstance(exc, RepositoryNotFoundError):
            found.warnings.append(Problem(path, f"{message}; asked with your own hub token, the pods use Secret "
                                          f"{secret}'s (--cluster reads it)"))  # fmt: skip
        else:
            found.not_checked.append(Problem("spec.model.tokenFrom", f"model {name!r} (your own hub token was "
                                             f"refused: {_short(exc)})"))  # fmt: skip
        return found
    if secret is not None and info.gated:
        unknown = f"whether Secret {secret}'s token can read model {name!r} (gated; your own hub token can; " \
            "--cluster reads the Secret)"  # fmt: skip
        found.not_checked.append(Problem("spec.model.tokenFrom", unknown))
    return found


def _auth_check(endpoint: str, name: str, token: str | bool | None, timeout: float) -> None:
    """HfApi.auth_check (the same request, read by the same hf_raise_for_status: huggingface_hub 0.30 to 2.4 send it
    alike) with a timeout: auth_check takes none and sends with the client get_session() shares, which has none of
    its own on huggingface_hub 0.x (a requests.Session; 1.x's is an httpx client). Both clients' get() take one."""
    from huggingface_hub import get_session
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    url = f"{endpoint}/api/models/{name}/auth-check"
    hf_raise_for_status(get_session().get(url, headers=build_hf_headers(token=token), timeout=timeout))


def _short(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
