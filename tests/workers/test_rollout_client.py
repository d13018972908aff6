"""The trainer's rollout client against the real inference API (fake generation, real version leasing): a replica
that moved past the asked version serves its live one and says so; a refused request is an error, not a dead
replica; a dead replica's share goes to the others."""

from __future__ import annotations

import pytest

from grpolora.workers.trainer.rollout import RequestRefused, RolloutClient, RolloutError, Sampling
from tests.workers.fakeengine import TOKEN, fake_servers
from tests.workers.syncfakes import free_port

SAMPLING = Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=4)
PROMPTS = [[5, 6], [7, 8], [9, 10], [11, 12]]


def test_a_replica_past_the_asked_version_serves_its_live_one_and_says_which(tmp_path):
    """Pipelined mode with a slow replica: the retry for version 1 comes after version 2 went live."""
    with fake_servers(tmp_path, 2) as servers:
        servers[0].engine.set_live(1)
        servers[1].engine.set_live(2)  # version 1 is no longer served there: 409
        client = RolloutClient([s.url for s in servers], TOKEN, timeout_seconds=10)
        results = client.generate(PROMPTS, SAMPLING, version=1, replicas=[0, 1])
        client.close()
    assert [[c.token_ids for c in group] for group in results] == [[[p[-1] + 1], [p[-1] + 2]] for p in PROMPTS]
    # Prompts 0 and 2 went to replica 0 (version 1), 1 and 3 to replica 1, which served version 2.
    assert [{c.version for c in group} for group in results] == [{1}, {2}, {1}, {2}]


def test_a_replica_behind_the_asked_version_is_treated_as_failed(tmp_path):
    with fake_servers(tmp_path, 2, version_wait_seconds=0.5) as servers:
        servers[0].engine.set_live(3)
        servers[1].engine.set_live(2)  # never reaches 3 within its wait: its share goes to replica 0
        client = RolloutClient([s.url for s in servers], TOKEN, timeout_seconds=10)
        results = client.generate(PROMPTS, SAMPLING, version=3, replicas=[0, 1])
        client.close()
    assert all(c.version == 3 for group in results for c in group) and len(results) == 4


def test_a_refused_request_is_raised_with_the_reason_not_retried_elsewhere(tmp_path):
    with fake_servers(tmp_path, 2) as servers:
        client = RolloutClient([s.url for s in servers], TOKEN, timeout_seconds=10)
        bad = Sampling(n=0, temperature=1.0, top_p=1.0, max_tokens=4)  # n >= 1: a 422 from the API
        with pytest.raises(RequestRefused, match=r"refused the request: .*\bn\b"):
            client.generate(PROMPTS, bad, version=0, replicas=[0, 1])
        client.close()


def test_a_dead_replica_loses_its_share_to_the_others_and_all_dead_names_each(tmp_path):
    with fake_servers(tmp_path, 1) as servers:
        dead = f"http://127.0.0.1:{free_port()}"
        client = RolloutClient([servers[0].url, dead], TOKEN, timeout_seconds=5)
        results = client.generate(PROMPTS, SAMPLING, version=0, replicas=[0, 1])
        assert len(results) == 4 and all(c.version == 0 for group in results for c in group)
        with pytest.raises(
            RolloutError, match=r"every replica failed to generate .*replica 1 \(http://127.0.0.1:\d+\): ConnectError"
        ):
            client.generate(PROMPTS, SAMPLING, version=0, replicas=[1])
        client.close()


def test_replicas_of_a_scaled_pool_are_reached_by_the_urls_the_sender_follows(tmp_path):
    """The trainer started with one endpoint; the pool scaled to two (the sender's members follow it, and the client
    asks the sender for their URLs): the new replica gets its share. A replica that left (scaled down: no URL any
    more) loses its share to the others."""
    with fake_servers(tmp_path, 2) as servers:
        members = {0: servers[0].url, 1: servers[1].url}
        client = RolloutClient([servers[0].url], TOKEN, timeout_seconds=10, endpoint_of=members.get)
        results = client.generate(PROMPTS, SAMPLING, version=0, replicas=[0, 1])
        assert len(results) == 4 and [len(s.engine.requests) for s in servers] == [2, 2]
        del members[1]
        results = client.generate(PROMPTS, SAMPLING, version=0, replicas=[0, 1])
        assert len(results) == 4 and [len(s.engine.requests) for s in servers] == [6, 2]
        client.close()
