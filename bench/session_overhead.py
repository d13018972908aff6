"""What a chat session's endpoint adds to a generate (issue 48, item 5): one session turn through
`POST /sessions/<id>/v1/chat/completions` against `POST /v1/generate` of the same prompt ids, on the same real
inference server, in one run:

    python bench/session_overhead.py [--repeats 16] [--max-tokens 32] [--fixed-repeats 16]
                                     [--out bench/results/session_overhead.json]

The server is the real one (`grpolora worker inference`, a process of its own started from the env contract as in a
pod: grpolora/testing/servers.py), on a vLLM CPU engine with SmolLM2-135M-Instruct (float32, maxModelLen 512, as
examples/calculator-episodes.yaml serves it). Both paths go through HTTP with the same client (httpx, keep-alive),
both at temperature 0 with the same seed and --max-tokens, so that both generate the same tokens (checked: a run
whose ids differ stops); the session's turn also renders the messages with the model's chat template (the first
turn: the whole opening; the second: only the new message, as a suffix of the session's ids), records the call and
parses the answer. Each repetition opens a new session and times each of its two turns next to the generate of the
same prompt ids, alternating which of the two goes first. The verdict holds each turn's median of the paired ratios
(session / generate, each pair timed within seconds) against the goal of an overhead of at most 10 % (<= 1.10);
beside it, the ratio of the two paths' median seconds, and the API process's CPU time per call of each path (/proc;
vLLM's EngineCore is a process of its own), which a busy machine disturbs far less than wall time. A second set of
turns with --max-tokens 1 shows the fixed cost alone (the generation's share is smallest there; no goal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: the repo's operator/ must not shadow stdlib

import httpx

from grpolora.testing.servers import TOKEN, ServerProcess, cpu_seconds, tiny_cpu_job

ROOT = Path(__file__).resolve().parents[1]
MODEL = "offline:smollm2-135m-instruct"
GOAL = 1.10
QUESTION = (
    "You are helping a student plan a week of study for an exam in linear algebra. They have two hours each "
    "evening. Suggest what to cover on Monday, in one sentence."
)
FOLLOW_UP = "And on Tuesday?"


SERVER_PID: list[int] = []  # the API process (`grpolora worker inference`; vLLM's EngineCore is a process below it)


def turn(http: httpx.Client, url: str, body: dict) -> tuple[float, float, dict]:
    """One call: its wall seconds and the API process's CPU seconds meanwhile (clock ticks: 10 ms)."""
    cpu, started = cpu_seconds(SERVER_PID[0]), time.perf_counter()
    answer = http.post(url, json=body)
    seconds, cpu = time.perf_counter() - started, cpu_seconds(SERVER_PID[0]) - cpu
    answer.raise_for_status()
    return seconds, cpu, answer.json()


def one_repeat(http: httpx.Client, base: str, sid: str, max_tokens: int, session_first: bool, prompts: list) -> dict:
    """A new session's two turns, each next to the generate of the same prompt ids (`prompts`, from the warm-up),
    the session's call first or second as asked: a pair is timed within a few seconds, so that the machine's load
    changes little between its two halves."""
    chat_url = f"{base}/sessions/{sid}/v1/chat/completions"
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "seed": 1}
    times: dict[str, list[float]] = {"session": [], "generate": []}
    cpu: dict[str, list[float]] = {"session": [], "generate": []}
    generated: list[list[int]] = []
    chat = [{"role": "user", "content": QUESTION}]
    for ids in prompts:

        def session_turn() -> None:
            seconds, used, answer = turn(http, chat_url, {"messages": chat, **sampling})
            times["session"].append(seconds)
            cpu["session"].append(used)
            chat.extend([answer["choices"][0]["message"], {"role": "user", "content": FOLLOW_UP}])

        def generate(ids: list[int] = ids) -> None:
            seconds, used, answer = turn(http, f"{base}/v1/generate", {"prompt_token_ids": [ids], "n": 1, **sampling})
            times["generate"].append(seconds)
            cpu["generate"].append(used)
            generated.append(answer["results"][0]["samples"][0]["token_ids"])

        for step in (session_turn, generate) if session_first else (generate, session_turn):
            step()
    record = http.post(f"{base}/sessions/{sid}/close").json()
    assert [call["segment"] for call in record["calls"]] == [0, 0], "the second turn did not continue the ids"
    assert [call["prompt_token_ids"] for call in record["calls"]] == prompts, "the session's prompt ids changed"
    assert [call["completion_token_ids"] for call in record["calls"]] == generated, "the paths generated other ids"
    return {
        "first": "session" if session_first else "generate",
        "session_s": [round(s, 4) for s in times["session"]],
        "generate_s": [round(s, 4) for s in times["generate"]],
        "session_api_cpu_s": cpu["session"],
        "generate_api_cpu_s": cpu["generate"],
        "prompt_tokens": [len(ids) for ids in prompts],
        "completion_tokens": [len(ids) for ids in generated],
    }


