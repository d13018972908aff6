"""Read GRPOLoraJob, RolloutPool and runtime documents and turn every problem into a message that names its field
path and line.

Used by `grpolora validate|render|run` and by the operator (where the path goes into the InvalidSpec condition).
"""

from __future__ import annotations

import difflib
import math
import sys
import typing
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpolora.api import constants as c
from grpolora.api.spec import (
    YAML11_NUMBER,
    ClusterGRPOLoraRuntime,
    FieldErrors,
    GRPOLoraJob,
    GRPOLoraRuntime,
    GRPOSpec,
    RolloutPool,
    Yaml11Number,
)

Runtime = GRPOLoraRuntime | ClusterGRPOLoraRuntime
Document = GRPOLoraJob | RolloutPool | GRPOLoraRuntime | ClusterGRPOLoraRuntime
_M = typing.TypeVar("_M", GRPOLoraJob, RolloutPool, GRPOLoraRuntime, ClusterGRPOLoraRuntime)
_MODELS: dict[str, type[BaseModel]] = {
    c.KIND: GRPOLoraJob,
    c.POOL_KIND: RolloutPool,
    c.RUNTIME_KIND: GRPOLoraRuntime,
    c.CLUSTER_RUNTIME_KIND: ClusterGRPOLoraRuntime,
}
_T = typing.TypeVar("_T")


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or worth a warning) in a job document."""

    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{where}{self.path}: {self.message}" if self.path else f"{where}{self.message}"


class InvalidJob(ValueError):
    """A job document that cannot run, with every problem found in it."""

    def __init__(self, problems: list[Problem], source: str = ""):
        self.problems = problems
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(f"{prefix}{p}" for p in problems))


def parse_job(document: Any, *, source: str = "", node: yaml.Node | None = None) -> GRPOLoraJob:
    """Validate one parsed document; raise InvalidJob listing all problems, each at its field path."""
    return _parse(GRPOLoraJob, document, source, node)


def parse_pool(document: Any, *, source: str = "", node: yaml.Node | None = None) -> RolloutPool:
    """Validate one parsed RolloutPool document, with the same messages as a job's."""
    return _parse(RolloutPool, document, source, node)


def parse_runtime(document: Any, *, source: str = "", node: yaml.Node | None = None) -> Runtime:
    """Validate one GRPOLoraRuntime or ClusterGRPOLoraRuntime document, with the same messages as a job's."""
    kind = document.get("kind") if isinstance(document, Mapping) else None
    return _parse(ClusterGRPOLoraRuntime if kind == c.CLUSTER_RUNTIME_KIND else GRPOLoraRuntime, document, source, node)


def parse_document(document: Any, *, source: str = "", node: yaml.Node | None = None) -> Document:
    """A RolloutPool, a runtime or (any other kind) a GRPOLoraJob, validated as such."""
    kind = document.get("kind") if isinstance(document, Mapping) else None
    model = _MODELS.get(kind) if isinstance(kind, str) else None
    return _parse(model or GRPOLoraJob, document, source, node)  # type: ignore[type-var]


def _parse(model: type[_M], document: Any, source: str, node: yaml.Node | None) -> _M:
    if not isinstance(document, Mapping):
        kind = next(k for k, m in _MODELS.items() if m is model)
        raise InvalidJob([Problem("", f"expected a {kind} mapping, got {type(document).__name__}")], source)
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        problems = [p for error in exc.errors() for p in _problems_from(error, model)]
        if node is not None:
            problems = in_line_order([Problem(p.path, p.message, _line_of(node, p.path)) for p in problems])
        raise InvalidJob(problems, source) from None


def in_line_order(problems: Iterable[Problem]) -> list[Problem]:
    """Problems in the order of their lines in the file (those without a line last), as a reader goes down it."""
    return sorted(problems, key=lambda p: (p.line is None, p.line or 0))


_SOURCE_NODES: dict[int, tuple[weakref.ref[Any], yaml.Node]] = {}
"""The YAML node each document read from text came from, by the document's id while it lives: what is found about
a document after it is parsed (its warnings) gets the lines its errors get (`located`)."""


def _remember_node(document: Any, node: yaml.Node) -> None:
    key = id(document)
    _SOURCE_NODES[key] = (weakref.ref(document, lambda _: _SOURCE_NODES.pop(key, None)), node)


