"""examples/textarena_env.py: a TextArena game (the third-party library, installed for the tests) through the thin
adapter to spec.environment's plugin shape, loaded as the trainer loads a plugin. TextArena's contract, from its
source (textarena/core.py, envs/GuessTheNumber/env.py): `make(id)`, `reset(num_players, seed)`, the state's
observations per player as (sender, text, type) with the player's own moves echoed, `step(action) -> (done, info)`
and `close() -> (rewards, game_info)`."""

from __future__ import annotations

import re

from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments import load_environment
from grpolora.workers.environments.base import checked_opening, checked_reply
from grpolora.workers.tasks import Prompt
from grpolora.workers.trainer.rollout import Sampling
from tests.helpers import ROOT
from tests.workers.test_episodes import PROMPT, ScriptedReplicas, _runner, tokenizer  # noqa: F401 -- the fixture

SPEC = EnvironmentSpec(plugin="textarena_env:guess_the_number", max_turns=10)


def test_a_textarena_game_plays_to_its_end_through_the_adapter():
    factory = load_environment(SPEC, root=ROOT / "examples")
    env = factory()
    opening = checked_opening(env.reset(Prompt("game 7", meta={"seed": 7})))
    assert "Guess The Number" in opening.messages[0]["content"] and opening.messages[0]["role"] == "user"
    low, high, turns = 1, 20, 0
    while True:  # a binary search, reading the game's hints as the model would
        guess = (low + high) // 2
        reply = checked_reply(env.step({"role": "assistant", "content": f"My guess: [{guess}]"}))
        turns += 1
        if reply.done:
            break
        [hint] = reply.messages
        assert hint["role"] == "user" and f"[{guess}]" not in hint["content"]  # the game's words, not our move
        if re.search(r"\bhigher\b", hint["content"]):
            low = guess + 1
        else:
            assert re.search(r"\blower\b", hint["content"]), hint
            high = guess - 1
    assert reply.reward == 1.0 and turns <= 5  # found within log2(20) + 1 guesses: a win
    # The same seed is the same game: a group's episodes play alike.
    again = factory()
    again.reset(Prompt("game 7", meta={"seed": 7}))
    assert checked_reply(again.step({"role": "assistant", "content": f"[{guess}]"})).done


def test_the_runner_plays_textarena_episodes(tokenizer):  # noqa: F811
    runner = _runner(tokenizer, factory=load_environment(SPEC, root=ROOT / "examples"), max_turns=2)
    replicas = ScriptedReplicas(tokenizer, {0: ["[10]", "[10]"]})
    [[episode]] = runner.run([PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 16), replicas, replicas=[0], version=3)
    assert episode.episode.error is None and episode.episode.turns >= 1
    assert "Guess The Number" in episode.episode.messages[0]["content"]
    runner.close()
