"""The GRPO loop. Trainer rank 0 drives it: prompts -> rollouts from every inference replica -> rewards ->
group-relative advantages -> one optimizer step on all trainer ranks -> adapter sync -> status and metrics.
Other ranks follow in lockstep: each step rank 0 broadcasts what to do (the batch, whether to sync, checkpoint
or stop), and all ranks take part in the collectives that gather the adapter and the optimizer state.

Rollouts come through a RolloutBuffer (buffer.py) filled by a producer thread on rank 0 that generates on every
replica, at most grpo.maxStaleness (k) steps ahead: k = 0 takes turns (generate, then train), k >= 1 overlaps.

A step is on-policy only when every rollout came from the adapter version that equals the trainer's weights at
that moment (the weights have not moved since that version was synced); then the importance ratio is taken
against the trainer's own logprobs. Otherwise (k > 0, `syncEverySteps > 1`, or a replica that served another
version) the decoupled objective weights each token by the trainer's over the sampler's (vLLM's) probability.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.workers import adapter as adapter_io
from grpolora.workers.sync.sender import RoundReport
from grpolora.workers.tasks import Prompt, Task, TaskError
from grpolora.workers.tracking import Tracking, drop_records_after
from grpolora.workers.trainer import checkpoint, evaluate, metrics, outputs
from grpolora.workers.trainer.buffer import BufferClosed, Group, RolloutBuffer
from grpolora.workers.trainer.checkpoint import Progress
from grpolora.workers.trainer.grpo import group_advantages
from grpolora.workers.trainer.policy import Batch, Policy, build_batch
from grpolora.workers.trainer.rollout import Completion, RolloutClient, Sampling, prompt_seed
from grpolora.workers.trainer.status_server import StatusBoard
from grpolora.workers.trainer.step import StepStats, make_optimizer, train_step

log = logging.getLogger(__name__)


@dataclass
class Instruction:
    """What rank 0 tells every rank to do next (broadcast as one object). Every rank does it in this order:
    train on `batch`, gather the full adapter (a collective; rank 0 then sends or saves it), checkpoint, stop."""

    batch: Batch | None = None
    on_policy: bool = True
    gather: bool = False
    checkpoint: bool = False
    stop: bool = False


@dataclass
class Rollouts:
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completions: list[list[Completion]]
    seconds: float
    """Wall time of the generation round(s) that produced them (the longest)."""

    @classmethod
    def of(cls, groups: list[Group]) -> Rollouts:
        return cls(
            [g.prompt for g in groups],
            [g.prompt_ids for g in groups],
            [g.completions for g in groups],
            max(g.seconds for g in groups),
        )

    def prompts_and_completions(self, count: int) -> list[tuple[Prompt, list[Completion]]]:
        return list(zip(self.prompts[:count], self.completions[:count], strict=True))

    @property
    def versions(self) -> set[int]:
        """The adapter versions that generated these completions (a replica may have served another one)."""
        return {c.version for group in self.completions for c in group}


@dataclass
class TrainerContext:
    spec: GRPOLoraJobSpec
    policy: Policy
    rank: int
    world_size: int
    checkpoint_dir: Path
    output_dir: Path
    instructions: dist.ProcessGroup | None = None
    """Where rank 0's instructions travel (instruction_group); None with one rank."""
    optimizer: torch.optim.Optimizer = field(init=False)
    progress: Progress = field(default_factory=Progress)

    def __post_init__(self) -> None:
        self.optimizer = make_optimizer(self.policy, self.spec.grpo)

    def resume(self) -> None:
        found = checkpoint.latest(self.checkpoint_dir)
        if found is not None:
            self.progress = checkpoint.restore(found, self.policy.model, self.optimizer)

    def save(self) -> None:
        checkpoint.save(
            self.checkpoint_dir, self.policy.model, self.optimizer, self.progress, keep=self.spec.checkpoint.keep
        )


