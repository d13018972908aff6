"""Runtimes (GRPOLoraRuntime, ClusterGRPOLoraRuntime): the merge rule, defaults applied after it, what a runtime may
set, their CRDs, and `grpolora validate | render` on a job that names one."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.api.crd import CRDS, crd, runtime_crd
from grpolora.api.load import InvalidJob, parse_job, parse_runtime
from grpolora.api.runtime import merge, resolve
from grpolora.api.spec import (
    EnvironmentServerPlacement,
    EnvironmentServerSpec,
    GRPOLoraJobSpec,
    GRPOLoraRuntimeSpec,
    RuntimeEnvironmentSpec,
    runtime_fields,
)
from grpolora.api.status import JobStatus
from tests.helpers import ROOT, job_doc, not_checked_lines
from tests.unit.test_cli import grpolora

RUNTIME = ROOT / "examples" / "runtime" / "cluster-runtime.yaml"
JOB = ROOT / "examples" / "runtime" / "small-job.yaml"


def runtime_doc(kind: str = c.CLUSTER_RUNTIME_KIND, name: str = "gpu", **spec: Any) -> dict[str, Any]:
    meta = {"name": name} if kind == c.CLUSTER_RUNTIME_KIND else {"name": name, "namespace": "team-a"}
    return {"apiVersion": c.API_VERSION, "kind": kind, "metadata": meta, "spec": spec}


def on_runtime(kind: str = c.CLUSTER_RUNTIME_KIND, name: str = "gpu", **spec: Any) -> dict[str, Any]:
    doc = job_doc(**spec)
    doc["spec"]["runtimeRef"] = {"kind": kind, "name": name}
    return doc


# ---- the merge rule --------------------------------------------------------------------------------------


def test_merge_is_deep_for_mappings_and_the_job_wins_every_value_it_sets():
    runtime = {"trainer": {"image": "r", "resources": {"requests": {"cpu": "8", "memory": "1Gi"}}, "replicas": 2}}
    job = {"trainer": {"resources": {"requests": {"memory": "2Gi"}}, "replicas": 1}}
    assert merge(runtime, job) == {
        "trainer": {"image": "r", "resources": {"requests": {"cpu": "8", "memory": "2Gi"}}, "replicas": 1}
    }


GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SPOT = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}


def test_tolerations_are_a_union_the_runtimes_first():
    runtime = {"trainer": {"tolerations": [GPU]}}
    job = {"trainer": {"tolerations": [SPOT, dict(GPU)]}}  # the GPU one again: kept once
    assert merge(runtime, job)["trainer"]["tolerations"] == [GPU, SPOT]


def test_env_merges_by_name_the_jobs_value_winning_in_the_runtimes_place():
    runtime = {"inference": {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}}
    job = {"inference": {"env": [{"name": "C", "value": "3"}, {"name": "A", "value": "9"}]}}
    assert merge(runtime, job)["inference"]["env"] == [
        {"name": "A", "value": "9"},
        {"name": "B", "value": "2"},
        {"name": "C", "value": "3"},
    ]


def test_a_pod_templates_lists_merge_by_their_strategic_merge_keys_at_any_depth():
    runtime = {"trainer": {"podTemplate": {"spec": {
        "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "ds"}}],
        "containers": [{"name": "trainer", "volumeMounts": [{"name": "datasets", "mountPath": "/data"}]},
                       {"name": "log-shipper", "image": "fluent-bit:3"}],
    }}}}  # fmt: skip
    job = {"trainer": {"podTemplate": {"spec": {
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "containers": [{"name": "trainer", "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
    }}}}  # fmt: skip
    spec = merge(runtime, job)["trainer"]["podTemplate"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["datasets", "scratch"]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "log-shipper"]
    assert [m["mountPath"] for m in spec["containers"][0]["volumeMounts"]] == ["/data", "/scratch"]


def test_patch_delete_drops_one_runtime_item_and_patch_replace_the_whole_list():
    runtime = {"trainer": {"tolerations": [GPU, SPOT], "env": [{"name": "A", "value": "1"}, {"name": "B"}],
                           "podTemplate": {"spec": {"volumes": [{"name": "ds", "emptyDir": {}}]}}}}  # fmt: skip
    job = {"trainer": {
        "tolerations": [{**SPOT, "$patch": "delete"}],
        "env": [{"$patch": "replace"}, {"name": "C", "value": "3"}],
        "podTemplate": {"spec": {"volumes": [{"name": "ds", "$patch": "delete"}]}},
    }}  # fmt: skip
    trainer = merge(runtime, job)["trainer"]
    assert trainer["tolerations"] == [GPU]
    assert trainer["env"] == [{"name": "C", "value": "3"}]
    assert trainer["podTemplate"]["spec"]["volumes"] == []


def test_deleting_what_the_runtime_does_not_set_is_an_error_naming_the_item():
    runtime = parse_runtime(runtime_doc(trainer={"env": [{"name": "A", "value": "1"}]}))
    job = parse_job(on_runtime(trainer={"env": [{"name": "AA", "$patch": "delete"}]}))
    with pytest.raises(InvalidJob) as caught:
        resolve(job, runtime)
    (problem,) = caught.value.problems
    assert problem.path == "spec.trainer.env[0]"
    assert problem.message == (
        "`$patch: delete` drops the runtime's item with name AA, and the runtime has none (it has: A) (the job "
        "merged with ClusterGRPOLoraRuntime gpu)"
    )


def test_a_directive_on_a_section_the_runtime_does_not_set_is_read_as_on_an_empty_list():
    """A runtime without `trainer` has no env to delete from: the delete is the typo it is elsewhere, and a
    `{$patch: replace}` leaves the job's own items (the directives were kept in the merged spec, where the pods'
    env would have carried them)."""
    runtime = parse_runtime(runtime_doc(sync={"backend": "gloo"}))
    job = parse_job(on_runtime(trainer={"env": [{"name": "A", "$patch": "delete"}]}))
    with pytest.raises(InvalidJob) as caught:
        resolve(job, runtime)
    assert [p.path for p in caught.value.problems] == ["spec.trainer.env[0]"]
    assert "the runtime has none (it has: none)" in caught.value.problems[0].message
    job = parse_job(on_runtime(trainer={"env": [{"$patch": "replace"}, {"name": "B", "value": "1"}]}))
    assert resolve(job, runtime).spec.trainer.env == [{"name": "B", "value": "1"}]


def test_a_patch_directive_needs_a_runtime_and_a_known_verb():
    with pytest.raises(InvalidJob) as caught:
        parse_job(job_doc(trainer={"env": [{"name": "A", "$patch": "delete"}]}))
    assert [(p.path, p.message) for p in caught.value.problems] == [
        ("spec.trainer.env[0].$patch", "drops an item of a runtime's list, and this job names no runtime "
         "(spec.runtimeRef): remove the item")
    ]  # fmt: skip
    with pytest.raises(InvalidJob) as caught:
        parse_job(on_runtime(inference={"tolerations": [{**GPU, "$patch": "remove"}]}))
    (problem,) = caught.value.problems
    assert problem.path == "spec.inference.tolerations[0].$patch"
    assert "`remove`: use `delete` (drop the runtime's item) or `replace`" in problem.message
    with pytest.raises(InvalidJob) as caught:
        parse_runtime(runtime_doc(trainer={"tolerations": [{**GPU, "$patch": "delete"}]}))
    assert [p.path for p in caught.value.problems] == ["spec.trainer.tolerations[0].$patch"]


def test_lists_outside_the_merged_ones_are_replaced_whole():
    runtime = {"trainer": {"affinity": {"nodeAffinity": {"x": [1, 2]}}}, "networkPolicy": {"metricsFrom": [{"a": 1}]}}
    job = {"trainer": {"affinity": {"nodeAffinity": {"x": [3]}}}, "networkPolicy": {"metricsFrom": [{"b": 2}]}}
    merged = merge(runtime, job)
    assert merged["trainer"]["affinity"]["nodeAffinity"]["x"] == [3]
    assert merged["networkPolicy"]["metricsFrom"] == [{"b": 2}]


def test_merge_leaves_its_inputs_alone():
    runtime, job = {"sync": {"backend": "gloo"}}, {"sync": {"port": 29700}}
    before = copy.deepcopy((runtime, job))
    merge(runtime, job)
    assert (runtime, job) == before


# ---- resolve: defaults after the merge -------------------------------------------------------------------


def test_a_field_the_job_leaves_out_takes_the_runtimes_value_not_the_models_default():
    runtime = parse_runtime(runtime_doc(trainer={"gpusPerReplica": 0, "image": "img:1"}, sync={"backend": "gloo"}))
    job = parse_job(on_runtime(trainer={"replicas": 2}))
    resolved = resolve(job, runtime)
    assert resolved.spec.trainer.gpus_per_replica == 0  # the model's default is 1
    assert resolved.spec.trainer.image == "img:1"
    assert resolved.spec.trainer.replicas == 2
    assert resolved.spec.sync.backend == "gloo"
    # Neither set it: the model's default, applied to the merged spec.
    assert resolved.spec.trainer.max_restarts == 3
    assert resolved.spec.runtime_ref is not None and resolved.spec.runtime_ref.name == "gpu"


def test_the_job_wins_over_the_runtime_field_by_field():
    runtime = parse_runtime(runtime_doc(inference={"replicas": 4, "nodeSelector": {"pool": "serve", "zone": "a"}}))
    job = parse_job(on_runtime(inference={"replicas": 1, "nodeSelector": {"zone": "b"}}))
    inference = resolve(job, runtime).spec.inference
    assert inference.replicas == 1
    assert inference.node_selector == {"pool": "serve", "zone": "b"}


def test_a_job_on_a_pool_leaves_the_runtimes_inference_out():
    runtime = parse_runtime(runtime_doc(inference={"gpusPerReplica": 2}, trainer={"image": "t:1"}))
    job = parse_job(on_runtime(inference={"poolRef": {"name": "shared"}}))
    resolved = resolve(job, runtime).spec
    assert resolved.inference.pool_ref is not None and resolved.trainer.image == "t:1"


def test_an_invalid_merged_spec_names_the_field_and_the_runtime():
    runtime = parse_runtime(runtime_doc(sync={"backend": "nccl"}))
    job = parse_job(on_runtime(trainer={"gpusPerReplica": 0}))
    with pytest.raises(InvalidJob) as caught:
        resolve(job, runtime)
    (problem,) = caught.value.problems
    assert problem.path == "spec.sync.backend"
    assert "the job merged with ClusterGRPOLoraRuntime gpu" in problem.message


def test_a_namespaced_runtime_is_named_with_its_namespace():
    runtime = parse_runtime(runtime_doc(c.RUNTIME_KIND, sync={"backend": "nccl"}))
    job = parse_job(on_runtime(c.RUNTIME_KIND, trainer={"gpusPerReplica": 0}))
    with pytest.raises(InvalidJob, match="GRPOLoraRuntime team-a/gpu"):
        resolve(job, runtime)


# ---- what a runtime may set ------------------------------------------------------------------------------


def test_a_runtime_refuses_a_field_about_what_the_job_trains_naming_the_valid_ones():
    with pytest.raises(InvalidJob) as caught:
        parse_runtime(runtime_doc(grpo={"steps": 10}))
    (problem,) = caught.value.problems
    assert problem.path == "spec.grpo"
    assert "unknown field `grpo`" in problem.message
    assert "valid fields: trainer, inference, sync, scheduling, networkPolicy, podSecurity, output" in problem.message


def test_a_runtime_checks_its_fields_as_a_job_does():
    with pytest.raises(InvalidJob) as caught:
        parse_runtime(runtime_doc(trainer={"replicas": 0}))
    assert [p.path for p in caught.value.problems] == ["spec.trainer.replicas"]


def test_a_runtime_cannot_name_a_pool():
    with pytest.raises(InvalidJob) as caught:
        parse_runtime(runtime_doc(inference={"poolRef": {"name": "p"}}))
    assert [p.path for p in caught.value.problems] == ["spec.inference.poolRef"]


def test_the_runtime_fields_have_the_job_specs_own_types():
    for name, field in GRPOLoraRuntimeSpec.model_fields.items():
        if name == "environment":
            continue  # where its server runs, not what it is: below
        job_field = GRPOLoraJobSpec.model_fields[name]
        own = job_field.annotation
        assert field.annotation in (own | None, own), name
    assert runtime_fields() == (
        "trainer", "inference", "sync", "scheduling", "networkPolicy", "podSecurity", "output", "environment"
    )  # fmt: skip
    # Of spec.environment, a runtime sets the server's placement, with the job's own model for those fields.
    assert set(RuntimeEnvironmentSpec.model_fields) == {"server"}
    assert RuntimeEnvironmentSpec.model_fields["server"].annotation == EnvironmentServerPlacement | None
    assert issubclass(EnvironmentServerSpec, EnvironmentServerPlacement)
    assert set(EnvironmentServerPlacement.model_fields) == set(SERVER_PLACEMENT)


# ---- CRDs ------------------------------------------------------------------------------------------------


def _defaults(schema: dict[str, Any], path: str = "") -> list[str]:
    found = [path] if "default" in schema else []
    for name, child in (schema.get("properties") or {}).items():
        found += _defaults(child, f"{path}.{name}")
    return found


SERVER_PLACEMENT = ("image", "image_pull_policy", "resources", "node_selector", "tolerations", "runtime_class_name",
                    "env")  # fmt: skip
"""What a runtime sets of spec.environment.server (EnvironmentServerPlacement): where and as what its pods run."""


def _runtime_part(schema: dict[str, Any], field: str) -> dict[str, Any]:
    """The part of a job spec section's schema a runtime sets: the whole section, or of `environment` the server's
    placement fields."""
    if field != "environment":
        return schema[field]
    server = schema["environment"]["properties"]["server"]["properties"]
    runtime_server = runtime_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["environment"]["properties"]["server"]["properties"]  # fmt: skip
    return {"properties": {name: server[name] for name in runtime_server}}


def test_the_job_crd_sets_no_defaults_on_fields_a_runtime_may_set_and_describes_them():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for field in runtime_fields():
        assert _defaults(_runtime_part(spec, field)) == [], field
    # The rest of spec.environment is the job's alone: its defaults stay (the CEL rules read them as written).
    environment = spec["environment"]["properties"]
    assert environment["retries"]["default"] == 2 and environment["server"]["properties"]["replicas"]["default"] == 1
    replicas = spec["trainer"]["properties"]["replicas"]
    assert replicas["description"].endswith("Default: 1.")
    # Fields runtimes do not set keep their server-side defaults.
    assert spec["lora"]["properties"]["rank"]["default"] == 16


@pytest.mark.parametrize(
    ("kind", "scope"), [(c.RUNTIME_KIND, "Namespaced"), (c.CLUSTER_RUNTIME_KIND, "Cluster")], ids=["ns", "cluster"]
)
def test_runtime_crds_carry_the_job_fields_bounds_and_no_defaults(kind: str, scope: str):
    runtime = CRDS[kind]()
    assert runtime["spec"]["scope"] == scope
    assert runtime["spec"]["names"]["kind"] == kind
    assert runtime["spec"]["names"]["categories"] == ["grpolora"]  # configuration: not in `kubectl get all`
    schema = runtime["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    job_spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(schema["properties"]) == set(runtime_fields())
    assert _defaults(schema) == []
    for field in runtime_fields():
        if field == "environment":
            own = schema["properties"][field]["properties"]["server"]
            jobs = _runtime_part(job_spec["properties"], field)
            assert own["properties"] == jobs["properties"]
            continue
        own, jobs = schema["properties"][field], job_spec["properties"][field]
        assert {**own, "description": ""} == {**jobs, "description": ""}, field


# ---- the CLI ---------------------------------------------------------------------------------------------


def test_validate_accepts_the_runtime_example_and_its_job():
    result = grpolora("validate", str(RUNTIME), "-f", str(JOB))
    assert result.returncode == 0, result.stderr
    assert f"{RUNTIME}: ClusterGRPOLoraRuntime a100-nccl is valid" in result.stdout
    assert f"{JOB}: GRPOLoraJob rl/arithmetic-on-a100 is valid" in result.stdout
    assert not not_checked_lines(result.stderr)


def test_validate_of_a_job_without_its_runtime_says_what_to_give():
    result = grpolora("validate", str(JOB))
    assert result.returncode == 0, result.stderr
    assert (
        "not checked here: spec.runtimeRef: the job merged with ClusterGRPOLoraRuntime a100-nccl (give the "
        "runtime's file too to check it)" in result.stderr
    )


def test_validate_reports_an_invalid_merge_at_the_job(tmp_path):
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["trainer"]["gpusPerReplica"] = 0  # the runtime's sync.backend nccl needs GPUs on both roles
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = grpolora("validate", str(RUNTIME), str(path))
    assert result.returncode == 1
    named = f"{path}: GRPOLoraJob rl/arithmetic-on-a100: spec.sync.backend: `nccl` needs GPUs on both roles"
    assert named in result.stderr
    assert "(the job merged with ClusterGRPOLoraRuntime a100-nccl)" in result.stderr


def test_render_resolves_the_job_on_its_runtime_in_one_file_or_two(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text(RUNTIME.read_text() + "---\n" + JOB.read_text())
    for args in ([str(RUNTIME), str(JOB)], [str(both)]):
        result = grpolora("render", *args)
        assert result.returncode == 0, result.stderr
        objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout)}
        trainer = objects[("Job", "arithmetic-on-a100-trainer")]["spec"]["template"]["spec"]
        assert trainer["nodeSelector"] == {"grpolora.dev/pool": "a100-train"}
        worker = trainer["containers"][0]
        assert worker["image"] == "ghcr.io/grpo-lora-operator/worker-gpu:0.1.0"
        assert worker["resources"]["requests"]["memory"] == "96Gi"
        assert worker["resources"]["requests"]["cpu"] == "8"
        assert objects[("StatefulSet", "arithmetic-on-a100-inference")]["spec"]["replicas"] == 2


def test_render_of_a_job_without_its_runtime_fails_naming_it():
    result = grpolora("render", str(JOB))
    assert result.returncode == 1
    assert (
        "spec.runtimeRef.name: names ClusterGRPOLoraRuntime a100-nccl, which none of the files given holds; give its "
        "file too" in result.stderr
    )


def test_a_namespaced_runtime_of_another_namespace_does_not_resolve(tmp_path):
    runtime = runtime_doc(c.RUNTIME_KIND, name="mine", trainer={"gpusPerReplica": 0})
    runtime["metadata"]["namespace"] = "other"
    job = on_runtime(c.RUNTIME_KIND, name="mine")
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump_all([runtime, job]))
    result = grpolora("render", str(path))
    assert result.returncode == 1
    assert "GRPOLoraRuntime mine is in namespace other, not team-a" in result.stderr


def test_run_reads_a_job_merged_with_its_runtime_and_refuses_it_without():
    from grpolora.workers.launcher.run_files import read_run_files

    given = read_run_files([str(RUNTIME), str(JOB)])
    ((path, job),) = given.jobs
    assert path == str(JOB)
    assert job.spec.trainer.node_selector == {"grpolora.dev/pool": "a100-train"}
    assert job.spec.sync.backend == "nccl"
    with pytest.raises(InvalidJob, match=r"names ClusterGRPOLoraRuntime a100-nccl, .* \(grpolora run RUNTIME_FILE"):
        read_run_files([str(JOB)])


def test_eval_of_a_job_on_a_runtime_needs_the_runtime_and_checks_the_merge(tmp_path):
    """`grpolora eval` starts an engine from the job's inference fields, which may be the runtime's."""
    result = grpolora("eval", str(JOB), "--adapter", str(tmp_path))
    assert result.returncode == 1
    assert "names ClusterGRPOLoraRuntime a100-nccl, which none of the files given holds" in result.stderr
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["trainer"]["gpusPerReplica"] = 0
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = grpolora("eval", str(path), str(RUNTIME), "--adapter", str(tmp_path))
    assert result.returncode == 1
    assert "spec.sync.backend" in result.stderr and "(the job merged with ClusterGRPOLoraRuntime a100-nccl)" in (
        result.stderr
    )


# ---- the operator's view of a job on a runtime (pure: grpolora.operator.job_view.job_view) ---------------------


def _started(doc: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """`doc` as the operator left it when it started on `runtime`: both records written, condition Created."""
    from grpolora.operator import names
    from grpolora.operator.job_view import job_view

    first = job_view(doc, runtime)
    assert first.record_applied and first.record_runtime
    started = copy.deepcopy(doc)
    started["metadata"]["annotations"] = {
        names.APPLIED_SPEC_ANNOTATION: first.record_applied,
        names.RUNTIME_ANNOTATION: first.record_runtime,
    }
    created = {"type": "Created", "status": "True", "reason": "ChildrenCreated", "message": "",
               "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    started["status"] = {"conditions": [created]}
    return started


def test_job_view_waits_for_a_missing_or_invalid_runtime_naming_it():
    from grpolora.operator import names
    from grpolora.operator.job_view import job_view

    missing = job_view(on_runtime())
    assert missing.job is None and missing.runtime_wait is not None
    assert missing.runtime_wait[0] == names.R_RUNTIME_NOT_FOUND
    assert "ClusterGRPOLoraRuntime gpu, which does not exist" in missing.runtime_wait[1]
    bad = runtime_doc(trainer={"env": [{"name": "GRPOLORA_SPEC", "value": "x"}]})  # beyond the CRD's reach
    invalid = job_view(on_runtime(), bad)
    assert invalid.runtime_wait is not None and invalid.runtime_wait[0] == names.R_RUNTIME_INVALID
    assert "spec.trainer.env[0].name: GRPOLORA_SPEC is set by the operator" in invalid.runtime_wait[1]


def test_job_view_of_a_started_job_uses_the_recorded_runtime_not_the_live_one():
    from grpolora.operator.job_view import job_view, runtime_to_read

    runtime = runtime_doc(trainer={"image": "img:1", "gpusPerReplica": 0}, sync={"backend": "gloo"})
    runtime["metadata"]["generation"] = 4
    started = _started(on_runtime(), runtime)
    assert runtime_to_read(started) is None  # nothing to read any more
    edited = runtime_doc(trainer={"image": "img:2"})
    for live in (edited, None):  # edited, or deleted
        view = job_view(started, live)
        assert view.job is not None and view.job.spec.trainer.image == "img:1" and view.refused == ()
        assert view.runtime == "ClusterGRPOLoraRuntime gpu (generation 4)"
    # The job's own change is still compared with what it started with, field by field.
    changed = copy.deepcopy(started)
    changed["spec"]["trainer"] = {"replicas": 2}
    assert job_view(changed, None).refused == ("spec.trainer.replicas",)


def test_the_runtime_resolved_condition_keeps_its_transition_time_over_passes():
    import datetime

    from grpolora.operator import names
    from grpolora.operator.job_view import job_view
    from grpolora.operator.reconcile import Observed, decide

    runtime = runtime_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 0}, sync={"backend": "gloo"})
    view = job_view(on_runtime(), runtime)
    first = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    status = decide(view, decide(view, JobStatus(), Observed(), first).status, Observed(), first).status
    later = decide(view, status, Observed(), first + datetime.timedelta(hours=1)).status
    resolved = next(x for x in later.conditions if x.type == names.RUNTIME_RESOLVED)
    assert resolved.status == "True" and resolved.last_transition_time == "2026-01-01T00:00:00Z"


def test_validate_reads_a_runtime_and_its_job_from_one_kind_list(tmp_path):
    listed = tmp_path / "list.yaml"
    items = [yaml.safe_load(RUNTIME.read_text()), yaml.safe_load(JOB.read_text())]
    listed.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    result = grpolora("validate", str(listed))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("is valid") == 2 and not not_checked_lines(result.stderr)


def test_the_runtime_examples_pass_their_crds_schema_and_cel_rules():
    from grpolora.testing.kube_apiserver import crd_schema, validate_custom

    for path in (RUNTIME, JOB):
        doc = yaml.safe_load(path.read_text())
        validate_custom(doc, crd_schema(doc["kind"]), strict=True, part="spec")  # raises what the API server would


def test_render_shows_the_runtimes_env_and_toleration_beside_the_ones_the_job_adds(tmp_path, capsys):
    """The issue as a new user met it: the job adds one env var and a spot toleration; the runtime's stay."""
    from grpolora.cli import main

    runtime = runtime_doc(trainer={"env": [{"name": "NCCL_IB_DISABLE", "value": "1"}], "tolerations": [GPU]})
    job = on_runtime(trainer={"env": [{"name": "WANDB_MODE", "value": "offline"}], "tolerations": [SPOT]})
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump_all([runtime, job], sort_keys=False))
    assert main(["render", str(path)]) == 0
    trainer_job = next(o for o in yaml.safe_load_all(capsys.readouterr().out) if o["kind"] == "Job")
    pod = trainer_job["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["NCCL_IB_DISABLE"] == "1" and env["WANDB_MODE"] == "offline"
    assert GPU in pod["tolerations"] and SPOT in pod["tolerations"]


# ---- a runtime pins the service account ------------------------------------------------------------------


def _sa_runtime() -> Any:
    return parse_runtime(runtime_doc(trainer={"podTemplate": {"spec": {"serviceAccountName": "trainer-bucket"}}}))


def test_a_runtimes_service_account_is_the_jobs_pods():
    job = parse_job(on_runtime(trainer={"podTemplate": {"spec": {"serviceAccountName": "trainer-bucket"}}}))
    assert resolve(job, _sa_runtime()).spec.trainer.pod_template["spec"]["serviceAccountName"] == "trainer-bucket"
    plain = resolve(parse_job(on_runtime()), _sa_runtime())
    assert plain.spec.trainer.pod_template["spec"]["serviceAccountName"] == "trainer-bucket"


@pytest.mark.parametrize(
    ("pod_spec", "path"),
    [
        ({"serviceAccountName": "admin"}, "spec.trainer.podTemplate.spec.serviceAccountName"),
        ({"serviceAccount": "admin"}, "spec.trainer.podTemplate.spec.serviceAccount"),  # PodSpec's deprecated alias
        ({"serviceAccountName": None}, "spec.trainer.podTemplate.spec.serviceAccountName"),  # back to `default`
    ],
    ids=["name", "deprecated-alias", "null"],
)
def test_a_job_may_not_choose_another_service_account_than_its_runtimes(pod_spec, path):
    job = parse_job(on_runtime(trainer={"podTemplate": {"spec": pod_spec}}))
    with pytest.raises(InvalidJob) as caught:
        resolve(job, _sa_runtime())
    (problem,) = caught.value.problems
    assert problem.path == path
    assert problem.message.startswith(
        "ClusterGRPOLoraRuntime gpu pins the trainer pods' service account to trainer-bucket: a job on it may not "
        "choose another; remove this field"
    )


def test_the_pin_is_per_role():
    job = parse_job(on_runtime(inference={"podTemplate": {"spec": {"serviceAccountName": "serving"}}}))
    resolved = resolve(job, _sa_runtime()).spec
    assert resolved.inference.pod_template["spec"]["serviceAccountName"] == "serving"


def test_a_runtime_names_the_gpu_resource_of_its_jobs():
    runtime = parse_runtime(runtime_doc(trainer={"gpuResource": "nvidia.com/mig-3g.40gb"}))
    resolved = resolve(parse_job(on_runtime(trainer={"gpusPerReplica": 1})), runtime).spec
    assert resolved.trainer.gpu_resource == "nvidia.com/mig-3g.40gb"
    assert resolved.inference.gpu_resource == c.DEFAULT_GPU_RESOURCE


# ---- where a job's environment server runs ---------------------------------------------------------------


SANDBOX = {"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}
SANDBOX_SERVER = {
    "image": "registry.local/sandbox:1",
    "runtimeClassName": "gvisor",
    "nodeSelector": {"pool": "sandbox", "zone": "a"},
    "tolerations": [SANDBOX],
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
    "env": [{"name": "PIP_INDEX_URL", "value": "http://mirror"}, {"name": "LEVEL", "value": "1"}],
}


def test_a_runtime_places_a_jobs_environment_server_and_the_job_wins_field_by_field():
    runtime = parse_runtime(runtime_doc(environment={"server": SANDBOX_SERVER}))
    job = parse_job(on_runtime(environment={
        "builtin": "calculator",
        "server": {"replicas": 2, "nodeSelector": {"zone": "b"}, "tolerations": [SPOT],
                   "env": [{"name": "LEVEL", "value": "3"}], "resources": {"requests": {"memory": "8Gi"}}},
    }))  # fmt: skip
    server = resolve(job, runtime).spec.environment.server
    assert server is not None
    assert (server.image, server.runtime_class_name, server.replicas) == ("registry.local/sandbox:1", "gvisor", 2)
    assert server.node_selector == {"pool": "sandbox", "zone": "b"}
    assert server.tolerations == [SANDBOX, SPOT]  # a union, the runtime's first
    assert server.env == [{"name": "PIP_INDEX_URL", "value": "http://mirror"}, {"name": "LEVEL", "value": "3"}]
    assert server.resources == {"requests": {"cpu": "2", "memory": "8Gi"}}


def test_a_runtimes_environment_server_reaches_only_a_job_that_runs_one():
    """A runtime places servers; it never turns a job's environment into a served one (nor gives a job one)."""
    runtime = parse_runtime(runtime_doc(environment={"server": SANDBOX_SERVER}, trainer={"image": "t:1"}))
    in_process = resolve(parse_job(on_runtime(environment={"builtin": "calculator"})), runtime).spec
    assert in_process.environment is not None and in_process.environment.server is None
    assert in_process.environment.processes == 4 and in_process.trainer.image == "t:1"
    assert resolve(parse_job(on_runtime()), runtime).spec.environment is None
    own = parse_job(on_runtime(environment={"server": {"command": ["/serve"]}}))
    assert resolve(own, runtime).spec.environment.server.runtime_class_name == "gvisor"


def test_a_runtime_sets_where_a_server_runs_never_what_it_is():
    for field in ("command", "args", "replicas", "port", "egress"):
        with pytest.raises(InvalidJob) as caught:
            parse_runtime(runtime_doc(environment={"server": {field: []}}))
        (problem,) = caught.value.problems
        assert problem.path == f"spec.environment.server.{field}"
        assert "valid fields: image, imagePullPolicy, resources, nodeSelector, tolerations, runtimeClassName, env" in (
            problem.message
        )
    with pytest.raises(InvalidJob) as caught:
        parse_runtime(runtime_doc(environment={"builtin": "calculator"}))
    assert [p.path for p in caught.value.problems] == ["spec.environment.builtin"]
    with pytest.raises(InvalidJob) as caught:  # the job's own checks, on the runtime's fields
        parse_runtime(runtime_doc(environment={"server": {"env": [{"name": contract.ENVIRONMENT_PORT, "value": "1"}]}}))
    assert [p.path for p in caught.value.problems] == ["spec.environment.server.env[0].name"]


def test_render_places_the_environment_servers_pods_where_the_runtime_says(tmp_path, capsys):
    from grpolora.cli import main

    runtime = runtime_doc(environment={"server": SANDBOX_SERVER})
    job = on_runtime(environment={"builtin": "calculator", "server": {"replicas": 2, "tolerations": [SPOT]}})
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump_all([runtime, job], sort_keys=False))
    assert main(["render", str(path)]) == 0, capsys.readouterr().err
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    [server] = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-env")]
    pod = server["spec"]["template"]["spec"]
    assert server["spec"]["replicas"] == 2
    assert (pod["runtimeClassName"], pod["nodeSelector"]) == ("gvisor", {"pool": "sandbox", "zone": "a"})
    assert SANDBOX in pod["tolerations"] and SPOT in pod["tolerations"]
    [container] = pod["containers"]
    assert container["image"] == "registry.local/sandbox:1"
    assert {"name": "PIP_INDEX_URL", "value": "http://mirror"} in container["env"]


def test_a_job_drops_or_replaces_the_runtimes_server_env_and_tolerations_as_a_roles():
    runtime = parse_runtime(runtime_doc(environment={"server": SANDBOX_SERVER}))
    job = parse_job(on_runtime(environment={"builtin": "calculator", "server": {
        "tolerations": [{**SANDBOX, "$patch": "delete"}],
        "env": [{"$patch": "replace"}, {"name": "OWN", "value": "1"}],
    }}))  # fmt: skip
    server = resolve(job, runtime).spec.environment.server
    assert server.tolerations == [] and server.env == [{"name": "OWN", "value": "1"}]
    with pytest.raises(InvalidJob) as caught:  # nothing of the runtime's to drop
        resolve(parse_job(on_runtime(environment={"builtin": "calculator", "server": {
            "env": [{"name": "NOT_THERE", "$patch": "delete"}]}})), runtime)  # fmt: skip
    assert [p.path for p in caught.value.problems] == ["spec.environment.server.env[0]"]
    assert "(it has: PIP_INDEX_URL, LEVEL)" in caught.value.problems[0].message


def test_server_directives_need_a_job_on_a_runtime_and_a_known_verb():
    server = {"env": [{"name": "A", "$patch": "delete"}]}
    with pytest.raises(InvalidJob) as caught:
        parse_job(job_doc(environment={"builtin": "calculator", "server": server}))
    assert [(p.path, p.message) for p in caught.value.problems] == [
        ("spec.environment.server.env[0].$patch", "drops an item of a runtime's list, and this job names no runtime "
         "(spec.runtimeRef): remove the item")
    ]  # fmt: skip
    with pytest.raises(InvalidJob) as caught:
        parse_runtime(runtime_doc(environment={"server": server}))
    assert [p.path for p in caught.value.problems] == ["spec.environment.server.env[0].$patch"]
    with pytest.raises(InvalidJob) as caught:
        parse_job(on_runtime(environment={"builtin": "calculator", "server": {"tolerations": [{**SANDBOX,
                                                                                                "$patch": "drop"}]}}))
    assert [p.path for p in caught.value.problems] == ["spec.environment.server.tolerations[0].$patch"]
