"""The job schema: defaults, and one failing case per validation rule, each naming its field path."""

from __future__ import annotations

import copy

import pytest

from grpolora.api.load import InvalidJob, job_warnings, load_jobs_from_text, parse_job
from grpolora.api.spec import GRPOLoraJobSpec, max_job_name_length
from tests.helpers import job_doc


def problems_of(doc) -> list[str]:
    with pytest.raises(InvalidJob) as info:
        parse_job(doc)
    return [str(p) for p in info.value.problems]


def test_defaults_are_the_documented_ones():
    spec = parse_job(job_doc()).spec
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.target_modules) == (
        16,
        32.0,
        0.0,
        "all-linear",
    )
    g = spec.grpo
    assert (g.steps, g.prompts_per_step, g.generations_per_prompt) == (100, 8, 8)
    assert (g.learning_rate, g.kl_coef, g.clip_epsilon, g.max_new_tokens) == (1e-5, 0.01, 0.2, 256)
    assert (g.temperature, g.seed, g.sync_every_steps, g.pipelined) == (1.0, 0, 1, False)
    assert spec.task.name == "arithmetic"
    assert (spec.trainer.replicas, spec.trainer.gpus_per_replica) == (1, 1)
    inf = spec.inference
    assert (inf.replicas, inf.gpus_per_replica, inf.tensor_parallel_size, inf.max_loras) == (1, 1, 1, 2)
    assert (spec.sync.backend, spec.sync.port, spec.sync.timeout_seconds) == ("auto", 29600, 600)
    assert spec.checkpoint.every_steps == 50
    assert spec.suspend is False and spec.ttl_seconds_after_finished is None
    assert spec.model.dtype == "bfloat16"
    # The recipe options default to the one recipe there was: token mean, symmetric clip, one update per batch.
    assert (g.loss_aggregation, g.importance_ratio, g.advantage_scale_in_force) == ("token-mean", "token", "group-std")
    assert (g.clip_low, g.clip_high, g.updates_per_batch, g.mini_batches) == (0.2, 0.2, 1, 1)
    assert (g.lr_schedule, g.warmup_steps, g.adam_beta1, g.adam_beta2) == ("constant", 0, 0.9, 0.999)


def test_clip_sides_and_advantage_scale_resolve_from_their_defaults():
    g = parse_job(job_doc(grpo={"clipEpsilon": 0.1, "clipEpsilonHigh": 0.28})).spec.grpo
    assert (g.clip_low, g.clip_high) == (0.1, 0.28)
    g = parse_job(job_doc(grpo={"clipEpsilonLow": 0.3})).spec.grpo
    assert (g.clip_low, g.clip_high) == (0.3, 0.2)
    assert parse_job(job_doc(grpo={"advantage": "leave-one-out"})).spec.grpo.advantage_scale_in_force == "none"
    g = parse_job(job_doc(grpo={"advantage": "leave-one-out", "advantageScale": "batch-std"})).spec.grpo
    assert g.advantage_scale_in_force == "batch-std"


def test_wire_form_round_trips():
    spec = parse_job(job_doc(lora={"targetModules": ["q_proj", "v_proj"]})).spec
    again = GRPOLoraJobSpec.model_validate(spec.to_wire())
    assert again == spec
    assert spec.to_wire()["lora"]["targetModules"] == ["q_proj", "v_proj"]


def test_sync_backend_auto_resolves_by_gpus():
    assert parse_job(job_doc()).spec.sync_backend == "nccl"
    cpu = job_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 0})
    assert parse_job(cpu).spec.sync_backend == "gloo"
    mixed = job_doc(inference={"gpusPerReplica": 0})
    assert parse_job(mixed).spec.sync_backend == "gloo"


def _without_model_name():
    doc = job_doc()
    del doc["spec"]["model"]["name"]
    return doc


