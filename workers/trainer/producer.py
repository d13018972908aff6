"""The rollout producer on trainer rank 0: a thread that draws prompts and generates their groups on every replica
at the live adapter version, as far ahead as the RolloutBuffer allows (grpo.maxStaleness steps)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from grpolora.api.spec import GRPOSpec
from grpolora.workers.environments.runner import EpisodeRunner
from grpolora.workers.tasks import Prompt, TaskError
from grpolora.workers.trainer.buffer import BufferClosed, Group, RolloutBuffer
from grpolora.workers.trainer.rollout import Completion, ReplicasLost, RolloutClient, Sampling, prompt_seed

log = logging.getLogger(__name__)


@dataclass
class DrawnPrompts:
    prompts: list[Prompt]
    ids: list[list[int]]  # each prompt's token ids
    drawn: int  # taken from the stream to find them (skipped ones included)
    positions: list[int]  # each prompt's stream position (it numbers the sampling seed, the same after a resume)
    skipped: int  # too long to fit


# A round whose every replica failed is generated again after the sync group re-forms, this many times in all.
ROUND_ATTEMPTS = 3
# Prompts that cannot fit, drawn in a row before the task is called unusable (for `wanted` prompts: 100 x wanted).
SKIPPED_IN_A_ROW_PER_PROMPT = 100


def draw_prompts(
    stream: Iterator[Prompt],
    tokenize: Callable[[Prompt], list[int]],
    wanted: int,
    start: int,
    longest: int | None,
) -> DrawnPrompts:
    """The next `wanted` prompts from stream position `start`.

    A prompt whose tokens and grpo.maxNewTokens cannot fit the model length (`longest` tokens left for it) is
    skipped (logged, counted in status.promptsSkipped): the replicas would refuse it. Not counted as consumed until
    trained on or dropped (RolloutBuffer.consumed): prompts generated ahead of a checkpoint are generated again after
    a restart. A task that yields nothing usable is a TaskError (the trainer exits with EXIT_INVALID_DATA, so the
    job fails instead of restarting into the same wall).
    """
    result = DrawnPrompts([], [], 0, [], 0)
    for prompt in stream:
        result.drawn += 1
        tokens = tokenize(prompt)
        if longest is not None and len(tokens) > longest:
            result.skipped += 1
            log.warning("prompt skipped: %d tokens, longer than the %d that fit (%.80r)", len(tokens), longest,
                        prompt.text)  # fmt: skip
            if result.drawn >= SKIPPED_IN_A_ROW_PER_PROMPT * wanted and not result.prompts:
                raise TaskError("spec.task", f"none of {result.drawn} prompts in a row fits in {longest} tokens (the "
                                "model length minus grpo.maxNewTokens)")  # fmt: skip
            continue
        result.prompts.append(prompt)
        result.ids.append(tokens)
        result.positions.append(start + result.drawn - 1)
        if len(result.prompts) == wanted:
            break
    if not result.prompts:
        raise TaskError("spec.task", "the prompt stream ended before grpo.steps were trained")
    return result


class RolloutProducer:
    """Fills `buffer` from `prompts` (the task's stream from the resume position) on a thread of its own. The sender
    tells it the live version and the replicas serving it; an error ends the thread and reaches the trainer's
    `take` as itself."""

    def __init__(
        self,
        grpo: GRPOSpec,
        prompts: Iterator[Prompt],
        tokenize: Callable[[Prompt], list[int]],
        max_prompt_tokens: int | None,
        *,
        sender,
        rollouts: RolloutClient,
        buffer: RolloutBuffer,
        episodes: EpisodeRunner | None = None,
    ):
        """`episodes`: each sample is a multi-turn episode run by it (spec.environment) instead of a completion."""
        self._grpo = grpo
        self._episodes = episodes
        self._prompts = prompts
        self._tokenize = tokenize
        self._max_prompt_tokens = max_prompt_tokens
        self._sender = sender
        self._rollouts = rollouts
        self._buffer = buffer
        self.skipped = 0  # prompts skipped as too long, since the start

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        thread.start()
        return thread

    def _produce(self) -> None:
        """Generate groups on the live adapter version, as far ahead as the buffer allows."""
        grpo = self._grpo
        sampling = Sampling(
            n=grpo.generations_per_prompt,
            temperature=grpo.temperature,
            top_p=grpo.top_p,
            max_tokens=grpo.max_new_tokens,
            reference_logprobs=grpo.reference_on_replicas,
            top_k=grpo.top_k,
            stop=tuple(grpo.stop),
        )
        try:
            while True:
                count, start = self._buffer.reserve(grpo.prompts_per_step)
                drawn = draw_prompts(self._prompts, self._tokenize, count, start, self._max_prompt_tokens)
                self.skipped += drawn.skipped
                started = time.perf_counter()
                completions = self._generate(drawn, sampling)
                seconds = time.perf_counter() - started
                groups = [
                    Group(position, prompt, prompt_ids, group, seconds)
                    for position, prompt, prompt_ids, group in zip(
                        drawn.positions, drawn.prompts, drawn.ids, completions, strict=True
                    )
                ]
                self._buffer.deliver(groups, reserved=count, next_position=start + drawn.drawn)
        except BufferClosed:
            return
        except BaseException as exc:  # the trainer's take() raises it
            exc.add_note("raised in the rollout producer thread")
            self._buffer.fail(exc)

    def _generate(self, drawn: DrawnPrompts, sampling: Sampling) -> list[list[Completion]]:
        seeds = [prompt_seed(self._grpo.seed, position) for position in drawn.positions]
        if self._episodes is None:
            return generate_round(self._sender, self._rollouts, drawn.ids, sampling, seeds=seeds)
        return episode_round(self._sender, self._rollouts, self._episodes, drawn.prompts, drawn.ids, sampling, seeds)


def generate_round(
    sender, rollouts: RolloutClient, prompts: list[list[int]], sampling: Sampling, *, seeds: list[int] | None = None
) -> list[list[Completion]]:
    """A round's completions on the live version (a rollout round or an evaluation). When every replica it went to
    failed (they died, or their node went), the sync group is re-formed -- waiting for replacements if none is left,
    and catching them up to the live version -- and the same prompts are generated again with the same seeds: a
    lost replica costs time, not the run."""
    return on_live_replicas(
        sender,
        lambda version, replicas: rollouts.generate(prompts, sampling, version=version, replicas=replicas, seeds=seeds),
    )


def episode_round(
    sender,
    rollouts: RolloutClient,
    episodes: EpisodeRunner,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    sampling: Sampling,
    seeds: list[int],
) -> list[list[Completion]]:
    """`sampling.n` episodes per prompt on the live version (a rollout round or an evaluation), each turn a request
    to the episode's replica (an agent's: a chat session there); again from scratch on the re-formed group when every
    replica failed, as a round."""

    def run(version: int, replicas: list[int]) -> list[list[Completion]]:
        def turn(replica: int, ids: list[list[int]], turn_sampling: Sampling, turn_seeds: list[int]):
            answers = rollouts.generate(ids, turn_sampling, version=version, replicas=[replica], seeds=turn_seeds)
            return [samples[0] for samples in answers]

        return episodes.run(prompts, prompt_ids, seeds, sampling, turn, replicas, version=version, sessions=rollouts)

    return on_live_replicas(sender, run)


def on_live_replicas(sender, generate: Callable[[int, list[int]], list[list[Completion]]]) -> list[list[Completion]]:
    """`generate(live version, replicas)`, again on the re-formed sync group when every replica it went to failed
    (at most ROUND_ATTEMPTS times in all): a round of completions, or of episodes (each a new start)."""
    for attempt in itertools.count(1):
        # Version and replicas read together, and never from a group that is re-forming (a replica lost or back):
        # the caller waits for the group there, where generating would fail the run.
        version, replicas = sender.live()
        try:
            return generate(version, replicas)
        except ReplicasLost as exc:
            if attempt >= ROUND_ATTEMPTS:
                raise
            log.warning("rollout round failed on every replica (attempt %d of %d): %s; re-forming the sync group",
                        attempt, ROUND_ATTEMPTS, exc)  # fmt: skip
            # The trainer may be waiting in take() for this very round: nobody else would re-form the group.
            sender.refresh()
    raise AssertionError("unreachable")  # itertools.count never ends
