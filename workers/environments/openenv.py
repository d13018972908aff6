"""OpenEnv environments (meta-pytorch/OpenEnv, `pip install openenv-core`) as environments of ours: the thin adapter
from OpenEnv's reset/step to spec.environment's plugin shape (base.py). It runs where a plugin's environments run:
in the trainer's environment processes (processes.py), or in the project's environment service (service.py) when a
job's spec.environment.server serves the plugin. A module beside the job names the environment in one line:

    from echo_env import EchoEnv                                        # `openenv init echo_env`'s client
    from echo_env.server.echo_env_environment import EchoEnvironment   # and its server's Environment class
    from grpolora.workers.environments.openenv import openenv_environment

    echo = openenv_environment(EchoEnv, "http://echo-env.rl.svc:8000")  # its client: a server that runs elsewhere
    echo_here = openenv_environment(EchoEnvironment)                    # its Environment class: run in this process

and the job says `environment: {plugin: my_module:echo}`. Two ways to reach the environment:

- **Its client** (an `EnvClient` subclass, or `GenericEnvClient` with `action=` naming the field): each episode is
  one client, i.e. one WebSocket to <base_url>/ws, on which the OpenEnv server keeps one environment of its own for
  the connection's life (openenv-core 0.3.0, env_server/http_server.py, `/ws`; at most `max_concurrent_envs` at
  once). OpenEnv's HTTP `/reset` and `/step` cannot carry an episode: each makes a fresh environment and closes it
  after the call (the same file's reset_handler and step_handler), which is also why spec.environment.url cannot
  point at an OpenEnv server. Several base URLs (a list, or comma-separated) share the episodes round-robin, each
  episode staying on its own.
- **Its Environment class** (a subclass of openenv.core.env_server.interfaces.Environment, or a factory of one):
  made per episode in this process, as OpenEnv's server would make it per connection; no server at all.

The mapping, both ways: reset(prompt) calls the environment's reset with `reset(prompt)` as keyword arguments
(default: a `seed`, the prompt's `seed` column or a CRC of its text, so the episodes of a group play the same game;
an environment's reset takes the ones its signature names, as OpenEnv's server filters them), and its observation
becomes the opening (one that says nothing: the task's prompt); step(message) makes the action from the assistant
message with `action` (default: the content into the Action class's one required text field), and the observation
it gets becomes the messages to append (`observation`: default its one text field, or else its fields as JSON), its
reward the turn's and its done the episode's end. An MCP environment (OpenEnv's MCPToolClient, or an MCPEnvironment
class) is a tool environment instead: its tools (ListToolsAction) reach the chat template at reset, and each tool
call of the assistant's (spec.environment.toolParser) is one CallToolAction, answered by a tool message.

Faults, as base.py has them: a server that cannot be reached, closes the connection, times out or is full
(CAPACITY_REACHED, a session it cannot make) is EnvironmentUnavailable: the episode is played again on a fresh
environment. An action the Action class (or the server's validation) refuses is InvalidAction: the model's mistake,
answered as the tool's error. The environment raising at an action is an EnvironmentFault: the episode ends with
errorReward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import json
import logging
import re
import threading
import typing
import zlib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

try:
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironmentBase
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
    from openenv.core.mcp_client import MCPClientBase
except ImportError as err:  # an optional dependency: only jobs that use OpenEnv need it
    raise ImportError(
        f"grpolora.workers.environments.openenv needs OpenEnv's client: pip install openenv-core ({err})"
    ) from err
import pydantic
import websockets.exceptions

from grpolora.workers.environments.base import (
    EnvironmentFault,
    EnvironmentUnavailable,
    InvalidAction,
    Message,
    Opening,
    Reply,
)
from grpolora.workers.tasks.base import Prompt

log = logging.getLogger(__name__)

ActionMap = Callable[[Message], Any]
ObservationMap = Callable[[Any], "str | list[Message]"]
ResetArgs = Callable[[Prompt], dict[str, Any]]

RESULT_FIELDS = frozenset({"done", "reward", "metadata"})
"""An Observation's own fields that are not what it says (openenv-core types.py: Observation)."""

