"""The GRPO math against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from grpolora.api.spec import GRPOSpec
from grpolora.workers.trainer.grpo import (
    LossStats,
    MismatchStats,
    group_advantages,
    grpo_loss,
    k3_kl,
    logprob_mismatch,
    loss_normalizer,
    overlong_penalty,
    sampling_mask,
    token_logprobs,
)
from grpolora.workers.trainer.step import (
    corrects_mismatch,
    learning_rate_factor,
    micro_batch_slices,
    mini_batch_indices,
    set_learning_rate,
    with_schedule_base,
)

LN2 = math.log(2.0)


def close(actual: torch.Tensor, expected: list | float, tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# --- advantages -----------------------------------------------------------------------------------------------------


def test_group_normalized_uses_population_std():
    # [1, 0, 0, 0]: mean 0.25, centred [0.75, -0.25, -0.25, -0.25],
    #   population variance (0.5625 + 3 * 0.0625) / 4 = 0.1875, std 0.4330127 → [sqrt(3), -1/sqrt(3) x3].
    # [2, 4, 6, 8]: mean 5, centred [-3, -1, 1, 3], variance (9 + 1 + 1 + 9) / 4 = 5, std sqrt(5)
    #   → [-3, -1, 1, 3] / 2.2360680 = [-1.3416408, -0.4472136, 0.4472136, 1.3416408].
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    advantages = group_advantages(rewards, "group-normalized", eps=1e-12)
    s3 = math.sqrt(3.0)
    close(advantages, [[s3, -1 / s3, -1 / s3, -1 / s3], [-1.3416408, -0.4472136, 0.4472136, 1.3416408]])
    # Population std: zero mean and unit variance within each group.
    close(advantages.mean(dim=1), [0.0, 0.0])
    close(advantages.pow(2).mean(dim=1), [1.0, 1.0], tol=1e-5)


def test_group_normalized_eps_keeps_tiny_spreads_finite():
    # [0, 1e-9]: centred ±5e-10, std 5e-10; with eps 1e-6 → ±5e-10 / (5e-10 + 1e-6) ≈ ±4.9975e-4 (float64).
    advantages = group_advantages(torch.tensor([[0.0, 1e-9]], dtype=torch.float64), "group-normalized")
    close(advantages, [[-4.9975012e-4, 4.9975012e-4]], tol=1e-10)


def test_leave_one_out_exact():
    # [1, 0, 0, 0]: 1 - (0+0+0)/3 = 1;  0 - (1+0+0)/3 = -1/3.
    # [2, 4, 6, 8]: 2 - 18/3 = -4;  4 - 16/3 = -4/3;  6 - 14/3 = 4/3;  8 - 12/3 = 4.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    advantages = group_advantages(rewards, "leave-one-out")
    close(advantages, [[1.0, -1 / 3, -1 / 3, -1 / 3], [-4.0, -4 / 3, 4 / 3, 4.0]], tol=1e-5)


@pytest.mark.parametrize("method", ["group-normalized", "leave-one-out"])
@pytest.mark.parametrize("value", [0.0, 0.1, 1 / 3, 0.7, 1.1])
def test_identical_rewards_give_exact_zero_advantage(method, value):
    rewards = torch.tensor([[value] * 8, [0.0, 1.0] * 4])
    advantages = group_advantages(rewards, method)
    assert torch.equal(advantages[0], torch.zeros(8))
    assert advantages[1].abs().min() > 0.5


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(3, 1), "group-normalized")
    with pytest.raises(ValueError, match=r"\[num_groups, group_size\]"):
        group_advantages(torch.zeros(8), "group-normalized")
    with pytest.raises(ValueError, match="must be finite"):  # NaN is an unscorable completion; inf has no meaning
        group_advantages(torch.tensor([[1.0, float("inf")], [0.0, 1.0]]), "leave-one-out")
    with pytest.raises(ValueError, match="unknown advantage method"):
        group_advantages(torch.zeros(2, 4), "mean")  # type: ignore[arg-type]


# --- token logprobs -------------------------------------------------------------------------------------------------


def test_token_logprobs_hand_computed():
    # logits [0, ln 3] → softmax [1/4, 3/4]: token 1 → ln(3/4) = -0.2876821, token 0 → ln(1/4) = -1.3862944.
    # temperature 2 → logits [0, ln(3)/2] → p(token 0) = 1 / (1 + sqrt(3)) → -ln(2.7320508) = -1.0050525.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(token_logprobs(logits, torch.tensor([[1, 0]])), [[-0.2876821, -1.3862944]])
    close(token_logprobs(logits, torch.tensor([[0, 0]]), temperature=2.0), [[-1.0050525, -1.0050525]])


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_log_softmax_values_and_grads(chunk_size, temperature):
    torch.manual_seed(0)
    full = torch.randn(3, 8, 11, requires_grad=True)
    logits = full[:, :-1]  # a non-contiguous view, as `outputs.logits[:, :-1]` is
    tokens = torch.randint(0, 11, (3, 7))
    weights = torch.randn(3, 7)

    ours = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), full)
    reference = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    (grad_ref,) = torch.autograd.grad((reference * weights).sum(), full)

    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad_ours, grad_ref)


def test_token_logprobs_gradcheck_float64():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 5))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, temperature=0.9, chunk_size=2), (logits,))


def test_token_logprobs_bf16_computes_in_float32_without_keeping_a_float32_copy():
    torch.manual_seed(2)
    logits = torch.randn(2, 6, 50).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 50, (2, 6))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours = token_logprobs(logits, tokens, chunk_size=4)
    assert ours.dtype == torch.float32
    # Autograd keeps the bf16 logits it was given and [B, T] float32 logsumexps, never a float32 [B, T, V] copy.
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape == logits.shape]
    reference = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(ours, reference)
    ours.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_top_p_logprobs_hand_computed():
    # probs [0.1, 0.2, 0.3, 0.4]; ascending cumulative mass [0.1, 0.3, 0.6, 1.0]; a token is dropped when that
    # mass is <= 1 - top_p, the most likely one never.
    #   top_p 0.65 (drop <= 0.35): tokens 0, 1 dropped; token 2, where the nucleus reaches 0.65, kept → {2, 3},
    #     mass 0.7: token 3 → ln(0.4 / 0.7) = -0.5596158, token 2 → ln(0.3 / 0.7) = -0.8472979.
    #   top_p 0.75 (drop <= 0.25): only token 0 dropped → {1, 2, 3}, mass 0.9: token 1 → ln(0.2 / 0.9) = -1.5040774.
    #   top_p 0.3 (drop <= 0.7): only the most likely token is left → token 3 → ln 1 = 0.
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).expand(1, 2, 4)
    assert sampling_mask(logits[0, 0], 0.65).tolist() == [False, False, True, True]
    assert sampling_mask(logits[0, 0], 0.75).tolist() == [False, True, True, True]
    assert sampling_mask(logits[0, 0], 0.3).tolist() == [False, False, False, True]
    close(token_logprobs(logits, torch.tensor([[3, 2]]), top_p=0.65), [[-0.5596158, -0.8472979]])
    close(token_logprobs(logits, torch.tensor([[1, 3]]), top_p=0.75), [[-1.5040774, math.log(0.4 / 0.9)]])
    close(token_logprobs(logits, torch.tensor([[3, 3]]), top_p=0.3), [[0.0, 0.0]])
    # A target outside the nucleus (trainer and sampler logits differ by rounding) counts as kept, so its logprob
    # is finite: top_p 0.65, token 0 → ln(0.1 / (0.1 + 0.7)) = ln(1/8) = -2.0794415.
    close(token_logprobs(logits, torch.tensor([[0, 3]]), top_p=0.65), [[-2.0794415, -0.5596158]])
    # Temperature first, then the nucleus: logits ln[0.1, 0.2, 0.3, 0.4] / 0.5 → probs ∝ [1, 4, 9, 16] / 30;
    # cumulative [1, 5, 14, 30] / 30, top_p 0.65 (drop <= 10.5 / 30) → {2, 3}: token 3 → ln(16 / 25) = -0.4462871.
    close(token_logprobs(logits, torch.tensor([[3, 3]]), temperature=0.5, top_p=0.65), [[-0.4462871, -0.4462871]])


def test_top_p_splits_a_tie_at_the_boundary_and_keeps_the_top_token():
    # probs [1/4, 1/4, 1/2]: top_p 0.6 (drop <= 0.4) keeps the top token and exactly one of the tied pair (the
    # one sorted after the other), as vLLM does; the kept mass is 3/4, so the top token has ln(2/3).
    logits = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))
    mask = sampling_mask(logits[0, 0], 0.6)
    assert mask[2] and int(mask[:2].sum()) == 1
    close(token_logprobs(logits, torch.tensor([[2]]), top_p=0.6), [[math.log(2 / 3)]])
    assert sampling_mask(torch.tensor([[5.0, 5.0, 5.0]]), 1e-6).sum() == 1  # a tiny top_p still keeps one token
    with pytest.raises(ValueError, match="top_p"):
        token_logprobs(logits, torch.tensor([[2]]), top_p=0.0)


def test_nucleus_is_vllms_for_the_installed_version():
    """Against vLLM's own top-p (the PyTorch path its CPU sampler takes) on random, tied and peaked logits."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(64, 50, generator=g) * scale for scale in (0.5, 2.0, 8.0)]
    rows.append(torch.randint(0, 4, (64, 50), generator=g).float())  # many ties
    for logits in rows:
        for top_p in (0.1, 0.5, 0.9, 0.95, 0.999):
            p = torch.full((logits.shape[0],), top_p, dtype=torch.float32)
            theirs = topk_topp.apply_top_k_top_p_pytorch(logits.clone(), None, p, allow_cpu_sync=True)
            assert torch.equal(sampling_mask(logits, top_p), theirs > float("-inf")), top_p