def located(problems: Iterable[Problem], document: object) -> list[Problem]:
    """`problems` about `document` (field paths such as spec.grpo.referenceFrom) with the line of each path in the
    file the document was read from (a field not written: its nearest written parent), in line order; without lines
    for a document that came from no file."""
    found = _SOURCE_NODES.get(id(document))
    if found is None or found[0]() is not document:
        return list(problems)
    node = found[1]
    return in_line_order(Problem(p.path, p.message, p.line or _line_of(node, p.path)) for p in problems)


def load_jobs(path: str | Path) -> list[GRPOLoraJob]:
    """Every GRPOLoraJob in a YAML file (one or more `---` documents); InvalidJob on any problem in any."""
    return load_jobs_from_text(_read(path), source=source_name(path))


def load_documents(path: str | Path) -> list[Document]:
    """Every GRPOLoraJob, RolloutPool and runtime in a YAML file, in order; InvalidJob on any problem in any.
    Documents of other API groups (a PersistentVolumeClaim beside its job) are left out (read_documents names
    them)."""
    return load_documents_from_text(_read(path), source=source_name(path))


def read_documents(path: str | Path) -> tuple[list[Document], list[Skipped]]:
    """load_documents, and the documents of other kinds it left out (for `validate` to name)."""
    skipped: list[Skipped] = []
    found = _load_from_text(_read(path), source_name(path), parse_document, skipped)
    return found, skipped


STDIN = "-"  # a file argument that means standard input, as for kubectl -f
STDIN_SOURCE = "<stdin>"


def source_name(path: str | Path) -> str:
    """How messages name where documents came from."""
    return STDIN_SOURCE if str(path) == STDIN else str(path)


def _read(path: str | Path) -> str:
    if str(path) == STDIN:
        stream = sys.stdin
        binary = getattr(stream, "buffer", None)  # bytes, decoded as a file's are, whatever the locale
        return decode(binary.read(), STDIN_SOURCE) if binary is not None else stream.read()
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidJob([Problem("", f"cannot read file: {exc.strerror}")], str(path)) from None
    return decode(data, str(path))