CLOSE_SECONDS = 2.0
# How EnvClient._send_and_receive (openenv-core 0.3.0, core/env_client.py) reports a server's error message: a
# RuntimeError "Server error: <message> (code: <WSErrorCode>)"; the codes are env_server/types.py's WSErrorCode.
_SERVER_ERROR = re.compile(r"^Server error: (?P<message>.*) \(code: (?P<code>[A-Z_]+)\)$", re.DOTALL)
# The server cannot hold the episode (full, or its factory or session failed) or did not understand our message
# (another protocol version): the infrastructure's, played again.
_UNAVAILABLE_CODES = frozenset({"CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR", "INVALID_JSON", "UNKNOWN_TYPE"})


def openenv_environment(
    env: type | Callable[[], Any],
    base_url: str | Sequence[str] | None = None,
    *,
    action: str | ActionMap | None = None,
    observation: str | ObservationMap | None = None,
    reset: ResetArgs | None = None,
    tools: list[dict[str, Any]] | None = None,
    role: str = "user",
    timeout_seconds: float = 60.0,
) -> OpenEnvFactory:
    """A factory for spec.environment.plugin: an OpenEnv environment, one per episode.

    `env`: an OpenEnv client class (an EnvClient subclass; `base_url` is its server: a URL, several in a list or
    comma-separated) or an OpenEnv Environment class or factory (run in this process; no `base_url`).
    `action`: how an assistant message becomes an Action: a function of the message, or the name of the Action's
    text field (with GenericEnvClient, of the action dict's). Default: the Action class's one required `str` field
    gets the message's content.
    `observation`: how an observation becomes the messages to append: a function returning a text (one message of
    `role`) or a list of messages, or the name of the observation's text field. Default: its one `str` field, or
    else its fields as JSON.
    `reset`: the reset's keyword arguments from the task's Prompt. Default: {"seed": the prompt's `seed` meta, or a
    CRC-32 of its text}.
    `tools`: tool specs for the chat template (OpenAI's form). An MCP environment's (an MCPToolClient, or an
    MCPEnvironment class) are listed from it at each reset, and its steps are the assistant's tool calls (one
    CallToolAction each, answered by a tool message); a message without calls ends the episode.
    `timeout_seconds`: a client's connection and each answer at most (the trainer's stepTimeoutSeconds bounds them
    too)."""
    return OpenEnvFactory(env, base_url, action=action, observation=observation, reset=reset, tools=tools, role=role,
                          timeout_seconds=timeout_seconds)  # fmt: skip


class OpenEnvFactory:
    """Makes one OpenEnvEpisode per call. Its clients share one event loop, on a thread started at the first reset
    (not at import: `grpolora validate` imports the plugin and calls the factory once without a server)."""

    def __init__(self, env: type | Callable[[], Any], base_url: str | Sequence[str] | None, *,
                 action: str | ActionMap | None, observation: str | ObservationMap | None, reset: ResetArgs | None,
                 tools: list[dict[str, Any]] | None, role: str, timeout_seconds: float):  # fmt: skip
        self.remote = inspect.isclass(env) and issubclass(env, EnvClient)
        name = getattr(env, "__name__", repr(env))
        where = f"openenv_environment({name})"
        if self.remote:
            urls = base_url.split(",") if isinstance(base_url, str) else list(base_url or [])
            self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
            if not self.urls:
                raise ValueError(f"{where}: an OpenEnv client needs base_url, its server's URL (http://host:port)")
        else:
            if not callable(env):
                raise TypeError(f"{where}: expected an OpenEnv client class or an Environment class or factory")
            if base_url is not None:
                raise ValueError(f"{where}: base_url is for an OpenEnv client class (EnvClient); an Environment "
                                 "runs in this process")  # fmt: skip
            self.urls = []
        if role not in ("user", "tool", "system"):
            raise ValueError(f"{where}: role {role!r}; valid: user, tool, system")
        if not timeout_seconds > 0:
            raise ValueError(f"{where}: timeout_seconds must be > 0, got {timeout_seconds!r}")
        self.env, self.role, self.timeout_seconds, self.tools = env, role, float(timeout_seconds), tools
        # An MCP environment's actions are tool calls (openenv-core's mcp_types: ListToolsAction, CallToolAction).
        self.mcp = inspect.isclass(env) and issubclass(env, MCPClientBase if self.remote else MCPEnvironment)
        if self.mcp and action is not None:
            raise ValueError(f"{where}: an MCP environment's actions are the assistant's tool calls; no action=")
        self.to_action = None if self.mcp else _action_map(action, _action_type(env, self.remote), where)
        self.to_messages = _observation_map(observation, role)
        self.default_observation = observation is None
        self.reset_args = reset or default_reset_args
        self._next = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def says_nothing(self, observation: Any) -> bool:
        """An observation with no field of its own (done, reward and metadata aside), read the default way: the
        episode opens with the task's prompt instead. OpenEnv's MCPToolClient parses every other observation so (its
        _parse_result keeps tools and tool results only), and its server never sends metadata (serialize_observation
        leaves it out)."""
        return self.default_observation and not _fields(observation)

    def __call__(self) -> OpenEnvEpisode:
        if self.remote:
            url = self.urls[next(self._next) % len(self.urls)]
            return OpenEnvEpisode(self, _ClientSession(self, url))
        return OpenEnvEpisode(self, _LocalSession(self.env))

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """`coroutine` on the clients' loop, its result here (every client of this factory lives on that loop)."""
        with self._loop_lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="openenv-clients", daemon=True).start()
            loop = self._loop
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        try:  # the client bounds its connection and each answer by timeout_seconds; this bounds the rest (a loop
            return future.result(2 * self.timeout_seconds + CLOSE_SECONDS)  # stopped under a call) as a timeout
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {2 * self.timeout_seconds + CLOSE_SECONDS:g} s") from None

    def close(self) -> None:
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