def test_top_k_is_vllms_for_the_installed_version_alone_and_before_top_p():
    """grpo.topK: vLLM keeps every token whose logit is at least the k-th largest (ties with it kept), then applies
    top-p over what is left; the trainer's mask must be the same op for op."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(32, 50, generator=g) * scale for scale in (0.5, 4.0)]
    rows.append(torch.randint(0, 4, (32, 50), generator=g).float())  # ties at the k-th value
    for logits in rows:
        for top_k in (1, 3, 10, 50):
            k = torch.full((logits.shape[0],), top_k, dtype=torch.long)
            for top_p in (1.0, 0.9, 0.5):
                p = None if top_p == 1.0 else torch.full((logits.shape[0],), top_p, dtype=torch.float32)
                theirs = topk_topp.apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)
                ours = sampling_mask(logits, top_p, top_k)
                assert torch.equal(ours, theirs > float("-inf")), (top_k, top_p)


def test_top_k_logprobs_hand_computed():
    # probs [0.1, 0.2, 0.3, 0.4]: top-k 2 keeps {2, 3}, renormalised over 0.7 -> token 3: ln(0.4 / 0.7); top-k 2
    # then top-p 0.5 over {0.3/0.7, 0.4/0.7}: drop <= 0.5, cumulative [0.4286, 1] -> token 2 dropped, token 3 alone.
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]))
    close(token_logprobs(logits, torch.tensor([[3]]), top_k=2), [[math.log(0.4 / 0.7)]])
    close(token_logprobs(logits, torch.tensor([[3]]), top_k=2, top_p=0.5), [[0.0]])
    close(token_logprobs(logits, torch.tensor([[3]]), top_k=4), [[math.log(0.4)]])  # k = V: nothing truncated
    with pytest.raises(ValueError, match="top_k"):
        token_logprobs(logits, torch.tensor([[3]]), top_k=-1)


@pytest.mark.parametrize("chunk_size", [1, 1024])
def test_top_p_logprobs_values_and_grads_match_the_truncated_softmax(chunk_size):
    torch.manual_seed(4)
    full = torch.randn(2, 6, 13, requires_grad=True)
    logits = full[:, :-1]
    scaled = logits.detach() / 0.7
    tokens = torch.distributions.Categorical(logits=scaled).sample()  # mostly inside the nucleus, some outside
    weights = torch.randn(2, 5)
    ours = token_logprobs(logits, tokens, temperature=0.7, top_p=0.8, chunk_size=chunk_size)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), full)
    keep = sampling_mask(scaled, 0.8).scatter(-1, tokens[..., None], True)
    truncated = (logits / 0.7).masked_fill(~keep, float("-inf"))
    reference = torch.log_softmax(truncated, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    (grad_ref,) = torch.autograd.grad((reference * weights).sum(), full)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad_ours, grad_ref)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, tokens, temperature=0.7, top_p=0.8, chunk_size=2),
        (logits.detach().double().requires_grad_(),),
    )


# --- k3 KL ----------------------------------------------------------------------------------------------------------


def test_k3_hand_computed():
    # logp = ln 1/2, ref = ln 1/4: d = ref - logp = -ln 2 → e^d - d - 1 = 0.5 + 0.6931472 - 1 = 0.1931472.
    # logp = ln 1/4, ref = ln 1/2: d = ln 2 → 2 - 0.6931472 - 1 = 0.3068528.
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    close(k3_kl(logp, ref), [0.1931472, 0.3068528])


def test_k3_non_negative_and_zero_iff_equal():
    torch.manual_seed(3)
    logp, ref = torch.randn(1000) - 3, torch.randn(1000) - 3
    kl = k3_kl(logp, ref)
    assert (kl > 0).all()
    assert torch.equal(k3_kl(logp, logp), torch.zeros(1000))


def test_k3_is_unbiased_for_kl_under_samples_from_pi():
    # E_{x~pi}[k3(x)] = sum_x pi(x) k3(x) must equal KL(pi || ref) = sum_x pi(x) (log pi(x) - log ref(x)) exactly.
    pi_logp = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 2.0], dtype=torch.float64), dim=0)
    ref_logp = torch.log_softmax(torch.tensor([0.0, 1.0, 0.3, 0.5], dtype=torch.float64), dim=0)
    expectation = (pi_logp.exp() * k3_kl(pi_logp, ref_logp)).sum()
    kl = (pi_logp.exp() * (pi_logp - ref_logp)).sum()
    torch.testing.assert_close(expectation, kl)


# --- loss -----------------------------------------------------------------------------------------------------------


def test_ratio_one_gives_minus_advantage_plus_kl():
    # A = [2, -1], mask [[1,1,1],[1,1,0]] → 5 tokens. logp = behaviour (ratio 1), ref = logp + ln 2 (k3 = 0.3068528).
    # policy: -(2 * 3) + (1 * 2) = -4 → -4 / 5 = -0.8; KL: 0.1 * 0.3068528 * 5 / 5 = 0.0306853 → -0.7693147.
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = grpo_loss(
        logp,
        logp.detach(),
        logp.detach() + LN2,
        torch.tensor([2.0, -1.0]),
        mask,
        clip_epsilon=0.2,
        kl_coef=0.1,
        normalizer=5,
    )
    close(loss, -0.7693147)
    # d l_t / d logp_t = -A + kl_coef * (1 - e^(ref - logp)) = -A + 0.1 * (1 - 2) = -A - 0.1, over 5 tokens:
    # row 0: (-2 - 0.1) / 5 = -0.42; row 1: (1 - 0.1) / 5 = 0.18; the padding token: 0.
    loss.backward()
    close(logp.grad, [[-0.42, -0.42, -0.42], [0.18, 0.18, 0.0]])
    assert stats == LossStats(
        token_count=5.0,
        ratio_sum=5.0,
        clipped_low=0.0,
        clipped_high=0.0,
        kl_sum=pytest.approx(5 * 0.3068528),
        policy_loss_sum=-4.0,
    )
    assert stats.mean_ratio == 1.0 and stats.clip_fraction == 0.0


def test_clipping_on_both_sides():
    # eps 0.2, one token per sequence, A = [1, 1, -1, -1], ratio = [1.5, 0.5, 0.5, 1.5]:
    #   A>0, r=1.5: min(1.5, 1.2) = 1.2  → loss -1.2, clipped (no gradient)
    #   A>0, r=0.5: min(0.5, 0.8) = 0.5  → loss -0.5, gradient -A * r = -0.5
    #   A<0, r=0.5: min(-0.5, -0.8) = -0.8 → loss 0.8, clipped (no gradient)
    #   A<0, r=1.5: min(-1.5, -1.2) = -1.5 → loss 1.5, gradient -A * r = 1.5
    # sum 0.6 / 4 tokens = 0.15; gradients / 4 = [0, -0.125, 0, 0.375].
    behaviour = torch.full((4, 1), -2.0)
    logp = (behaviour + torch.tensor([[1.5], [0.5], [0.5], [1.5]]).log()).requires_grad_()
    loss, stats = grpo_loss(
        logp,
        behaviour,
        None,
        torch.tensor([1.0, 1.0, -1.0, -1.0]),
        torch.ones(4, 1),
        clip_epsilon=0.2,
        kl_coef=0.0,
        normalizer=4,
    )
    close(loss, 0.15)
    loss.backward()
    close(logp.grad, [[0.0], [-0.125], [0.0], [0.375]])
    assert (stats.clipped_low, stats.clipped_high, stats.clip_fraction) == (1.0, 1.0, 0.5)
    assert stats.mean_ratio == pytest.approx(1.0)
    assert stats.policy_loss_sum == pytest.approx(0.6)


def test_decoupled_objective_with_truncated_behaviour_weight():
    # Off-policy (docs/design.md): w = min(exp(proximal - behaviour), cap) times PPO's clipped surrogate of
    # r = exp(logp - proximal). eps 0.2, cap 2, one token per sequence, 4 tokens:
    #   row 0: A  1, w = 1.5,           r = 1   → loss -1.5 * 1 = -1.5;   d/dlogp = -w A r = -1.5
    #   row 1: A  1, w = 3 → 2 (cut),   r = 1   → loss -2;                d/dlogp = -2
    #   row 2: A -1, w = 0.5,           r = 1   → loss -0.5 * -1 = 0.5;   d/dlogp = +0.5
    #   row 3: A  1, w = 1,             r = 1.5 → min(1.5, 1.2) = 1.2, loss -1.2, clipped: no gradient
    # loss (-1.5 - 2 + 0.5 - 1.2) / 4 = -1.05; gradients / 4 = [-0.375, -0.5, 0.125, 0].
    behaviour = torch.full((4, 1), -2.0)
    proximal = behaviour + torch.tensor([[1.5], [3.0], [0.5], [1.0]]).log()
    logp = (proximal + torch.tensor([[1.0], [1.0], [1.0], [1.5]]).log()).requires_grad_()
    loss, stats = grpo_loss(
        logp,
        proximal,
        None,
        torch.tensor([1.0, 1.0, -1.0, 1.0]),
        torch.ones(4, 1),
        clip_epsilon=0.2,
        kl_coef=0.0,
        normalizer=4,
        behaviour_logp=behaviour,
        weight_cap=2.0,
    )
    close(loss, -1.05)
    loss.backward()
    close(logp.grad, [[-0.375], [-0.5], [0.125], [0.0]])
    # Spread of the untruncated weights: mean (1.5 + 3 + 0.5 + 1) / 4 = 1.5, max 3; one token of four truncated.
    assert stats.off_policy_tokens == 4.0
    assert stats.mean_weight == pytest.approx(1.5) and stats.weight_max == pytest.approx(3.0)
    assert stats.truncated_fraction == 0.25
    assert (stats.clipped_high, stats.clip_fraction) == (1.0, 0.25)
    assert stats.policy_loss_sum == pytest.approx(-4.2)
    # Effective sample size of the weights as the loss used them (1.5, 2, 0.5, 1), as verl reports it
    # (rollout_is_eff_sample_size, 1 / mean((w / mean w)^2)): (sum w)^2 / (n sum w^2) = 25 / (4 * 7.5) = 0.8333.
    assert stats.weight_ess == pytest.approx(25 / 30)


def test_behaviour_weight_stats_add_up_over_micro_batches_and_ranks():
    # Sums add, the largest weight is a max (an all-reduce of as_tensor() with SUM and MAX, rebuilt by field name).
    a = LossStats(token_count=2, off_policy_tokens=2, weight_sum=3.0, weight_max=2.5, truncated=1)
    b = LossStats(token_count=3, off_policy_tokens=3, weight_sum=3.0, weight_max=1.5)
    total = a + b
    assert (total.token_count, total.weight_sum, total.weight_max, total.truncated) == (5, 6.0, 2.5, 1)
    both = torch.stack([a.as_tensor(), b.as_tensor()])
    assert LossStats.from_reduced(both.sum(0), both.max(0).values) == total


def test_on_policy_loss_reports_no_behaviour_weights():
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    _, stats = grpo_loss(
        logp, logp.detach(), None, torch.tensor([1.0]), torch.ones(1, 2), clip_epsilon=0.2, kl_coef=0.0,
        normalizer=2,
    )  # fmt: skip
    assert (stats.off_policy_tokens, stats.mean_weight, stats.truncated_fraction) == (0.0, 0.0, 0.0)


def _random_batch(seed: int, batch: int = 4, length: int = 6, vocab: int = 9):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=generator)
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    behaviour = torch.log_softmax(logits + 0.3 * torch.randn(logits.shape, generator=generator), -1)
    ref = torch.log_softmax(logits + 0.3 * torch.randn(logits.shape, generator=generator), -1)
    behaviour = behaviour.gather(-1, tokens[..., None]).squeeze(-1)
    ref = ref.gather(-1, tokens[..., None]).squeeze(-1)
    lengths = torch.tensor([6, 2, 4, 1])[:batch]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    advantages = torch.randn(batch, generator=generator)
    return logits, tokens, behaviour, ref, advantages, mask


def _loss_and_grad(logits, tokens, behaviour, ref, advantages, mask, normalizer):
    params = logits.clone().requires_grad_()
    loss, stats = grpo_loss(
        token_logprobs(params, tokens),
        behaviour,
        ref,
        advantages,
        mask,
        clip_epsilon=0.2,
        kl_coef=0.05,
        normalizer=normalizer,
    )
    loss.backward()
    return loss.detach(), params.grad, stats


def test_padding_never_affects_loss_or_gradients():
    logits, tokens, behaviour, ref, advantages, mask = _random_batch(4)
    loss, grad, stats = _loss_and_grad(logits, tokens, behaviour, ref, advantages, mask, 13.0)
    pad = mask == 0
    # Garbage in every padded position: other logits and tokens, inf and NaN logprobs.
    logits2 = torch.where(pad[..., None], torch.randn(logits.shape) * 50, logits)
    tokens2 = torch.where(pad, (tokens + 1) % 9, tokens)
    behaviour2 = torch.where(pad, torch.tensor(float("-inf")), behaviour)
    ref2 = torch.where(pad, torch.tensor(float("nan")), ref)
    loss2, grad2, stats2 = _loss_and_grad(logits2, tokens2, behaviour2, ref2, advantages, mask, 13.0)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2, grad)
    assert torch.equal(grad[pad], torch.zeros_like(grad[pad]))
    assert stats2 == stats and stats.token_count == 13.0


def test_micro_batches_with_shared_normalizer_equal_one_batch():
    logits, tokens, behaviour, ref, advantages, mask = _random_batch(5)
    total = float(mask.sum())  # 6 + 2 + 4 + 1 = 13 tokens in the step
    loss, grad, stats = _loss_and_grad(logits, tokens, behaviour, ref, advantages, mask, total)

    params = logits.clone().requires_grad_()
    losses, all_stats = [], []
    for rows in (slice(0, 1), slice(1, 4)):  # unequal micro-batches: 6 tokens, then 7
        part, part_stats = grpo_loss(
            token_logprobs(params[rows], tokens[rows]),
            behaviour[rows],
            ref[rows],
            advantages[rows],
            mask[rows],
            clip_epsilon=0.2,
            kl_coef=0.05,
            normalizer=total,
        )
        part.backward()  # gradients accumulate in params.grad
        losses.append(part.detach())
        all_stats.append(part_stats)
    torch.testing.assert_close(sum(losses), loss)
    torch.testing.assert_close(params.grad, grad)
    summed = sum(all_stats, LossStats())
    for name in ("token_count", "ratio_sum", "kl_sum", "policy_loss_sum", "clipped_low", "clipped_high"):
        assert getattr(summed, name) == pytest.approx(getattr(stats, name))
    assert LossStats.from_tensor(summed.as_tensor()) == summed


def test_identical_reward_group_gives_zero_policy_gradient():
    logits, tokens, behaviour, _, _, mask = _random_batch(6)
    advantages = group_advantages(torch.full((1, 4), 0.7), "group-normalized").flatten()
    params = logits.clone().requires_grad_()
    loss, _ = grpo_loss(
        token_logprobs(params, tokens),
        behaviour,
        None,
        advantages,
        mask,
        clip_epsilon=0.2,
        kl_coef=0.0,
        normalizer=float(mask.sum()),
    )
    loss.backward()
    assert torch.equal(params.grad, torch.zeros_like(params))


def test_loss_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    common = {"clip_epsilon": 0.2, "kl_coef": 0.1, "normalizer": 6}
    with pytest.raises(ValueError, match="ref_logp is required"):
        grpo_loss(x, x, None, torch.zeros(2), torch.ones(2, 3), **common)
    with pytest.raises(ValueError, match="normalizer must be positive"):
        grpo_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), **{**common, "normalizer": 0})
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(x, x, x, torch.zeros(3), torch.ones(2, 3), **common)


# --- mismatch -------------------------------------------------------------------------------------------------------


def test_mismatch_hand_computed():
    # Δ = trainer - sampler over the two real tokens = [ln 2, 0]:
    #   exp(|Δ|) - 1 = [1, 0] → mean 0.5; max |Δ| = ln 2;
    #   k3(sampler, trainer) = e^Δ - Δ - 1 = [2 - ln 2 - 1, 0] = [0.3068528, 0] → mean 0.1534264.
    trainer = torch.tensor([[math.log(0.5), math.log(0.25), 5.0]])
    sampler = torch.tensor([[math.log(0.25), math.log(0.25), float("nan")]])
    stats = logprob_mismatch(trainer, sampler, torch.tensor([[1, 1, 0]]))
    assert stats.token_count == 2.0
    assert stats.mean_exp_abs_diff == pytest.approx(0.5)
    assert stats.max_abs_diff == pytest.approx(LN2)
    assert stats.mean_kl == pytest.approx(0.1534264)


def test_mismatch_zero_for_identical_and_empty_and_adds_up():
    logp = torch.randn(3, 4)
    assert logprob_mismatch(logp, logp.clone(), torch.ones(3, 4)) == MismatchStats(token_count=12.0)
    assert logprob_mismatch(logp, logp + 1, torch.zeros(3, 4)) == MismatchStats()
    a = MismatchStats(token_count=2, exp_abs_diff_sum=1.0, max_abs_diff=0.7, kl_sum=0.3)
    b = MismatchStats(token_count=3, exp_abs_diff_sum=0.5, max_abs_diff=0.2, kl_sum=0.1)
    assert a + b == MismatchStats(token_count=5, exp_abs_diff_sum=1.5, max_abs_diff=0.7, kl_sum=pytest.approx(0.4))


def test_mismatch_reduces_by_field_name_sums_and_max():
    # Two ranks' stats as an all-reduce sees them: the SUM and the MAX of the as_tensor()s rebuild the merged
    # stats with max_abs_diff a max (0.7) and the rest sums, exactly what adding them gives.
    a = MismatchStats(token_count=2, exp_abs_diff_sum=1.0, max_abs_diff=0.7, kl_sum=0.3)
    b = MismatchStats(token_count=3, exp_abs_diff_sum=0.5, max_abs_diff=0.2, kl_sum=0.1)
    stacked = torch.stack([a.as_tensor(), b.as_tensor()])
    merged = MismatchStats.from_reduced(stacked.sum(0), stacked.amax(0))
    assert merged == MismatchStats(token_count=5, exp_abs_diff_sum=1.5, max_abs_diff=0.7, kl_sum=pytest.approx(0.4))
    assert merged == a + b
    assert MismatchStats.from_reduced(a.as_tensor(), a.as_tensor()) == a


# --- recipes: advantage scale, loss aggregation, clip-higher, sequence-level ratios, schedules -----------------------


def test_batch_std_scale_divides_by_the_std_of_every_reward_in_the_batch():
    # [1, 0, 0, 0] and [2, 4, 6, 8]: group means 0.25 and 5, centred [0.75, -0.25 x3] and [-3, -1, 1, 3].
    # All eight rewards: mean 21 / 8 = 2.625; squared deviations 2.640625 + 3 * 6.890625 + 0.390625 + 1.890625
    #   + 11.390625 + 28.890625 = 65.875; population variance 65.875 / 8 = 8.234375, std 2.8695601.
    # → [0.2613641, -0.0871214 x3] and [-1.0454564, -0.3484855, 0.3484855, 1.0454564].
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    advantages = group_advantages(rewards, "group-normalized", eps=1e-12, scale="batch-std")
    a, b = 0.2613641, -0.0871214
    close(advantages, [[a, b, b, b], [-1.0454564, -0.3484855, 0.3484855, 1.0454564]])


def test_no_scale_is_the_centred_reward_dr_grpo():
    # Dr. GRPO: r - mean(r), no std (a group of small spread is not blown up to unit variance).
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    advantages = group_advantages(rewards, "group-normalized", scale="none")
    close(advantages, [[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 1.0, 3.0]])
    # Leave-one-out is unscaled by default; "group-std" divides its G / (G - 1) * (r - mean) by the group's std:
    # [1, 0, 0, 0] → [1, -1/3 x3] / 0.4330127 = [2.3094011, -0.7698004 x3].
    loo = group_advantages(rewards[:1], "leave-one-out", eps=1e-12, scale="group-std")
    close(loo, [[2.3094011, -0.7698004, -0.7698004, -0.7698004]], tol=1e-5)
    assert torch.equal(
        group_advantages(rewards, "leave-one-out"), group_advantages(rewards, "leave-one-out", scale="none")
    )
    with pytest.raises(ValueError, match="unknown advantage scale 'sample'; valid: group-std, batch-std, none"):
        group_advantages(rewards, "group-normalized", scale="sample")


def test_clip_higher_lets_a_positive_advantage_rise_further():
    # eps_low 0.2, eps_high 0.28 (DAPO), one token per sequence, A = [1, 1, -1, -1], ratio = [1.25, 1.3, 0.75, 0.85]:
    #   A>0, r=1.25 < 1.28: not clipped (a symmetric 0.2 would clip it) → loss -1.25, gradient -A r = -1.25
    #   A>0, r=1.3  > 1.28: loss -1.28, clipped high (no gradient)
    #   A<0, r=0.75 < 0.8:  min(-0.75, -0.8) = -0.8 → loss 0.8, clipped low (no gradient)
    #   A<0, r=0.85:        loss 0.85, gradient -A r = 0.85
    # sum -0.88 / 4 tokens = -0.22; gradients / 4 = [-0.3125, 0, 0, 0.2125].
    behaviour = torch.full((4, 1), -2.0)
    logp = (behaviour + torch.tensor([[1.25], [1.3], [0.75], [0.85]]).log()).requires_grad_()
    loss, stats = grpo_loss(
        logp,
        behaviour,
        None,
        torch.tensor([1.0, 1.0, -1.0, -1.0]),
        torch.ones(4, 1),
        clip_epsilon=0.2,
        clip_epsilon_high=0.28,
        kl_coef=0.0,
        normalizer=4,
    )
    close(loss, -0.22)
    loss.backward()
    close(logp.grad, [[-0.3125], [0.0], [0.0], [0.2125]])
    assert (stats.clipped_low, stats.clipped_high, stats.clip_fraction) == (1.0, 1.0, 0.5)


def test_sequence_mean_weights_each_completion_equally():
    # A = [2, -1], ratio 1, no KL; 3 tokens in row 0, 1 in row 1 (then padding).
    # Per-token losses -2 (row 0) and +1 (row 1). Sequence mean: ((-6) / 3 + 1 / 1) / 2 sequences = -0.5
    # (the token mean would be -5 / 4 = -1.25). Gradients: row 0 -A / 3 / 2 = -1/3 each; row 1 +1 / 1 / 2 = 0.5.
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = grpo_loss(
        logp, logp.detach(), None, torch.tensor([2.0, -1.0]), mask, clip_epsilon=0.2, kl_coef=0.0, normalizer=2,
        aggregation="sequence-mean",
    )  # fmt: skip
    close(loss, -0.5)
    loss.backward()
    close(logp.grad, [[-1 / 3, -1 / 3, -1 / 3], [0.5, 0.0, 0.0]])
    assert stats.policy_loss_sum == -5.0 and stats.token_count == 4.0  # the figures stay per token


def test_loss_normalizer_per_aggregation():
    # 13 completion tokens in 4 sequences, maxNewTokens 8: token mean / 13, sequence mean / 4, Dr. GRPO / (4 * 8).
    assert loss_normalizer("token-mean", tokens=13, sequences=4, max_new_tokens=8) == 13
    assert loss_normalizer("sequence-mean", tokens=13, sequences=4, max_new_tokens=8) == 4
    assert loss_normalizer("constant", tokens=13, sequences=4, max_new_tokens=8) == 32
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'; valid: token-mean, sequence-mean, constant"):
        loss_normalizer("sum", tokens=13, sequences=4, max_new_tokens=8)


def test_sequence_level_ratio_gspo():
    # GSPO: s_i = exp(mean_t(logp - proximal)) over the completion's tokens, clipped per sequence.
    #   row 0: log ratios [ln 2, 0] → s = sqrt 2 = 1.4142136 > 1.2 with A = 1: clipped high → loss -1.2 per token,
    #          no gradient (token-level ratios [2, 1] would clip one token and not the other).
    #   row 1: log ratios [ln 0.81, 0] → s = 0.9, A = 1, inside the range → loss -0.9 per token; each token's
    #          gradient -A * s / |y| from each of the two per-token copies = -0.9, / 4 tokens = -0.225.
    #   row 2: no completion token (a stand-in): NaN logprobs there change nothing.
    # token mean: (2 * -1.2 + 2 * -0.9) / 4 = -1.05.
    proximal = torch.full((3, 2), -1.0)
    logp = proximal + torch.tensor([[math.log(2.0), 0.0], [math.log(0.81), 0.0], [0.0, 0.0]])
    logp[2] = float("nan")
    logp.requires_grad_()
    loss, stats = grpo_loss(
        logp, proximal, None, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([[1, 1], [1, 1], [0, 0]]),
        clip_epsilon=0.2, kl_coef=0.0, normalizer=4, ratio_level="sequence",
    )  # fmt: skip
    close(loss, -1.05)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [-0.225, -0.225], [0.0, 0.0]])
    assert stats.clipped_high == 2.0 and stats.clipped_low == 0.0
    assert stats.ratio_sum == pytest.approx(2 * math.sqrt(2.0) + 2 * 0.9)
    # Sequence mean over the two real completions: (-1.2 + -0.9) / 2, the GSPO paper's 1/G sum_i.
    loss, _ = grpo_loss(
        logp.detach(), proximal, None, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([[1, 1], [1, 1], [0, 0]]),
        clip_epsilon=0.2, kl_coef=0.0, normalizer=2, ratio_level="sequence", aggregation="sequence-mean",
    )  # fmt: skip
    close(loss, -1.05)


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        # 10 steps. Warmup ramps (s + 1) / warmup, so the first step already learns; then the decay runs over the
        # remaining steps, reaching 0 one step past the last.
        ("constant", 0, {0: 1.0, 5: 1.0, 9: 1.0}),
        ("constant", 2, {0: 0.5, 1: 1.0, 9: 1.0}),
        # linear: (10 - s) / 10 → 1, 0.5, 0.1; with warmup 2: (10 - s) / 8 → s 2: 1, s 6: 0.5, s 9: 0.125.
        ("linear", 0, {0: 1.0, 5: 0.5, 9: 0.1}),
        ("linear", 2, {0: 0.5, 1: 1.0, 2: 1.0, 6: 0.5, 9: 0.125}),
        # cosine: (1 + cos(pi (s - 2) / 8)) / 2 → s 2: 1, s 6: (1 + cos(pi / 2)) / 2 = 0.5,
        #   s 9: (1 + cos(7 pi / 8)) / 2 = (1 - 0.9238795) / 2 = 0.0380602.
        ("cosine", 2, {0: 0.5, 2: 1.0, 6: 0.5, 9: 0.0380602}),
    ],
)
def test_learning_rate_schedule(schedule, warmup, expected):
    for step, factor in expected.items():
        assert learning_rate_factor(schedule, step, total_steps=10, warmup_steps=warmup) == pytest.approx(factor)


def test_mini_batches_split_the_batch_into_near_equal_runs():
    # 10 sequences in 3 mini-batches: 4, 3, 3, in order (groups stay together where the count divides them).
    assert [s.tolist() for s in mini_batch_indices(10, 3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [s.tolist() for s in mini_batch_indices(2, 5)] == [[0], [1]]  # never an empty mini-batch


def test_the_schedule_scales_the_base_rate_the_optimizer_keeps():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = with_schedule_base(torch.optim.AdamW([param], lr=0.3), 0.3)
    assert set_learning_rate(optimizer, 0.5) == pytest.approx(0.15)
    assert set_learning_rate(optimizer, 0.25) == pytest.approx(0.075)  # of the base, not of the last rate
    fresh = with_schedule_base(torch.optim.AdamW([param], lr=0.3), 0.3)
    fresh.load_state_dict(optimizer.state_dict())
    assert set_learning_rate(fresh, 1.0) == pytest.approx(0.3)
    plain = torch.optim.SGD([param], lr=1.0)
    assert set_learning_rate(plain, 1.0) == 1.0
    with pytest.raises(ValueError, match="needs the optimizer of make_optimizer"):
        set_learning_rate(plain, 0.5)


def test_overlong_penalty_is_dapos_soft_length_penalty():
    # maxNewTokens 10, buffer 4: free up to 10 - 4 = 6 tokens; then (6 - length) / 4 down to -1 at 10 tokens, all
    # times the factor 0.5: lengths [3, 6, 7, 8, 10] → [0, 0, -0.125, -0.25, -0.5].
    penalty = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), max_new_tokens=10, buffer=4, factor=0.5)
    close(penalty, [0.0, 0.0, -0.125, -0.25, -0.5])


def test_masking_drops_the_tokens_whose_weight_passes_the_cap():
    # As test_decoupled_objective_with_truncated_behaviour_weight, but a weight above the cap drops its token
    # (AReaL, verl's rollout IS "mask") instead of being cut to it: row 1 (w = 3 > 2) gives no loss and no
    # gradient. loss (-1.5 + 0 + 0.5 - 1.2) / 4 = -0.55; gradients / 4 = [-0.375, 0, 0.125, 0].
    behaviour = torch.full((4, 1), -2.0)
    proximal = behaviour + torch.tensor([[1.5], [3.0], [0.5], [1.0]]).log()
    logp = (proximal + torch.tensor([[1.0], [1.0], [1.0], [1.5]]).log()).requires_grad_()
    loss, stats = grpo_loss(
        logp, proximal, None, torch.tensor([1.0, 1.0, -1.0, 1.0]), torch.ones(4, 1), clip_epsilon=0.2, kl_coef=0.0,
        normalizer=4, behaviour_logp=behaviour, weight_cap=2.0, weight_mode="mask",
    )  # fmt: skip
    close(loss, -0.55)
    loss.backward()
    close(logp.grad, [[-0.375], [0.0], [0.125], [0.0]])
    assert stats.truncated_fraction == 0.25 and stats.weight_max == pytest.approx(3.0)  # counted the same way
    with pytest.raises(ValueError, match="unknown weight mode 'clip'; valid: truncate, mask"):
        grpo_loss(logp, proximal, None, torch.ones(4), torch.ones(4, 1), clip_epsilon=0.2, kl_coef=0.0, normalizer=4,
                  behaviour_logp=behaviour, weight_mode="clip")  # fmt: skip


def test_the_mismatch_correction_is_on_by_default_for_half_precision_only():
    grpo = GRPOSpec()
    assert [corrects_mismatch(grpo, d) for d in ("bfloat16", "float16", "float32")] == [True, True, False]
    assert not corrects_mismatch(GRPOSpec(mismatchCorrection=False), "bfloat16")
    assert corrects_mismatch(GRPOSpec(mismatchCorrection=True), "float32")


def test_micro_batches_by_a_token_budget():
    # Lengths sorted as by_length leaves them; a micro-batch costs its count x its longest (padded) length.
    # Budget 12: [3, 4] (2 x 4 = 8; adding 5 would cost 15), [5] (adding 9: 18), [9] (adding 10: 20), [10].
    lengths = [3, 4, 5, 9, 10]
    assert micro_batch_slices(lengths, size=8, tokens=12) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    # The sequence count still bounds it: at most 2 per micro-batch under a budget that would allow more.
    assert micro_batch_slices(lengths, size=2, tokens=100) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    # A sequence longer than the budget goes alone; no budget: by count only.
    assert micro_batch_slices([20, 30], size=8, tokens=12) == [slice(0, 1), slice(1, 2)]
    assert micro_batch_slices(lengths, size=2, tokens=None) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert micro_batch_slices([], size=2, tokens=12) == []


# --- entropy of the sampling distribution ---------------------------------------------------------------------------


def test_token_entropy_of_uniform_and_two_point_distributions():
    from grpolora.workers.trainer.grpo import token_entropy

    # Position 0: four equal logits -> uniform over 4, H = ln 4. Position 1: logits (ln 3, 0, -inf, -inf) ->
    # p = (3/4, 1/4), H = -(3/4 ln 3/4 + 1/4 ln 1/4) = ln 4 - (3/4) ln 3.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e9, -1e9]]])
    close(token_entropy(logits), [[math.log(4.0), math.log(4.0) - 0.75 * math.log(3.0)]], tol=1e-6)


def test_token_entropy_follows_the_sampler_temperature_and_truncation():
    from grpolora.workers.trainer.grpo import token_entropy

    # logits (2 ln 2, 0) at temperature 2 -> (ln 2, 0) -> p = (2/3, 1/3), H = ln 3 - (2/3) ln 2.
    logits = torch.tensor([[[2 * LN2, 0.0]]])
    close(token_entropy(logits, temperature=2.0), [[math.log(3.0) - (2 / 3) * LN2]])
    # top_k 2 over (ln 3, 0, -5): the third token is dropped, p = (3/4, 1/4) as above; never NaN from 0 * -inf.
    three = torch.tensor([[[math.log(3.0), 0.0, -5.0]]])
    close(token_entropy(three, top_k=2), [[math.log(4.0) - 0.75 * math.log(3.0)]])
    # top_p 0.5: only the most likely token is kept, a point mass, H = 0.
    close(token_entropy(three, top_p=0.5), [[0.0]])


def test_token_entropy_in_chunks_equals_one_pass():
    from grpolora.workers.trainer.grpo import token_entropy

    logits = torch.randn(2, 7, 11, generator=torch.Generator().manual_seed(0))
    whole = token_entropy(logits, chunk_size=1024)
    close(token_entropy(logits, chunk_size=3), whole.tolist(), tol=1e-6)
    probs = logits.softmax(-1)
    close(whole, (-(probs * probs.log()).sum(-1)).tolist(), tol=1e-5)


def test_entropy_stats_mean_over_completion_tokens_only():
    from grpolora.workers.trainer.grpo import EntropyStats, entropy_stats

    # Tokens 1.0 and 3.0 are completion tokens; the padding's 100 (and a NaN) must not count: mean 2.0.
    entropy = torch.tensor([[1.0, 100.0], [3.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    stats = entropy_stats(entropy, mask)
    assert stats == EntropyStats(token_count=2.0, entropy_sum=4.0)
    assert (stats + EntropyStats(token_count=2.0, entropy_sum=2.0)).mean == 1.5
    assert EntropyStats().mean == 0.0


def test_clipped_update_share_counts_norms_above_the_bound():
    from grpolora.workers.trainer.step import clipped_share

    # torch's clip_grad_norm_ scales by max_norm / (norm + 1e-6) only where that is below 1: norms 0.5 and 1.0 are
    # left alone, 3.0 is cut; 1 of 3 updates.
    assert clipped_share([0.5, 1.0, 3.0], max_norm=1.0) == pytest.approx(1 / 3)
    assert clipped_share([], max_norm=1.0) == 0.0


# --- two-sided clip (TRL's delta) and the mismatch correction's level and floor -------------------------------------


def test_two_sided_clip_bounds_the_loss_of_a_negative_advantage():
    # eps 0.2, delta 3, one token per sequence, ratio r = exp(logp - proximal):
    #   A -1, r 4:   PPO alone: -min(4 * -1, 1.2 * -1) = 4, gradient -A r = 4 (unbounded as r grows).
    #                two-sided: -min(min(r, 3) * -1, -1.2) = 3, and min(r, 3) is flat in r: no gradient.
    #   A -1, r 2:   below delta, as PPO: -min(-2, -1.2) = 2, gradient 2.
    #   A +1, r 4:   -min(min(4, 3), 1.2) = -1.2 as PPO (the clip already bounds a positive advantage), no gradient.
    # Sum 3 + 2 - 1.2 = 3.8 over 3 tokens; gradients / 3 = [0, 2/3, 0]. Tokens cut by delta count as clipped.
    proximal = torch.full((3, 1), -3.0)
    logp = (proximal + torch.tensor([[4.0], [2.0], [4.0]]).log()).requires_grad_()
    kwargs = {"clip_epsilon": 0.2, "kl_coef": 0.0, "normalizer": 3}
    advantages = torch.tensor([-1.0, -1.0, 1.0])
    plain, _ = grpo_loss(logp, proximal, None, advantages, torch.ones(3, 1), **kwargs)
    close(plain, (4 + 2 - 1.2) / 3)
    loss, stats = grpo_loss(logp, proximal, None, advantages, torch.ones(3, 1), clip_ratio_max=3.0, **kwargs)
    close(loss, 3.8 / 3)
    loss.backward()
    close(logp.grad, [[0.0], [2 / 3], [0.0]])
    assert (stats.clipped_low, stats.clipped_high, stats.clipped_ratio_max) == (0.0, 1.0, 1.0)
    assert stats.clip_fraction == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="clip_ratio_max must be above 1"):
        grpo_loss(logp, proximal, None, advantages, torch.ones(3, 1), clip_ratio_max=1.0, **kwargs)


def _weights_case(level, floor=None, mode="truncate"):
    # Two sequences of two tokens, A = 1, on-policy (ratio 1, so each token's loss is -w_t):
    #   sequence 0: per-token weights exp(proximal - behaviour) = 2 and 0.5
    #   sequence 1: 0.25 and 0.25
    behaviour = torch.full((2, 2), -2.0)
    proximal = behaviour + torch.tensor([[2.0, 0.5], [0.25, 0.25]]).log()
    logp = proximal.clone().requires_grad_()
    loss, stats = grpo_loss(
        logp, proximal, None, torch.ones(2), torch.ones(2, 2), clip_epsilon=0.2, kl_coef=0.0, normalizer=4,
        behaviour_logp=behaviour, weight_cap=3.0, weight_floor=floor, weight_mode=mode, weight_level=level,
    )  # fmt: skip
    loss.backward()
    return loss, logp.grad, stats


def test_mismatch_weight_per_token_with_a_floor():
    # token: w = (2, 0.5 | 0.25, 0.25), loss -(2 + 0.5 + 0.25 + 0.25) / 4 = -0.75, gradient -w / 4.
    loss, grad, _ = _weights_case("token")
    close(loss, -0.75)
    close(grad, [[-0.5, -0.125], [-0.0625, -0.0625]])
    # floor 0.4, truncate: 0.25 -> 0.4: -(2 + 0.5 + 0.4 + 0.4) / 4 = -0.825; the two raised weights count.
    loss, grad, stats = _weights_case("token", floor=0.4)
    close(loss, -0.825)
    close(grad, [[-0.5, -0.125], [-0.1, -0.1]])
    assert stats.truncated == 2.0
    # floor 0.4, mask: the two tokens below it leave the loss: -(2 + 0.5) / 4 = -0.625.
    loss, grad, stats = _weights_case("token", floor=0.4, mode="mask")
    close(loss, -0.625)
    close(grad, [[-0.5, -0.125], [0.0, 0.0]])


def test_mismatch_weight_per_sequence_and_geometric():
    # sequence: w_b = prod_t w_t: 2 * 0.5 = 1 and 0.25 * 0.25 = 0.0625, for every token of the sequence:
    #   loss -(1 + 1 + 0.0625 + 0.0625) / 4 = -0.53125.
    loss, grad, stats = _weights_case("sequence")
    close(loss, -0.53125)
    close(grad, [[-0.25, -0.25], [-0.015625, -0.015625]])
    assert stats.weight_max == pytest.approx(1.0) and stats.mean_weight == pytest.approx(0.53125)
    # geometric: w_b = exp(mean_t log w_t) = sqrt(2 * 0.5) = 1 and sqrt(0.0625) = 0.25: -(1 + 1 + 0.25 + 0.25) / 4.
    loss, grad, _ = _weights_case("geometric")
    close(loss, -0.625)
    close(grad, [[-0.25, -0.25], [-0.0625, -0.0625]])
    # sequence with floor 0.1, mask: sequence 1 (0.0625) leaves whole: -(1 + 1) / 4 = -0.5; counted per token.
    loss, grad, stats = _weights_case("sequence", floor=0.1, mode="mask")
    close(loss, -0.5)
    close(grad, [[-0.25, -0.25], [0.0, 0.0]])
    assert stats.truncated == 2.0
    with pytest.raises(ValueError, match="unknown weight level 'batch'; valid: token, sequence, geometric"):
        _weights_case("batch")
    with pytest.raises(ValueError, match="weight_floor must be in"):
        _weights_case("token", floor=3.0)


# --- completions that no reward scored ------------------------------------------------------------------------------


def test_unscorable_completions_are_left_out_of_their_groups_baseline():
    # Group 0: rewards (1, None, 0, 0). Without the None the group is (1, 0, 0): mean 1/3, population std
    # sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2) / 3, so A = (2/3) / (sqrt(2)/3) = sqrt(2) and (-1/3) / (sqrt(2)/3)
    # = -1/sqrt(2); the None gets 0. Scored as 0 instead, the group would be (1, 0, 0, 0): A = (sqrt(3), ...).
    # Group 1: (None, 1, None, None): one scored completion has nothing to be compared with, all 0.
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan, 0.0, 0.0], [nan, 1.0, nan, nan]])
    advantages = group_advantages(rewards, "group-normalized")
    s2 = math.sqrt(2.0)
    close(advantages, [[s2, 0.0, -1 / s2, -1 / s2], [0.0, 0.0, 0.0, 0.0]], tol=1e-5)
    # leave-one-out over the scored ones: 1 - (0 + 0) / 2 = 1, 0 - (1 + 0) / 2 = -0.5.
    close(group_advantages(rewards, "leave-one-out"), [[1.0, 0.0, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]])
    # batch-std: the population std of the 4 scored rewards (1, 0, 0, 1): 0.5; group 0 centred by its own mean 1/3.
    close(
        group_advantages(rewards, "group-normalized", scale="batch-std"),
        [[(2 / 3) / 0.5, 0.0, (-1 / 3) / 0.5, (-1 / 3) / 0.5], [0.0, 0.0, 0.0, 0.0]],
        tol=1e-5,
    )
    with pytest.raises(ValueError, match="finite or NaN"):
        group_advantages(torch.tensor([[1.0, float("inf")]]), "group-normalized")


# --- numerics: log-ratios clamped as verl clamps them (issue 47) ------------------------------------------------------


def _finite_stats(stats: LossStats) -> bool:
    return all(math.isfinite(v) for v in stats.as_tensor().tolist())


def test_a_sequence_log_weight_past_float32s_range_gives_a_finite_loss_and_figures():
    # importanceWeightLevel: sequence multiplies the token weights: two tokens of log-weight 50 each sum to 100, and
    # exp(100) overflows float32 (max ~3.4e38, exp(88.7)). Before the clamp the weight was inf: the loss was still
    # finite (capped at 2) but weight_sum was NaN (row 0's padding position carried its row's inf times 0) and
    # weight_max inf, so metrics.jsonl got NaN and Infinity. verl clamps the summed log-ratio to +-20
    # (verl/trainer/ppo/rollout_corr_helper.py:75 SAFETY_BOUND, :543, volcengine/verl b178a3c, v0.7.0+125):
    # row 0's weight is exp(20) before truncation, cut to the cap 2. Row 1: one token, log-weight -100 -> exp(-20).
    # On-policy ratio 1, A = (1, 1): loss -(2 + 2 + exp(-20)) / 3; weight_max exp(20), weight_sum
    # 2 exp(20) + exp(-20) over the 3 tokens.
    behaviour = torch.tensor([[-60.0, -60.0, 0.0], [-5.0, -5.0, 0.0]])
    proximal = torch.tensor([[-10.0, -10.0, 0.0], [-105.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp = proximal.clone().requires_grad_()
    loss, stats = grpo_loss(
        logp, proximal, None, torch.ones(2), mask, clip_epsilon=0.2, kl_coef=0.0, normalizer=3,
        behaviour_logp=behaviour, weight_cap=2.0, weight_level="sequence",
    )  # fmt: skip
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    close(loss, -(4 + math.exp(-20)) / 3)
    assert _finite_stats(stats), stats
    assert stats.weight_max == pytest.approx(math.exp(20)) and stats.weight_sum == pytest.approx(2 * math.exp(20))
    assert stats.truncated == 2.0


def test_a_token_ratio_past_float32s_range_gives_a_finite_loss():
    # Several updates per batch: a token whose logprob rose by 100 nats since the proximal policy (a degenerate
    # step) has ratio exp(100) = inf in float32; with A < 0 PPO's min() keeps the unclipped term, -inf * -1: an
    # infinite loss and a NaN gradient. verl clamps the log-ratio to +-20 before exp (core_algos.py:1130,
    # compute_policy_loss_vanilla): the ratio is exp(20), loss exp(20) * 1 / 1, and no gradient past the clamp.
    proximal = torch.tensor([[-101.0]])
    logp = torch.tensor([[-1.0]], requires_grad=True)
    loss, stats = grpo_loss(
        logp, proximal, None, torch.tensor([-1.0]), torch.ones(1, 1), clip_epsilon=0.2, kl_coef=0.0, normalizer=1
    )
    loss.backward()
    close(loss, math.exp(20), tol=1e-6 * math.exp(20))
    close(logp.grad, [[0.0]])
    assert _finite_stats(stats) and stats.mean_ratio == pytest.approx(math.exp(20))


def test_the_k3_estimator_stays_finite_for_a_token_the_policy_all_but_excludes():
    # ref - logp = 100: exp(100) overflows float32. verl's low_var_kl (k3) clamps that log-ratio to +-20
    # (core_algos.py:1893): k3 = exp(20) - 20 - 1.
    value = k3_kl(torch.tensor([-100.0]), torch.tensor([0.0]))
    close(value, [math.exp(20) - 21], tol=1e-6 * math.exp(20))


def test_the_kl_term_is_importance_weighted_on_off_policy_tokens():
    # The tokens of an off-policy step were sampled by the behaviour policy mu, and k3 estimates KL(pi || ref) only
    # under samples of pi: each token's KL term takes the same (capped) weight w = pi_prox / mu as its policy term
    # (TRL's use_bias_correction_kl weights it by its ratio; docs/design.md says why this weight).
    # Two tokens, A = 0 (no policy term), on-policy ratio 1, kl_coef 0.5, cap 2:
    #   token 0: w = 1.5, ref - logp = ln 2: k3 = 2 - ln 2 - 1 = 0.3068528; d k3 / d logp = 1 - 2 = -1
    #   token 1: w = 3 -> 2, ref - logp = -ln 2: k3 = 0.5 + ln 2 - 1 = 0.1931472; d k3 / d logp = 1 - 0.5 = 0.5
    # loss = 0.5 * (1.5 * 0.3068528 + 2 * 0.1931472) / 2 = 0.2116434; gradient 0.5 * w * dk3 / 2 = [-0.375, 0.25].
    # The reported KL is the weighted one too: (1.5 * 0.3068528 + 2 * 0.1931472) / 2 tokens.
    behaviour = torch.full((2, 1), -2.0)
    proximal = behaviour + torch.tensor([[1.5], [3.0]]).log()
    logp = proximal.clone().requires_grad_()
    ref = proximal + torch.tensor([[LN2], [-LN2]])
    loss, stats = grpo_loss(
        logp, proximal, ref, torch.zeros(2), torch.ones(2, 1), clip_epsilon=0.2, kl_coef=0.5, normalizer=2,
        behaviour_logp=behaviour, weight_cap=2.0,
    )  # fmt: skip
    close(loss, 0.2116434)
    loss.backward()
    close(logp.grad, [[-0.375], [0.25]])
    assert stats.mean_kl == pytest.approx((1.5 * 0.3068528 + 2 * 0.1931472) / 2, rel=1e-6)
    # Masked (weight past the cap): token 1 leaves the KL term as it leaves the policy term.
    loss, _ = grpo_loss(
        logp, proximal, ref, torch.zeros(2), torch.ones(2, 1), clip_epsilon=0.2, kl_coef=0.5, normalizer=2,
        behaviour_logp=behaviour, weight_cap=2.0, weight_mode="mask",
    )  # fmt: skip
    close(loss, 0.5 * 1.5 * 0.3068528 / 2)


def test_clip_fractions_low_and_high_apart_as_trl_logs_them():
    # TRL's clip_ratio/low_mean, high_mean and region_mean (trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss):
    # the share of completion tokens clipped below (A < 0) and above (A > 0), and of either.
    stats = LossStats(token_count=8, clipped_low=1, clipped_high=3, clipped_ratio_max=2)
    assert (stats.clip_low_fraction, stats.clip_high_fraction, stats.clip_region_fraction) == (0.125, 0.375, 0.5)
    assert stats.clip_fraction == 0.75  # ours also counts the two-sided clip's (clipRatioMax)
    assert LossStats().clip_low_fraction == 0.0


def test_entropy_as_trl_averages_it_with_one_group_per_micro_batch():
    # TRL's `entropy` is the mean of its micro-batches' token means; with per_device_train_batch_size equal to
    # num_generations (TRL's defaults, and the race) a micro-batch is one group. Two groups of two sequences:
    #   group 0: tokens 1, 1, 1 | 3           -> 4 tokens, sum 6, mean 1.5
    #   group 1: tokens 4 | 2 (one padding position, NaN there, never counted)  -> 2 tokens, sum 6, mean 3
    # mean of group means (1.5 + 3) / 2 = 2.25; the token mean over all 6 tokens is 12 / 6 = 2.
    from grpolora.workers.trainer.grpo import group_entropy_sums, mean_of_group_means

    nan = float("nan")
    entropy = torch.tensor([[1.0, 1.0, 1.0], [3.0, 0.0, 0.0], [4.0, nan, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    sums = group_entropy_sums(entropy, mask, torch.tensor([0, 0, 1, 1]), num_groups=3)
    assert sums.tolist() == [[6.0, 6.0, 0.0], [4.0, 2.0, 0.0]]  # a group of no tokens (the third) is left out
    assert mean_of_group_means(sums) == 2.25
    # Micro-batches and ranks add up: the same figure from the halves.
    halves = group_entropy_sums(entropy[:2], mask[:2], torch.tensor([0, 0]), 3) + group_entropy_sums(
        entropy[2:], mask[2:], torch.tensor([1, 1]), 3
    )
    assert mean_of_group_means(halves) == 2.25 and mean_of_group_means(torch.zeros(2, 0)) == 0.0
