"""The events a GRPOLoraJob's status transitions post, pure (transition_events): each Kubernetes Event a pass's new
status calls for, compared with the status before it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from grpolora.api.status import (
    Condition,
    JobStatus,
)
from grpolora.operator import conditions as cond
from grpolora.operator import names

_QUIET_POD_REASONS: Final = (
    names.R_WAITING_FOR_PODS,
    names.R_NO_WORKLOADS,
    names.R_ALL_READY,
    "ContainerCreating",
    "PodInitializing",
    "NotReady",
    "Pending",
)


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


# ---- events ------------------------------------------------------------------------------------------------


def transition_events(old: JobStatus, new: JobStatus) -> list[Event]:
    """Events for the key transitions between two statuses; repeating a pass repeats no event."""
    events: list[Event] = []

    def became_true(type_: str) -> Condition | None:
        now, before = cond.find(new.conditions, type_), cond.find(old.conditions, type_)
        if now is None or now.status != "True":
            return None
        if before is not None and before.status == "True" and before.message == now.message:
            return None
        return now

    if became_true(names.CREATED):
        if new.pool is not None:  # a job on a RolloutPool: its trainer waits for the pool to attach it
            what = "the token Secret, the trainer's headless Service and the NetworkPolicy"
        else:
            what = "the token Secret, headless Services and NetworkPolicy"
            if new.phase != "Suspended":
                what += ", the trainer Job and the inference StatefulSet"
        events.append(Event("Normal", names.E_CREATED, f"created {what}"))
    if new.phase != old.phase:
        if old.phase == "Suspended" and new.phase in ("Pending", "Running"):
            events.append(
                Event(
                    "Normal",
                    names.E_RESUMED,
                    "recreated the trainer Job and inference StatefulSet; training resumes from the latest checkpoint "
                    "(from step 0 without a checkpoint PVC)",
                )
            )
        by_phase = {
            "Running": Event("Normal", names.E_RUNNING, new.message or "running"),
            "Succeeded": Event("Normal", names.E_SUCCEEDED, new.message or "succeeded"),
            "Failed": Event("Warning", names.E_FAILED, new.message or "failed"),
            "Suspended": Event("Normal", names.E_SUSPENDED, new.message or "suspended"),
        }
        if new.phase in by_phase:
            events.append(by_phase[new.phase])
    rekeying = cond.find(new.conditions, names.PROGRESSING)
    rekeyed_before = cond.find(old.conditions, names.PROGRESSING)
    if (
        rekeying is not None
        and rekeying.reason == names.R_REKEYING
        and (rekeyed_before is None or rekeyed_before.reason != names.R_REKEYING)
    ):
        events.append(Event("Warning", names.E_REKEYED, rekeying.message))
    if (new.trainer_restarts or 0) > (old.trainer_restarts or 0):
        progressing = cond.find(new.conditions, names.PROGRESSING)
        events.append(
            Event("Warning", names.E_TRAINER_RESTARTING, progressing.message if progressing else "restarting")
        )
    # A re-form, not the first formation: the group had formed before under an older epoch.
    old_epoch = old.rendezvous.epoch if old.rendezvous is not None else None
    formed_before = cond.is_true(old.conditions, names.RENDEZVOUS_READY)
    if formed_before and old_epoch is not None and new.rendezvous is not None and new.rendezvous.epoch > old_epoch:
        rendezvous = cond.find(new.conditions, names.RENDEZVOUS_READY)
        detail = rendezvous.message if rendezvous is not None else ""
        events.append(Event("Normal", names.E_GROUP_REFORMED, f"the sync group re-formed: {detail}"))
    pods_now, pods_before = cond.find(new.conditions, names.PODS_READY), cond.find(old.conditions, names.PODS_READY)
    if (
        pods_now is not None
        and pods_now.status == "False"
        and pods_now.reason not in _QUIET_POD_REASONS
        and (pods_before is None or pods_before.reason != pods_now.reason)
    ):
        events.append(Event("Warning", names.E_PODS_NOT_READY, pods_now.message))
    waiting, waited = (
        cond.find(new.conditions, names.RUNTIME_RESOLVED),
        cond.find(old.conditions, names.RUNTIME_RESOLVED),
    )
    if waiting is not None and waiting.status == "False" and (waited is None or waited.reason != waiting.reason):
        events.append(Event("Warning", waiting.reason, waiting.message))  # RuntimeNotFound, RuntimeInvalid
    attached = became_true(names.POOL_ATTACHED)
    if attached is not None:
        events.append(Event("Normal", names.E_ATTACHED, attached.message))
    invalid = became_true(names.INVALID_SPEC)
    if invalid is not None:
        events.append(Event("Warning", names.E_INVALID_SPEC, invalid.message))
    refused = became_true(names.SPEC_CHANGE_REFUSED)
    if refused is not None:
        events.append(Event("Warning", names.E_SPEC_CHANGE_REFUSED, refused.message))
    volumes, volumes_before = (
        cond.find(new.conditions, names.VOLUMES_SHAREABLE),
        cond.find(old.conditions, names.VOLUMES_SHAREABLE),
    )
    if (
        volumes is not None
        and volumes.status == "False"
        and (volumes_before is None or volumes_before.status != "False")
    ):
        events.append(Event("Warning", names.E_VOLUMES_NOT_SHAREABLE, volumes.message))
    return events