def learn_prompts(http: httpx.Client, base: str, sid: str, max_tokens: int) -> list[list[int]]:
    """A warm-up session: its two turns' prompt ids (greedy, so every repetition's are the same)."""
    chat_url = f"{base}/sessions/{sid}/v1/chat/completions"
    chat = [{"role": "user", "content": QUESTION}]
    for _ in range(2):
        *_, answer = turn(http, chat_url, {"messages": chat, "temperature": 0.0, "max_tokens": max_tokens, "seed": 1})
        chat += [answer["choices"][0]["message"], {"role": "user", "content": FOLLOW_UP}]
    record = http.post(f"{base}/sessions/{sid}/close").json()
    return [call["prompt_token_ids"] for call in record["calls"]]


def verdicts(runs: list[dict]) -> dict:
    out = {}
    for index, name in enumerate(("first_turn", "second_turn")):
        session = statistics.median(r["session_s"][index] for r in runs)
        generate = statistics.median(r["generate_s"][index] for r in runs)
        paired = statistics.median(r["session_s"][index] / r["generate_s"][index] for r in runs)
        ratio = session / generate
        # The API process's CPU time per call, averaged over the repetitions (its clock ticks are 10 ms): what the
        # session path makes that process do beyond a generate, whatever else the machine runs meanwhile.
        cpu_session = statistics.fmean(r["session_api_cpu_s"][index] for r in runs)
        cpu_generate = statistics.fmean(r["generate_api_cpu_s"][index] for r in runs)
        out[name] = {
            "median_session_s": round(session, 4),
            "median_generate_s": round(generate, 4),
            "overhead_ms": round(1000 * (session - generate), 1),
            "ratio": round(ratio, 3),
            "median_paired_ratio": round(paired, 3),
            "min_session_s": round(min(r["session_s"][index] for r in runs), 4),
            "min_generate_s": round(min(r["generate_s"][index] for r in runs), 4),
            "api_cpu_ms_session": round(1000 * cpu_session, 1),
            "api_cpu_ms_generate": round(1000 * cpu_generate, 1),
            "api_cpu_overhead_share": round((cpu_session - cpu_generate) / generate, 4),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--fixed-repeats", type=int, default=16, help="repetitions at --max-tokens 1 (0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "session_overhead.json")
    args = parser.parse_args()

    job = tiny_cpu_job(model={"name": MODEL, "dtype": "float32"}, inference={"maxModelLen": 512})
    log_dir = Path(tempfile.mkdtemp(prefix="session-overhead-"))
    server = ServerProcess(job, 0, log_dir)
    SERVER_PID.append(server.proc.pid)
    base = job.inference_endpoints[0]
    started = time.perf_counter()
    try:
        server.wait_healthy(timeout=600)
        print(f"server up after {time.perf_counter() - started:.0f}s", flush=True)
        results: dict[str, dict] = {}
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http:
            for label, max_tokens, repeats in (("turn", args.max_tokens, args.repeats),
                                               ("fixed_cost", 1, args.fixed_repeats)):  # fmt: skip
                if repeats == 0:
                    continue
                prompts = learn_prompts(http, base, f"warm-{label}", max_tokens)
                runs = []
                for repeat in range(repeats):
                    run = one_repeat(http, base, f"{label}-{repeat}", max_tokens, repeat % 2 == 0, prompts)
                    runs.append(run)
                    print(json.dumps({"set": label, "repeat": repeat, **run}), flush=True)
                results[label] = {"max_tokens": max_tokens, "runs": runs, "verdicts": verdicts(runs)}
    finally:
        server.stop()
    turns = results["turn"]["verdicts"]
    # The verdict is on the paired ratios: each pair is timed within seconds, while the machine's load (other work
    # on its 2 cores) can change several-fold between pairs and move one path's median more than the other's.
    worst = max(v["median_paired_ratio"] for v in turns.values())
    result = {
        "command": "python " + " ".join(sys.argv),
        "model": MODEL,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sets": results,
        "goal": GOAL,
        "worst_paired_ratio": worst,
        "verdict": "met" if worst <= GOAL else "missed",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({label: r["verdicts"] for label, r in results.items()}, indent=2))
    print(json.dumps({"worst_paired_ratio": worst, "goal": GOAL, "verdict": result["verdict"]}))


if __name__ == "__main__":
    main()
