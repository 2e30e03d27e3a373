#!/usr/bin/env python3
"""bench/inference/turn_ttft.py: time to first token of the last turn of a multi-turn
connect_four episode with the conversation's prefix in the engine's cache, against a
cold prefill of the same prompt (issue 25: goal <= 15%).

1. `agentstack eval --env connect_four` (SmolLM2, greedy, constrained actions, up to
   --turns turns) plays episodes; the longest is kept, with every turn's exact prompt
   and completion token ids from results.jsonl.
2. Per round, a fresh `model serve` (prefix cache on) is sent turns 1 .. N-1 as
   they were played (token-id prompts to /v1/completions, greedy, as many tokens as
   the turn generated; the episode's actions were constrained and the replay is not,
   so where they differ the cache holds the replay's tokens, and the report says how
   much of turn N's prompt the cache held), then turn N streamed: the time to its
   first chunk is the warm TTFT. A second server with
   `--prefix-cache-mib 0` gets turn N alone: the cold TTFT. Rounds alternate which
   server is asked first; both run with the same --threads.

    python3 bench/inference/turn_ttft.py --agentstack target/release/agentstack \
        --rounds 10 --write-results bench/RESULTS.md
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone

parser = argparse.ArgumentParser()
parser.add_argument("--agentstack", default="target/release/agentstack")
parser.add_argument(
    "--model",
    default=os.path.expanduser("~/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
)
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--turns", type=int, default=10, help="turns of the episode (at most)")
parser.add_argument("--episodes", type=int, default=8, help="episodes played to find a long one")
parser.add_argument("--rounds", type=int, default=10)
parser.add_argument("--write-results")
args = parser.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=300):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=timeout)


def serve(prefix_cache_mib):
    port = free_port()
    command = [
        args.agentstack, "model", "serve", args.model, "--host", "127.0.0.1",
        "--port", str(port), "--threads", str(args.threads),
        "--prefix-cache-mib", str(prefix_cache_mib),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    sys.exit("model serve did not start")


def complete(url, prompt, max_tokens):
    with post(url + "/v1/completions", {
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
    }) as r:
        body = json.load(r)
    return body["usage"]


def first_chunk(url, prompt):
    """Seconds until the first streamed chunk of a completion of `prompt`."""
    started = time.perf_counter()
    with post(url + "/v1/completions", {
        "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
    }) as r:
        for line in r:
            if line.startswith(b"data: {"):
                took = time.perf_counter() - started
                break
        for _ in r:
            pass
    return took


# 1. A long episode, with its exact token ids.
runs = tempfile.mkdtemp()
best = None
for seed in range(args.episodes):
    run_id = f"episode-{seed}"
    subprocess.run([
        args.agentstack, "eval", "--env", "connect_four", "--model", args.model,
        "--constrain", "--options", '{"strength": 0}', "--max-turns", str(args.turns),
        "--max-tokens", "12", "--episodes", "1", "--seed", str(seed),
        "--runs-dir", runs, "--run-id", run_id,
        "--threads", str(args.threads),
    ], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(runs, run_id, "results.jsonl")) as f:
        for line in f:
            turns = [t for t in json.loads(line)["turns"] if "prompt_ids" in t]
            if best is None or len(turns) > len(best):
                best = turns
    if best and len(best) >= args.turns:
        break
n = len(best)
last = best[-1]["prompt_ids"]
print(f"episode of {n} turns; the last turn's prompt is {len(last)} tokens", file=sys.stderr)

# 2. Warm vs cold, alternating.
warm, cold, cached = [], [], []
for round_ in range(args.rounds):
    order = ["warm", "cold"] if round_ % 2 == 0 else ["cold", "warm"]
    for side in order:
        if side == "warm":
            if round_ == 0:
                # How much of the last prompt the cache holds after the replay (on a
                # server of its own: the probe itself fills the cache).
                process, url = serve(1024)
                try:
                    for turn in best[:-1]:
                        complete(url, turn["prompt_ids"], max(1, len(turn["completion_ids"])))
                    usage = complete(url, last, 1)
                    cached.append(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
                finally:
                    process.kill()
                    process.wait()
            process, url = serve(1024)
            try:
                for turn in best[:-1]:
                    complete(url, turn["prompt_ids"], max(1, len(turn["completion_ids"])))
                warm.append(first_chunk(url, last))
            finally:
                process.kill()
                process.wait()
        else:
            process, url = serve(0)
            try:
                complete(url, best[0]["prompt_ids"][:8], 1)  # a first call, as on the warm side
                cold.append(first_chunk(url, last))
            finally:
                process.kill()
                process.wait()
    print(f"round {round_ + 1}: warm {warm[-1] * 1000:.1f} ms, cold {cold[-1] * 1000:.1f} ms",
          file=sys.stderr)

ms = lambda xs: statistics.median(xs) * 1000
ratio = statistics.median(warm) / statistics.median(cold)
date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
section = f"""
## inference: time to first token of turn {n} of a connect_four episode, warm prefix vs cold prefill, {date}

`python3 bench/inference/turn_ttft.py --rounds {args.rounds} --threads {args.threads}`: SmolLM2-135M-Instruct Q4_1, `agentstack model serve` (release), one episode of {n} turns played greedily by `agentstack eval --env connect_four --constrain` (the longest of up to {args.episodes}); turn {n}'s prompt is {len(last)} tokens. Warm: a fresh server replays turns 1-{n - 1} as played, then turn {n} is streamed; {statistics.median(cached) if cached else 0:.0f} of its {len(last)} prompt tokens came from the cache. Cold: a server with `--prefix-cache-mib 0`. Medians over {args.rounds} alternating rounds.

| turn {n} TTFT | warm (prefix cached) | cold prefill | warm / cold |
|---|--:|--:|--:|
| ms, median | {ms(warm):.1f} | {ms(cold):.1f} | **{ratio:.1%}** (goal <= 15%) |
"""
print(section)
if args.write_results:
    with open(args.write_results, "a") as f:
        f.write(section)