CPU = {"gpusPerReplica": 0}
# (document, field path that must be named, words the message must contain)
INVALID = [
    (_without_model_name(), "spec.model.name", "required"),
    (job_doc(model={"name": ""}), "spec.model.name", "at least 1"),
    (job_doc(model={"name": "offline:gpt5"}), "spec.model.name", "offline:smollm2-135m-instruct"),
    (job_doc(model={"dtype": "fp8"}), "spec.model.dtype", "'bfloat16'"),
    (job_doc(grpo={"steps": 0}), "spec.grpo.steps", "greater than 0"),
    (job_doc(grpo={"steps": "many"}), "spec.grpo.steps", "expected an integer, got the string"),
    (job_doc(grpo={"promptsPerStep": -2}), "spec.grpo.promptsPerStep", "greater than 0"),
    (job_doc(grpo={"generationsPerPrompt": 1}), "spec.grpo.generationsPerPrompt", "greater than or equal to 2"),
    (job_doc(grpo={"learningRate": 0}), "spec.grpo.learningRate", "greater than 0"),
    (job_doc(grpo={"maxNewTokens": 0}), "spec.grpo.maxNewTokens", "greater than 0"),
    (job_doc(grpo={"temperature": 0}), "spec.grpo.temperature", "greater than 0"),
    (job_doc(grpo={"syncEverySteps": 0}), "spec.grpo.syncEverySteps", "greater than 0"),
    (job_doc(grpo={"advantage": "median"}), "spec.grpo.advantage", "leave-one-out"),
    (job_doc(lora={"rank": 0}), "spec.lora.rank", "greater than 0"),
    (job_doc(lora={"rank": 1024}), "spec.lora.rank", "less than or equal to 512"),
    (job_doc(lora={"alpha": -1}), "spec.lora.alpha", "greater than 0"),
    (job_doc(lora={"dropout": 1.0}), "spec.lora.dropout", "less than 1"),
    (job_doc(lora={"dropout": -0.1}), "spec.lora.dropout", "greater than or equal to 0"),
    (job_doc(lora={"targetModules": []}), "spec.lora.targetModules", "non-empty list"),
    (job_doc(lora={"targetModules": "attention"}), "spec.lora.targetModules", "all-linear"),
    (job_doc(lora={"rnk": 8}), "spec.lora.rnk", "did you mean `rank`"),
    (job_doc(trainer={"replicas": 0}), "spec.trainer.replicas", "greater than 0"),
    (job_doc(inference={"replicas": 0}), "spec.inference.replicas", "greater than 0"),
    (job_doc(inference={"gpusPerReplica": -1}), "spec.inference.gpusPerReplica", "greater than or equal to 0"),
    (
        job_doc(inference={"gpusPerReplica": 4, "tensorParallelSize": 3}),
        "spec.inference.tensorParallelSize",
        "is 3 but gpusPerReplica is 4",
    ),
    (  # vLLM data parallelism inside a replica: one engine per GPU group, each needing the adapter (use replicas)
        job_doc(inference={"gpusPerReplica": 4, "tensorParallelSize": 2}),
        "spec.inference.tensorParallelSize",
        "use tensorParallelSize 4, or gpusPerReplica 2 and twice the replicas",
    ),
    (
        job_doc(inference={"gpusPerReplica": 0, "tensorParallelSize": 2}),
        "spec.inference.tensorParallelSize",
        "CPU replicas",
    ),
    (job_doc(inference={"maxLoras": 1}), "spec.inference.maxLoras", "greater than or equal to 2"),
    (job_doc(grpo={"maxStaleness": -1}), "spec.grpo.maxStaleness", "greater than or equal to 0"),
    (job_doc(grpo={"pipelined": True, "maxStaleness": 2}), "spec.grpo.pipelined", "grpo.maxStaleness is 2"),
    (job_doc(grpo={"pipelined": True, "maxStaleness": 0}), "spec.grpo.pipelined", "set only maxStaleness"),
    (job_doc(grpo={"maxStaleness": 2}), "spec.inference.maxLoras", "set inference.maxLoras to at least 3"),
    (
        job_doc(grpo={"maxStaleness": 4}, inference={"maxLoras": 4}),
        "spec.inference.maxLoras",
        "set inference.maxLoras to at least 5",
    ),
    (job_doc(grpo={"importanceWeightCap": 1.0}), "spec.grpo.importanceWeightCap", "greater than 1"),
    (
        job_doc(grpo={"promptsPerStep": 2, "generationsPerPrompt": 2, "miniBatches": 5}),
        "spec.grpo.miniBatches",
        "at most the completions of a step (promptsPerStep x generationsPerPrompt): every mini-batch needs a "
        "completion; got 5 for 4 completions",
    ),
    (job_doc(grpo={"steps": 10, "warmupSteps": 11}), "spec.grpo.warmupSteps", "at most grpo.steps; got 11 for 10"),
    (
        job_doc(grpo={"maxNewTokens": 64, "overlongBuffer": 65}),
        "spec.grpo.overlongBuffer",
        "at most grpo.maxNewTokens (the soft zone ends there); got 65 for maxNewTokens 64",
    ),
    (job_doc(grpo={"lossAggregation": "sum"}), "spec.grpo.lossAggregation", "'token-mean', 'sequence-mean' or"),
    (job_doc(grpo={"advantageScale": "std"}), "spec.grpo.advantageScale", "'group-std', 'batch-std' or 'none'"),
    (job_doc(grpo={"importanceRatio": "seq"}), "spec.grpo.importanceRatio", "'token' or 'sequence'"),
    (job_doc(grpo={"lrSchedule": "step"}), "spec.grpo.lrSchedule", "'constant', 'linear' or 'cosine'"),
    (job_doc(grpo={"importanceWeightMode": "clip"}), "spec.grpo.importanceWeightMode", "'truncate' or 'mask'"),
    (job_doc(grpo={"mismatchCorrection": "yes"}), "spec.grpo.mismatchCorrection", "expected true or false"),
    (
        job_doc(grpo={"referenceFrom": "inference", "temperature": 0.7}),
        "spec.grpo.referenceFrom",
        "needs grpo.temperature 1, grpo.topP 1 and no grpo.topK (vLLM scores the reference under the untempered, "
        "untruncated distribution): leave them so, or set referenceFrom `trainer`; got temperature 0.7, topP 1.0 "
        "and topK 0",
    ),
    (
        job_doc(grpo={"referenceFrom": "inference", "topK": 20}),
        "spec.grpo.referenceFrom",
        "no grpo.topK (vLLM scores the reference under the untempered, untruncated distribution)",
    ),
    (job_doc(grpo={"minP": 0.1}), "spec.grpo.minP", "vLLM applies it in its own logits processors"),
    (job_doc(grpo={"repetitionPenalty": 1.1}), "spec.grpo.repetitionPenalty", "vLLM applies it in its own logits"),
    (job_doc(grpo={"referenceFrom": "replicas"}), "spec.grpo.referenceFrom", "'trainer' or 'inference'"),
    (
        job_doc(grpo={"referenceFrom": "inference"}, lora={"targetModules": ["q_proj", "lm_head"]}),
        "spec.grpo.referenceFrom",
        "cannot be used with an lm_head LoRA",
    ),
    (job_doc(sync={"backend": "nccl"}, trainer=CPU, inference=CPU), "spec.sync.backend", "needs GPUs"),
    (job_doc(sync={"backend": "nccl"}, inference=CPU), "spec.sync.backend", "needs GPUs"),
    (job_doc(sync={"backend": "mpi"}), "spec.sync.backend", "'gloo'"),
    (job_doc(sync={"port": 80}), "spec.sync.port", "greater than or equal to 1024"),
    (job_doc(sync={"port": 70000}), "spec.sync.port", "less than or equal to 65535"),
    (job_doc(sync={"port": 29500}), "spec.sync.port", "already used by trainer.masterPort"),
    (job_doc(trainer={"statusPort": 29500}), "spec.trainer.statusPort", "already used by trainer.masterPort"),
    (job_doc(sync={"timeoutSeconds": 0}), "spec.sync.timeoutSeconds", "greater than 0"),
    (job_doc(task={"name": "arithmetic", "dataset": {"path": "x.jsonl"}, "reward": "m:f"}), "spec.task", "exactly one"),
    (job_doc(task={"name": None}), "spec.task", "exactly one"),
    (job_doc(task={"name": "chess"}), "spec.task.name", "arithmetic"),
    (job_doc(task={"name": None, "dataset": {"path": "x.jsonl"}}), "spec.task.reward", "needs `reward"),
    (job_doc(task={"name": "arithmetic", "reward": "no_colon"}), "spec.task.reward", "should match pattern"),
    (job_doc(task={"name": "arithmetic", "reward": "pkg.mod:"}), "spec.task.reward", "should match pattern"),
    (job_doc(task={"name": "arithmetic", "reward": "1pkg:f"}), "spec.task.reward", "should match pattern"),
    (
        job_doc(trainer={"resources": {"limits": {"nvidia.com/gpu": 2}}}),
        "spec.trainer.resources.limits.nvidia.com/gpu",
        "gpusPerReplica",
    ),
    (
        job_doc(trainer={"env": [{"name": "MASTER_ADDR", "value": "x"}]}),
        "spec.trainer.env[0].name",
        "set by the operator",
    ),
    (job_doc(trainer={"env": [{"value": "x"}]}), "spec.trainer.env[0].name", "needs a `name`"),
    (job_doc(checkpoint={"everySteps": 0}), "spec.checkpoint.everySteps", "greater than 0"),
    (job_doc(checkpoint={"path": "relative/dir"}), "spec.checkpoint.path", "should match pattern"),
    (job_doc(ttlSecondsAfterFinished=-5), "spec.ttlSecondsAfterFinished", "greater than or equal to 0"),
    (job_doc(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds", "greater than 0"),
    (job_doc(suspend="maybe"), "spec.suspend", "expected true or false"),
    (job_doc(replicas=3), "spec.replicas", "unknown field"),
    ({**job_doc(), "apiVersion": "grpolora.dev/v1"}, "apiVersion", "grpolora.dev/v1alpha1"),
    ({**job_doc(), "kind": "PyTorchJob"}, "kind", "GRPOLoraJob"),
    ({**job_doc(), "metadata": {"name": "Demo_Job"}}, "metadata.name", "lower-case"),
    ({**job_doc(), "metadata": {"name": "9lives"}}, "metadata.name", "starting with a letter"),
    ({**job_doc(), "metadata": {"name": "a" * 50}}, "metadata.name", "at most"),
]


@pytest.mark.parametrize(("doc", "path", "words"), INVALID, ids=[f"{p}:{w}" for _, p, w in INVALID])
def test_each_rule_names_its_field(doc, path, words):
    problems = problems_of(doc)
    assert any(p.startswith(f"{path}:") and words in p for p in problems), problems


def test_all_errors_are_reported_at_once():
    doc = job_doc(lora={"rank": -1, "alpah": 3}, grpo={"steps": 0, "generationsPerPrompt": 1})
    paths = {p.split(":")[0] for p in problems_of(doc)}
    assert {"spec.lora.rank", "spec.lora.alpah", "spec.grpo.steps", "spec.grpo.generationsPerPrompt"} <= paths


def test_name_length_limit_is_derived_from_the_longest_child_name():
    longest = max_job_name_length()
    assert len(f"{'a' * longest}-inference") + 11 <= 63
    parse_job({**job_doc(), "metadata": {"name": "a" * longest}})
    assert problems_of({**job_doc(), "metadata": {"name": "a" * (longest + 1)}})


def test_yaml_syntax_error_has_a_line_number():
    with pytest.raises(InvalidJob) as info:
        load_jobs_from_text("apiVersion: grpolora.dev/v1alpha1\nspec:\n  model: [unclosed\n  lora: {}\n")
    (problem,) = info.value.problems
    assert problem.line in (3, 4) and "YAML syntax error" in problem.message


def test_field_errors_carry_their_line():
    text = (
        "apiVersion: grpolora.dev/v1alpha1\nkind: GRPOLoraJob\nmetadata: {name: demo}\n"
        "spec:\n  model: {name: m}\n  lora:\n    rank: -4\n"
    )
    with pytest.raises(InvalidJob) as info:
        load_jobs_from_text(text, source="job.yaml")
    assert "job.yaml: line 7: spec.lora.rank: Input should be greater than 0 (got -4)" in str(info.value)


def test_multi_document_files_report_each_document():
    good = "apiVersion: grpolora.dev/v1alpha1\nkind: GRPOLoraJob\nmetadata: {name: a}\nspec: {model: {name: m}}\n"
    bad = good.replace("name: m", "name: m, dtype: int4")
    with pytest.raises(InvalidJob) as info:
        load_jobs_from_text(good + "---\n" + bad)
    assert "document 2" in str(info.value) and "spec.model.dtype" in str(info.value)
    assert len(load_jobs_from_text(good + "---\n" + good.replace("name: a", "name: b"))) == 2


def test_odd_lora_rank_is_served_in_the_next_vllm_slot_with_a_warning():
    job = parse_job(job_doc(lora={"rank": 12}))
    assert job.spec.lora.vllm_max_lora_rank == 16
    assert any(w.path == "spec.lora.rank" and "16-rank" in w.message for w in job_warnings(job))
    assert not [w for w in job_warnings(parse_job(job_doc())) if w.path == "spec.lora.rank"]


def test_a_parsed_job_is_immutable():
    job = parse_job(job_doc())
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises its own ValidationError subclass
        job.spec.lora.rank = 3  # type: ignore[misc]
    assert copy.deepcopy(job) == job


# Numeric bounds: a value just outside each is refused, naming the field, and the bound itself (or the nearest
# value inside) is accepted, so that loosening or tightening any bound (`le` turned into `lt`, a dropped `ge=0`)
# fails here and not only in the shipped-CRD comparison that `make crd` regenerates.
# (section, field, just outside, just inside, words of the message)
BOUNDS = [
    ("grpo", "topP", 1.0001, 1.0, "less than or equal to 1"),
    ("grpo", "topP", 0.0, 1e-6, "greater than 0"),
    ("grpo", "klCoef", -1e-9, 0.0, "greater than or equal to 0"),
    ("grpo", "clipEpsilon", 0.0, 1e-6, "greater than 0"),
    ("grpo", "clipEpsilonLow", 0.0, 1e-6, "greater than 0"),
    ("grpo", "clipEpsilonLow", 1.0, 0.999, "less than 1"),
    ("grpo", "clipEpsilonHigh", 0.0, 1e-6, "greater than 0"),
    ("grpo", "updatesPerBatch", 0, 1, "greater than 0"),
    ("grpo", "updatesPerBatch", 65, 64, "less than or equal to 64"),
    ("grpo", "miniBatches", 0, 1, "greater than 0"),
    ("grpo", "warmupSteps", -1, 0, "greater than or equal to 0"),
    ("grpo", "overlongBuffer", 0, 1, "greater than 0"),
    ("grpo", "dynamicSamplingDraws", -1, 0, "greater than or equal to 0"),
    ("grpo", "dynamicSamplingDraws", 33, 32, "less than or equal to 32"),
    ("grpo", "overlongPenalty", 0.0, 1e-6, "greater than 0"),
    ("grpo", "adamBeta1", -0.1, 0.0, "greater than or equal to 0"),
    ("grpo", "adamBeta1", 1.0, 0.999, "less than 1"),
    ("grpo", "adamBeta2", 1.0, 0.999, "less than 1"),
    ("grpo", "seed", -1, 0, "greater than or equal to 0"),
    ("grpo", "maxGradNorm", 0.0, 1e-6, "greater than 0"),
    ("grpo", "weightDecay", -1e-9, 0.0, "greater than or equal to 0"),
    ("grpo", "microBatchSize", 0, 1, "greater than 0"),
    ("grpo", "microBatchTokens", 0, 1, "greater than 0"),
    ("trainer", "gpusPerReplica", -1, 0, "greater than or equal to 0"),
    ("trainer", "maxRestarts", -1, 0, "greater than or equal to 0"),
    # 257: the nearest value inside that also holds the default maxNewTokens (256) and a prompt token.
    ("inference", "maxModelLen", 0, 257, "greater than 0"),
    ("inference", "gpuMemoryUtilization", 1.0001, 1.0, "less than or equal to 1"),
    ("inference", "gpuMemoryUtilization", 0.0, 1e-6, "greater than 0"),
    ("inference", "kvCacheGiB", 0, 1, "greater than 0"),
    ("sync", "bucketMiB", 0, 1, "greater than 0"),
    ("checkpoint", "keep", 0, 1, "greater than 0"),
]


@pytest.mark.parametrize(
    ("section", "field", "outside", "inside", "words"), BOUNDS, ids=[f"{s}.{f}={o}" for s, f, o, _, _ in BOUNDS]
)
def test_each_numeric_bound_refuses_a_value_just_outside_it(section, field, outside, inside, words):
    problems = problems_of(job_doc(**{section: {field: outside}}))
    assert any(p.startswith(f"spec.{section}.{field}:") and words in p for p in problems), problems
    parse_job(job_doc(**{section: {field: inside}}))


def _text(spec_yaml: str) -> str:
    return "apiVersion: grpolora.dev/v1alpha1\nkind: GRPOLoraJob\nmetadata: {name: demo}\nspec:\n" + spec_yaml


GRPO = "  model: {name: m}\n  grpo:\n"
FINITE = "Input should be a finite number"


@pytest.mark.parametrize(
    ("spec_yaml", "expected"),
    [
        (GRPO + "    learningRate: .inf\n", f"line 7: spec.grpo.learningRate: {FINITE}"),
        (GRPO + "    temperature: .inf\n", f"line 7: spec.grpo.temperature: {FINITE}"),
        (GRPO + "    klCoef: .nan\n", f"line 7: spec.grpo.klCoef: {FINITE}"),
        ("  model: {name: m}\n  lora:\n    alpha: -.inf\n", f"line 7: spec.lora.alpha: {FINITE}"),
        (GRPO + "    steps: true\n", "line 7: spec.grpo.steps: expected a number, got the boolean true"),
        (GRPO + "    topP: false\n", "line 7: spec.grpo.topP: expected a number, got the boolean false"),
        ("  model: {name: m}\n  suspend: 1\n", "line 6: spec.suspend: expected true or false, got 1"),
        (GRPO + '    pipelined: "yes"\n', "line 7: spec.grpo.pipelined: expected true or false, got 'yes'"),
    ],
)
def test_non_finite_numbers_and_booleans_for_numbers_are_refused_at_their_line(spec_yaml, expected):
    with pytest.raises(InvalidJob) as info:
        load_jobs_from_text(_text(spec_yaml), source="job.yaml")
    assert f"job.yaml: {expected}" in str(info.value)


def test_numbers_yaml_reads_as_strings_still_parse():
    # PyYAML reads `1e-5` (no dot) as a string; kubectl and users treat it as a number.
    (job,) = load_jobs_from_text(_text("  model: {name: m}\n  grpo:\n    learningRate: 1e-5\n"))
    assert job.spec.grpo.learning_rate == 1e-5


def test_a_duplicated_key_is_refused_naming_both_lines():
    text = _text("  model: {name: m}\n  grpo:\n    steps: 6\n    promptsPerStep: 2\n    steps: 600\n")
    with pytest.raises(InvalidJob) as info:
        load_jobs_from_text(text, source="job.yaml")
    assert "job.yaml: line 9: spec.grpo.steps: duplicate key `steps` (first at line 7)" in str(info.value)
    nested = _text("  model: {name: m}\n  model: {name: other}\n")
    with pytest.raises(InvalidJob) as info:
        load_jobs_from_text(nested, source="job.yaml")
    assert "line 6: spec.model: duplicate key `model` (first at line 5)" in str(info.value)


def test_max_new_tokens_must_fit_in_the_model_length():
    doc = job_doc(grpo={"maxNewTokens": 600}, inference={"maxModelLen": 512})
    assert any(p.startswith("spec.grpo.maxNewTokens:") and "inference.maxModelLen (512)" in p for p in problems_of(doc))
    parse_job(job_doc(grpo={"maxNewTokens": 256}, inference={"maxModelLen": 512}))
    parse_job(job_doc(grpo={"maxNewTokens": 600}))  # the model's own length is checked when the engine starts


@pytest.mark.parametrize(
    ("grpo", "k"),
    [({}, 0), ({"pipelined": True}, 1), ({"pipelined": True, "maxStaleness": 1}, 1), ({"maxStaleness": 2}, 2)],
)
def test_staleness_bound_and_its_pipelined_alias(grpo, k):
    spec = parse_job(job_doc(grpo=grpo, inference={"maxLoras": 3})).spec
    assert spec.grpo.staleness == k
    # What reaches the workers (defaults written) parses to the same bound.
    assert GRPOLoraJobSpec.model_validate(spec.to_wire()).grpo.staleness == k


REMOTE = {"url": "http://judge.rl.svc:8000/score"}


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"task": {"name": "arithmetic", "reward": [{**REMOTE, "headersFrom": {"secretName": "b-grpolora-token"}}]}},
         "spec.task.reward[0].headersFrom.secretName"),
        ({"output": {"push": {"hub": {"repo": "a/b", "secretName": "b-grpolora-token"}}}},
         "spec.output.push.hub.secretName"),
        ({"trainer": {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "b-grpolora-token", "key": "k"}}}]}},
         "spec.trainer.env[0].valueFrom.secretKeyRef.name"),
        ({"inference": {"podTemplate": {"spec": {"containers": [{"name": "side", "envFrom": [
            {"secretRef": {"name": "shared-pool-jobs"}}]}]}}}},
         "spec.inference.podTemplate.spec.containers[0].envFrom[0].secretRef.name"),
        ({"trainer": {"podTemplate": {"spec": {"volumes": [{"name": "t", "projected": {"sources": [
            {"secret": {"name": "b-grpolora-token"}}]}}]}}}},
         "spec.trainer.podTemplate.spec.volumes[0].projected.sources[0].secret.name"),
    ],
)  # fmt: skip
def test_a_secret_the_operator_manages_cannot_be_named_by_a_job(spec, path):
    """Confused deputy: with another job's `<name>-grpolora-token` (or a pool's attachment list, which holds each
    attached job's sync key) a job could act as that job on a shared pool."""
    with pytest.raises(InvalidJob) as refused:
        parse_job(job_doc(**spec))
    (problem,) = [str(p) for p in refused.value.problems]
    assert problem.startswith(f"{path}: Secret ") and "a name the operator gives its own Secrets" in problem