# How long a follower waits for rank 0's next instruction. Rank 0 works alone for long stretches between two
# instructions (forming the sync group at start, up to main.STARTUP_WAIT_SECONDS plus the join timeout; generating,
# scoring, evaluating, retrying a sync), so this bound is not the collectives' timeout (10 minutes for NCCL, after
# which its watchdog aborts the process): it only has to catch a rank 0 that is hung, not one that has died (gloo
# sees the peer's socket close at once).
INSTRUCTION_TIMEOUT = timedelta(hours=24)


def instruction_group(world_size: int) -> dist.ProcessGroup | None:
    """The side channel rank 0's instructions travel on: a gloo group of all trainer ranks with its own long
    timeout, next to the default group (NCCL on GPUs) that the step's collectives use. Every rank creates it
    right after init_process_group, together."""
    if world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=INSTRUCTION_TIMEOUT)


def logprob_agreement(stats: StepStats, on_policy: bool) -> dict[str, float | None]:
    """The step's trainer-vs-vLLM logprob figures under the name of what they measure. On an on-policy step the
    trainer's weights are the version vLLM sampled from, so any difference is numerics (kernels, dtype): the
    `mismatch`. On an off-policy step they are a newer version's, so the same comparison measures how far the
    policy moved since (`policy_drift`), which must not read as broken numerics."""
    mean, largest = stats.mismatch, stats.mismatch_max
    if on_policy:
        return {"mismatch": mean, "mismatch_max_abs": largest, "policy_drift": None, "policy_drift_max_abs": None}
    return {"mismatch": None, "mismatch_max_abs": None, "policy_drift": mean, "policy_drift_max_abs": largest}


def broadcast_instruction(
    instruction: Instruction | None, world_size: int, group: dist.ProcessGroup | None
) -> Instruction:
    """Rank 0 sends `instruction`; every other rank passes None and waits on `group` (instruction_group) for it."""
    if world_size == 1:
        assert instruction is not None
        return instruction
    holder = [instruction]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def run_follower(ctx: TrainerContext) -> None:
    """Trainer ranks > 0: do what rank 0 says until it says stop, in the order Instruction documents."""
    while True:
        instruction = broadcast_instruction(None, ctx.world_size, ctx.instructions)
        if instruction.batch is not None:
            train_step(
                ctx.policy,
                ctx.optimizer,
                instruction.batch,
                ctx.spec.grpo,
                on_policy=instruction.on_policy,
                rank=ctx.rank,
                world_size=ctx.world_size,
            )
        if instruction.gather:
            adapter_io.lora_tensors(ctx.policy.model)  # the gather is collective; rank 0 sends or saves the result
        if instruction.checkpoint:
            ctx.save()
        if instruction.stop:
            return


@dataclass
class DrawnPrompts:
    prompts: list[Prompt]
    ids: list[list[int]]  # each prompt's token ids
    drawn: int  # taken from the stream to find them (skipped ones included)
    positions: list[int]  # each prompt's stream position (it numbers the sampling seed, the same after a resume)
    skipped: int  # too long to fit


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


@dataclass
class Scored:
    rewards: torch.Tensor  # [prompts, generations], the weighted total
    parts: dict[str, torch.Tensor]  # each reward's own scores, same shape (several rewards only)
    advantages: torch.Tensor  # same shape
    batch: Batch


