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

    python3 bench/rl/async.py --agentstack target/release/agentstack --minutes 7 \
        --rounds 2 --write-results bench/RESULTS.md
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
parser = argparse.ArgumentParser()
parser.add_argument("--agentstack", default="target/release/agentstack")
parser.add_argument("--model", default=os.path.expanduser("~/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--minutes", type=float, default=7.0, help="wall time per run")
parser.add_argument("--staleness", type=int, default=2, help="max_staleness of the async side")
parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
parser.add_argument("--write-results")
args = parser.parse_args()


def config_text(mode):
    text = open(os.path.join(HERE, "async.toml")).read()
    text = text.replace('model = "SmolLM2-135M-Instruct.Q4_1.gguf"', f"model = {json.dumps(args.model)}")
    if mode == "async":
        text = text.replace("concurrency = 16\n", f'concurrency = 16\nmode = "async"\nmax_staleness = {args.staleness}\n')
    return text


def run(mode, tmp, index):
    path = os.path.join(tmp, f"{mode}.toml")
    open(path, "w").write(config_text(mode))
    run_id = f"{mode}-{index}"
    out = subprocess.run(
        [args.agentstack, "train", "grpo", "--config", path, "--runs-dir", tmp, "--run-id", run_id,
         "--threads", str(args.threads), "--time-limit", f"{args.minutes * 60:.0f}s", "--json", "--fresh"],
        capture_output=True, text=True,
    )
    if out.returncode != 0:
        sys.exit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    metrics = [json.loads(l) for l in open(os.path.join(tmp, run_id, "metrics.jsonl"))]
    wall = sum(m["step_s"] for m in metrics)
    r = {
        "mode": mode,
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
    if mode == "async":
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
        order = ["sync", "async"] if round_ % 2 == 0 else ["async", "sync"]
        pair = {mode: run(mode, tmp, round_) for mode in order}
        results.append(pair)
    last = results[-1]
    curves = {mode: os.path.join(last[mode]["dir"], "reward.png") for mode in ("sync", "async")}
    if args.write_results:
        for mode, png in curves.items():
            if os.path.exists(png):
                shutil.copy(png, os.path.join(HERE, f"async-{mode}-reward.png"))
load_end = os.getloadavg()

ratio = lambda key: [p["async"][key] / p["sync"][key] for p in results]
lines = [
    f"## rl: asynchronous vs synchronous GRPO at equal wall time, {started:%Y-%m-%d %H:%M} UTC",
    "",
    f"- Command: `python3 bench/rl/async.py --agentstack {args.agentstack} --minutes {args.minutes:g} --rounds {args.rounds} --threads {args.threads}`; "
    f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} at start, {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} at end.",
    f"- Both: SmolLM2-135M-Instruct (Q4_1 rollouts, f32 learner), bench/rl/async.toml: `arithmetic` difficulty 1 asked as a chat assistant (answers ~10 to 256 tokens), 2 prompts × 8 samples per step, LoRA r 8 on all linear weights, lr 2e-4, TIS cap 2; "
    f"{args.minutes:g} min of training per run (`--time-limit`), then 64 held-out test tasks, greedy. Async: `mode = \"async\"`, `max_staleness = {args.staleness}`. Sides alternate; {args.threads} threads.",
    "",
    "| round | side | steps | steps/min | samples/s | trained tokens/s | mean completion | generating / learning share of step time | staleness (mean), masked tokens, partial samples | held-out reward after (95% CI) |",
    "|--:|---|--:|--:|--:|--:|--:|--:|---|---|",
]
for i, pair in enumerate(results):
    for mode in ("sync", "async"):
        r = pair[mode]
        stale = f"{r['staleness']:.2f}, {r['stale_masked']}, {r['partial']}" if mode == "async" else "–"
        lines.append(
            f"| {i + 1} | {mode} | {r['steps']} | {r['steps_per_min']:.2f} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['completion_len']:.1f} | "
            f"{r['generate_share']:.0%} / {r['learn_share']:.0%} | {stale} | {fmt_eval(r['eval_after'])} |"
        )
lines += [
    "",
    f"- async / sync, per round: steps/min {', '.join(f'{x:.2f}×' for x in ratio('steps_per_min'))}; "
    f"samples/s {', '.join(f'{x:.2f}×' for x in ratio('samples_per_s'))}; trained tokens/s {', '.join(f'{x:.2f}×' for x in ratio('tokens_per_s'))}.",
    f"- Held-out reward before training (the same base for both): {fmt_eval(results[0]['sync']['eval_before'])}.",
    "",
]
text = "\n".join(lines)
print(text)
if args.write_results:
    with open(args.write_results, "a") as f:
        f.write("\n" + text + "\n")
