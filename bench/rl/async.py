#!/usr/bin/env python3
"""bench/rl/async.py: asynchronous (rollout.mode = "async", max_staleness = k) vs
synchronous GRPO at equal wall time, in one run.

Both sides train SmolLM2-135M-Instruct (the Q4_1 GGUF) with bench/rl/async.toml: the
`arithmetic` environment asked as a chat assistant, so answers run from ~10 tokens to
the 256-token limit (a long-tailed length mix), 2 prompts x 8 samples per step, LoRA
r 8 on every linear weight. Each run trains for --minutes of wall time
(`train --time-limit`), then evaluates the adapters on 64 held-out test tasks
(greedy). Sides alternate over --rounds. Reported per run and as async / sync ratios:
steps, samples and trained tokens per second (over the steps' wall time, step 1
included), the share of a synchronous step spent generating, the staleness of the
asynchronous side, and the held-out reward after the time with its 95% CI. With
--write-results the table goes to bench/RESULTS.md and the last round's reward curves
to bench/rl/async-{sync,async}-reward.png.

--sides picks the sides. `sync` and `async` run rollouts and learner in one process on
--threads threads. `sync-split` and `async-split` give the rollouts compute of their
own: an `agentstack model serve` process pinned (taskset) to --rollout-cpus plays them
(`rollout.servers`, adapters pushed after every step), and the trainer is pinned to
--learner-cpus. The split sides are how a run with a rollout box beside its trainer
is laid out; against `sync` they compare at equal total compute (verl's fully
asynchronous mode against its colocated synchronous one).

    python3 bench/rl/async.py --agentstack target/release/agentstack --minutes 7 \
        --rounds 2 --write-results bench/RESULTS.md
    python3 bench/rl/async.py --sides sync,sync-split,async-split --minutes 7 --rounds 2
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
parser = argparse.ArgumentParser()
parser.add_argument("--agentstack", default="target/release/agentstack")
parser.add_argument("--model", default=os.path.expanduser("~/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--minutes", type=float, default=7.0, help="wall time per run")
parser.add_argument("--staleness", type=int, default=2, help="max_staleness of the async side")
parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
parser.add_argument("--sides", default="sync,async", help="comma-separated: sync, async, sync-split, async-split")
parser.add_argument("--rollout-cpus", default="1", help="CPUs of the split sides' model server (taskset list)")
parser.add_argument("--learner-cpus", default="0", help="CPUs of the split sides' trainer (taskset list)")
parser.add_argument("--lr", type=float, default=2e-4,
                    help="learning rate; 1e-12 keeps the policy (and its answer lengths) as it starts, to time the pipeline alone")
parser.add_argument("--write-results")
args = parser.parse_args()
SIDES = args.sides.split(",")
for side in SIDES:
    if side not in ("sync", "async", "sync-split", "async-split"):
        sys.exit(f"--sides: unknown side `{side}`; the sides are sync, async, sync-split, async-split")
# The model servers' API key (they load adapters, so they ask for one); the trainer
# sends it from the same variable.
KEY = os.urandom(16).hex()


def cpu_count(cpus):
    """The number of CPUs in a taskset list such as `0`, `2-5` or `0,2`."""
    count = 0
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            sys.exit(f"`{cpus}` is not a CPU list; write one like 1, 2-5 or 0,2 (as taskset -c takes)")
        count += int(hi or lo) - int(lo) + 1
    return count


# Malformed CPU lists are refused before any run starts.
cpu_count(args.rollout_cpus), cpu_count(args.learner_cpus)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(runs_dir):
    """An `agentstack model serve` on --rollout-cpus that may load adapters from the
    runs directory; returns the process and its base URL once /health answers."""
    port = free_port()
    command = ["taskset", "-c", args.rollout_cpus, args.agentstack, "model", "serve", args.model,
               "--host", "127.0.0.1", "--port", str(port), "--threads", str(cpu_count(args.rollout_cpus)),
               "--adapter-dir", runs_dir, "--quiet"]
    env = dict(os.environ, AGENTSTACK_API_KEY=KEY)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if process.poll() is not None:
            sys.exit(f"agentstack model serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    sys.exit("agentstack model serve did not start in 120 s")


def config_text(side, server):
    text = open(os.path.join(HERE, "async.toml")).read()
    text = text.replace('model = "SmolLM2-135M-Instruct.Q4_1.gguf"', f"model = {json.dumps(args.model)}")
    assert "lr = 2e-4\n" in text
    text = text.replace("lr = 2e-4\n", f"lr = {args.lr!r}\n")
    rollout = "concurrency = 16\n"
    if side.startswith("async"):
        rollout += f'mode = "async"\nmax_staleness = {args.staleness}\n'
    if server:
        rollout += f"servers = [{json.dumps(server)}]\n"
    assert "concurrency = 16\n" in text
    return text.replace("concurrency = 16\n", rollout)


def run(side, tmp, index):
    split = side.endswith("-split")
    server, url = start_server(tmp) if split else (None, None)
    path = os.path.join(tmp, f"{side}.toml")
    open(path, "w").write(config_text(side, url))
    run_id = f"{side}-{index}"
    threads = cpu_count(args.learner_cpus) if split else args.threads
    command = [args.agentstack, "train", "grpo", "--config", path, "--runs-dir", tmp, "--run-id", run_id,
               "--threads", str(threads), "--time-limit", f"{args.minutes * 60:.0f}s", "--json", "--fresh"]
    if split:
        command = ["taskset", "-c", args.learner_cpus] + command
    try:
        out = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, AGENTSTACK_API_KEY=KEY))
    finally:
        if server:
            server.terminate()
            server.wait()
    if out.returncode != 0:
        sys.exit(f"{side} run failed:\n{out.stderr[-3000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    metrics = [json.loads(l) for l in open(os.path.join(tmp, run_id, "metrics.jsonl"))]
    wall = sum(m["step_s"] for m in metrics)
    r = {
        "mode": side,
        "dir": os.path.join(tmp, run_id),
        "steps": len(metrics),
        "wall": wall,
        "steps_per_min": len(metrics) / wall * 60,
        "samples_per_s": sum(m["samples"] for m in metrics) / wall,
        "tokens_per_s": sum(m["tokens"] for m in metrics) / wall,
        "completion_len": statistics.mean(m["completion_len"] for m in metrics),
        "generate_share": sum(m["generate_s"] for m in metrics) / wall,
        "learn_share": sum(m["learn_s"] for m in metrics) / wall,
        "reward_train": statistics.mean(m["reward_mean"] for m in metrics),
        "eval_before": report.get("eval_before"),
        "eval_after": report.get("eval_after"),
    }
    if side.startswith("async"):
        r["staleness"] = statistics.mean(m["staleness_mean"] for m in metrics)
        r["stale_masked"] = sum(m["stale_masked"] for m in metrics)
        r["partial"] = sum(m["partial_samples"] for m in metrics)
        r["trained_tokens"] = sum(m["tokens"] for m in metrics)
    print(json.dumps({k: v for k, v in r.items() if k != "dir"}), flush=True)
    return r


def fmt_eval(e):
    if not e:
        return "–"
    mean, (lo, hi) = e
    return f"{mean:.3f} ({lo:.3f}–{hi:.3f})"


started = datetime.now(timezone.utc)
load_start = os.getloadavg()
with tempfile.TemporaryDirectory() as tmp:
    results = []
    for round_ in range(args.rounds):
        order = SIDES if round_ % 2 == 0 else SIDES[::-1]
        results.append({side: run(side, tmp, round_) for side in order})
    last = results[-1]
    if args.write_results:
        for side in ("sync", "async"):
            png = os.path.join(last[side]["dir"], "reward.png") if side in last else ""
            if os.path.exists(png):
                shutil.copy(png, os.path.join(HERE, f"async-{side}-reward.png"))
load_end = os.getloadavg()

split_note = (
    f" Split sides: rollouts on one `agentstack model serve` pinned to CPUs {args.rollout_cpus} "
    f"(`--threads {cpu_count(args.rollout_cpus)}`, `rollout.servers`), the trainer pinned to CPUs {args.learner_cpus} "
    f"(`--threads {cpu_count(args.learner_cpus)}`)."
    if any(side.endswith("-split") for side in SIDES) else ""
)
lines = [
    f"## rl: asynchronous vs synchronous GRPO at equal wall time, {started:%Y-%m-%d %H:%M} UTC",
    "",
    f"- Command: `python3 bench/rl/async.py --agentstack {args.agentstack} --sides {args.sides} --minutes {args.minutes:g} --rounds {args.rounds} --threads {args.threads} --lr {args.lr:g}`; "
    f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} at start, {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} at end.",
    f"- Every side: SmolLM2-135M-Instruct (Q4_1 rollouts, f32 learner), bench/rl/async.toml: `arithmetic` difficulty 1 asked as a chat assistant (answers ~10 to 256 tokens), 2 prompts × 8 samples per step, LoRA r 8 on all linear weights, lr {args.lr:g}, TIS cap 2; "
    f"{args.minutes:g} min of training per run (`--time-limit`), then 64 held-out test tasks, greedy. Async: `mode = \"async\"`, `max_staleness = {args.staleness}`. Sides alternate; sync and async on {args.threads} threads in one process.{split_note}",
    "",
    "| round | side | steps | steps/min | samples/s | trained tokens/s | mean completion | generating / learning share of step time | staleness (mean), masked tokens, partial samples | held-out reward after (95% CI) |",
    "|--:|---|--:|--:|--:|--:|--:|--:|---|---|",
]
for i, sides in enumerate(results):
    for side in SIDES:
        r = sides[side]
        stale = f"{r['staleness']:.2f}, {r['stale_masked']}, {r['partial']}" if side.startswith("async") else "–"
        lines.append(
            f"| {i + 1} | {side} | {r['steps']} | {r['steps_per_min']:.2f} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['completion_len']:.1f} | "
            f"{r['generate_share']:.0%} / {r['learn_share']:.0%} | {stale} | {fmt_eval(r['eval_after'])} |"
        )
lines.append("")
for over, under in (("async", "sync"), ("async-split", "sync-split"), ("async-split", "sync")):
    if over in SIDES and under in SIDES:
        ratio = lambda key: ", ".join(f"{p[over][key] / p[under][key]:.2f}×" for p in results)
        lines.append(
            f"- {over} / {under}, per round: steps/min {ratio('steps_per_min')}; samples/s {ratio('samples_per_s')}; "
            f"trained tokens/s {ratio('tokens_per_s')}."
        )
lines += [
    f"- Held-out reward before training (the same base for every side): {fmt_eval(results[0][SIDES[0]]['eval_before'])}.",
    "",
]
text = "\n".join(lines)
print(text)
if args.write_results:
    with open(args.write_results, "a") as f:
        f.write("\n" + text + "\n")
