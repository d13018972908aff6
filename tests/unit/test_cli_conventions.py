"""`grpolora validate | render` by kubectl's and helm's conventions: `-f`, `-` for stdin, `kind: List`, `-o json|yaml`
(validation problems as objects with path, line and message), `--strict`, shell completion; and the mistakes a
file can hold around its jobs (the same job twice, a pool of another namespace, a YAML 1.1 number string).

In process (grpolora.cli.main) where a subprocess adds nothing: the installed entry point is covered by test_cli."""

from __future__ import annotations

import io
import json
import shutil
import subprocess

import pytest
import yaml

from grpolora.cli import main
from tests.helpers import ROOT, job_doc

POOL = ROOT / "examples" / "pool" / "qwen3-shared-pool.yaml"
JOB = ROOT / "examples" / "pool" / "sweep-job.yaml"


def run(capsys, *argv: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def named(name: str, namespace: str = "default", **spec) -> dict:
    doc = job_doc(**spec)
    doc["metadata"] = {"name": name, "namespace": namespace}
    return doc


def test_dash_f_names_files_as_kubectl_does(capsys):
    code, out, err = run(capsys, "validate", "-f", str(POOL), "--filename", str(JOB))
    assert code == 0, err
    assert "RolloutPool rl/qwen3-shared is valid" in out and "GRPOLoraJob rl/sweep-lr-1e-5 is valid" in out
    assert "not checked here: its fit" not in err  # both files were read, so the fit was checked


def test_dash_reads_the_documents_from_stdin(capsys, monkeypatch):
    text = yaml.safe_dump(named("from-stdin"))
    code, out, err = run(capsys, "validate", "-", stdin=text, monkeypatch=monkeypatch)
    assert code == 0, err
    assert "<stdin>: GRPOLoraJob default/from-stdin is valid" in out
    code, out, err = run(capsys, "render", "-f", "-", stdin=text, monkeypatch=monkeypatch)
    assert code == 0, err
    assert any(o["kind"] == "Job" for o in yaml.safe_load_all(out))


def test_a_kind_list_is_read_item_by_item(tmp_path, capsys):
    pool, job = yaml.safe_load(POOL.read_text()), yaml.safe_load(JOB.read_text())
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [pool, job]}))
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0, err
    assert "RolloutPool rl/qwen3-shared is valid" in out and "GRPOLoraJob rl/sweep-lr-1e-5 is valid" in out
    # A problem inside an item names the item and the line of the file.
    job["spec"]["grpo"]["steps"] = -1
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [pool, job]}, sort_keys=False))
    code, out, err = run(capsys, "validate", str(path))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "steps: -1" in text)
    assert code == 1
    assert f"{path}: line {line}: items[1].spec.grpo.steps: " in err


def test_the_same_job_twice_is_refused_naming_both_places(tmp_path, capsys):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(yaml.safe_dump_all([named("twice"), named("other")]))
    second.write_text(yaml.safe_dump(named("twice")))
    code, out, err = run(capsys, "validate", str(first), str(second))
    assert code == 1
    assert (
        f"{second}: GRPOLoraJob default/twice: also in {first} (document 1); a kind's names are unique in a "
        "namespace, so one would replace the other"
    ) in err
    assert "default/twice is valid" not in out.replace(f"{first}: GRPOLoraJob default/twice is valid", "")
    # The same name in another namespace is another job.
    second.write_text(yaml.safe_dump(named("twice", namespace="team-b")))
    code, _, err = run(capsys, "validate", str(first), str(second))
    assert code == 0, err


def test_a_pool_of_another_namespace_is_named(tmp_path, capsys):
    job = yaml.safe_load(JOB.read_text())
    job["metadata"]["namespace"] = "team-b"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    for command in ("validate", "render"):
        code, _, err = run(capsys, command, str(POOL), str(path))
        assert code == 1, command
        assert (
            f"{path}: GRPOLoraJob team-b/sweep-lr-1e-5: spec.inference.poolRef: RolloutPool qwen3-shared is in "
            "namespace rl, not team-b: a job attaches only to a pool of its own namespace"
        ) in err


@pytest.mark.parametrize("written", ["1e3", "2E+2", "-1e1"])
def test_a_yaml_1_1_number_string_is_named_as_such(tmp_path, capsys, written):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(named("big", grpo={"steps": 3})).replace("steps: 3", f"steps: {written}"))
    assert f"steps: {written}" in path.read_text()
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    value = float(written)
    assert (
        f"spec.grpo.steps: `{written}` is a string in YAML 1.1, which reads a number with an exponent only with a "
        f"dot (`{value:.1e}`); write {value:g}"
    ) in err