def decode(data: bytes, source: str) -> str:
    """A YAML file's text: UTF-8 (as YAML 1.2 and kubectl read it), whatever this machine's locale says; otherwise
    InvalidJob naming the first byte that is not, and where."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        message = f"not UTF-8 text: byte 0x{data[exc.start]:02x} at position {exc.start}; save the file as UTF-8"
        raise InvalidJob([Problem("", message, line)], source) from None


def load_one_job(path: str | Path, what: str) -> GRPOLoraJob:
    """The one GRPOLoraJob in a YAML file, for the commands that take one (`what` says so, e.g. "`grpolora run` runs
    one"); InvalidJob on any problem, or when the file holds several."""
    jobs = load_jobs(path)
    if len(jobs) != 1:
        raise InvalidJob([Problem("", f"holds {len(jobs)} jobs; {what}")], str(path))
    return jobs[0]


def load_jobs_from_text(text: str, *, source: str = "<input>") -> list[GRPOLoraJob]:
    return _load_from_text(text, source, parse_job)


def load_documents_from_text(text: str, *, source: str = "<input>") -> list[Document]:
    return _load_from_text(text, source, parse_document)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, marking the plain scalars YAML 1.1 reads as strings and kubectl (YAML 1.2) as numbers
    (`1e-5`): a number field takes those, and refuses a quoted string as the API server does (spec.Yaml11Number)."""


_YAML11_NUMBER_TAG: typing.Final = "tag:grpolora.dev,2026:yaml11-number"
_Loader.add_implicit_resolver(_YAML11_NUMBER_TAG, YAML11_NUMBER, list("-+0123456789"))
_Loader.add_constructor(_YAML11_NUMBER_TAG, lambda loader, node: Yaml11Number(loader.construct_scalar(node)))


@dataclass(frozen=True)
class Skipped:
    """A document of a kind that is not ours (the PersistentVolumeClaim a job uses, in the job's file): kubectl
    applies it, grpolora's commands leave it, and `validate` says so."""

    line: int
    kind: str
    namespace: str
    name: str
    document: str  # "document 2: " where the file holds several, else ""

    def __str__(self) -> str:
        named = f"{self.namespace}/{self.name}" if self.namespace else self.name
        where = f" ({self.document.removesuffix(': ')})" if self.document else ""
        return (
            f"line {self.line}: {self.kind} {named}{where}: not a {c.GROUP} kind, not checked here (kubectl apply "
            "checks it)"
        )


def _foreign(document: Any, node: yaml.Node, label: str) -> Skipped | None:
    """`document` as Skipped when it is a Kubernetes object of another API group; None for ours (a document of our
    group with an unknown kind, or with no kind, is checked as a job, and refused as one)."""
    if not isinstance(document, Mapping):
        return None
    kind, api_version = document.get("kind"), document.get("apiVersion")
    if not isinstance(kind, str) or kind in _MODELS or kind == "List":
        return None
    if isinstance(api_version, str) and api_version.partition("/")[0] == c.GROUP:
        return None
    meta = document.get("metadata") if isinstance(document.get("metadata"), Mapping) else {}
    return Skipped(node.start_mark.line + 1, kind, str(meta.get("namespace") or ""), str(meta.get("name")), label)


def _load_from_text(
    text: str, source: str, parse: typing.Callable[..., _T], skipped: list[Skipped] | None = None
) -> list[_T]:
    try:
        nodes = [n for n in yaml.compose_all(text, Loader=_Loader) if n is not None]
        documents = [yaml.load(yaml.serialize(n), Loader=_Loader) for n in nodes]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidJob([Problem("", f"YAML syntax error: {problem}", line)], source) from None
    if not documents:
        raise InvalidJob([Problem("", "no YAML document found")], source)
    jobs, problems = [], []
    for index, (node, document) in enumerate(zip(nodes, documents, strict=True)):
        label = f"document {index + 1}: " if len(documents) > 1 else ""
        found = _duplicate_keys(node, "")
        for prefix, item_node, item in _items(node, document):
            other = _foreign(item, item_node, label + (f"{prefix.rstrip('.')}: " if prefix else ""))
            if other is not None:
                if skipped is not None:
                    skipped.append(other)
                continue
            try:
                jobs.append(parse(item, source=source, node=item_node))
                _remember_node(jobs[-1], item_node)
            except InvalidJob as exc:
                found += [Problem(prefix + p.path if p.path else prefix.rstrip("."), p.message, p.line)
                          for p in exc.problems]  # fmt: skip
        problems += [Problem(p.path, label + p.message, p.line) for p in in_line_order(found)]
    if problems:
        raise InvalidJob(problems, source)
    if not jobs and not problems and skipped is None:
        kinds = ", ".join(c.CRD_KINDS)
        raise InvalidJob([Problem("", f"holds no {c.GROUP} document ({kinds})")], source)
    return jobs


def _items(node: yaml.Node, document: Any) -> list[tuple[str, yaml.Node, Any]]:
    """The documents in one YAML document: itself, or the items of a `kind: List` (as `kubectl get -o yaml` writes
    several objects, and `kubectl apply -f` reads them), each with the path prefix its problems are named by."""
    if not (isinstance(document, Mapping) and document.get("kind") == "List" and "items" in document):
        return [("", node, document)]
    items = document["items"]
    items_node = next((v for k, v in node.value if getattr(k, "value", None) == "items"), None)
    if not isinstance(items, list) or not isinstance(items_node, yaml.SequenceNode):
        return [("items", node, items)]  # refused as not a mapping, at the List's line
    return [(f"items[{i}].", n, item) for i, (n, item) in enumerate(zip(items_node.value, items, strict=True))]


QOS_RESOURCES: typing.Final = ("cpu", "memory")
"""The resources a pod's QoS class is computed from; an extended resource (a GPU) does not count."""


def best_effort_roles(job: GRPOLoraJob) -> list[str]:
    """The spec paths of the roles whose pods would be BestEffort: no container (the worker, sidecars and init
    containers of podTemplate) requests or limits cpu or memory. Kubernetes' rule (pkg/apis/core/helper/qos/qos.go,
    ComputePodQOS: only cpu and memory, non-zero, in requests or limits); such pods are evicted first under node
    pressure. A job on a RolloutPool has no inference pods of its own; spec.environment.server's pods (one
    container, no podTemplate) count too."""
    roles = [("spec.trainer", job.spec.trainer)]
    if job.spec.inference.pool_ref is None:
        roles.append(("spec.inference", job.spec.inference))
    found = []
    for path, role in roles:
        template = role.pod_template.get("spec") or {}
        containers = [role.resources] + [
            container.get("resources") or {}
            for container in [*(template.get("containers") or []), *(template.get("initContainers") or [])]
        ]
        if not any(_sets_qos_resource(resources) for resources in containers):
            found.append(path)
    server = job.spec.environment.server if job.spec.environment is not None else None
    if server is not None and not _sets_qos_resource(server.resources):
        found.append("spec.environment.server")
    return found


def _sets_qos_resource(resources: Mapping[str, Any]) -> bool:
    for section in ("requests", "limits"):
        for name in QOS_RESOURCES:
            value = (resources.get(section) or {}).get(name)
            if value is not None and str(value).rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") not in (
                "0",
                "0.0",
                "",
            ):
                return True
    return False


def best_effort_warnings(job: GRPOLoraJob) -> list[Problem]:
    """best_effort_roles as warnings: `grpolora validate` prints them, the operator's PodsBestEffort condition says
    them."""
    return [
        Problem(
            f"{path}.resources",
            "no cpu or memory requests: the pods would run BestEffort (a GPU limit does not count for QoS) and are "
            f"the first evicted under node pressure; set {path}.resources.requests (memory at least)",
        )
        for path in best_effort_roles(job)
    ]


# The per-token log-weight spread a sequence-level weight's cap is judged against: a stale step's drift (metrics.jsonl
# policy_drift measured 0.09 per token at maxStaleness 2 in a float32 run; bf16 mismatch is of that order too).
SEQUENCE_WEIGHT_TOKEN_SPREAD = 0.1


def sequence_weight_cap_warning(grpo: GRPOSpec) -> Problem | None:
    """importanceWeightLevel: sequence multiplies up to maxNewTokens token weights, so its log spreads as
    sqrt(length) times the per-token one: a cap below exp(0.1 * sqrt(maxNewTokens)) cuts (or masks) a large share
    of the completions' weights, and the correction then mostly measures the cap."""
    if grpo.importance_weight_level != "sequence":
        return None
    spread = SEQUENCE_WEIGHT_TOKEN_SPREAD * math.sqrt(grpo.max_new_tokens)
    if math.log(grpo.importance_weight_cap) >= spread:
        return None
    return Problem(
        "spec.grpo.importanceWeightCap",
        f"{grpo.importance_weight_cap:g} with importanceWeightLevel: sequence: a completion's weight is the product "
        f"of its up to {grpo.max_new_tokens} token weights, and at a per-token log-weight spread of "
        f"{SEQUENCE_WEIGHT_TOKEN_SPREAD} nats (a stale step's drift) its log spreads about "
        f"{SEQUENCE_WEIGHT_TOKEN_SPREAD} x sqrt({grpo.max_new_tokens}) = {spread:.2f} nats, far past the cap's "
        f"log {math.log(grpo.importance_weight_cap):.2f}: a large share of the completions would be "
        f"{'masked' if grpo.importance_weight_mode == 'mask' else 'cut to the cap'}; raise importanceWeightCap to "
        f"at least {math.exp(spread):.2f}, or use importanceWeightLevel: geometric (the per-token mean, which does "
        "not grow with length)",
    )


def job_warnings(job: GRPOLoraJob) -> list[Problem]:
    """Things that run but may surprise: said by `grpolora validate` (and `grpolora run`)."""
    spec, warnings = job.spec, best_effort_warnings(job)
    if "task" not in spec.model_fields_set:
        warnings.append(
            Problem("spec.task", "not set: the job trains on the built-in `arithmetic` task; name the task it is for")
        )
    if spec.lora.rank not in c.VLLM_MAX_LORA_RANKS:
        warnings.append(
            Problem(
                "spec.lora.rank",
                f"rank {spec.lora.rank} is served in vLLM's {spec.lora.vllm_max_lora_rank}-rank LoRA slots "
                f"(vLLM sizes slots at {', '.join(map(str, c.VLLM_MAX_LORA_RANKS))}); the adapter keeps rank "
                f"{spec.lora.rank}",
            )
        )
    if spec.grpo.reference_on_replicas and spec.model.dtype in ("bfloat16", "float16"):
        warnings.append(
            Problem(
                "spec.grpo.referenceFrom",
                f"inference with a {spec.model.dtype} model: the reference logprobs come from vLLM's kernels and the "
                "policy's from the trainer's, which in half precision do not agree exactly (metrics.jsonl's "
                "mismatch), so the KL term is not 0 at step 0 and pulls the policy towards vLLM's numerics rather "
                "than the base "
                "model; set referenceFrom: trainer (a reference pass with the adapter off, the same kernels) or a "
                "float32 model where the KL matters",
            )
        )
    if spec.grpo.importance_ratio == "sequence" and spec.grpo.loss_aggregation in ("token-mean", "constant"):
        # TRL warns of the same for its token-summing losses (bnpo, dr_grpo, dapo); verl's GSPO forces
        # seq-mean-token-mean.
        how = "the token mean" if spec.grpo.loss_aggregation == "token-mean" else "the constant normaliser"
        warnings.append(
            Problem(
                "spec.grpo.importanceRatio",
                f"sequence (GSPO) with lossAggregation: {spec.grpo.loss_aggregation}: every token of a completion "
                f"gets the completion's one clipped ratio, and {how} then sums its tokens, weighing each "
                "completion by its length, which GSPO's objective does not; set lossAggregation: sequence-mean "
                "(GSPO's own averaging)",
            )
        )
    if (tight := sequence_weight_cap_warning(spec.grpo)) is not None:
        warnings.append(tight)
    output = spec.output
    if output is not None and output.folder is not None:
        persists = output.pvc is not None
    else:  # beside the checkpoints (grpolora.api.spec.OutputSpec.folder)
        persists = spec.checkpoint.pvc is not None
    pushed = output is not None and output.push is not None
    if not persists:
        warnings.append(
            Problem(
                "spec.output",
                "no persistent location: in a cluster the final adapter, metrics.jsonl, samples and status.json "
                "are written to the trainer pod's own disk and are lost with it; "
                + ("spec.output.push copies the adapter, so only the adapter outlives the pod; " if pushed else "")
                + "set spec.output.pvc (or spec.checkpoint.pvc, where outputs go by default)"
                + ("" if pushed else " or spec.output.push"),
            )
        )
    if spec.checkpoint.pvc is None:
        warnings.append(
            Problem(
                "spec.checkpoint.pvc",
                "not set: in a cluster, checkpoints live in the trainer pod's emptyDir and go with it: a replaced or "
                "restarted trainer starts again at step 0",
            )
        )
    return warnings


# ---- error formatting -------------------------------------------------------------------------------------

# peft options that vLLM cannot serve (PEFTHelper._validate_features in vllm/lora/peft_helper.py refuses them):
# a job could train them but its replicas could never generate with them.
UNSERVABLE_PEFT: dict[str, str] = {
    "useDora": "vLLM cannot serve DoRA adapters (peft's use_dora), so the replicas could not load them",
    "modulesToSave": "vLLM cannot serve modules_to_save with a causal LM's adapter (it takes them only for "
    "classification heads: classifier, score)",
}

# Sampling options vLLM offers that the trainer's logprobs do not reproduce: a rollout sampled with them would be
# trained with importance ratios against another distribution (grpo.topP and grpo.topK are reproduced, op for op).
_LOGITS_PROCESSOR = (
    "not offered: vLLM applies it in its own logits processors, and the trainer's logprobs would have to reproduce "
    "them for the importance ratios to compare like with like; grpo.topK, grpo.topP and grpo.temperature are"
)
UNREFLECTED_SAMPLING: dict[str, str] = {
    "minP": _LOGITS_PROCESSOR + " (min-p truncates like them)",
    "repetitionPenalty": _LOGITS_PROCESSOR,
    "presencePenalty": _LOGITS_PROCESSOR,
    "frequencyPenalty": _LOGITS_PROCESSOR,
}


def _problems_from(error: Mapping[str, Any], root: type[BaseModel] = GRPOLoraJob) -> Iterable[Problem]:
    loc = tuple(error["loc"])
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldErrors):
        for sub_path, message in cause.errors:
            yield Problem(_join(loc + tuple(_split(sub_path))), message)
        return
    kind = error["type"]
    if kind == "extra_forbidden":
        field = str(loc[-1])
        valid = _field_names_at(loc[:-1], root)
        hint = difflib.get_close_matches(field, valid, n=1)
        message = f"unknown field `{field}`"
        if len(loc) >= 2 and loc[-2] == "lora" and field in UNSERVABLE_PEFT:
            message += f": {UNSERVABLE_PEFT[field]}"
        elif len(loc) >= 2 and loc[-2] == "grpo" and field in UNREFLECTED_SAMPLING:
            message += f": {UNREFLECTED_SAMPLING[field]}"
        elif hint:
            message += f" (did you mean `{hint[0]}`?)"
        if valid:
            message += f"; valid fields: {', '.join(valid)}"
        yield Problem(_join(loc), message)
    elif kind == "missing":
        yield Problem(_join(loc), "required field is missing")
    elif kind == "int_parsing_size":  # beyond any integer (2^63): name the field's own bound instead
        bound = _upper_bound(loc, root)
        limit = f"; at most {bound}" if bound is not None else ""
        yield Problem(_join(loc), f"{error.get('input')!r} is far too large{limit}")
    elif (
        kind in ("int_parsing", "float_parsing")
        and isinstance(error.get("input"), str)
        and YAML11_NUMBER.match(error["input"])
    ):
        written = error["input"]
        value = float(written)
        yield Problem(
            _join(loc),
            f"`{written}` is a string in YAML 1.1, which reads a number with an exponent only with a dot "
            f"(`{value:.1e}`); write {value:g}",
        )
    else:
        message = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        if isinstance(given, str | int | float | bool) and kind != "value_error":
            message += f" (got {given!r})"
        yield Problem(_join(loc), message)