class Controller:
    """Rank 0's loop. The sender, rollout client and task are injected (built by the entry point)."""

    def __init__(
        self,
        ctx: TrainerContext,
        *,
        task: Task,
        sender,
        rollouts: RolloutClient,
        board: StatusBoard,
        run_name: str = "grpolora",
    ):
        self.ctx = ctx
        self.spec = ctx.spec
        self.task = task
        self.sender = sender
        self.rollouts = rollouts
        self.board = board
        self._metrics_file = ctx.output_dir / "metrics.jsonl"
        dropped = drop_records_after(self._metrics_file, ctx.progress.step)
        if dropped:
            log.info("metrics.jsonl: dropped %d records of steps after the checkpoint this run resumes from", dropped)
        self._prompts = self._prompt_stream()
        # The adapter version that equals the trainer's weights right now; None once they moved past every synced
        # version (between an optimizer step and the next sync).
        self._weights_version: int | None = None
        # Groups generated ahead of the trainer (at most grpo.maxStaleness steps' worth); it also keeps the stream
        # position of the next prompt to draw (ahead of progress.prompts_consumed while groups are buffered or in
        # flight), which numbers the per-prompt sampling seeds.
        self._buffer = RolloutBuffer(self.spec.grpo.staleness, ctx.progress.prompts_consumed)
        self.run_name = run_name
        self.tracking = Tracking(self.spec, ctx.output_dir, run_name, resume_step=ctx.progress.step)
        self.pushes = outputs.Pusher(self.spec, ctx.output_dir, job_name=run_name)
        self._eval_prompts = evaluate.held_out(task, self.spec) if self.spec.eval else []
        self._skipped = 0
        model_length = self.spec.inference.max_model_len or getattr(
            ctx.policy.model.config, "max_position_embeddings", None
        )
        # The replicas score prompt + completion as one prompt for the reference, which vLLM takes only when one more
        # token would fit.
        margin = 1 if self.spec.grpo.reference_on_replicas else 0
        self._max_prompt_tokens = model_length - self.spec.grpo.max_new_tokens - margin if model_length else None

    def _prompt_stream(self) -> Iterator[Prompt]:
        # The stream is deterministic for the seed; a resumed run skips what it already consumed.
        return self.task.stream(self.spec.grpo.seed, self.ctx.progress.prompts_consumed)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        return evaluate.tokenize_prompt(self.ctx.policy.tokenizer, prompt, self.spec.task.system_prompt)

    def _produce(self) -> None:
        """The producer thread: generate groups on the live adapter version, as far ahead as the buffer allows."""
        grpo = self.spec.grpo
        sampling = Sampling(
            n=grpo.generations_per_prompt,
            temperature=grpo.temperature,
            top_p=grpo.top_p,
            max_tokens=grpo.max_new_tokens,
            reference_logprobs=grpo.reference_on_replicas,
        )
        try:
            while True:
                count, start = self._buffer.reserve(grpo.prompts_per_step)
                prompts, ids, drawn, positions = self._next_prompts(count, start)
                started = time.perf_counter()
                version = self.sender.version
                completions = self.rollouts.generate(
                    ids,
                    sampling,
                    version=version,
                    replicas=self.sender.serving(version),
                    seeds=[prompt_seed(grpo.seed, position) for position in positions],
                )
                seconds = time.perf_counter() - started
                groups = [
                    Group(position, prompt, prompt_ids, group, seconds)
                    for position, prompt, prompt_ids, group in zip(positions, prompts, ids, completions, strict=True)
                ]
                self._buffer.deliver(groups, reserved=count, next_position=start + drawn)
        except BufferClosed:
            return
        except BaseException as exc:  # the trainer's take() raises it
            exc.add_note("raised in the rollout producer thread")
            self._buffer.fail(exc)

    def _next_prompts(self, wanted: int, start: int) -> tuple[list[Prompt], list[list[int]], int, list[int]]:
        drawn = draw_prompts(self._prompts, self._tokenize, wanted, start, self._max_prompt_tokens)
        self._skipped += drawn.skipped
        return drawn.prompts, drawn.ids, drawn.drawn, drawn.positions

    def _on_policy(self, rollouts: Rollouts) -> bool:
        """Sampled from exactly the trainer's current weights: the synced version they equal, unmoved since."""
        return self._weights_version is not None and rollouts.versions == {self._weights_version}

    def run(self) -> None:
        ctx, grpo = self.ctx, self.spec.grpo
        self.board.update(phase="Running", step=ctx.progress.step, sync_round=ctx.progress.version)
        if self.sender.version > 0 or ctx.progress.step > 0:
            # Resumed (or replicas already serve an adapter): make every replica serve this checkpoint's adapter.
            broadcast_instruction(Instruction(gather=True), ctx.world_size, ctx.instructions)
            self._sync()
        else:
            self._weights_version = 0  # LoRA B starts at zero: the fresh adapter is exactly the base model
        producer = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        producer.start()
        try:
            while ctx.progress.step < grpo.steps:
                self._train_one_step()
        finally:
            self._buffer.close()
        broadcast_instruction(Instruction(gather=True, stop=True), ctx.world_size, ctx.instructions)
        final = outputs.save_adapter(
            ctx.output_dir / outputs.FINAL_ADAPTER,
            adapter_io.lora_tensors(ctx.policy.model),
            adapter_io.lora_config(ctx.policy.model),
            self.spec,
            step=ctx.progress.step,
            job_name=self.run_name,
        )
        self.board.update(adapter_path=str(final))  # a failed push below leaves the adapter there, and says so
        try:
            pushed = self.pushes.finish(final, step=ctx.progress.step)
        finally:
            self.board.update(**self.pushes.status())
        where = f"; pushed to {', '.join(pushed)}" if pushed else ""
        self.board.update(phase="Succeeded", message=f"{grpo.steps} steps done; adapter in {final}{where}")

    def _train_one_step(self) -> None:
        ctx, grpo = self.ctx, self.spec.grpo
        iteration_started = time.perf_counter()  # wall time of the whole step, waiting for rollouts included
        self.sender.refresh()
        step, per_step, k = ctx.progress.step, grpo.prompts_per_step, grpo.staleness
        # While the trainer waits it allows this step's groups and k steps more ...
        self._buffer.allow(min(k + 1, grpo.steps - step) * per_step)
        trainer_version = self.sender.version
        # ... and while it trains, k steps' groups: set as the groups are taken (at k = 0 the producer may not
        # start a round between the take and the optimizer step, whatever the interpreter's threads do).
        groups, dropped = self._buffer.take(
            per_step, trainer_version, then_allow=min(k, grpo.steps - step - 1) * per_step
        )
        wait_seconds = time.perf_counter() - iteration_started
        rollouts = Rollouts.of(groups)
        on_policy = self._on_policy(rollouts)
        last = step + 1 == grpo.steps
        reward_started = time.perf_counter()
        scored = self._score(rollouts)
        reward_seconds = time.perf_counter() - reward_started
        eval_now = self._eval_due(ctx.progress.step + 1, last)
        # An evaluation runs on the replicas, so it needs them to serve this step's adapter.
        sync_now = (ctx.progress.step + 1) % grpo.sync_every_steps == 0 or last or eval_now
        save_now = (ctx.progress.step + 1) % self.spec.checkpoint.every_steps == 0 or last
        push_now = self.pushes.due(ctx.progress.step + 1)
        instruction = Instruction(
            batch=scored.batch, on_policy=on_policy, gather=sync_now or push_now, checkpoint=save_now
        )
        broadcast_instruction(instruction, ctx.world_size, ctx.instructions)
        train_started = time.perf_counter()
        stats = train_step(
            ctx.policy, ctx.optimizer, scored.batch, grpo, on_policy=on_policy, rank=0, world_size=ctx.world_size
        )
        train_seconds = time.perf_counter() - train_started
        self._weights_version = None  # the weights moved: no served version equals them until the next sync
        ctx.progress.step += 1
        # Only what was trained on or dropped: buffered and in-flight groups are generated again after a resume.
        ctx.progress.prompts_consumed = self._buffer.consumed()
        # One gather per instruction on every rank: the sync and the push share its tensors.
        tensors = adapter_io.lora_tensors(ctx.policy.model) if sync_now or push_now else None
        report = self._sync(tensors) if sync_now else None
        if push_now:
            assert tensors is not None
            self.pushes.submit(ctx.progress.step, tensors, adapter_io.lora_config(ctx.policy.model))
        if save_now:
            ctx.save()
        evaluation = self._evaluate() if eval_now else None
        self._record(
            rollouts,
            scored,
            evaluation,
            stats,
            report,
            on_policy,
            {
                "trainer_version": trainer_version,
                "staleness_max": trainer_version - min(rollouts.versions),
                "dropped_stale": dropped,
            },
            {
                "generate": rollouts.seconds,
                "wait": wait_seconds,
                "reward": reward_seconds,
                "train": train_seconds,
                "sync": report.seconds if report else 0.0,
                "step": time.perf_counter() - iteration_started,
            },
        )

    def close(self) -> None:
        self.tracking.close()

    def _eval_due(self, step: int, last: bool) -> bool:
        every = self.spec.eval.every_steps if self.spec.eval else None
        return self.spec.eval is not None and (last or (every is not None and step % every == 0))

    def _evaluate(self) -> evaluate.EvalResult:
        version = self.sender.version
        result = evaluate.evaluate(
            self._eval_prompts,
            task=self.task,
            tokenize=self._tokenize,
            generate=lambda ids, sampling: self.rollouts.generate(
                ids, sampling, version=version, replicas=self.sender.serving(version)
            ),
            spec=self.spec,
        )
        log.info("eval at step %d: reward %.3f over %d prompts", self.ctx.progress.step, result.reward_mean,
                 result.prompts)  # fmt: skip
        return result

    def _score(self, rollouts: Rollouts) -> Scored:
        items = [(p, c.text) for p, group in zip(rollouts.prompts, rollouts.completions, strict=True) for c in group]
        scores = self.task.score(items)
        shape = (len(rollouts.prompts), -1)
        rewards = torch.tensor(scores.total, dtype=torch.float32).view(shape)
        parts = {label: torch.tensor(v, dtype=torch.float32).view(shape) for label, v in scores.parts.items()}
        advantages = group_advantages(rewards, self.spec.grpo.advantage)
        sequences, flat_advantages, reference = [], [], []
        for ids, completions, row in zip(rollouts.prompt_ids, rollouts.completions, advantages, strict=True):
            for completion, advantage in zip(completions, row.tolist(), strict=True):
                sequences.append((ids, completion.token_ids, completion.logprobs))
                flat_advantages.append(advantage)
                reference.append(completion.reference_logprobs)
        pad = self.ctx.policy.tokenizer.pad_token_id
        given = reference if self.spec.grpo.reference_on_replicas else None
        return Scored(rewards, parts, advantages, build_batch(sequences, flat_advantages, pad, given))

    def _reference_from(self, scored: Scored) -> str | None:
        """Where the step's KL reference logprobs came from: `inference` (the replicas), `trainer`, None at klCoef 0."""
        if scored.batch.reference_logprobs is not None:
            return "inference"
        return "trainer" if self.spec.grpo.kl_coef > 0 else None

    def _samples(self, rollouts: Rollouts, scored: Scored) -> list[dict[str, Any]]:
        """The first prompts of the step, each with all its completions, rewards and advantages."""
        rows = []
        for i, (prompt, group) in enumerate(rollouts.prompts_and_completions(self.spec.tracking.samples_per_step)):
            for j, completion in enumerate(group):
                row = {
                    "prompt": prompt.text,
                    "answer": prompt.answer,
                    "completion": completion.text,
                    "reward": float(scored.rewards[i, j]),
                    "advantage": float(scored.advantages[i, j]),
                }
                if scored.parts:
                    row["rewards"] = {label: float(v[i, j]) for label, v in scored.parts.items()}
                rows.append(row)
        return rows

    def _sync(self, tensors: dict[str, torch.Tensor] | None = None) -> RoundReport:
        """Send the adapter (`tensors` when this step's gather already made them)."""
        if tensors is None:
            tensors = adapter_io.lora_tensors(self.ctx.policy.model)
        report = self.sender.send(tensors, adapter_io.lora_config(self.ctx.policy.model))
        progress = self.ctx.progress
        progress.version, progress.epoch = report.version, report.epoch
        self._weights_version = report.version
        metrics.SYNC_ROUND.set(report.version)
        metrics.SYNC_EPOCH.set(report.epoch)
        metrics.SYNC_SECONDS.observe(report.seconds)
        metrics.SYNC_BYTES.inc(report.bytes)
        self.board.update(
            sync_round=report.version,
            epoch=report.epoch,
            sync_members=list(report.members),
            last_sync_seconds=report.seconds,
            last_sync_bytes=report.bytes,
            last_sync_time=datetime.fromtimestamp(report.finished_at, UTC).isoformat(),
        )
        return report

    def _record(
        self,
        rollouts: Rollouts,
        scored: Scored,
        evaluation: evaluate.EvalResult | None,
        stats: StepStats,
        report,
        on_policy: bool,
        staleness: dict[str, int],
        seconds: dict[str, float],
    ) -> None:
        """`staleness`: the version the trainer measured staleness against (its latest synced one), the largest
        lag of a trained group behind it, and the groups dropped as more than grpo.maxStaleness behind."""
        progress = self.ctx.progress
        rewards = scored.rewards
        agreement = logprob_agreement(stats, on_policy)
        lengths = [len(c.token_ids) for group in rollouts.completions for c in group]
        record: dict[str, Any] = {
            "step": progress.step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            **({"rewards": {label: float(v.mean()) for label, v in scored.parts.items()}} if scored.parts else {}),
            "kl": stats.kl,
            "reference_from": self._reference_from(scored),
            "loss": stats.loss,
            "clip_fraction": stats.clip_fraction,
            "grad_norm": stats.grad_norm,
            **agreement,
            "gen_kl": stats.gen_kl,
            "importance_weight_mean": stats.weight_mean,
            "importance_weight_max": stats.weight_max,
            "truncated_fraction": stats.truncated_fraction,
            "tokens": stats.tokens,
            "completion_length_mean": sum(lengths) / max(len(lengths), 1),
            "prompts_skipped": self._skipped,
            "rollout_version": min(rollouts.versions),
            "on_policy": on_policy,
            **staleness,
            "dropped_stale_total": self._buffer.dropped,
            "sync_round": progress.version,  # the API name of the adapter version
            "epoch": progress.epoch,
            "sync_bytes": report.bytes if report else 0,
            "sync_transport_seconds": report.transport_seconds if report else 0.0,
            "seconds": seconds,
            "time": time.time(),
            **(evaluation.record() if evaluation else {}),
            **self.pushes.report(),
        }
        with self._metrics_file.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        last = progress.step == self.spec.grpo.steps
        samples = self._samples(rollouts, scored) if self.tracking.samples_due(progress.step, last) else None
        self.tracking.step(progress.step, record, samples)
        self.board.update(prompts_skipped=self._skipped, **self.pushes.status())
        if evaluation is not None:
            metrics.EVAL_REWARD.set(evaluation.reward_mean)
            self.board.update(eval_reward=evaluation.reward_mean, eval_step=progress.step)
        metrics.STEP.set(progress.step)
        metrics.REWARD_MEAN.set(record["reward_mean"])
        metrics.KL.set(stats.kl)
        if on_policy:  # each gauge keeps its last step of its kind
            metrics.MISMATCH.set(stats.mismatch)
            self.board.update(mismatch=stats.mismatch)
        else:
            metrics.POLICY_DRIFT.set(stats.mismatch)
        for phase in ("generate", "reward", "train", "sync"):
            metrics.PHASE_SECONDS.labels(phase=phase).observe(seconds[phase])
        self.board.update(
            step=progress.step,
            reward_mean=record["reward_mean"],
            reward_std=record["reward_std"],
            kl=stats.kl,
            gen_kl=stats.gen_kl,
            importance_weight_mean=stats.weight_mean,
            importance_weight_max=stats.weight_max,
            truncated_fraction=stats.truncated_fraction,
            staleness=staleness["staleness_max"],
            dropped_stale=self._buffer.dropped,
        )
        log.info(
            "step %d/%d reward %.3f kl %.4f %s %.2e sync %.3fs (round %d)",
            progress.step,
            self.spec.grpo.steps,
            record["reward_mean"],
            stats.kl,
            "mismatch" if on_policy else "policy drift",
            stats.mismatch,
            seconds["sync"],
            progress.version,
        )
