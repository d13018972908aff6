"""Episodes under any chat template (issue 46, item 1): an environment's turn is the suffix the template renders after
a fixed conversation, never the conversation rendered again, and the end of an assistant's turn is decided by token
ids. The fixtures are the real templates of Qwen3, Qwen3-Instruct-2507, Qwen2.5, Llama 3.1, Mistral NeMo and
Gemma 3 (workers/environments/chat_templates/README.md gives each file's source and release), rendered by
transformers' own apply_chat_template on SmolLM2's tokenizer given each family's special tokens (so that each
family's end-of-turn is one id, as in its own tokenizer). No model, no engine."""

from __future__ import annotations

import kubernetes_validate
import pytest

from grpolora.api import constants as c
from grpolora.api.spec import TaskSpec
from grpolora.workers.environments import Opening
from grpolora.workers.environments.episode import ChatDelta, ChatTemplateError, EpisodeTokens
from grpolora.workers.environments.templates import SHIPPED, chat_template_text, shipped_template
from grpolora.workers.models import resolve_model
from grpolora.workers.trainer.main import exit_code

MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
MISTRAL_SPECIALS += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# family: (its end-of-turn token, the special tokens its tokenizer has that SmolLM2's lacks, its bos token)
FAMILIES = {
    "qwen3": ("<|im_end|>", [], None),
    "qwen3-instruct-2507": ("<|im_end|>", [], None),
    "qwen2.5": ("<|im_end|>", [], None),
    "llama3.1": (
        "<|eot_id|>",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        "<|begin_of_text|>",
    ),
    "mistral-nemo": (
        "</s>",
        MISTRAL_SPECIALS,
        "<s>",
    ),
    "gemma3": ("<end_of_turn>", ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>"),
}

# What follows `<calc>12*7</calc>` + the end-of-turn id the model generated, when the calculator answers
# `<result>84</result>` as a tool message: read off each template's text (Qwen's wrap a tool answer in a user turn's
# <tool_response>; Llama 3.1 sends it as `ipython`, JSON-quoted; Mistral NeMo and Gemma 3 take no tool message
# without a call id, so it goes as the user's).
SUFFIXES = {
    "qwen3": "\n<|im_start|>user\n<tool_response>\n<result>84</result>\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
    "qwen3-instruct-2507": "\n<|im_start|>user\n<tool_response>\n<result>84</result>\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
    "qwen2.5": "\n<|im_start|>user\n<tool_response>\n<result>84</result>\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama3.1": '<|start_header_id|>ipython<|end_header_id|>\n\n"<result>84</result>"<|eot_id|>'
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral-nemo": "[INST]<result>84</result>[/INST]",
    "gemma3": "\n<start_of_turn>user\n<result>84</result><end_of_turn>\n<start_of_turn>model\n",
}
TOOL_AS_USER = {"mistral-nemo", "gemma3"}


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("offline:smollm2-135m-instruct")


def family_tokenizer(model_dir, family: str):
    from transformers import AutoTokenizer

    end, specials, bos = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    if bos:
        tokenizer.bos_token = bos
    tokenizer.eos_token = end
    tokenizer.chat_template = shipped_template(family)
    return tokenizer


def test_the_shipped_templates_are_the_names_the_schema_takes():
    assert tuple(sorted(p.stem for p in SHIPPED.glob("*.jinja"))) == c.CHAT_TEMPLATES
    assert chat_template_text("qwen3") == (SHIPPED / "qwen3.jinja").read_text()
    assert chat_template_text("{{ messages }}") == "{{ messages }}" and chat_template_text(None) is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_episode_continues_under_each_familys_own_template(model_dir, family):
    tokenizer = family_tokenizer(model_dir, family)
    delta = ChatDelta(tokenizer)
    delta.probe()
    assert delta.tool_role == (family not in TOOL_AS_USER)
    opening = Opening([{"role": "system", "content": "S"}, {"role": "user", "content": "What is 12 * 7?"}])
    tokens = EpisodeTokens(delta.opening(opening))
    end = tokenizer.convert_tokens_to_ids(FAMILIES[family][0])
    first = tokenizer("<calc>12*7</calc>", add_special_tokens=False)["input_ids"] + [end]  # stopped at end-of-turn
    tokens.add_assistant(first, [-0.1] * len(first), None)
    reply = [{"role": "tool", "content": "<result>84</result>"}]
    environment = delta.environment_turn(first, reply)
    assert tokenizer.decode(environment) == SUFFIXES[family]
    assert end not in environment[:1]  # the end-of-turn the model generated is not repeated
    tokens.add_environment(environment)
    second = tokenizer("Answer: 84", add_special_tokens=False)["input_ids"] + [end]
    tokens.add_assistant(second, [-0.1] * len(second), None)
    # The sample is the opening the template renders, then exactly what was generated and the suffixes.
    assert tokens.ids[: len(tokens.opening)] == tokenizer(
        tokenizer.apply_chat_template(opening.messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert tokens.tokens[: len(first)] == first and tokens.tokens[-len(second) :] == second
    assert tokens.mask == [1] * len(first) + [0] * len(environment) + [1] * len(second)
    if family in ("qwen2.5", "qwen3-instruct-2507", "llama3.1", "gemma3"):
        # Prefix-preserving templates: the sample decodes to the template's own rendering of the conversation.
        sent = [{**m, "role": "user"} if family in TOOL_AS_USER else m for m in reply]
        transcript = [*opening.messages, {"role": "assistant", "content": "<calc>12*7</calc>"}, *sent,
                      {"role": "assistant", "content": "Answer: 84"}]  # fmt: skip
        rendered = tokenizer.apply_chat_template(transcript, tokenize=False)
        assert rendered.startswith(tokenizer.decode(tokens.ids))


def test_qwen3_whose_template_rewrites_earlier_turns_continues_what_was_generated(model_dir):
    """Qwen3's template renders an empty think block in the last assistant message and drops it once a message
    follows: rendering the conversation again does not extend what was generated (every episode failed, exit 65).
    The suffix continues the generated ids, think block and all."""
    tokenizer = family_tokenizer(model_dir, "qwen3")
    alone = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tokenize=False
    )
    followed = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"}],
        tokenize=False,
    )
    assert "<think>\n\n</think>\n\n" in alone and not followed.startswith(alone)  # not prefix-preserving
    delta = ChatDelta(tokenizer, {"enable_thinking": False})
    delta.probe()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generated = tokenizer("<think>\n\n</think>\n\n<calc>1+1</calc>", add_special_tokens=False)["input_ids"] + [end]
    ids = delta.environment_turn(generated, [{"role": "tool", "content": "2"}])
    # With thinking off, the next generation prompt carries the empty think block, as Qwen3's template writes it.
    assert tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\n"
    )


