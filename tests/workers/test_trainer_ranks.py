"""Several trainer ranks train one model: two gloo ranks with FSDP2 give the same update as one rank, and a
checkpoint written by sharded ranks restores exactly."""

from __future__ import annotations

import pytest
import torch

from grpolora.workers.models import resolve_model
from grpolora.workers.trainer import checkpoint
from grpolora.workers.trainer.policy import Policy
from grpolora.workers.trainer.step import make_optimizer, train_step
from tests.workers.ranks import (
    RECIPE_FILE,
    RECIPES,
    RESULT_FILE,
    SEQUENCES,
    SPEC,
    episode_batch,
    lora_state,
    new_policy,
    recipe_step,
    sgd,
    spec_with,
    synthetic_batch,
    with_reference,
)


@pytest.fixture(scope="module")
def one_rank():
    policy = new_policy()
    before = lora_state(policy)
    optimizer = sgd(policy)
    stats = train_step(policy, optimizer, synthetic_batch(SEQUENCES), SPEC.grpo, on_policy=True)
    return before, lora_state(policy), stats


def test_reference_logprobs_in_the_batch_replace_the_reference_pass(monkeypatch):
    """grpo.referenceFrom: inference: the replicas' reference logprobs travel in the batch and the trainer runs no
    reference pass of its own; with the same values the step is the same step. A first step moves the adapter off
    zero on both policies, so the second one has a KL term that matters."""
    batch = synthetic_batch(SEQUENCES)
    policies = [new_policy(), new_policy()]
    optimizers = [sgd(p) for p in policies]
    for policy, optimizer in zip(policies, optimizers, strict=True):
        train_step(policy, optimizer, batch, SPEC.grpo, on_policy=True)
    before = lora_state(policies[0])
    computed = train_step(policies[0], optimizers[0], batch, SPEC.grpo, on_policy=True)
    given_batch = with_reference(policies[1], batch)
    passes = []
    real = policies[1].reference
    monkeypatch.setattr(policies[1], "reference", lambda: passes.append(1) or real())
    given = train_step(policies[1], optimizers[1], given_batch, SPEC.grpo, on_policy=True)
    assert passes == []
    assert computed.kl > 1e-4
    assert given.kl == pytest.approx(computed.kl, rel=1e-5)
    assert given.loss == pytest.approx(computed.loss, rel=1e-5)
    after_computed, after_given = lora_state(policies[0]), lora_state(policies[1])
    moved = max((after_computed[k] - before[k]).abs().max().item() for k in before)
    assert max((after_given[k] - after_computed[k]).abs().max().item() for k in before) < 1e-5 * moved


