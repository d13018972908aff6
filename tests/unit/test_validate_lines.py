"""`grpolora validate` points at the line of each problem: errors in the order of their lines, and warnings with
their line too (the review: warnings carried none, errors came in pydantic's order)."""

from __future__ import annotations

import re

from grpolora.cli import main

BAD = """\
apiVersion: grpolora.dev/v1alpha1
kind: GRPOLoraJob
metadata: {name: bad, namespace: rl}
spec:
  model: {name: Qwen/Qwen3-0.6B}
  task: {name: arithmetic}
  grpo:
    steps: -1
  trainer:
    replicas: 0
  lora:
    rank: -3
  inference:
    replicas: 0
"""

WARNED = """\
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: ckpt, namespace: rl}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Gi}}}
---
apiVersion: grpolora.dev/v1alpha1
kind: GRPOLoraJob
metadata: {name: warned, namespace: rl}
spec:
  model: {name: Qwen/Qwen3-0.6B, dtype: bfloat16}
  task: {name: arithmetic}
  grpo:
    referenceFrom: inference
  trainer:
    gpusPerReplica: 1
  checkpoint:
    pvc: {claimName: ckpt}
"""


def lines_said(text: str) -> list[int]:
    return [int(n) for n in re.findall(r": line (\d+): ", text)]


def test_errors_are_listed_in_the_order_of_their_lines(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert lines_said(err) == [8, 10, 12, 14], err


def test_warnings_carry_the_line_of_their_field_in_line_order(tmp_path, capsys):
    path = tmp_path / "warned.yaml"
    path.write_text(WARNED)
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if ": warning: " in line]
    assert warnings, err
    said = {re.search(r"warning: line (\d+): (spec[\w.]*)", w).groups() for w in warnings}  # type: ignore[union-attr]
    # referenceFrom where it is written; a field nobody wrote inside its nearest written parent, as for errors
    # (the first line of the trainer's section; with no inference section, the spec's).
    assert ("13", "spec.grpo.referenceFrom") in said
    assert ("15", "spec.trainer.resources") in said
    assert ("10", "spec.inference.resources") in said
    in_order = lines_said("\n".join(warnings).replace("warning: line", "line"))  # the warnings among themselves
    assert in_order == sorted(in_order)