def _join(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part:
            path += f".{part}" if path else str(part)
    return path


def _field_names_at(loc: tuple[Any, ...], root: type[BaseModel] = GRPOLoraJob) -> list[str]:
    """The wire names of the fields of the model found at `loc` (empty if it is not a model)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        model = _model_in(_field_annotation(model, str(part)))
        if model is None:
            return []
    return [f.alias or name for name, f in model.model_fields.items()] if model else []


def _upper_bound(loc: tuple[Any, ...], root: type[BaseModel]) -> Any:
    """The `le` bound of the field at `loc`, if it has one."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        model = _model_in(_field_annotation(model, str(part)))
        if model is None:
            return None
    for name, info in model.model_fields.items():
        if str(loc[-1]) in (name, info.alias):
            return next((m.le for m in info.metadata if getattr(m, "le", None) is not None), None)
    return None


def _field_annotation(model: type[BaseModel], wire_name: str) -> Any:
    for name, field in model.model_fields.items():
        if wire_name in (name, field.alias):
            return field.annotation
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _duplicate_keys(node: yaml.Node, path: str) -> list[Problem]:
    """Keys given twice in one mapping: YAML keeps the last silently, kubectl's strict decoding refuses them."""
    problems: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key, value in node.value:
            name = str(getattr(key, "value", ""))
            child = f"{path}.{name}" if path else name
            line = key.start_mark.line + 1
            if name in first_line:
                problems.append(Problem(child, f"duplicate key `{name}` (first at line {first_line[name]})", line))
            else:
                first_line[name] = line
            problems += _duplicate_keys(value, child)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            problems += _duplicate_keys(item, f"{path}[{index}]")
    return problems


def _line_of(node: yaml.Node, path: str) -> int | None:
    """1-based line of the deepest node along `path` (a missing field points at its parent). A key may hold dots
    (`nvidia.com/gpu.product` in a nodeSelector), so each step takes the longest key of the mapping that the rest
    of the path starts with, rather than splitting the path at every dot."""
    line, rest = node.start_mark.line + 1, path
    while rest:
        child, after = None, ""
        if isinstance(node, yaml.MappingNode) and not rest.startswith("["):
            keyed = [(str(getattr(k, "value", "")), v) for k, v in node.value]
            matches = [(key, v) for key, v in keyed if rest == key or rest.startswith((key + ".", key + "["))]
            if matches:
                key, child = max(matches, key=lambda match: len(match[0]))
                after = rest[len(key) :]
        elif isinstance(node, yaml.SequenceNode) and rest.startswith("["):
            index, _, after = rest[1:].partition("]")
            if index.isdigit() and int(index) < len(node.value):
                child = node.value[int(index)]
        if child is None:
            break
        node, line, rest = child, child.start_mark.line + 1, after.removeprefix(".")
    return line


def _split(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for dotted in path.split("."):
        name, *indices = dotted.replace("]", "").split("[")
        if name:
            parts.append(name)
        parts += [int(i) for i in indices]
    return parts