def test_a_users_own_token_secret_is_not_mistaken_for_the_operators():
    """The operator's token Secrets end in `-grpolora-token`, a name nobody gives a Secret by chance: `hf-token`,
    the name Hugging Face's guides give theirs, was refused while they ended in `-token`."""
    doc = job_doc(output={"push": {"hub": {"repo": "a/b", "secretName": "hf-token"}}})
    assert parse_job(doc).spec.secret_references() == [("output.push.hub.secretName", "hf-token")]


def test_the_secrets_a_job_names_are_listed_with_their_fields():
    doc = job_doc(
        task={"name": "arithmetic", "reward": [{**REMOTE, "headersFrom": {"secretName": "judge"}}]},
        trainer={"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}}]},
        tracking={"wandb": {"project": "p", "secretName": "wandb"}},
    )
    assert parse_job(doc).spec.secret_references() == [
        ("task.reward[0].headersFrom.secretName", "judge"),
        ("tracking.wandb.secretName", "wandb"),
        ("trainer.env[0].valueFrom.secretKeyRef.name", "keys"),
    ]


# ---- QoS: pods without cpu or memory requests run BestEffort --------------------------------------------------------

REQUESTS = {"requests": {"memory": "8Gi", "cpu": "2"}}


@pytest.mark.parametrize(
    ("spec", "warned"),
    [
        ({}, ["spec.trainer", "spec.inference"]),
        ({"trainer": {"resources": REQUESTS}, "inference": {"resources": REQUESTS}}, []),
        # A GPU is an extended resource: it does not count for QoS (kubernetes pkg/apis/core/helper/qos/qos.go).
        (
            {"trainer": {"gpusPerReplica": 2}, "inference": {"resources": {"limits": {"memory": "4Gi"}}}},
            ["spec.trainer"],
        ),
        # Zero is no request at all; ephemeral-storage does not count either.
        (
            {"trainer": {"resources": {"requests": {"memory": "0", "ephemeral-storage": "1Gi"}}}},
            ["spec.trainer", "spec.inference"],
        ),
        # Any container of the pod counts: a sidecar's or an init container's requests make it Burstable.
        (
            {
                "trainer": {
                    "podTemplate": {
                        "spec": {"containers": [{"name": "log", "resources": {"requests": {"cpu": "100m"}}}]}
                    }
                },
                "inference": {
                    "podTemplate": {
                        "spec": {"initContainers": [{"name": "fetch", "resources": {"limits": {"cpu": "1"}}}]}
                    }
                },
            },
            [],
        ),
    ],
    ids=["nothing", "requests", "gpu-only", "zero", "sidecar-and-init"],
)
def test_a_role_whose_pods_would_be_best_effort_is_warned_about(spec, warned):
    job = parse_job(job_doc(**spec))
    paths = [w.path for w in job_warnings(job) if w.path.endswith(".resources")]
    assert paths == [f"{path}.resources" for path in warned]
    assert all("BestEffort" in w.message for w in job_warnings(job) if w.path in paths)


def test_a_job_on_a_pool_is_not_warned_about_the_pools_servers():
    job = parse_job(
        job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, inference={"poolRef": {"name": "p"}})
    )
    assert [w.path for w in job_warnings(job) if w.path.endswith(".resources")] == ["spec.trainer.resources"]


