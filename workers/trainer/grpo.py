"""The GRPO math as small pure functions over tensors: advantages (and their scale), token logprobs, the k3 KL
estimator, the clipped loss (its clip range, ratio level and aggregation) and the trainer-vs-sampler mismatch.
Nothing here knows about models, optimizers or processes, so every formula is unit-tested on CPU against
hand-computed values (tests/workers/test_grpo_math.py).

Shapes: B sequences (completions), T completion positions, V vocabulary; G completions per prompt form a group.
`mask[B, T]` is 1 on completion tokens and 0 on padding (prompt tokens are not part of these tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

AdvantageMethod = Literal["group-normalized", "leave-one-out"]
AdvantageScale = Literal["group-std", "batch-std", "none"]
LossAggregation = Literal["token-mean", "sequence-mean", "constant"]
RatioLevel = Literal["token", "sequence"]
WeightMode = Literal["truncate", "mask"]
WeightLevel = Literal["token", "sequence", "geometric"]

LOG_RATIO_BOUND = 20.0
"""Every log-ratio is clamped to [-20, 20] before exp(), as verl clamps them (volcengine/verl b178a3c, v0.7.0+125:
`SAFETY_BOUND = 20.0` in verl/trainer/ppo/rollout_corr_helper.py:75 for its rollout IS weights, and
verl/trainer/ppo/core_algos.py:1130 for the PPO ratio, :1893 for k3). exp(20) is about 4.9e8: far past any cap or
clip, so nothing a healthy run computes changes, while a sequence-level weight's summed log-ratio (|y| tokens'
worth) or a degenerate token can no longer overflow float32 (exp(88.7)) into inf, and from there NaN, in the loss
or in metrics.jsonl. Past the bound the value stays exp(+-20) and its gradient is 0."""


def group_advantages(
    rewards: Tensor, method: AdvantageMethod, eps: float = 1e-6, scale: AdvantageScale | None = None
) -> Tensor:
    """Group-relative advantages, one per completion, from `rewards[num_groups, group_size]`.

    - `group-normalized`: A_i = (r_i - mean(r)) / (std(r) + eps), with the *population* std
      sqrt(sum_j (r_j - mean)^2 / G). We take the population std (not Bessel's G - 1) because then each group's
      advantages have exactly zero mean and unit variance whatever G is; the sample std would shrink them by
      sqrt((G - 1) / G), a group-size-dependent rescaling of the learning rate. (TRL's GRPOTrainer uses the
      sample std, so its advantages are ours times sqrt((G - 1) / G), about 0.935 for G = 8.)
    - `leave-one-out` (RLOO): A_i = r_i - sum_{j != i} r_j / (G - 1), the reward minus the mean of the others,
      which equals G / (G - 1) * (r_i - mean(r)); not rescaled by a std.

    `scale` is what the centred rewards are divided by: `group-std` (the group's population std + eps; the
    default of `group-normalized`), `batch-std` (the population std of every reward in the batch + eps, as TRL's
    `scale_rewards="batch"`: groups of little spread are not blown up to unit variance, yet the step size stays
    independent of the reward's units), or `none` (Dr. GRPO: the centred reward itself, so a group's weight is its
    spread; the default of `leave-one-out`).

    A group whose rewards are all equal gets exactly zero advantages (it carries no signal about which completion
    is better), also where floating-point rounding would leave a residue of order 1e-17 / eps.

    NaN marks an unscorable completion (every reward returned None): it is left out of its group's mean and std
    (and of the batch std), with G the count of the group's scored completions, and its advantage is 0, as TRL's
    GRPOTrainer does; a group with fewer than 2 scored completions has nothing to compare and gets zeros.
    Returns float32 (or float64 for float64 input) of the same shape as `rewards`.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    group_size = rewards.shape[1]
    if group_size < 2:
        raise ValueError(f"a group needs at least 2 completions to compare, got group_size={group_size}")
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    scored = ~torch.isnan(r)
    if torch.isinf(r).any():
        raise ValueError("rewards must be finite or NaN (unscorable): an inf would spread to its whole group")
    if method not in ("group-normalized", "leave-one-out"):
        raise ValueError(f"unknown advantage method {method!r}; valid: group-normalized, leave-one-out")
    count = scored.sum(dim=1, keepdim=True)
    values = torch.where(scored, r, torch.zeros_like(r))
    mean = values.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(scored, r - mean, torch.zeros_like(r))
    advantages = centered
    if method == "leave-one-out":
        advantages = centered * (count / (count - 1).clamp(min=1))
    if scale is None:
        scale = "group-std" if method == "group-normalized" else "none"
    if scale == "group-std":
        std = (centered.square().sum(dim=1, keepdim=True) / count.clamp(min=1)).sqrt()
        advantages = advantages / (std + eps)
    elif scale == "batch-std":
        advantages = advantages / (r[scored].std(correction=0) + eps if scored.any() else 1.0)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}; valid: group-std, batch-std, none")
    first = torch.where(scored, r, torch.full_like(r, float("inf"))).amin(dim=1, keepdim=True)
    flat = ((r == first) | ~scored).all(dim=1, keepdim=True) | (count < 2)
    return torch.where(flat | ~scored, torch.zeros_like(advantages), advantages)