def test_the_end_of_a_turn_is_decided_by_token_ids_not_text(model_dir):
    """A turn whose last token is a plain `<` (a stop string cut it there) has not begun `<|im_end|>`: the whole
    closing follows, its special id included (the text check took `<` for its start and tokenised `|im_end|>` as
    text)."""
    tokenizer = family_tokenizer(model_dir, "qwen3")
    delta = ChatDelta(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generated = tokenizer("<calc>1+1</calc> <", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(generated[-1:]) in (["<"], ["Ġ<"])
    ids = delta.environment_turn(generated, [{"role": "tool", "content": "2"}])
    assert ids[0] == end and tokenizer.decode(ids).startswith("<|im_end|>\n<|im_start|>user\n")


@pytest.mark.parametrize(
    ("template", "says"),
    [
        # A template that drops the assistant's content (a completion-only template, as some base models ship).
        ("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}",
         "cannot continue a conversation after an assistant's turn"),
        # One that refuses a message after the assistant's.
        ("{% for m in messages %}{% if loop.index0 > 1 %}{{ raise_exception('two turns at most') }}{% endif %}"
         "{{ m.role }}: {{ m.content }}\n{% endfor %}", "two turns at most"),
    ],
)  # fmt: skip
def test_a_template_that_cannot_be_continued_is_refused_at_start_naming_the_field(model_dir, template, says):
    tokenizer = family_tokenizer(model_dir, "qwen3")
    tokenizer.chat_template = template
    with pytest.raises(ChatTemplateError) as caught:
        ChatDelta(tokenizer).probe("spec.task.chatTemplate's template")
    message = str(caught.value)
    assert message.startswith("spec.task.chatTemplate: spec.task.chatTemplate's template") and says in message
    assert "set spec.task.chatTemplate to a template" in message
    assert exit_code(caught.value) == 78


def test_the_field_takes_a_shipped_name_or_jinja_text():
    assert TaskSpec(name="arithmetic", chatTemplate="qwen3").chat_template == "qwen3"
    assert TaskSpec(name="arithmetic", chatTemplate="{{ messages[0].content }}").chat_template
    with pytest.raises(ValueError, match=r"chatTemplate[\s\S]*'qwen4' is neither a template the project ships "
                       r"\(valid: gemma3, llama3.1"):  # fmt: skip
        TaskSpec(name="arithmetic", chatTemplate="qwen4")


# ---- native tool calls (spec.environment.toolParser) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_env(model_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    try:
        import tool_calling_env
    finally:
        sys.path.pop(0)
    return tool_calling_env


class Counting:
    def __init__(self, env):
        self.env, self.steps = env, []

    def reset(self, prompt):
        return self.env.reset(prompt)

    def step(self, message):
        self.steps.append(message)
        return self.env.step(message)


def _tool_episode(model_dir, tool_env, script: list[str]):
    from grpolora.workers.environments.runner import EpisodeLimits, EpisodeRunner
    from grpolora.workers.environments.tools import ToolCallParser
    from grpolora.workers.tasks import Prompt
    from grpolora.workers.trainer.rollout import Sampling
    from tests.workers.test_episodes import ScriptedReplicas

    tokenizer = family_tokenizer(model_dir, "qwen3")
    made: list[Counting] = []

    def factory():
        made.append(Counting(tool_env.make()))
        return made[-1]

    limits = EpisodeLimits(max_turns=3, max_episode_tokens=1024, max_new_tokens=64, step_timeout_seconds=5.0)
    runner = EpisodeRunner(factory, ChatDelta(tokenizer), limits, tool_parser=ToolCallParser("hermes", tokenizer))
    [[done]] = runner.run([Prompt("What is 2 + 3?")], [[1]], [0], Sampling(1, 1.0, 1.0, 64),
                          ScriptedReplicas(tokenizer, {0: script}), replicas=[0], version=1)  # fmt: skip
    runner.close()
    return tokenizer, done, made[0]


def test_native_tool_calls_are_parsed_by_vllms_parser_and_answered_as_tool_messages(model_dir, tool_env):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    tokenizer, done, env = _tool_episode(model_dir, tool_env, [f"Let me add. {call}", "Answer: 5"])
    sample = tokenizer.decode(done.episode.opening + done.token_ids)
    # The environment's tool specs reached the template: Qwen3's tool prompt lists them.
    assert "<tools>" in sample and '"name": "add"' in sample and '"name": "multiply"' in sample
    # vLLM's hermes parser read the call; the environment got it in OpenAI's form and answered its id.
    [asked, final] = env.steps
    [parsed] = asked["tool_calls"]
    assert asked["content"] == "Let me add. " and parsed["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    tool = done.episode.messages[-2]
    assert tool == {"role": "tool", "content": "5.0", "tool_call_id": parsed["id"], "name": "add"}
    assert "<tool_response>\n5.0\n</tool_response>" in sample and final["content"] == "Answer: 5"
    assert (done.episode.turns, done.episode.tool_calls, done.episode.tool_errors) == (2, 1, 0)
    assert done.episode.error is None and done.text == "Answer: 5"


def test_a_call_the_parser_cannot_read_is_answered_with_a_tool_error_not_sent_to_the_environment(model_dir, tool_env):
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
    _, done, env = _tool_episode(model_dir, tool_env, [broken, "Answer: 5"])
    assert [m.get("tool_calls") for m in env.steps] == [None]  # only the final answer reached it
    tool = done.episode.messages[-2]
    assert tool["role"] == "tool" and tool["content"].startswith("error: the tool call could not be read (hermes")
    assert (done.episode.turns, done.episode.tool_errors, done.episode.error) == (2, 1, None)


@pytest.mark.parametrize(
    ("family", "parser", "text"),
    [
        ("llama3.1", "llama3_json", '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
        # [TOOL_CALLS] is a special token: vLLM's text leaves it out, the parser reads the ids decoded with it.
        ("mistral-nemo", "mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]'),
    ],
)
def test_each_familys_parser_reads_its_calls_from_the_generated_ids(model_dir, family, parser, text):
    from grpolora.workers.environments.tools import ToolCallParser

    tokenizer = family_tokenizer(model_dir, family)
    generated = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    shown = tokenizer.decode(generated, skip_special_tokens=True)  # what vLLM's text says
    message, error = ToolCallParser(parser, tokenizer).message(generated, shown, tool_calling_tools())
    assert error is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'} and call["type"] == "function"


def tool_calling_tools():
    return [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def test_an_unknown_tool_parser_is_refused_naming_the_field(model_dir):
    from grpolora.workers.environments.tools import ToolCallParser
    from grpolora.workers.tasks import TaskError

    says = r"^spec.environment.toolParser: unknown tool parser 'hermes2'; vLLM's: .*hermes"
    with pytest.raises(TaskError, match=says):
        ToolCallParser("hermes2", family_tokenizer(model_dir, "qwen3"))


def test_a_template_from_a_configmap_key_is_mounted_in_the_trainer_and_read_there(tmp_path, monkeypatch):
    """spec.task.chatTemplateFrom: the operator mounts the ConfigMap's key as a file in trainer and inference pods
    (and tells each where: a job's own servers render its chat sessions with it, workers/inference/sessions.py); the
    trainer renders with its text; one not there fails the job naming the field (exit 78)."""
    from grpolora.api import contract
    from grpolora.api.load import parse_job
    from grpolora.api.plan import plan
    from grpolora.operator.builders import build_children
    from grpolora.workers.environments.templates import job_chat_template
    from tests.helpers import job_doc
    from tests.unit.test_render import K8S_VERSION

    doc = job_doc(task={"name": "arithmetic", "chatTemplateFrom": {"name": "templates", "key": "qwen3.jinja"}})
    job = parse_job(doc)
    children = build_children(plan(job), owner_uid="1", token="t")
    for workload in (o for o in children if o["kind"] in ("Job", "StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["chat-template"]["configMap"] == {
            "name": "templates",
            "items": [{"key": "qwen3.jinja", "path": "template.jinja"}],
        }
        [container] = pod["containers"]
        assert {"name": "chat-template", "mountPath": "/var/run/grpolora/chat-template", "readOnly": True} in (
            container["volumeMounts"])  # fmt: skip
        kubernetes_validate.validate(workload, K8S_VERSION, strict=True)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[contract.CHAT_TEMPLATE_FILE] == "/var/run/grpolora/chat-template/template.jinja", workload["kind"]
    # The trainer reads the mounted text.
    (tmp_path / "template.jinja").write_text(shipped_template("qwen3"))
    monkeypatch.setenv(contract.CHAT_TEMPLATE_FILE, str(tmp_path / "template.jinja"))
    assert job_chat_template(job.spec.task) == shipped_template("qwen3")
    monkeypatch.setenv(contract.CHAT_TEMPLATE_FILE, str(tmp_path / "absent.jinja"))
    with pytest.raises(ChatTemplateError, match=r"^spec.task.chatTemplateFrom: ConfigMap 'templates', key "
                       r"'qwen3.jinja': not mounted at .*absent.jinja") as caught:  # fmt: skip
        job_chat_template(job.spec.task)
    assert exit_code(caught.value) == 78
    with pytest.raises(ValueError, match="set at most one of `chatTemplate`"):
        TaskSpec(name="arithmetic", chatTemplate="qwen3", chatTemplateFrom={"name": "t", "key": "k"})
