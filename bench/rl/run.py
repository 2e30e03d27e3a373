#!/usr/bin/env python3
"""bench/rl: seconds per GRPO step, agentstack vs TRL's GRPOTrainer, in one run.

Both train SmolLM2-135M-Instruct (the Q4_1 GGUF) with the same step: one prompt x 8
samples, <= 32 new tokens, LoRA r 8 on q_proj/v_proj, one optimizer step (see
agentstack.toml and trl_grpo.py). Reports the mean of steps 2..N, the share spent
generating, and the ratio; with --write-results appends the table to bench/RESULTS.md.

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
parser.add_argument("--write-results")
args = parser.parse_args()

load_before = os.getloadavg()
rows = []
for threads in args.threads:
    # TRL.
    t = time.perf_counter()
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
    rows.append({
        "who": f"TRL {json.loads(json.dumps(trl['torch']))} (fp32 rollouts)",
        "threads": threads,
        "step": statistics.mean(steps),
        "sd": statistics.stdev(steps) if len(steps) > 1 else 0.0,
        "gen": statistics.mean(gen),
        "learn": statistics.mean(s - g for s, g in zip(steps, gen)),
        "wall": time.perf_counter() - t,
    })
    # agentstack, on quantized rollout weights (its default) and on the f32 weights.
    for weights in args.weights:
        with tempfile.TemporaryDirectory() as tmp:
            config = open(os.path.join(HERE, "agentstack.toml")).read()
            config = config.replace("[rollout]\n", f"[rollout]\nweights = \"{weights}\"\n")
            config = config.replace('model = "SmolLM2-135M-Instruct.Q4_1.gguf"', f"model = {json.dumps(args.model)}")
            path = os.path.join(tmp, "bench.toml")
            open(path, "w").write(config)
            t = time.perf_counter()
            out = subprocess.run(
                [args.agentstack, "train", "grpo", "--config", path, "--runs-dir", tmp,
                 "--run-id", "bench", "--threads", str(threads), "--steps", str(args.steps)],
                capture_output=True, text=True,
            )
            if out.returncode != 0:
                sys.exit(f"agentstack failed:\n{out.stderr[-3000:]}")
            metrics = [json.loads(l) for l in open(os.path.join(tmp, "bench", "metrics.jsonl"))][1:]
        total = [m["generate_s"] + m["learn_s"] + m["sync_ms"] / 1e3 for m in metrics]
        rows.append({
            "who": f"agentstack ({weights} rollouts)",
            "threads": threads,
            "step": statistics.mean(total),
            "sd": statistics.stdev(total) if len(total) > 1 else 0.0,
            "gen": statistics.mean(m["generate_s"] for m in metrics),
            "learn": statistics.mean(m["learn_s"] for m in metrics),
            "sync_ms": statistics.mean(m["sync_ms"] for m in metrics),
            "tokens": statistics.mean(m["completion_len"] for m in metrics),
            "wall": time.perf_counter() - t,
        })
load_after = os.getloadavg()

lines = [
    "| framework | threads | s/step (mean ± sd, steps 2–%d) | generation s | learning s | generation share | vs TRL |" % args.steps,
    "|:--|--:|--:|--:|--:|--:|--:|",
]
for r in rows:
    trl = next(x for x in rows if x["threads"] == r["threads"] and x["who"].startswith("TRL"))
    lines.append(
        f"| {r['who']} | {r['threads']} | {r['step']:.2f} ± {r['sd']:.2f} | {r['gen']:.2f} | {r['learn']:.2f} | "
        f"{100 * r['gen'] / r['step']:.0f}% | {r['step'] / trl['step']:.2f}× |"
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
