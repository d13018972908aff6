"""The files `grpolora run` is given: one job, or a RolloutPool and its jobs (and the runtimes they name), read as
`grpolora validate` reads them, and why they cannot run together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from grpolora.api.load import InvalidJob, load_documents
from grpolora.api.plan import LoopbackNetwork, PoolMismatch, plan
from grpolora.api.runtime import resolve_given, runtimes_by_key
from grpolora.api.spec import GRPOLoraJob, RolloutPool


@dataclass
class RunFiles:
    """What `grpolora run` was given: the jobs (each with the file it came from, resolved on its runtime) and at most
    one RolloutPool."""

    jobs: list[tuple[str, GRPOLoraJob]] = field(default_factory=list)
    pools: list[tuple[str, RolloutPool]] = field(default_factory=list)


def read_run_files(paths: Sequence[str]) -> RunFiles:
    """Every document of every file, a RolloutPool or a GRPOLoraJob, read as `grpolora validate` reads them;
    InvalidJob listing the problems of a file. A job that names a runtime runs merged with it (one of the files must
    hold it)."""
    found = RunFiles()
    loaded = [(path, load_documents(path)) for path in paths]
    runtimes = runtimes_by_key(d for _, documents in loaded for d in documents)
    for path, documents in loaded:
        for document in documents:
            if isinstance(document, RolloutPool):
                found.pools.append((path, document))
            elif isinstance(document, GRPOLoraJob):
                try:
                    found.jobs.append((path, resolve_given(document, runtimes, source=path, command="run")))
                except InvalidJob as exc:
                    raise InvalidJob(exc.problems, path) from None
    return found


def run_problems(files: RunFiles) -> list[str]:
    """Why these files cannot run together, each naming a file and a field; empty when they can. On a pool, every
    job must fit it (grpolora.api.pool.fit_errors, through plan()) before anything starts."""
    if not files.jobs:
        return ["no GRPOLoraJob in the files given; `grpolora run` runs one job, or a RolloutPool and its jobs"]
    if len(files.pools) > 1:
        return [
            f"{path}: RolloutPool {p.name}: a run has one RolloutPool; give one pool file" for path, p in files.pools
        ]
    problems: list[str] = []
    seen: dict[str, str] = {}
    for path, job in files.jobs:
        if job.name in seen:
            problems.append(
                f"{path}: metadata.name: {job.name} is also the name of a job in {seen[job.name]}; each job's "
                "results go to <run-dir>/<job name>/, so give each job a name of its own"
            )
        seen.setdefault(job.name, path)
    if not files.pools:
        sources = list(dict.fromkeys(p for p, _ in files.jobs))
        if len(files.jobs) > 1 and len(sources) == 1:
            problems.append(f"{sources[0]}: holds {len(files.jobs)} jobs; `grpolora run` runs one")  # as before pools
        elif len(files.jobs) > 1:
            problems.append(
                f"{', '.join(sources)}: {len(files.jobs)} jobs but no RolloutPool: "
                "jobs run together on a shared pool (grpolora run pool.yaml job-a.yaml job-b.yaml), or one at a time"
            )
        for path, job in files.jobs:
            if job.spec.inference.pool_ref is not None:
                problems.append(
                    f"{path}: spec.inference.poolRef.name: {job.name} runs on RolloutPool "
                    f"{job.spec.inference.pool_ref.name}; give that pool's file too: grpolora run pool.yaml {path}"
                )
        return problems
    ((pool_path, pool),) = files.pools
    for path, job in files.jobs:
        if job.spec.inference.pool_ref is None:
            problems.append(
                f"{path}: spec.inference.poolRef: not set, but this run serves its jobs from RolloutPool {pool.name} "
                f"({pool_path}); set inference.poolRef.name: {pool.name} (and none of inference's other fields)"
            )
            continue
        try:
            plan(job, LoopbackNetwork(), pool=pool)
        except PoolMismatch as exc:
            problems += [f"{path}: spec.{where}: {message} ({pool_path})" for where, message in exc.errors]
    return problems
