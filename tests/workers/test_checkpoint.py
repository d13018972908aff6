"""Checkpoints refuse what they must not load: pickled code in the state file, and an adapter that does not fit
the model (by name or shape), on one rank and on sharded FSDP2 ranks; and they bring every RNG back."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from grpolora.workers.trainer import checkpoint
from grpolora.workers.trainer.step import make_optimizer
from tests.workers.ranks import SPEC, new_policy, outcome_file, renamed, tamper


def with_extra(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return tensors | {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4)}


def reshaped(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    first = sorted(tensors)[0]
    return tensors | {first: tensors[first][:4]}


class _Payload:
    """What a hostile or corrupted state file could hold: unpickling it runs a call (here: touch a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    policy = new_policy()
    folder = checkpoint.save(root, policy.model, make_optimizer(policy, SPEC.grpo), checkpoint.Progress(step=3), 1)
    return root, folder


def test_the_state_file_is_loaded_without_running_pickled_code(saved, tmp_path):
    _, folder = saved
    hostile = shutil.copytree(folder, tmp_path / "step-00000003")
    state = torch.load(hostile / checkpoint.STATE_FILE, weights_only=True)
    marker = tmp_path / "code-ran"
    state["extra"] = _Payload(marker)
    torch.save(state, hostile / checkpoint.STATE_FILE)
    policy = new_policy()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.restore(hostile, policy.model, make_optimizer(policy, SPEC.grpo))
    assert not marker.exists()


@pytest.mark.parametrize("edit", [renamed, with_extra, reshaped])
def test_an_adapter_that_does_not_fit_is_refused(saved, tmp_path, edit):
    _, folder = saved
    bad = tamper(folder, tmp_path / "bad", edit)
    policy = new_policy()
    with pytest.raises(ValueError, match="does not fit this model's LoRA adapter"):
        checkpoint.restore(bad, policy.model, make_optimizer(policy, SPEC.grpo))


def test_rng_states_come_back(tmp_path):
    import random

    policy = new_policy()
    optimizer = make_optimizer(policy, SPEC.grpo)
    checkpoint.save(tmp_path, policy.model, optimizer, checkpoint.Progress(step=1), 1)
    expected = (torch.rand(3), random.random(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])
    torch.manual_seed(123)
    random.seed(123)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(123)
    checkpoint.restore(checkpoint.latest(tmp_path), policy.model, optimizer)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    state = torch.load(checkpoint.latest(tmp_path) / checkpoint.STATE_FILE, weights_only=True)
    assert ("cuda" in state["rng"]) == torch.cuda.is_available()
    if torch.cuda.is_available():  # the state restored is the one saved
        assert all(torch.equal(a, b) for a, b in zip(state["rng"]["cuda"], expected[2], strict=True))


def test_a_sharded_restore_refuses_a_renamed_tensor(two_ranks):
    # tests/workers/ranks.py: both FSDP2 ranks restore a sharded checkpoint with one tensor renamed.
    for rank in (0, 1):
        outcome = (two_ranks / outcome_file(rank)).read_text()
        assert "does not fit this model's LoRA adapter" in outcome and "layers.1000." in outcome, outcome
