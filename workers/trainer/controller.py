"""The GRPO loop. Trainer rank 0 drives it: prompts -> rollouts from every inference replica -> rewards ->
group-relative advantages -> one optimizer step on all trainer ranks -> adapter sync -> status and metrics.
Other ranks follow in lockstep: each step rank 0 broadcasts what to do (the batch, whether to sync, checkpoint
or stop), and all ranks take part in the collectives that gather the adapter and the optimizer state.

Rollouts come through a RolloutBuffer (buffer.py) filled by a producer thread on rank 0 (producer.py) that
generates on every replica, at most grpo.maxStaleness (k) steps ahead: k = 0 takes turns (generate, then train),
k >= 1 overlaps. Scoring is scoring.py, the ranks' protocol ranks.py, the step itself step.py.

A step is on-policy only when every rollout came from the adapter version that equals the trainer's weights at
that moment (the weights have not moved since that version was synced); then the importance ratio is taken
against the trainer's own logprobs. Otherwise (k > 0, `syncEverySteps > 1`, or a replica that served another
version) the decoupled objective weights each token by the trainer's over the sampler's (vLLM's) probability.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import torch

from grpolora.api.constants import CHAT_TEMPLATES
from grpolora.workers import adapter as adapter_io
from grpolora.workers.environments import load_environment
from grpolora.workers.environments.episode import ChatDelta
from grpolora.workers.environments.processes import EnvironmentProcesses
from grpolora.workers.environments.runner import EpisodeLimits, EpisodeRunner
from grpolora.workers.environments.tools import ToolCallParser
from grpolora.workers.sync.sender import RoundReport
from grpolora.workers.tasks import Prompt, Task
from grpolora.workers.tracking import Tracking, drop_records_after, metrics_line
from grpolora.workers.trainer import evaluate, metrics, outputs
from grpolora.workers.trainer.buffer import Group, RolloutBuffer
from grpolora.workers.trainer.producer import RolloutProducer, episode_round, generate_round
from grpolora.workers.trainer.ranks import Instruction, TrainerContext, broadcast_instruction
from grpolora.workers.trainer.rollout import Completion, RolloutClient, Sampling, prompt_seed
from grpolora.workers.trainer.scoring import (
    Filled,
    Rollouts,
    Scored,
    completion_figures,
    episode_figures,
    fill_with_spread,
    reference_from,
    reward_figures,
    rewards_of,
    sample_rows,
    score,
)
from grpolora.workers.trainer.status_server import StatusBoard
from grpolora.workers.trainer.step import StepStats, logprob_agreement, train_step

log = logging.getLogger(__name__)


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
        model_length = self.spec.inference.max_model_len or getattr(
            ctx.policy.model.config, "max_position_embeddings", None
        )
        # The replicas score prompt + completion as one prompt for the reference, which vLLM takes only when one more
        # token would fit.
        margin = 1 if self.spec.grpo.reference_on_replicas else 0
        self._episodes = self._episode_runner(margin, model_length)
        if self._episodes is not None:  # an episode's opening leaves room for a turn at least
            model_length = self._episodes.limits.max_episode_tokens
        self._producer = RolloutProducer(
            self.spec.grpo,
            self._prompt_stream(),
            self._tokenize,
            model_length - self.spec.grpo.max_new_tokens - margin if model_length else None,
            sender=sender,
            rollouts=rollouts,
            buffer=self._buffer,
            episodes=self._episodes,
        )

    def _episode_runner(self, margin: int, model_length: int | None) -> EpisodeRunner | None:
        """spec.environment's runner (its plugin loaded now: a bad one fails before any rollout), or None."""
        env, task = self.spec.environment, self.spec.task
        if env is None:
            return None
        delta = ChatDelta(self.ctx.policy.tokenizer, task.chat_template_args, task.system_prompt)
        # A template that cannot continue a conversation fails the job now (exit 78), not every episode later.
        where = "the model's chat template"
        if task.chat_template is not None:
            shipped = f" ({task.chat_template})" if task.chat_template in CHAT_TEMPLATES else ""
            where = f"spec.task.chatTemplate's template{shipped}"
        elif task.chat_template_from is not None:
            where = f"spec.task.chatTemplateFrom's template (ConfigMap {task.chat_template_from.name!r})"
        delta.probe(where)
        log.info("episodes: %s continues turn by turn; tool answers go as %s messages", where,
                 "tool" if delta.tool_role else "user")  # fmt: skip
        limits = EpisodeLimits.of(env, self.spec.grpo.max_new_tokens, model_length, margin)
        parser = ToolCallParser(env.tool_parser, self.ctx.policy.tokenizer) if env.tool_parser else None
        # A built-in's or plugin's code runs in processes of its own (a bad plugin fails here, in the first one).
        # An agent runs there too (an agent's sessions parse its calls on the replicas: no parser here).
        factory = load_environment(env) if env.remote else EnvironmentProcesses(env).start()
        name = env.builtin or env.plugin or env.url or env.agent or "the environment"
        return EpisodeRunner(factory, delta, limits, tool_parser=parser, name=name, agent=env.agent is not None)

    def _prompt_stream(self) -> Iterator[Prompt]:
        # The stream is deterministic for the seed; a resumed run skips what it already consumed.
        return self.task.stream(self.spec.grpo.seed, self.ctx.progress.prompts_consumed)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        task = self.spec.task
        return evaluate.tokenize_prompt(self.ctx.policy.tokenizer, prompt, task.system_prompt, task.chat_template_args)

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
        self._producer.start()
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
        then_allow = min(k, grpo.steps - step - 1) * per_step
        groups, dropped = self._buffer.take(per_step, trainer_version, then_allow=then_allow)
        wait_seconds = time.perf_counter() - iteration_started
        reward_started = time.perf_counter()
        rated, sampling, waited = None, {}, 0.0
        if grpo.dynamic_sampling_draws:
            filled, dropped_more, waited = self._fill_with_spread(groups, trainer_version, then_allow)
            groups, rated, dropped = filled.groups, (filled.rewards, filled.parts), dropped + dropped_more
            sampling = {
                "groups_filtered": filled.filtered,
                "extra_draws": filled.draws,
                "reward_mean_drawn": filled.drawn_reward_mean,
            }
        rollouts = Rollouts.of(groups)
        on_policy = self._on_policy(rollouts)
        last = step + 1 == grpo.steps
        budget = self._episodes.limits.max_episode_tokens if self._episodes is not None else None
        scored = score(self.task, rollouts, self.spec.grpo, self.ctx.policy.tokenizer.pad_token_id, rated, budget)
        # Waiting for dynamic sampling's extra draws counts as waiting, not as scoring.
        reward_seconds = time.perf_counter() - reward_started - waited
        wait_seconds += waited
        eval_now = self._eval_due(ctx.progress.step + 1, last)
        # An evaluation runs on the replicas, so it needs them to serve this step's adapter.
        sync_now = (ctx.progress.step + 1) % grpo.sync_every_steps == 0 or last or eval_now
        save_now = (ctx.progress.step + 1) % self.spec.checkpoint.every_steps == 0 or last
        push_now = self.pushes.due(ctx.progress.step + 1)
        instruction = Instruction(
            batch=scored.batch, on_policy=on_policy, step=step, gather=sync_now or push_now, checkpoint=save_now
        )
        broadcast_instruction(instruction, ctx.world_size, ctx.instructions)
        train_started = time.perf_counter()
        stats = train_step(
            ctx.policy,
            ctx.optimizer,
            scored.batch,
            grpo,
            on_policy=on_policy,
            rank=0,
            world_size=ctx.world_size,
            step=step,
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
            sampling,
            {
                "generate": rollouts.seconds,
                "wait": wait_seconds,
                "reward": reward_seconds,
                "train": train_seconds,
                "sync": report.seconds if report else 0.0,
                "step": time.perf_counter() - iteration_started,
            },
        )
        # After the step's record: a checkpoint at step N means metrics.jsonl (and samples, TensorBoard) hold step N,
        # so a run stopped right after it and resumed from it never lacks that step's record (it redoes only later
        # steps). The checkpoint is collective, but every rank reaches it after the same collectives still.
        if save_now:
            ctx.save()

    def _fill_with_spread(self, first: list[Group], version: int, then_allow: int) -> tuple[Filled, int, float]:
        """grpo.dynamicSamplingDraws: replace the groups without reward spread by further draws from the buffer
        (allowing the producer that many more groups beyond what the step leaves it). Returns the filled step, the
        stale groups dropped while drawing, and the seconds spent waiting for the draws."""
        dropped, waited = 0, 0.0

        def take(count: int) -> list[Group]:
            nonlocal dropped, waited
            started = time.perf_counter()
            self._buffer.allow(then_allow + count)
            more, stale = self._buffer.take(count, version, then_allow=then_allow)
            dropped, waited = dropped + stale, waited + time.perf_counter() - started
            return more

        filled = fill_with_spread(
            first,
            lambda groups: rewards_of(self.task, Rollouts.of(groups)),
            take,
            wanted=self.spec.grpo.prompts_per_step,
            extra_draws=self.spec.grpo.dynamic_sampling_draws,
        )
        return filled, dropped, waited

    def close(self) -> None:
        self.tracking.close()
        if self._episodes is not None:
            self._episodes.close()

    def _eval_due(self, step: int, last: bool) -> bool:
        every = self.spec.eval.every_steps if self.spec.eval else None
        return self.spec.eval is not None and (last or (every is not None and step % every == 0))

    def _evaluate(self) -> evaluate.EvalResult:
        # On the live version, the one just synced (an evaluation is always preceded by a sync).
        def generate(prompts: Sequence[Prompt], ids: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
            if self._episodes is None:
                return generate_round(self.sender, self.rollouts, ids, sampling)
            # One episode per held-out prompt; seeds of their own (greedy by default, where they do not matter).
            seeds = [prompt_seed(self.spec.grpo.seed + evaluate.EVAL_SEED_OFFSET, i) for i in range(len(ids))]
            return episode_round(self.sender, self.rollouts, self._episodes, list(prompts), ids, sampling, seeds)

        result = evaluate.evaluate(
            self._eval_prompts, task=self.task, tokenize=self._tokenize, generate=generate, spec=self.spec
        )
        log.info("eval at step %d: reward %.3f over %d prompts", self.ctx.progress.step, result.reward_mean,
                 result.prompts)  # fmt: skip
        return result

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
        sampling: dict[str, float],
        seconds: dict[str, float],
    ) -> None:
        """`staleness`: the version the trainer measured staleness against (its latest synced one), the largest
        lag of a trained group behind it, and the groups dropped as more than grpo.maxStaleness behind."""
        progress = self.ctx.progress
        agreement = logprob_agreement(stats, on_policy)
        record: dict[str, Any] = {
            "step": progress.step,
            **reward_figures(scored),
            **({"rewards": scored.part_means()} if scored.parts else {}),
            "kl": stats.kl,
            "reference_from": reference_from(scored, self.spec.grpo),
            "loss": stats.loss,
            "clip_fraction": stats.clip_fraction,
            "clip_ratio": {"low_mean": stats.clip_low, "high_mean": stats.clip_high, "region_mean": stats.clip_region},
            "grad_norm": stats.grad_norm,
            "grad_clipped": stats.grad_clipped,
            "learning_rate": stats.learning_rate,
            "entropy": stats.entropy,
            "entropy_group_mean": stats.entropy_group_mean,
            "updates": stats.updates,
            **agreement,
            "gen_kl": stats.gen_kl,
            "importance_weight_mean": stats.weight_mean,
            "importance_weight_max": stats.weight_max,
            "truncated_fraction": stats.truncated_fraction,
            "importance_weight_ess": stats.weight_ess,
            "tokens": stats.tokens,
            **completion_figures(rollouts),
            "completions_truncated": scored.truncated,
            **({"overlong_penalty_mean": float(scored.penalty.mean())} if scored.penalty is not None else {}),
            **episode_figures(rollouts),
            "prompts_skipped": self._producer.skipped,
            "rollout_version": min(rollouts.versions),
            "on_policy": on_policy,
            **staleness,
            **sampling,
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
            handle.write(metrics_line(record))
        last = progress.step == self.spec.grpo.steps
        samples = (
            sample_rows(rollouts, scored, self.spec.tracking.samples_per_step)
            if self.tracking.samples_due(progress.step, last)
            else None
        )
        self.tracking.step(progress.step, record, samples)
        self.board.update(prompts_skipped=self._producer.skipped, **self.pushes.status())
        if evaluation is not None:
            metrics.EVAL_REWARD.set(evaluation.reward_mean)
            self.board.update(eval_reward=evaluation.reward_mean, eval_step=progress.step)
        metrics.STEP.set(progress.step)
        metrics.REWARD_MEAN.set(record["reward_mean"])
        metrics.KL.set(stats.kl)
        metrics.ENTROPY.set(stats.entropy)
        metrics.set_step_figures(record)
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
            entropy=stats.entropy,
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