def test_the_kueue_queue_is_the_jobs_label_else_spec_scheduling_queue_name():
    """One answer to "which LocalQueue?", read by the Workload builder, the job's pass and the pool's admission: the
    kueue.x-k8s.io/queue-name label (Kueue's own convention) wins over spec.scheduling.queueName, which a runtime may
    set for every job on it."""
    assert parse_job(job_doc()).queue_name is None
    assert parse_job(job_doc(scheduling={"queueName": "team-queue"})).queue_name == "team-queue"
    labelled = job_doc(scheduling={"queueName": "team-queue"})
    labelled["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "urgent"}
    assert parse_job(labelled).queue_name == "urgent"
    # A LocalQueue is named as any object is (Kueue's Workload spec.queueName: a DNS-1123 subdomain).
    assert any("spec.scheduling.queueName" in p for p in problems_of(job_doc(scheduling={"queueName": "Team_Q"})))


# ---- the GPU resource name -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu", "gpu.intel.com/i915"])
def test_an_extended_resource_name_is_a_gpu_resource(name):
    spec = parse_job(job_doc(trainer={"gpuResource": name}, inference={"gpuResource": name})).spec
    assert spec.trainer.gpu_resource == spec.inference.gpu_resource == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("gpu", "has no domain (`vendor.com/gpu`)"),
        ("kubernetes.io/gpu", "is in the kubernetes.io namespace"),
        ("requests.nvidia.com/gpu", "starts with `requests.`"),
        ("NVIDIA.com/gpu", "is not an extended resource name"),
        ("nvidia.com/gpu!", "is not an extended resource name"),
    ],
)
def test_a_gpu_resource_that_is_no_extended_resource_name_is_refused(name, why):
    with pytest.raises(InvalidJob) as info:
        parse_job(job_doc(trainer={"gpuResource": name}))
    (problem,) = info.value.problems
    assert problem.path == "spec.trainer.gpuResource"
    assert problem.message.startswith(f"{name!r} {why}")
    assert "nvidia.com/gpu, a MIG profile such as nvidia.com/mig-1g.10gb, amd.com/gpu" in problem.message


def test_the_roles_gpu_resource_is_set_with_gpus_per_replica_not_in_resources():
    with pytest.raises(InvalidJob) as info:
        parse_job(job_doc(inference={"gpuResource": "amd.com/gpu", "resources": {"limits": {"amd.com/gpu": 1}}}))
    (problem,) = info.value.problems
    assert problem.path == "spec.inference.resources.limits.amd.com/gpu"
    assert "set GPUs with `gpusPerReplica` (their resource name with `gpuResource`)" in problem.message
