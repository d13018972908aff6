"""spec.task.chatTemplate resolved to the Jinja text a job renders with, at start, in the trainer's process (prompts,
episodes) and in the job's inference servers' (chat sessions: workers/inference/sessions.py): a name the project
ships (chat_templates/<name>.jinja, the models' own templates; README.md there gives each one's source) or the text
itself."""

from __future__ import annotations

import os
from pathlib import Path

from grpolora.api.constants import CHAT_TEMPLATES
from grpolora.api.contract import CHAT_TEMPLATE_FILE
from grpolora.api.spec import TaskSpec
from grpolora.workers.environments.episode import ChatTemplateError

SHIPPED = Path(__file__).with_name("chat_templates")
FIELD = "spec.task.chatTemplateFrom"


def shipped_template(name: str) -> str:
    """The Jinja text of a template the project ships; KeyError for another name."""
    if name not in CHAT_TEMPLATES:
        raise KeyError(name)
    return (SHIPPED / f"{name}.jinja").read_text()


def chat_template_text(value: str | None) -> str | None:
    """spec.task.chatTemplate as Jinja text (None: the tokenizer's own template)."""
    if value is None:
        return None
    return shipped_template(value) if value in CHAT_TEMPLATES else value


def job_chat_template(task: TaskSpec) -> str | None:
    """The job's chat template: spec.task.chatTemplate's, or the text of spec.task.chatTemplateFrom's ConfigMap key
    (mounted at $GRPOLORA_CHAT_TEMPLATE_FILE); None: the model's own. ChatTemplateError (exit 78) if not there."""
    ref = task.chat_template_from
    if ref is None:
        return chat_template_text(task.chat_template)
    path = os.environ.get(CHAT_TEMPLATE_FILE)
    if not path or not Path(path).is_file():
        where = f"ConfigMap {ref.name!r}, key {ref.key!r}: not mounted at {path or '(unset)'}"
        raise ChatTemplateError(f"{where} (set {CHAT_TEMPLATE_FILE} to the template's file for `grpolora run`)", FIELD)
    text = Path(path).read_text()
    if not text.strip():
        raise ChatTemplateError(f"ConfigMap {ref.name!r}, key {ref.key!r}: empty", FIELD)
    return text