def overlong_penalty(lengths: Tensor, *, max_new_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to each completion's reward: with L = max_new_tokens and the last
    `buffer` tokens before it as the soft zone,

        0                                  for length <= L - buffer
        factor * ((L - buffer) - length) / buffer   inside the zone, down to -factor at length L
        -factor                            beyond L

    so a completion that runs into the limit loses reward in proportion to how far it went, instead of a cut-off
    answer being judged (and rewarded or punished) like a finished one. Returns float32 of `lengths`' shape."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    free = max_new_tokens - buffer
    lengths = lengths.to(torch.float32)
    penalty = ((free - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return penalty * factor


def sampling_mask(logits: Tensor, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Which tokens survive vLLM's top-k and then top-p (nucleus) truncation of softmax(`logits`), op for op.

    `logits[..., V]` are the temperature-scaled logits the sampler truncates. This is the CPU/PyTorch path of the
    installed vLLM (`apply_top_k_top_p_pytorch` in vllm/v1/sample/ops/topk_topp_sampler.py): sort ascending; top-k
    (`top_k` > 0, at most V as vLLM clamps it) drops every token whose logit is below the k-th largest, so ties with
    that one are kept; top-p then cumulates the softmax of what is left from the least likely token up, drops every
    token whose cumulative probability (its own plus all less likely ones) is <= 1 - top_p, and always keeps the
    most likely one. So the token at which the nucleus reaches top_p is kept, and the kept set's mass is >= top_p.
    Tied logits are ordered by the same `sort` call, so a tie straddling the boundary is split the way vLLM splits
    it on the same logits. `1 - top_p` is taken in float32 as vLLM does (its per-request top_p is a float32
    tensor), which matters at the boundary. Returns a bool mask shaped like `logits` (True: kept).
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be 0 (off) or positive, got {top_k}")
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    kept = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k:
        vocabulary = sorted_logits.shape[-1]
        kth = sorted_logits[..., vocabulary - min(top_k, vocabulary), None]
        kept = sorted_logits >= kth
        sorted_logits = sorted_logits.masked_fill(~kept, float("-inf"))
    if top_p < 1:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32)
        drop[..., -1] = False
        kept = kept & ~drop
    return torch.empty_like(kept).scatter_(-1, order, kept)


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    chunk_size: int = 1024,
) -> Tensor:
    """log softmax(logits / temperature)[b, t, tokens[b, t]], over the tokens top-k (top_k > 0) and top-p
    (top_p < 1) keep; computed in (at least) float32.

    `logits[B, T, V]` must already be aligned with `tokens[B, T]` (the logits at position t predict token t, i.e.
    the model output shifted by one). `temperature`, `top_p` and `top_k` must equal the sampler's: vLLM's
    `processed_logprobs` are those of the distribution it samples from, softmax(logits / temperature) truncated by
    top-k and top-p (`sampling_mask`) and renormalised over what is kept, and the importance ratio must compare
    like with like. The token itself always counts as kept: vLLM only samples among the tokens it keeps, so this
    changes nothing unless the trainer's slightly different logits put the sampled token just outside the
    trainer's kept set, where it gives a finite logprob (and gradient) instead of -inf.

    Memory: `log_softmax(logits.float())` would materialise a float32 [B, T, V] copy and autograd would keep
    another one for the backward pass (GiBs for a 150k vocabulary). This computes logsumexp over chunks of at
    most `chunk_size` positions of one sequence, and the backward pass recomputes softmax (and the nucleus) chunk
    by chunk from the saved logits, so the float32 working set is one [chunk_size, V] slice (with top-k or top-p,
    also the sort's int64 indices of that slice). Returns [B, T] float32 (float64 for float64 logits). Padding
    positions need a valid token id too (e.g. the pad token, not -100); the loss's mask ignores their values.
    """
    if logits.ndim != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"need logits [B, T, V] and tokens [B, T], got {tuple(logits.shape)} and {tuple(tokens.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be 0 (off) or positive, got {top_k}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedTokenLogprobs.apply(logits, tokens, temperature, top_p, top_k, chunk_size)


def _chunks(batch: int, length: int, chunk_size: int):
    # Chunks stay inside one sequence so that `logits[b, s:e]` is a view even when `logits` is a non-contiguous
    # slice such as `output.logits[:, :-1]` (reshaping that to [B * T, V] would copy it).
    for b in range(batch):
        for start in range(0, length, chunk_size):
            yield b, slice(start, min(start + chunk_size, length))


def _scaled(logits: Tensor, tokens: Tensor, dtype: torch.dtype, temperature: float, top_p: float, top_k: int) -> Tensor:
    """logits / temperature in `dtype`, with the tokens top-k and top-p drop (but never `tokens`) at -inf."""
    x = logits.to(dtype) / temperature
    if top_p < 1 or top_k:
        keep = sampling_mask(x, top_p, top_k).scatter_(-1, tokens[..., None], True)
        x = x.masked_fill(~keep, float("-inf"))
    return x


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: Tensor, tokens: Tensor, temperature: float, top_p: float, top_k: int, chunk_size: int
    ) -> Tensor:
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        batch, length, _ = logits.shape
        out = torch.empty(batch, length, dtype=compute_dtype, device=logits.device)
        lse = torch.empty_like(out)
        for b, s in _chunks(batch, length, chunk_size):
            x = _scaled(logits[b, s], tokens[b, s], compute_dtype, temperature, top_p, top_k)
            lse[b, s] = torch.logsumexp(x, dim=-1)
            out[b, s] = x.gather(-1, tokens[b, s, None]).squeeze(-1) - lse[b, s]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.top_p, ctx.top_k, ctx.chunk_size = temperature, top_p, top_k, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tokens, lse = ctx.saved_tensors
        # d logp_t / d logits_v = (onehot(t)_v - p_v) / temperature, p the (truncated) sampling distribution:
        # tokens outside the nucleus have p_v = 0 (the nucleus is piecewise constant in the logits).
        grad = torch.empty_like(logits)
        for b, s in _chunks(logits.shape[0], logits.shape[1], ctx.chunk_size):
            g_out = grad_out[b, s, None]
            x = _scaled(logits[b, s], tokens[b, s], lse.dtype, ctx.temperature, ctx.top_p, ctx.top_k)
            probs = torch.exp(x - lse[b, s, None])
            g = (-probs * g_out).scatter_add_(-1, tokens[b, s, None], g_out)
            grad[b, s] = (g / ctx.temperature).to(logits.dtype)
        return grad, None, None, None, None, None


@torch.no_grad()
def token_entropy(
    logits: Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, chunk_size: int = 1024
) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of the distribution the sampler draws each token from: p = softmax(logits /
    temperature), truncated by top-k and top-p (`sampling_mask`) and renormalised, as in `token_logprobs`.

    Computed as logsumexp(x) - sum_v p_v x_v over the kept tokens (dropped ones have p_v = 0 and add nothing; a
    plain p * x would be 0 * -inf = NaN there), chunk by chunk like `token_logprobs`, so the float32 working set is
    one [chunk_size, V] slice. A figure to watch (entropy collapse is what clip-higher guards against), not a loss
    term: no gradient. `logits[B, T, V]` -> [B, T] float32 (float64 for float64 logits); mask padding yourself."""
    if logits.ndim != 3:
        raise ValueError(f"need logits [B, T, V], got {tuple(logits.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    batch, length, _ = logits.shape
    out = torch.empty(batch, length, dtype=dtype, device=logits.device)
    for b, s in _chunks(batch, length, chunk_size):
        x = logits[b, s].to(dtype) / temperature
        if top_p < 1 or top_k:
            x = x.masked_fill(~sampling_mask(x, top_p, top_k), float("-inf"))
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        probs = torch.exp(x - lse)
        out[b, s] = lse.squeeze(-1) - torch.where(probs > 0, probs * x, 0.0).sum(dim=-1)
    return out


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref_logp - logp) - (ref_logp - logp) - 1.

    With tokens sampled from pi, E[exp(ref - logp)] = 1, so the expectation is E[logp - ref] = KL(pi || ref):
    unbiased, and lower-variance than log(pi / ref) because each term is >= 0 (e^x >= 1 + x), with equality
    exactly where logp == ref_logp. Its gradient with respect to logp is 1 - exp(ref - logp).
    ref - logp is clamped to +-LOG_RATIO_BOUND (verl's low_var_kl does the same), so a token the policy all but
    excludes gives a large but finite term.
    """
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(log_ratio) - log_ratio - 1


class _Reducible:
    """Detached per-token sums (and a few maxima) that add up over micro-batches and ranks: `a + b`, or all-reduce
    `as_tensor()` with SUM and with MAX and rebuild with `from_reduced`. Fields named in `_max_fields` take the
    max, every other field the sum; matched by name, so adding a field cannot shift the others."""

    _max_fields: frozenset[str] = frozenset()

    def __add__(self, other):
        mine, theirs = self.as_tensor(), other.as_tensor()
        return type(self).from_reduced(mine + theirs, torch.maximum(mine, theirs))

    def as_tensor(self) -> Tensor:
        """The fields in declaration order, for an all-reduce."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_reduced(cls, sums: Tensor | list[float], maxima: Tensor | list[float]):
        """From the element-wise sum and max of several `as_tensor()`s (micro-batches, ranks)."""
        sums, maxima = torch.as_tensor(sums), torch.as_tensor(maxima)
        return cls(
            **{f.name: float((maxima if f.name in cls._max_fields else sums)[i]) for i, f in enumerate(fields(cls))}
        )


@dataclass(frozen=True)
class LossStats(_Reducible):
    """Detached sums from one `grpo_loss` call, so that micro-batches and ranks add up exactly (`_Reducible`)."""

    _max_fields = frozenset({"weight_max"})

    token_count: float = 0.0
    """Completion tokens (mask sum)."""
    ratio_sum: float = 0.0
    """Sum of the PPO ratios exp(logp - proximal_logp)."""
    clipped_low: float = 0.0
    """Tokens with A < 0 and ratio < 1 - eps_low: the clip zeroes their policy gradient."""
    clipped_high: float = 0.0
    """Tokens with A > 0 and ratio > 1 + eps_high: the clip zeroes their policy gradient."""
    kl_sum: float = 0.0
    """Sum of the per-token k3 KL to the reference (0 when no reference logprobs were given); on weighted steps
    (behaviour_logp given) each token's term times its capped weight w_t, as in the loss."""
    policy_loss_sum: float = 0.0
    """Sum of the per-token (weighted) clipped surrogate loss."""
    off_policy_tokens: float = 0.0
    """Tokens weighted by a behaviour importance weight (0 on an on-policy step without mismatch correction)."""
    weight_sum: float = 0.0
    """Sum of the behaviour importance weights exp(proximal_logp - behaviour_logp), before truncation."""
    weight_max: float = 0.0
    """Largest behaviour importance weight, before truncation."""
    truncated: float = 0.0
    """Tokens whose behaviour importance weight passed the cap or the floor (cut to it, or masked)."""
    clipped_ratio_max: float = 0.0
    """Tokens with A < 0 and ratio > clip_ratio_max: the two-sided clip zeroes their policy gradient."""
    used_weight_sum: float = 0.0
    """Sum of the behaviour weights as the loss used them (after the cap and floor; 0 where masked)."""
    used_weight_sq_sum: float = 0.0
    """... and of their squares, for the effective sample size."""

    @classmethod
    def from_tensor(cls, values: Tensor) -> LossStats:
        return cls(*(float(v) for v in values.tolist()))

    @property
    def clip_fraction(self) -> float:
        """Share of the tokens whose policy gradient a clip zeroed: PPO's below and above, and clipRatioMax's."""
        return safe_div(self.clipped_low + self.clipped_high + self.clipped_ratio_max, self.token_count)

    @property
    def clip_low_fraction(self) -> float:
        """Share clipped below (A < 0, ratio < 1 - eps_low): TRL's `clip_ratio/low_mean`."""
        return safe_div(self.clipped_low, self.token_count)

    @property
    def clip_high_fraction(self) -> float:
        """Share clipped above (A > 0, ratio > 1 + eps_high): TRL's `clip_ratio/high_mean`."""
        return safe_div(self.clipped_high, self.token_count)

    @property
    def clip_region_fraction(self) -> float:
        """Share clipped either way by PPO's clip (not clipRatioMax's): TRL's `clip_ratio/region_mean`."""
        return safe_div(self.clipped_low + self.clipped_high, self.token_count)

    @property
    def mean_ratio(self) -> float:
        return safe_div(self.ratio_sum, self.token_count)

    @property
    def mean_kl(self) -> float:
        return safe_div(self.kl_sum, self.token_count)

    @property
    def mean_weight(self) -> float:
        """Mean behaviour importance weight over the off-policy tokens (0 when there were none)."""
        return safe_div(self.weight_sum, self.off_policy_tokens)

    @property
    def weight_ess(self) -> float:
        """Effective sample size of the weights the loss used, as a share of the off-policy tokens: (sum w)^2 /
        (n sum w^2), 1 when all weights are equal, near 1 / n when one dominates (verl's
        rollout_is_eff_sample_size); 0 without off-policy tokens."""
        return safe_div(self.used_weight_sum**2, self.off_policy_tokens * self.used_weight_sq_sum)

    @property
    def truncated_fraction(self) -> float:
        """Share of the off-policy tokens whose importance weight was truncated."""
        return safe_div(self.truncated, self.off_policy_tokens)


def safe_div(numerator: float, denominator: float) -> float:
    # An empty batch reports 0 rather than NaN, which JSON (the /status contract) cannot carry.
    return numerator / denominator if denominator else 0.0


def loss_normalizer(aggregation: LossAggregation, *, tokens: float, sequences: float, max_new_tokens: int) -> float:
    """What `grpo_loss`'s summed loss is divided by, for a (mini-)batch of `sequences` completions holding `tokens`
    completion tokens in all (every rank, every micro-batch):

    - `token-mean` (DAPO; today's default): the token count, so every token weighs the same and a long
      completion counts more than a short one.
    - `sequence-mean` (the original GRPO): the sequence count; `grpo_loss` divides each completion's token sum by
      its own length first, so every completion weighs the same and its tokens share that weight.
    - `constant` (Dr. GRPO): sequences * maxNewTokens, a normaliser that does not depend on the lengths sampled,
      so that neither a long wrong answer nor a short right one is favoured by the normalisation.
    """
    if aggregation == "token-mean":
        return tokens
    if aggregation == "sequence-mean":
        return sequences
    if aggregation == "constant":
        return sequences * max_new_tokens
    raise ValueError(f"unknown loss aggregation {aggregation!r}; valid: token-mean, sequence-mean, constant")


def grpo_loss(
    logp: Tensor,
    proximal_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_epsilon: float,
    kl_coef: float,
    normalizer: float,
    clip_epsilon_high: float | None = None,
    aggregation: LossAggregation = "token-mean",
    ratio_level: RatioLevel = "token",
    behaviour_logp: Tensor | None = None,
    weight_cap: float = float("inf"),
    weight_mode: WeightMode = "truncate",
    weight_level: WeightLevel = "token",
    weight_floor: float | None = None,
    clip_ratio_max: float | None = None,
) -> tuple[Tensor, LossStats]:
    """GRPO loss of one micro-batch: PPO clipped surrogate plus k3 KL, summed over completion tokens only; with
    `behaviour_logp`, the decoupled PPO objective (Hilton et al. 2021, as AReaL uses it; docs/design.md).

        ratio_t = exp(logp_t - proximal_logp_t)                                  (ratio_level "token")
        ratio_t = exp(sum_t'(logp_t' - proximal_logp_t') / |y|) for every t      (ratio_level "sequence", GSPO)
        d_t     = proximal_logp_t - behaviour_logp_t
        w_t     = exp(d_t)                                  (weight_level "token"; 1 without behaviour_logp)
        w_t     = exp(sum_t' d_t')  for every t of y        (weight_level "sequence": the sequence's likelihood ratio)
        w_t     = exp(sum_t' d_t' / |y|)  for every t of y  (weight_level "geometric": its per-token geometric mean)
        w_t     = clamp(w_t, weight_floor, weight_cap)      (weight_mode "truncate")
                  or w_t if weight_floor <= w_t <= weight_cap else 0    (weight_mode "mask")
        l_t     = -w_t * min(min(ratio_t, clip_ratio_max) * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
                  + kl_coef * w_t * k3(logp_t, ref_logp_t)
        loss    = sum_t(l_t * mask_t) / normalizer                                (token-mean, constant)
        loss    = sum_b(sum_t(l_t * mask_t) / |y_b|) / normalizer                 (sequence-mean)

    A = advantages[b] is the sequence's advantage, the same for every token of that completion.
    `proximal_logp` anchors the trust region: the trainer's logprobs before the batch's first update.
    `behaviour_logp` are the logprobs of the policy that sampled the tokens (vLLM's, for the adapter version that
    generated them): the weight w_t corrects for sampling from that older (or numerically different) policy, and
    is truncated at `weight_cap` so that a token the sampler found unlikely cannot blow up the step's variance
    (or, `mask`, such a token leaves the loss: no biased gradient for it, but none at all).
    Without it (an on-policy step) this is the plain clipped surrogate. The KL term takes the same w_t: k3
    estimates KL(pi || ref) from tokens sampled by pi, and these were sampled by the behaviour policy
    (docs/design.md, "The KL term off-policy"). Every log-ratio (ratio, weight, k3) is clamped to
    +-LOG_RATIO_BOUND before exp(), as verl does, so the loss and the figures stay finite.

    `weight_floor` (None: no lower bound) keeps tokens (or, at the sequence levels, whole sequences) the trainer
    finds far less likely than the sampler did from pulling the gradient down to nothing (truncate) or drops them
    (mask, verl's rollout-IS lower threshold); a sequence-level weight multiplies |y| token ratios, so its cap and
    floor want a wider range than the token level's.
    `clip_ratio_max` (TRL's `delta`, INTELLECT-2's two-sided clip; None: off): PPO's min() leaves the ratio of a
    negative-advantage token unbounded above, so with several updates per batch one token whose probability grew
    far can dominate the loss; capping that ratio at delta bounds it (and zeroes its gradient past delta). A
    positive advantage is already bounded by the clip at 1 + eps_high.

    Clip range: eps_low = `clip_epsilon`, eps_high = `clip_epsilon_high` (the same when None). DAPO's clip-higher
    (eps_high > eps_low) leaves a low-probability token more room to rise before its gradient is cut.
    Sequence-level ratios (GSPO, Zheng et al. 2025): the geometric mean of a completion's token ratios, so the
    whole completion is clipped or not; each token's gradient is then s * A / |y| (the behaviour weight and the
    KL term stay per token).

    `normalizer` comes from `loss_normalizer` over the whole optimizer step (all micro-batches, all ranks), not
    this micro-batch: backward() of every micro-batch then adds up to the gradient of the step's loss, exactly,
    however the step is split (a per-micro-batch mean would weight the tokens of short micro-batches more).
    With data parallelism, if the gradient reduction averages over ranks (DDP and FSDP do by default), pass the
    global normaliser / world_size so that the average is the global mean.

    Padding positions (mask 0) never reach the loss or the gradient, even if their logprobs are inf or NaN; a
    sequence without completion tokens (a stand-in) contributes exactly 0.
    `ref_logp` may be None only when kl_coef == 0 (the reference forward pass can then be skipped).
    """
    eps_low = clip_epsilon
    eps_high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
    if eps_low <= 0 or eps_high <= 0:
        raise ValueError(f"clip_epsilon and clip_epsilon_high must be positive, got {eps_low} and {eps_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if not normalizer > 0:
        raise ValueError(f"normalizer must be positive (see loss_normalizer), got {normalizer}")
    if ref_logp is None and kl_coef != 0:
        raise ValueError("ref_logp is required when kl_coef > 0")
    if not weight_cap > 0:
        raise ValueError(f"weight_cap must be positive, got {weight_cap}")
    if aggregation not in ("token-mean", "sequence-mean", "constant"):
        raise ValueError(f"unknown loss aggregation {aggregation!r}; valid: token-mean, sequence-mean, constant")
    if weight_mode not in ("truncate", "mask"):
        raise ValueError(f"unknown weight mode {weight_mode!r}; valid: truncate, mask")
    if weight_level not in ("token", "sequence", "geometric"):
        raise ValueError(f"unknown weight level {weight_level!r}; valid: token, sequence, geometric")
    if weight_floor is not None and not 0 < weight_floor < min(weight_cap, 1.0):
        raise ValueError(f"weight_floor must be in (0, min(weight_cap, 1)), got {weight_floor}")
    if clip_ratio_max is not None and not clip_ratio_max > 1:
        raise ValueError(f"clip_ratio_max must be above 1 (it caps ratios above the clip range), got {clip_ratio_max}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"unknown ratio level {ratio_level!r}; valid: token, sequence")
    shapes = [t.shape for t in (proximal_logp, mask, behaviour_logp) if t is not None]
    if advantages.shape != logp.shape[:1] or any(shape != logp.shape for shape in shapes):
        raise ValueError(
            f"need logp, proximal_logp, behaviour_logp and mask [B, T] and advantages [B]; got {tuple(logp.shape)}, "
            f"{[tuple(shape) for shape in shapes]} and {tuple(advantages.shape)}"
        )
    keep = mask.bool()
    weight = keep.to(logp.dtype)
    # Padding is replaced before any arithmetic: where() passes no gradient to the dropped branch, whereas a
    # multiply by zero would turn an inf/NaN there into a NaN loss or gradient.
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(keep, logp, zero)
    proximal_logp = torch.where(keep, proximal_logp.detach(), zero)
    adv = advantages.detach().to(logp.dtype)[:, None]
    lengths = weight.sum(dim=1, keepdim=True).clamp(min=1)

    if ratio_level == "sequence":
        log_ratio = ((logp - proximal_logp) * weight).sum(dim=1, keepdim=True) / lengths
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).expand_as(logp)
    else:
        ratio = torch.exp((logp - proximal_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    unclipped = ratio if clip_ratio_max is None else ratio.clamp(max=clip_ratio_max)
    policy_loss = -torch.minimum(unclipped * adv, clipped_ratio * adv)
    if behaviour_logp is not None:
        log_weight = proximal_logp - torch.where(keep, behaviour_logp.detach(), zero)
        if weight_level != "token":
            log_weight = (log_weight * weight).sum(dim=1, keepdim=True)
            if weight_level == "geometric":
                log_weight = log_weight / lengths
            log_weight = log_weight.expand_as(logp)
        behaviour_weight = torch.exp(log_weight.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        floor = 0.0 if weight_floor is None else weight_floor
        outside = (behaviour_weight > weight_cap) | (behaviour_weight < floor)
        if weight_mode == "mask":
            capped = torch.where(outside, zero, behaviour_weight)
        else:
            capped = behaviour_weight.clamp(min=floor, max=weight_cap)
        policy_loss = capped * policy_loss
    per_token = policy_loss
    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp, torch.where(keep, ref_logp.detach(), zero))
        if behaviour_logp is not None:  # sampled by the behaviour policy: weighted as the policy term is
            kl = capped * kl
        per_token = per_token + kl_coef * kl
    token_weight = weight / lengths if aggregation == "sequence-mean" else weight
    loss = (per_token * token_weight).sum() / normalizer

    with torch.no_grad():
        # where(), not a multiply by the mask: a padding position must add 0 whatever its row's value is.
        sums = torch.stack(
            [
                weight.sum(),
                torch.where(keep, ratio, zero).sum(),
                ((ratio < 1 - eps_low) & (adv < 0) & keep).sum().to(weight.dtype),
                ((ratio > 1 + eps_high) & (adv > 0) & keep).sum().to(weight.dtype),
                torch.where(keep, kl, zero).sum() if kl is not None else zero,
                torch.where(keep, policy_loss, zero).sum(),
                *(
                    (
                        weight.sum(),
                        torch.where(keep, behaviour_weight, zero).sum(),
                        torch.where(keep, behaviour_weight, zero).max() if keep.any() else zero,
                        (outside & keep).sum().to(weight.dtype),
                    )
                    if behaviour_logp is not None
                    else (zero, zero, zero, zero)
                ),
                (
                    ((ratio > clip_ratio_max) & (adv < 0) & keep).sum().to(weight.dtype)
                    if clip_ratio_max is not None
                    else zero
                ),
                *(
                    (torch.where(keep, capped, zero).sum(), torch.where(keep, capped.square(), zero).sum())
                    if behaviour_logp is not None
                    else (zero, zero)
                ),
            ]
        )
    # One device-to-host copy for all the figures (each float() on a GPU tensor would wait for the device).
    return loss, LossStats(*sums.tolist())


@dataclass(frozen=True)
class EntropyStats(_Reducible):
    """The policy's token entropy summed over completion tokens, so micro-batches and ranks add up (`_Reducible`)."""

    token_count: float = 0.0
    entropy_sum: float = 0.0

    @property
    def mean(self) -> float:
        """Mean token entropy (nats) over the completion tokens; 0 when there were none."""
        return safe_div(self.entropy_sum, self.token_count)


@torch.no_grad()
def entropy_stats(entropy: Tensor, mask: Tensor) -> EntropyStats:
    """`token_entropy` summed over the completion tokens (mask 1); padding never counts, even where it is NaN."""
    keep = mask.bool()
    return EntropyStats(token_count=float(keep.sum()), entropy_sum=float(entropy[keep].double().sum()))


@torch.no_grad()
def group_entropy_sums(entropy: Tensor, mask: Tensor, groups: Tensor, num_groups: int) -> Tensor:
    """Per prompt group: `token_entropy` summed over its completion tokens (row 0) and their count (row 1), as a
    [2, num_groups] float64 tensor on the CPU, so that micro-batches and ranks add up. `groups[B]` numbers each
    sequence's group (0 .. num_groups - 1); padding never counts, even where it is NaN."""
    keep = mask.bool()
    per_sequence = torch.stack([torch.where(keep, entropy, 0.0).sum(dim=1), keep.sum(dim=1)]).double().cpu()
    return torch.zeros(2, num_groups, dtype=torch.float64).index_add_(1, groups.cpu(), per_sequence)


def mean_of_group_means(sums: Tensor) -> float:
    """The mean over groups (those with tokens) of each group's mean token entropy: TRL's `entropy` where each of
    its micro-batches is one group (per_device_train_batch_size = num_generations, one process: its defaults).
    TRL's `log` averages the micro-batches' token means, so a token of a short-answer group weighs more than in
    the token mean (`EntropyStats.mean`). 0 without tokens."""
    entropy, count = sums
    has = count > 0
    return float((entropy[has] / count[has]).mean()) if bool(has.any()) else 0.0


@dataclass(frozen=True)
class MismatchStats(_Reducible):
    """How far the trainer's logprobs are from the sampler's for the same tokens (sums, so they add up over
    micro-batches; `max_abs_diff` takes the max)."""

    _max_fields = frozenset({"max_abs_diff"})

    token_count: float = 0.0
    exp_abs_diff_sum: float = 0.0
    """Sum of exp(|trainer_logp - sampler_logp|) - 1 (0 for identical logprobs; ~|diff| when small)."""
    max_abs_diff: float = 0.0
    """Largest |trainer_logp - sampler_logp| over the tokens."""
    kl_sum: float = 0.0
    """Sum of the k3 estimate of KL(sampler || trainer) per token."""

    @property
    def mean_exp_abs_diff(self) -> float:
        """Mean over tokens of exp(|Δlogprob|) - 1."""
        return safe_div(self.exp_abs_diff_sum, self.token_count)

    @property
    def mean_kl(self) -> float:
        """k3 estimate of KL(sampler || trainer) per token."""
        return safe_div(self.kl_sum, self.token_count)


@torch.no_grad()
def logprob_mismatch(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> MismatchStats:
    """Train-vs-inference mismatch over the completion tokens, as RL practitioners report it.

        Δ_t = trainer_logp_t - sampler_logp_t
        mean exp(|Δ_t|) - 1,   max |Δ_t|,   KL(sampler || trainer) ≈ mean k3(sampler_logp_t, trainer_logp_t)

    The KL is taken with the sampler as the sampling distribution because that is where the tokens came from,
    which is what makes k3 unbiased. Identical logprobs give zeros everywhere.
    """
    if trainer_logp.shape != sampler_logp.shape or mask.shape != trainer_logp.shape:
        raise ValueError(
            f"need matching [B, T] shapes, got {tuple(trainer_logp.shape)}, {tuple(sampler_logp.shape)}, "
            f"{tuple(mask.shape)}"
        )
    keep = mask.bool()
    dtype = torch.promote_types(trainer_logp.dtype, torch.float32)
    trainer = trainer_logp.to(dtype)[keep]
    sampler = sampler_logp.to(dtype)[keep]
    if trainer.numel() == 0:
        return MismatchStats()
    abs_diff = (trainer - sampler).abs()
    return MismatchStats(
        token_count=float(trainer.numel()),
        exp_abs_diff_sum=float(torch.expm1(abs_diff.clamp(max=LOG_RATIO_BOUND)).sum()),
        max_abs_diff=float(abs_diff.max()),
        kl_sum=float(k3_kl(sampler, trainer).sum()),
    )
