"""Which adapter versions an inference engine keeps loaded under grpo.maxStaleness = k: the newest k + 1 (live
included), which buffered and in-flight work may still ask for, plus any version a request is still running on;
the rest go as soon as their last request ends. Version 0 is the base model: nothing to unload."""

from __future__ import annotations

import pytest

from grpolora.api.spec import min_lora_slots
from grpolora.workers.inference.engine import EngineConfig, config_for, versions_to_unload
from tests.helpers import job_doc


@pytest.mark.parametrize(
    ("loaded", "live", "leases", "kept", "unload"),
    [
        # k = 0 (keep 1): the previous version goes once idle, stays while a request runs on it.
        ({4, 5}, 5, {}, 1, [4]),
        ({4, 5}, 5, {4: 2}, 1, []),
        # k = 2 (keep 3): live 7 keeps 5, 6, 7; 4 goes, 3 stays for its running request.
        ({3, 4, 5, 6, 7}, 7, {3: 1}, 3, [4]),
        ({5, 6, 7}, 7, {}, 3, []),
        # A late request's lease on the live version or inside the window changes nothing.
        ({2, 3}, 3, {3: 1, 2: 1}, 2, []),
        # The base model (0) is never unloaded; an empty engine has nothing to unload.
        ({0, 1}, 1, {}, 1, []),
        (set(), 0, {}, 1, []),
    ],
)
def test_versions_to_unload(loaded, live, leases, kept, unload):
    assert versions_to_unload(loaded, live=live, leases=leases, kept=kept) == unload


def test_engine_keeps_k_plus_one_versions_in_its_slots():
    spec = job_doc(grpo={"maxStaleness": 2}, inference={"maxLoras": 3, "gpusPerReplica": 0})
    from grpolora.api.load import parse_job

    config = config_for(parse_job(spec).spec, "model")
    assert isinstance(config, EngineConfig)
    assert (config.kept_versions, config.max_loras) == (3, 3)
    assert min_lora_slots(0) == min_lora_slots(1) == 2 and min_lora_slots(2) == 3