def without_checkpoint_volume(tmp_path):
    """The pool example's job without its checkpoint volume: valid, with warnings (outputs and checkpoints would be
    lost with the pod)."""
    job = yaml.safe_load(JOB.read_text())
    del job["spec"]["checkpoint"]
    path = tmp_path / "warned.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_validate_o_json_gives_every_problem_as_an_object(tmp_path, capsys):
    warned = without_checkpoint_volume(tmp_path)
    bad = named("bad")
    bad["spec"]["lora"] = {"rnk": 8}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all([bad], sort_keys=False))
    code, out, err = run(capsys, "validate", "-o", "json", str(warned), str(path))
    assert code == 1 and err == ""
    report = json.loads(out)
    good, wrong = report["items"]
    assert good | {"warnings": [], "notChecked": []} == {
        "file": str(warned),
        "kind": "GRPOLoraJob",
        "namespace": "rl",
        "name": "sweep-lr-1e-5",
        "valid": True,
        "errors": [],
        "warnings": [],
        "notChecked": [],
    }
    assert any(w["path"] == "spec.output" for w in good["warnings"])
    assert any("poolRef" in n["path"] for n in good["notChecked"])
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "rnk" in text)
    assert wrong["valid"] is False and wrong["file"] == str(path)
    assert {"path": "spec.lora.rnk", "line": line} | {"message": wrong["errors"][0]["message"]} in wrong["errors"]
    assert wrong["errors"][0]["message"].startswith("unknown field `rnk` (did you mean `rank`?)")
    assert report["valid"] is False
    # YAML carries the same report.
    code, out, _ = run(capsys, "validate", "-o", "yaml", str(warned), str(path))
    assert yaml.safe_load(out) == report


def test_validate_o_json_reports_an_unreadable_file_as_an_item(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    code, out, _ = run(capsys, "validate", "-o", "json", str(missing))
    assert code == 1
    (item,) = json.loads(out)["items"]
    assert item["file"] == str(missing) and item["valid"] is False
    assert item["errors"] == [{"path": "", "line": None, "message": "cannot read file: No such file or directory"}]


def test_render_o_json_prints_a_list(capsys):
    code, out, err = run(capsys, "render", "-o", "json", str(POOL), str(JOB))
    assert code == 0, err
    rendered = json.loads(out)
    assert rendered["apiVersion"] == "v1" and rendered["kind"] == "List"
    code, out, _ = run(capsys, "render", str(POOL), str(JOB))
    assert rendered["items"] == list(yaml.safe_load_all(out))


def test_strict_makes_warnings_fail(tmp_path, capsys):
    warned = without_checkpoint_volume(tmp_path)
    code, _, err = run(capsys, "validate", "--strict", str(POOL), str(warned))
    assert code == 1
    assert ": spec.output: no persistent location" in err and "warning: line " in err
    code, _, _ = run(capsys, "validate", str(POOL), str(warned))
    assert code == 0
    quiet = yaml.safe_load(JOB.read_text())
    quiet["spec"]["trainer"]["resources"] = {"requests": {"memory": "16Gi"}}
    path = tmp_path / "quiet.yaml"
    path.write_text(yaml.safe_dump(quiet))
    code, _, err = run(capsys, "validate", "--strict", str(POOL), str(path))  # nothing to warn about
    assert code == 0, err


def test_a_job_without_a_task_is_warned_about(tmp_path, capsys):
    doc = named("no-task")
    doc["spec"].pop("task", None)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    code, _, err = run(capsys, "validate", str(path))
    assert code == 0
    assert ": spec.task: not set: the job trains on the built-in `arithmetic` task" in err and "warning: line " in err


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_completes_commands_and_options(capsys):
    code, script, _ = run(capsys, "completion", "bash")
    assert code == 0

    def complete(*words: str) -> list[str]:
        line = " ".join(("grpolora", *words))
        shell = (
            f"{script}\nCOMP_WORDS=(grpolora {' '.join(words)}); COMP_CWORD={len(words)}; COMP_LINE='{line}'; "
            "_grpolora_complete; printf '%s\\n' \"${COMPREPLY[@]}\""
        )
        done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert complete("va") == ["validate"]
    assert set(complete("")) >= {"validate", "render", "run", "crd", "completion"}
    assert {"--strict", "--output", "--filename"} <= set(complete("validate", "--"))
    assert complete("crd", "--kind", "R") == ["RolloutPool"]
    assert complete("completion", "") == ["bash", "zsh"]


def test_zsh_completion_is_the_bash_one_through_bashcompinit(capsys):
    code, script, _ = run(capsys, "completion", "zsh")
    assert code == 0
    assert "bashcompinit" in script and "complete -o filenames -F _grpolora_complete grpolora" in script
    with pytest.raises(SystemExit) as refused:  # argparse: an invalid choice is a usage error
        main(["completion", "fish"])
    assert refused.value.code == 2 and "invalid choice: 'fish'" in capsys.readouterr().err