def test_two_fsdp_ranks_give_the_same_update_as_one(one_rank, two_ranks):
    """The two ranks get the reference logprobs with the batch (rank 1 then runs a stand-in micro-batch that must
    skip the reference pass too); one rank computes them itself."""
    before, after_one, stats_one = one_rank
    result = torch.load(two_ranks / RESULT_FILE, weights_only=False)
    after_two, stats_two = result["state"], result["stats"]
    assert after_two.keys() == after_one.keys()
    moved = max((after_one[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3  # the step really changed the adapter, so agreement below means something
    worst = max((after_two[k] - after_one[k]).abs().max().item() for k in after_one)
    assert worst < 1e-4 * moved, f"two ranks differ from one by {worst} (the update is {moved})"
    # The gradient before any clipping: a scale error across ranks (a lost `/ world_size`, a per-micro-batch
    # normaliser) shows here even where the update would hide it.
    assert stats_two.grad_norm == pytest.approx(stats_one.grad_norm, rel=1e-4)
    assert stats_two.tokens == stats_one.tokens
    assert stats_two.loss == pytest.approx(stats_one.loss, rel=1e-4, abs=1e-6)
    assert stats_two.kl == pytest.approx(stats_one.kl, rel=1e-4, abs=1e-7)
    # The sharded checkpoint restores the very same adapter.
    assert result["step"] == 1
    assert all(torch.equal(result["restored"][k], after_two[k]) for k in after_two)


@pytest.mark.parametrize("name", list(RECIPES))
def test_two_fsdp_ranks_give_the_same_update_as_one_under_each_recipe(name, two_ranks):
    """Several updates over mini-batches, sequence-level ratios, the per-sequence mean, Dr. GRPO's constant
    normaliser and multi-turn episodes (see RECIPES): two ranks equal one, figures included."""
    before, after_one, stats_one = recipe_step(name)
    _, after_two, stats_two = torch.load(two_ranks / RECIPE_FILE, weights_only=False)[name]
    moved = max((after_one[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3
    worst = max((after_two[k] - after_one[k]).abs().max().item() for k in after_one)
    assert worst < 1e-4 * moved, f"two ranks differ from one by {worst} (the update is {moved})"
    grpo, _ = RECIPES[name]
    assert stats_one.updates == stats_two.updates == grpo.updates_per_batch * grpo.mini_batches
    assert stats_two.grad_norm == pytest.approx(stats_one.grad_norm, rel=1e-4)
    assert (stats_two.tokens, stats_two.clip_fraction) == (stats_one.tokens, pytest.approx(stats_one.clip_fraction))
    assert stats_two.loss == pytest.approx(stats_one.loss, rel=1e-4, abs=1e-6)
    assert stats_two.weight_mean == pytest.approx(stats_one.weight_mean, rel=1e-5)
    assert stats_two.truncated_fraction == pytest.approx(stats_one.truncated_fraction)
    # The entropy as TRL averages it (the mean of each prompt group's token mean) adds up over ranks too; the
    # synthetic batch's groups are of uneven lengths, so it is not the token mean (episodes: no groups, 0).
    assert stats_two.entropy_group_mean == pytest.approx(stats_one.entropy_group_mean, rel=1e-5)
    if name != "episodes":
        assert stats_one.entropy_group_mean > 0 and stats_one.entropy_group_mean != pytest.approx(stats_one.entropy)
    # Off-policy, or on-policy with the mismatch correction: the behaviour weights were applied (and some masked).
    assert stats_one.weight_mean > 0 and stats_one.truncated_fraction > 0
    if grpo.updates_per_batch > 1:
        assert stats_one.clip_fraction > 0  # the second pass is clipped around the old logprobs


def test_two_fsdp_ranks_train_multi_turn_episodes_on_the_assistants_tokens_alone(two_ranks):
    """Several trainer ranks with spec.environment (issue 39): every sample of the "episodes" recipe has an
    environment's turn between two assistant turns. Split across the ranks, each share keeps its loss mask: the step
    counts the assistant's tokens alone, as one rank does (and updates as one rank does: the recipe test above)."""
    mask = episode_batch(SEQUENCES).completion_mask
    for row in mask.tolist():  # ones, then the environment's zeros, then ones again
        first, last = row.index(1), len(row) - row[::-1].index(1)
        assert 0 in row[first:last], row
    _, _, stats_two = torch.load(two_ranks / RECIPE_FILE, weights_only=False)["episodes"]
    assert stats_two.tokens == int(mask.sum())


def test_the_step_runs_at_its_scheduled_rate_with_its_betas():
    # learningRate 1e-2, linear over 4 steps after 2 of warmup: step 0 at 1/2 of it, step 3 at (4 - 3) / (4 - 2).
    grpo = spec_with(lrSchedule="linear", steps=4, warmupSteps=2, adamBeta1=0.8, adamBeta2=0.99).grpo
    policy = new_policy()
    optimizer = make_optimizer(policy, grpo)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    first = train_step(policy, optimizer, synthetic_batch(), grpo, on_policy=True, step=0)
    assert first.learning_rate == optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    last = train_step(policy, optimizer, synthetic_batch(), grpo, on_policy=True, step=3)
    assert last.learning_rate == optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert (first.updates, first.clip_fraction) == (1, 0.0)  # one update per batch: the ratio is exactly 1


def test_a_second_pass_over_an_on_policy_batch_is_clipped_around_the_first():
    grpo = spec_with(updatesPerBatch=2, clipEpsilon=0.01).grpo
    policy = new_policy()
    stats = train_step(policy, sgd(policy, 1e-4), synthetic_batch(), grpo, on_policy=True)
    assert stats.updates == 2 and 0 < stats.clip_fraction <= 0.5  # only the second pass can clip
    assert stats.tokens == int(synthetic_batch().completion_mask.sum())  # the batch's tokens, not twice them


def test_activation_checkpointing_gives_the_same_update():
    """grpo.gradientCheckpointing recomputes each decoder layer in backward: the layers say so, and the step's
    update and figures are those without it."""
    results = []
    for enabled in (False, True):
        grpo = spec_with(gradientCheckpointing=enabled).grpo
        policy = Policy(resolve_model("offline:tiny-llama"), SPEC.model_copy(update={"grpo": grpo}),
                        device=torch.device("cpu"))  # fmt: skip
        layers = policy.model.get_base_model().model
        assert layers.gradient_checkpointing is enabled
        before = lora_state(policy)
        stats = train_step(policy, sgd(policy, 1e-2), synthetic_batch(), grpo, on_policy=True)
        results.append((before, lora_state(policy), stats))
    (before, plain, plain_stats), (_, checkpointed, checkpointed_stats) = results
    moved = max((plain[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4
    assert max((checkpointed[k] - plain[k]).abs().max().item() for k in plain) < 1e-5 * moved
    assert checkpointed_stats.grad_norm == pytest.approx(plain_stats.grad_norm, rel=1e-5)


def test_single_rank_checkpoint_round_trip(one_rank, tmp_path):
    policy = new_policy()
    optimizer = make_optimizer(policy, SPEC.grpo)
    train_step(policy, optimizer, synthetic_batch(), SPEC.grpo, on_policy=True)
    checkpoint.save(
        tmp_path,
        policy.model,
        optimizer,
        checkpoint.Progress(step=7, version=9, epoch=2, prompts_consumed=28),
        keep=2,
    )
    fresh = new_policy()
    fresh_optimizer = make_optimizer(fresh, SPEC.grpo)
    progress = checkpoint.restore(checkpoint.latest(tmp_path), fresh.model, fresh_optimizer)
    assert (progress.step, progress.version, progress.epoch, progress.prompts_consumed) == (7, 9, 2, 28)
    saved, restored = lora_state(policy), lora_state(fresh)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert fresh_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    # A second step from either gives the same result: the optimizer moments came back too.
    train_step(policy, optimizer, synthetic_batch(), SPEC.grpo, on_policy=True)
    train_step(fresh, fresh_optimizer, synthetic_batch(), SPEC.grpo, on_policy=True)
    again, again_fresh = lora_state(policy), lora_state(fresh)
    assert all(torch.allclose(again[k], again_fresh[k], atol=1e-6) for k in again)


def test_old_checkpoints_are_pruned_and_a_partial_one_is_ignored(one_rank, tmp_path):
    policy = new_policy()
    optimizer = make_optimizer(policy, SPEC.grpo)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, policy.model, optimizer, checkpoint.Progress(step=step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    (tmp_path / "step-00000009").mkdir()  # a folder without its state file: a crash mid-write
    assert checkpoint.latest(tmp_path).name == "step-00000003"


def test_a_checkpoint_written_before_the_version_rename_still_resumes():
    """Progress called the adapter version `sync_round` until it took the one name the code uses everywhere."""
    progress = checkpoint.Progress.from_saved({"step": 4, "sync_round": 3, "epoch": 1, "prompts_consumed": 8})
    assert (progress.step, progress.version, progress.epoch, progress.prompts_consumed) == (4, 3, 1, 8)