class OpenEnvEpisode:
    """One episode of an OpenEnv environment (an environment of base.py's protocol)."""

    def __init__(self, factory: OpenEnvFactory, session: _ClientSession | _LocalSession):
        self._factory, self._session = factory, session

    def reset(self, prompt: Prompt) -> Opening:
        observation, _reward, done = self._session.reset(self._factory.reset_args(prompt))
        if done:
            raise EnvironmentFault("reset(): the OpenEnv environment says its episode is already over")
        tools = self._factory.tools
        if tools is None and self._factory.mcp:
            listed, _reward, _done = self._session.step(ListToolsAction())
            tools = [_tool_spec(tool) for tool in getattr(listed, "tools", None) or []]
        if self._factory.says_nothing(observation):  # e.g. MCPToolClient's reset, which keeps no field of its own
            return Opening(prompt_messages(prompt), tools)
        return Opening(self._factory.to_messages(observation), tools)

    def step(self, message: Message) -> Reply:
        if self._factory.mcp:
            return self._call_tools(message)
        assert self._factory.to_action is not None  # every other kind has one
        try:
            act = self._factory.to_action(message)
        except pydantic.ValidationError as exc:  # the model's text does not make an action: its mistake
            raise InvalidAction(_validation_summary(exc)) from None
        observation, reward, done = self._session.step(act)
        if done:
            return self._ended(Reply([], True, reward))
        return Reply(self._factory.to_messages(observation), False, reward)

    def _call_tools(self, message: Message) -> Reply:
        """Each of the message's tool calls as a CallToolAction, answered by a tool message with its call's id; the
        turn's reward sums theirs. A message without calls is the final answer: the episode ends (spec.task's reward
        scores it unless a call gave one)."""
        answers, rewards, done = [], [], False
        for name, arguments, call_id in _tool_calls(message):
            answer: Message = {"role": "tool", "content": "", "name": name}
            if call_id is not None:
                answer["tool_call_id"] = call_id
            if isinstance(arguments, str):  # arguments that are not a JSON object: the model's mistake, answered
                answer["content"] = f"error: {arguments}"
            else:
                observation, reward, done = self._session.step(CallToolAction(tool_name=name, arguments=arguments))
                answer["content"] = _tool_result(observation)
                if reward is not None:
                    rewards.append(reward)
            answers.append(answer)
            if done:
                break
        if not answers or done:
            return self._ended(Reply([], True, sum(rewards) if rewards else None))
        return Reply(answers, False, sum(rewards) if rewards else None)

    def _ended(self, reply: Reply) -> Reply:
        """The episode is over: its session ends now rather than when the runner closes the step's environments
        (after every episode of the step has ended), so that a server with few sessions serves the next ones."""
        try:
            self._session.close()
        except Exception as exc:  # the episode is over either way
            log.info("closing an ended OpenEnv episode: %s: %s", type(exc).__name__, exc)
        return reply

    def close(self) -> None:
        self._session.close()


