"""A TextArena game as a grpolora environment: the thin adapter from a third-party environment library to
spec.environment's plugin shape (reset/step; docs/tasks.md). TextArena (`pip install textarena`) holds text games
written for LLM agents (GuessTheNumber, Wordle, TowerOfHanoi, ...) behind `make`, `reset`, `get_observation`, `step`
and `close`. Beside your job file:

    environment:
      plugin: textarena_env:guess_the_number   # this file; any single-player game id with `textarena_game`
      maxTurns: 10                             # the game's own limit, so that it always ends with its reward

Each prompt of spec.task starts one game, seeded by the prompt (its `seed` column, else its text), so the episodes
of a group play the same game; the game's messages are the user turns, and its reward at the end (TextArena's: 1 for
a win, 0 or -1 otherwise) is the episode's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import textarena

from grpolora.workers.environments import Opening, Reply

PLAYER = 0  # single-player games: the model is player 0


class TextArenaEnvironment:
    def __init__(self, game: str):
        self.env = textarena.make(game)
        self.seen = 0  # observations of player 0 already passed on

    def reset(self, prompt) -> Opening:
        seed = int(prompt.meta.get("seed", zlib.crc32(prompt.text.encode())))
        self.env.reset(num_players=1, seed=seed)
        return Opening([{"role": "user", "content": self._news()}])

    def step(self, message) -> Reply:
        done, _ = self.env.step(action=message["content"])
        if done:
            rewards, _ = self.env.close()
            return Reply(done=True, reward=float(rewards[PLAYER]))
        return Reply([{"role": "user", "content": self._news()}])

    def _news(self) -> str:
        """What the game said to player 0 since the last call (not the player's own moves, which TextArena echoes)."""
        observations = self.env.state.observations[PLAYER]
        new, self.seen = observations[self.seen :], len(observations)
        return "\n".join(text for sender, text, _kind in new if sender != PLAYER)


def textarena_game(game: str) -> Callable[[], TextArenaEnvironment]:
    """A factory for spec.environment.plugin: one environment per episode."""
    return lambda: TextArenaEnvironment(game)


guess_the_number = textarena_game("GuessTheNumber-v0")
