"""spec.task.chatTemplate resolved to the Jinja text the trainer renders with (in the trainer's process, at start):
a name the project ships (chat_templates/<name>.jinja, the models' own templates; README.md there gives each one's
source) or the text itself."""

from __future__ import annotations

from pathlib import Path

from grpolora.api.constants import CHAT_TEMPLATES

SHIPPED = Path(__file__).with_name("chat_templates")


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