class _ClientSession:
    """The episode's OpenEnv client: its WebSocket opened at reset, closed with the episode."""

    def __init__(self, factory: OpenEnvFactory, url: str):
        self._factory, self.url = factory, url
        self._client: Any = None

    def reset(self, kwargs: dict[str, Any]) -> tuple[Any, float | None, bool]:
        if self._client is None:
            timeout = self._factory.timeout_seconds
            self._client = self._factory.env(base_url=self.url, connect_timeout_s=timeout, message_timeout_s=timeout)
        return self._call("reset", lambda: self._client.reset(**kwargs))

    def step(self, act: Any) -> tuple[Any, float | None, bool]:
        if self._client is None:
            raise EnvironmentFault("step() before reset()")
        return self._call("step", lambda: self._client.step(act))

    def _call(self, what: str, call: Callable[[], Coroutine[Any, Any, Any]]) -> tuple[Any, float | None, bool]:
        try:
            result = self._factory.run(call())
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
            # ConnectionError (refused), a dropped connection (ConnectionClosed), no answer within timeout_seconds.
            raise EnvironmentUnavailable(f"{what}(): the OpenEnv server at {self.url}: {type(exc).__name__}: "
                                         f"{exc}") from None  # fmt: skip
        except RuntimeError as exc:
            said = _SERVER_ERROR.match(str(exc))
            if said is None:
                raise
            code, message = said["code"], said["message"]
            where = f"{what}(): the OpenEnv server at {self.url} answered {code}: {message}"
            if code in _UNAVAILABLE_CODES:
                raise EnvironmentUnavailable(where) from None
            if code == "VALIDATION_ERROR" and what == "step":  # the action does not fit the environment's Action
                raise InvalidAction(f"{message}") from None
            raise EnvironmentFault(where) from None  # EXECUTION_ERROR: the environment raised at the action
        return result.observation, _reward(result.reward, what), bool(result.done)

    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            self._factory.run(asyncio.wait_for(client.close(), CLOSE_SECONDS))


class _LocalSession:
    """The episode's OpenEnv Environment, in this process."""

    def __init__(self, make: Callable[[], Any]):
        self._env = make()
        if not isinstance(self._env, OpenEnvEnvironmentBase) and not callable(getattr(self._env, "step", None)):
            raise EnvironmentFault(f"{make!r}() made a {type(self._env).__name__}, not an OpenEnv Environment")

    def reset(self, kwargs: dict[str, Any]) -> tuple[Any, float | None, bool]:
        return _result(self._env.reset(**_accepted(self._env.reset, kwargs)), "reset")

    def step(self, act: Any) -> tuple[Any, float | None, bool]:
        return _result(self._env.step(act), "step")

    def close(self) -> None:
        env, self._env = self._env, None  # once: an ended episode's is closed at once, and again by the runner
        if callable(close := getattr(env, "close", None)):
            close()


def _result(observation: Any, what: str) -> tuple[Any, float | None, bool]:
    """An Observation's own reward and done (OpenEnv's server sends them beside its other fields)."""
    return observation, _reward(getattr(observation, "reward", None), what), bool(getattr(observation, "done", False))


