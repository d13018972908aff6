"""How `grpolora run` reads its workers' exits, without starting any: a follower trainer rank leaves as soon as the
final collective is done, while rank 0 still writes the final adapter; that is the run ending, not a failure."""

from __future__ import annotations

from grpolora.api.load import parse_job
from grpolora.workers.launcher import local
from grpolora.workers.launcher.local import LocalRun, Worker
from tests.helpers import job_doc


class ScriptedRun(LocalRun):
    """Exit codes come from a script, one list per poll (inference 0, trainer 0, trainer 1)."""

    def __init__(self, tmp_path, polls):
        job = parse_job(job_doc(trainer={"replicas": 2, "gpusPerReplica": 0}, inference={"gpusPerReplica": 0}))
        super().__init__(job, tmp_path, ray_address=None, show_progress=False)
        self.workers = [
            Worker("inference", 0, 0, tmp_path / "i0.log"),
            *(Worker("trainer", i, 0, tmp_path / f"t{i}.log") for i in range(2)),
        ]
        self._polls = iter(polls)

    def _exit_codes(self):
        return next(self._polls)


def test_a_follower_rank_that_finished_first_is_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    run = ScriptedRun(tmp_path, [[None, None, None], [None, None, 0], [None, None, 0], [None, 0, 0]])
    run.wait()  # returns once trainer 0 is done; raised RunFailed("trainer 1 exited with code 0") before
