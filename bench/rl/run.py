#!/usr/bin/env python3
"""bench/rl: seconds per GRPO step, agentstack vs TRL's GRPOTrainer, in one run.

Both train SmolLM2-135M-Instruct (the Q4_1 GGUF) with the same step: one prompt x 8
samples, <= 32 new tokens, LoRA r 8 on q_proj/v_proj, one optimizer step (see
agentstack.toml and trl_grpo.py). Runs each side --rounds times, alternating
them; reports the mean of steps 2..N over all rounds, the share spent generating, and
the ratio (overall and per round); with --write-results appends the table to bench/RESULTS.md.

    python3 bench/rl/run.py --agentstack target/release/agentstack \
        --python ~/.cache/agentstack/venv-trl-1.16.0/bin/python --threads 2 \
        --write-results bench/RESULTS.md
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
parser = argparse.ArgumentParser()
parser.add_argument("--agentstack", default="target/release/agentstack")
parser.add_argument("--python", default=os.path.expanduser("~/.cache/agentstack/venv-trl-1.16.0/bin/python"))
parser.add_argument("--model", default=os.path.expanduser("~/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
parser.add_argument("--threads", type=int, nargs="+", default=[2])
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--weights", nargs="+", default=["quantized", "f32"])
parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
parser.add_argument("--write-results")
args = parser.parse_args()

def run_trl(threads):
    out = subprocess.run(
        [args.python, os.path.join(HERE, "trl_grpo.py"), "--model", args.model,
         "--threads", str(threads), "--steps", str(args.steps)],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    if out.returncode != 0:
        sys.exit(f"TRL failed:\n{out.stderr[-3000:]}")
    trl = json.loads(out.stdout.strip().splitlines()[-1])
    steps = trl["step_s"][1:]
    gen = trl["generate_s"][1 : len(steps) + 1]
    return f"TRL {trl['torch']} (fp32 rollouts)", [
        {"step": s, "gen": g, "learn": s - g} for s, g in zip(steps, gen)
    ]


def run_agentstack(threads, weights):
    # agentstack, on quantized rollout weights (its default) or on the f32 weights.
    with tempfile.TemporaryDirectory() as tmp:
        config = open(os.path.join(HERE, "agentstack.toml")).read()
        config = config.replace("[rollout]\n", f"[rollout]\nweights = \"{weights}\"\n")
        config = config.replace('model = "SmolLM2-135M-Instruct.Q4_1.gguf"', f"model = {json.dumps(args.model)}")
        path = os.path.join(tmp, "bench.toml")
        open(path, "w").write(config)
        out = subprocess.run(
            [args.agentstack, "train", "grpo", "--config", path, "--runs-dir", tmp,
             "--run-id", "bench", "--threads", str(threads), "--steps", str(args.steps)],
            capture_output=True, text=True,
        )
        if out.returncode != 0:
            sys.exit(f"agentstack failed:\n{out.stderr[-3000:]}")
        metrics = [json.loads(l) for l in open(os.path.join(tmp, "bench", "metrics.jsonl"))][1:]
    return f"agentstack ({weights} rollouts)", [
        {
            "step": m["generate_s"] + m["learn_s"] + m["sync_ms"] / 1e3,
            "gen": m["generate_s"],
            "learn": m["learn_s"],
            "sync_ms": m["sync_ms"],
            "tokens": m["completion_len"],
        }
        for m in metrics
    ]


load_before = os.getloadavg()
# Rounds alternate the two sides (TRL, then agentstack), so that a shared machine's
# drift lands on both: each side's figures pool the measured steps of every round, and
# the ratio is also given per round.
runs = {}  # (who, threads) -> list of rounds, each a list of steps
order = []
for round_ in range(args.rounds):
    for threads in args.threads:
        jobs = [lambda t=threads: run_trl(t)] + [
            lambda t=threads, w=w: run_agentstack(t, w) for w in args.weights
        ]
        for job in jobs:
            who, steps = job()
            key = (who, threads)
            if key not in runs:
                runs[key] = []
                order.append(key)
            runs[key].append(steps)
            print(f"round {round_ + 1}: {who}, {threads} threads: "
                  f"{statistics.mean(s['step'] for s in steps):.2f} s/step", file=sys.stderr)
rows = []
for who, threads in order:
    pooled = [s for r in runs[(who, threads)] for s in r]
    row = {
        "who": who,
        "threads": threads,
        "step": statistics.mean(s["step"] for s in pooled),
        "sd": statistics.stdev(s["step"] for s in pooled) if len(pooled) > 1 else 0.0,
        "gen": statistics.mean(s["gen"] for s in pooled),
        "learn": statistics.mean(s["learn"] for s in pooled),
        "rounds": [statistics.mean(s["step"] for s in r) for r in runs[(who, threads)]],
    }
    if "sync_ms" in pooled[0]:
        row["sync_ms"] = statistics.mean(s["sync_ms"] for s in pooled)
        row["tokens"] = statistics.mean(s["tokens"] for s in pooled)
    rows.append(row)
load_after = os.getloadavg()

lines = [
    "| framework | threads | s/step (mean ± sd, steps 2–%d of %d rounds) | generation s | learning s | generation share | vs TRL | vs TRL, per round |"
    % (args.steps, args.rounds),
    "|:--|--:|--:|--:|--:|--:|--:|:--|",
]
for r in rows:
    trl = next(x for x in rows if x["threads"] == r["threads"] and x["who"].startswith("TRL"))
    per_round = " ".join(f"{a / b:.2f}×" for a, b in zip(r["rounds"], trl["rounds"]))
    lines.append(
        f"| {r['who']} | {r['threads']} | {r['step']:.2f} ± {r['sd']:.2f} | {r['gen']:.2f} | {r['learn']:.2f} | "
        f"{100 * r['gen'] / r['step']:.0f}% | {r['step'] / trl['step']:.2f}× | {per_round} |"
    )
table = "\n".join(lines)
print(table)
for r in rows:
    if "sync_ms" in r:
        print(f"{r['who']}: adapter sync to the engine {r['sync_ms']:.1f} ms/step, mean completion {r['tokens']:.1f} tokens")
if args.write_results:
    command = " ".join(shlex.quote(a) for a in sys.argv)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    extra = "\n".join(
        f"- {r['who']}: adapter sync to the rollout engine {r['sync_ms']:.1f} ms per step; mean completion {r['tokens']:.1f} tokens."
        for r in rows if "sync_ms" in r
    )
    with open(args.write_results, "a") as f:
        f.write(
            f"\n\n## rl: seconds per GRPO step vs TRL's GRPOTrainer, {stamp}\n\n"
            f"- Command: `python3 {command}`; load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} at start, "
            f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} at end.\n"
            f"- Both: SmolLM2-135M-Instruct (Q4_1 GGUF; TRL dequantizes it to fp32), one prompt × 8 samples per step at "
            f"temperature 1, ≤ 32 new tokens, LoRA r 8 / α 16 on q_proj and v_proj, AdamW lr 1e-5 linear, clip 1, "
            f"token-level loss, ε 0.2, no KL, one pass per batch (bench/rl/agentstack.toml, bench/rl/trl_grpo.py).\n"
            f"{extra}\n\n{table}\n"
        )
