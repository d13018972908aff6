"""Pod template overlays (`spec.trainer.podTemplate`, `spec.inference.podTemplate`): a partial PodTemplateSpec
merged over the pod template the operator builds, like a strategic merge patch.

- Objects merge key by key; lists of named things merge item by item on their merge key (containers, init
  containers, volumes, env and image pull secrets by `name`, volume mounts by `mountPath`, host aliases by `ip`);
  an item with a new key is appended (a sidecar, a volume). Other lists and scalars replace.
- An overlay adds; it never replaces what the operator sets. Fields the operator owns (the env contract and token,
  ports, probes, the role and job labels, the service-account token, restart policy, its volumes and mounts) and
  fields that have their own spec field (image, resources, env, nodeSelector, tolerations, affinity, pod security
  ids) cannot be set: `clashes` names the overlay's path and the owner. Torch- and operator-free, so that the
  spec validation, `grpolora render` and the operator share it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any, Final

from grpolora.api import constants as c

MERGE_KEYS: Final = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "hostAliases": "ip",
}
OPERATOR: Final = "the operator"
_OPERATOR_LABELS: Final = (
    c.LABEL_NAME,
    c.LABEL_INSTANCE,
    c.LABEL_MANAGED_BY,
    c.LABEL_JOB,
    c.LABEL_POOL,
    c.LABEL_COMPONENT,
    c.LABEL_ROLE,
    c.LABEL_JOB_UID,
)


def merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`overlay` merged over a copy of `base` (see the module docstring)."""
    result = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        current = result.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            result[key] = merge(current, value)
        elif key in MERGE_KEYS and isinstance(current, list) and isinstance(value, list):
            result[key] = _merge_list(current, value, MERGE_KEYS[key])
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(base: list[Any], overlay: list[Any], merge_key: str) -> list[Any]:
    result = copy.deepcopy(base)
    for item in overlay:
        at = next(
            (i for i, old in enumerate(result) if isinstance(old, dict) and old.get(merge_key) == item.get(merge_key)),
            None,
        )
        if at is None:
            result.append(copy.deepcopy(item))
        else:
            result[at] = merge(result[at], item)
    return result


PATCH: Final = "$patch"
"""A list item's directive, as in a strategic merge patch: `$patch: delete` on a job's item drops the runtime's item
it matches; an item `{$patch: replace}` makes the job's list replace the runtime's whole (grpolora.api.runtime)."""
PATCH_VERBS: Final = ("delete", "replace")


def directives(value: Any, path: str) -> list[tuple[str, Any]]:
    """(path of the `$patch` key, its value) for each directive in `value`, at any depth."""
    found: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            at = _dot(path, str(key))
            found += [(at, item)] if key == PATCH else directives(item, at)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += directives(item, f"{path}[{i}]")
    return found


def without_directives(value: Any) -> Any:
    """`value` as the Kubernetes checks see it: `$patch` keys left out, and the items that held nothing else."""
    if isinstance(value, Mapping):
        return {key: without_directives(item) for key, item in value.items() if key != PATCH}
    if isinstance(value, list):
        return [without_directives(i) for i in value if not (isinstance(i, Mapping) and set(i) == {PATCH})]
    return value


def owned_paths(role: str, *, checkpoint_path: str | None, fields_at: str | None = None) -> dict[str, str]:
    """Pod template paths (list items as `[key]`) the overlay of `role` cannot set, and who sets them: the operator
    or a field of spec.<role> / spec (`fields_at`: where the role's fields are, `spec` for a RolloutPool)."""
    container = f"spec.containers[{role}]"
    spec_role = fields_at or f"spec.{role}"
    owned = {f"metadata.labels.{label}": OPERATOR for label in _OPERATOR_LABELS}
    for field in ("restartPolicy", "automountServiceAccountToken", "enableServiceLinks", "subdomain"):
        owned[f"spec.{field}"] = OPERATOR
    for field in ("runAsNonRoot", "seccompProfile", "fsGroupChangePolicy"):
        owned[f"spec.securityContext.{field}"] = OPERATOR
    for field in ("runAsUser", "runAsGroup", "fsGroup"):
        owned[f"spec.securityContext.{field}"] = f"spec.podSecurity.{field}"
    for field in ("nodeSelector", "tolerations", "affinity"):
        owned[f"spec.{field}"] = f"{spec_role}.{field}"
    for volume in c.POD_VOLUMES:
        owned[f"spec.volumes[{volume}]"] = OPERATOR
    for field in ("image", "imagePullPolicy", "resources", "env"):
        owned[f"{container}.{field}"] = f"{spec_role}.{field}"
    for field in ("command", "args", "ports", "readinessProbe", "startupProbe", "livenessProbe",
                  "terminationMessagePolicy"):  # fmt: skip
        owned[f"{container}.{field}"] = OPERATOR
    for field in ("allowPrivilegeEscalation", "capabilities.drop"):
        owned[f"{container}.securityContext.{field}"] = OPERATOR
    for mount in (
        c.SHM_MOUNT,
        c.CACHE_MOUNT,
        c.MODEL_MOUNT,
        c.POOL_JOBS_MOUNT,
        c.TOKEN_MOUNT,
        c.HUB_TOKEN_MOUNT,
        *([checkpoint_path] if checkpoint_path else []),
    ):
        owned[f"{container}.volumeMounts[{mount}]"] = OPERATOR
    return owned


def clashes(
    role: str, overlay: Mapping[str, Any], *, checkpoint_path: str | None, fields_at: str | None = None
) -> list[tuple[str, str]]:
    """(the overlay's path as written, message naming the rendered pod template's path and its owner) for each
    place where `overlay` would replace what the operator sets."""
    owned = owned_paths(role, checkpoint_path=checkpoint_path, fields_at=fields_at)
    found, reported = [], set()
    for written, keyed in _leaves(overlay):
        for path, owner in owned.items():
            if _within(keyed, path) or _within(path, keyed):
                if path not in reported:  # once per owned field (an item sets several)
                    reported.add(path)
                    by = "set by the operator" if owner == OPERATOR else f"set from `{owner}`: use that field"
                    found.append((written, f"clashes with the pod template's `{path}`, {by}"))
                break
    return found


def _within(path: str, ancestor: str) -> bool:
    return path == ancestor or path.startswith((ancestor + ".", ancestor + "["))


def _leaves(value: Any, written: str = "", keyed: str = "") -> Iterator[tuple[str, str]]:
    """(path with list indexes, path with merge keys) of every value the overlay sets (merged lists: per item)."""
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            child_written, child_keyed = _dot(written, key), _dot(keyed, key)
            if key in MERGE_KEYS and isinstance(item, list):
                for i, element in enumerate(item):
                    name = element.get(MERGE_KEYS[key]) if isinstance(element, Mapping) else None
                    yield from _leaves(element, f"{child_written}[{i}]", f"{child_keyed}[{name}]")
            else:
                yield from _leaves(item, child_written, child_keyed)
    else:
        yield written, keyed


def _dot(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