def _reward(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float):  # a bool is one too (OpenEnv's Observation.reward allows it)
        raise EnvironmentFault(f"{what}(): the OpenEnv environment's reward {value!r:.100} is not a number")
    return float(value)


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` takes, as OpenEnv's server passes reset's (http_server.py: _get_valid_kwargs)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(kwargs)
    names = {p.name for p in parameters}
    return {k: v for k, v in kwargs.items() if k in names}


def prompt_messages(prompt: Prompt) -> list[Message]:
    """The task's prompt as a conversation: its chat row's messages, or its text as the user's; its system prompt
    first where it has one."""
    messages: list[Message] = [dict(m) for m in prompt.messages] if prompt.messages else []
    if not messages:
        messages = [{"role": "user", "content": prompt.text}]
    if prompt.system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": prompt.system})
    return messages


def default_reset_args(prompt: Prompt) -> dict[str, Any]:
    """The prompt's `seed` column, else a CRC-32 of its text: the episodes of a group play the same game (OpenEnv's
    ResetRequest takes a seed >= 0)."""
    seed = prompt.meta.get("seed") if prompt is not None else None
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        seed = zlib.crc32((prompt.text if prompt is not None else "").encode())
    return {"seed": seed}


def _action_type(env: Any, remote: bool) -> type | None:
    """The Action class `env` takes, where it says: EnvClient[Action, ...] or Environment[Action, ...] among its
    bases, else its step's annotation."""
    generic = EnvClient if remote else OpenEnvEnvironmentBase
    for klass in inspect.getmro(env) if inspect.isclass(env) else ():
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is generic and (args := typing.get_args(base)):
                return args[0] if inspect.isclass(args[0]) else None
    if not remote and inspect.isclass(env):
        try:
            hinted = typing.get_type_hints(env.step).get("action")
        except Exception:  # an annotation that does not resolve here
            return None
        return hinted if inspect.isclass(hinted) else None
    return None


def _action_map(action: str | ActionMap | None, action_type: type | None, where: str) -> ActionMap:
    if callable(action):
        return action
    if action is None:
        action = _text_field(action_type, where)
    if not isinstance(action, str):
        raise TypeError(f"{where}: action must be a function of the assistant message or a field name")
    name = action
    if action_type is None:  # GenericEnvClient: the action is a dict
        return lambda message: {name: message["content"]}
    fields = getattr(action_type, "model_fields", {})
    if name not in fields:
        raise ValueError(f"{where}: {action_type.__name__} has no field {name!r}; its fields: {', '.join(fields)}")
    return lambda message: action_type(**{name: message["content"]})


def _text_field(action_type: type | None, where: str) -> str:
    """The Action class's one required `str` field, or a ValueError asking for `action=`."""
    if action_type is None or not issubclass(action_type, pydantic.BaseModel):
        raise ValueError(f"{where}: the Action class is not known from the client; pass action= (the name of the "
                         "action's text field, or a function from the assistant message to an action)")  # fmt: skip
    required = {n: f for n, f in action_type.model_fields.items() if f.is_required()}
    text = [n for n, f in required.items() if f.annotation is str]
    if len(text) != 1 or len(required) != 1:
        raise ValueError(f"{where}: {action_type.__name__} needs {', '.join(required) or 'no field'}, not one text "
                         "field; pass action= (a function from the assistant message to an action)")  # fmt: skip
    return text[0]


def _tool_calls(message: Message) -> list[tuple[str, dict[str, Any] | str, str | None]]:
    """(name, arguments or why they are unusable, call id) of each OpenAI-form tool call of the message."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        name, arguments = str(function.get("name") or ""), function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = f"the arguments of {name!r} are not JSON: {arguments[:200]!r}"
        if not isinstance(arguments, dict | str):
            arguments = f"the arguments of {name!r} are not a JSON object"
        calls.append((name, arguments, call.get("id")))
    return calls


def _tool_spec(tool: Any) -> dict[str, Any]:
    """An MCP tool (openenv-core mcp_types.Tool) as the chat template takes a tool: OpenAI's function form."""
    fields = _fields(tool)
    parameters = fields.get("input_schema") or {"type": "object", "properties": {}}
    function = {"name": fields.get("name", ""), "description": fields.get("description", ""), "parameters": parameters}
    return {"type": "function", "function": function}


def _tool_result(observation: Any) -> str:
    """A CallToolObservation as the tool message's text: its error, or its result (FastMCP's CallToolResult gives
    the tool's return value as `data`, in-process as an attribute and over the wire as a key)."""
    error = getattr(observation, "error", None)
    if error is not None:
        return f"error: {getattr(error, 'message', error)}"
    result = getattr(observation, "result", None)
    if hasattr(result, "data"):
        result = result.data
    elif isinstance(result, Mapping) and "data" in result:
        result = result["data"]
    return "" if result is None else _as_text(result)


def _observation_map(observation: str | ObservationMap | None, role: str) -> Callable[[Any], list[Message]]:
    if observation is None:
        text = observation_text
    elif isinstance(observation, str):
        name = observation
        text = lambda obs: _as_text(_fields(obs).get(name, ""))  # noqa: E731
    elif callable(observation):
        text = observation
    else:
        raise TypeError("observation must be a function of the observation or a field name")

    def messages(obs: Any) -> list[Message]:
        said = text(obs)
        if isinstance(said, str):
            return [{"role": role, "content": said}]
        return said  # a list of messages, checked by the runner (checked_messages)

    return messages


def observation_text(observation: Any) -> str:
    """What an observation says: its one `str` field (an echo's `echoed_message`, a game's `prompt`), or else its
    fields (not done, reward, metadata) as JSON."""
    fields = _fields(observation)
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(texts) == 1 else _as_text(fields)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _fields(observation: Any) -> dict[str, Any]:
    if isinstance(observation, pydantic.BaseModel):
        observation = observation.model_dump(mode="json")
    if not isinstance(observation, Mapping):
        return {"observation": observation}
    return {k: v for k, v in observation.items() if k not in RESULT_FIELDS}


def _validation_summary(exc: pydantic.ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}" for e in exc.errors())[:500]
