#!/usr/bin/env python3
"""bench/inference/speculative.py: decode speed with and without prompt-lookup
speculative decoding, agentstack `model serve` vs llama-server (issue 25).

Two workloads, greedy, one request at a time:
  (a) rewrite: each file the coding environment's repository tasks fix
      (crates/envs/tasks/coding/repos/*/solution/...): the prompt gives the task's
      issue text and the file as it is in the repository, and asks for the whole file
      rewritten with the fix (max_tokens: the fixed file's length + 64);
  (b) chat: plain chat prompts (max_tokens 256).

Servers, all on the same GGUF file and --threads:
  agentstack, requests with "speculative": false (plain) and without the field (the
  default: drafts where they pay); llama-server plain; llama-server with each setting
  in --llama-spec (by default its n-gram types ngram-simple and ngram-mod with their
  own defaults, and ngram-simple with a 3-token lookup and 16-token drafts, closer to
  ours).

Per round, every prompt goes to every configuration, the order of configurations
rotating by round. Decode speed is (completion tokens - 1) / (time of the last
streamed chunk - time of the first), so prefill is left out. Reported: the median
over rounds of each workload's total decode tok/s, and the ratio to the same
engine's plain decoding. agentstack's two configurations must give the same text
(checked).

    python3 bench/inference/speculative.py --agentstack target/release/agentstack \
        --threads 2 --rounds 3 --write-results bench/RESULTS.md
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

parser = argparse.ArgumentParser()
parser.add_argument("--agentstack", default=os.path.join(ROOT, "target/release/agentstack"))
parser.add_argument(
    "--llama-server",
    default=os.path.expanduser("~/.cache/agentstack/llama.cpp-0.3.36/bin/llama-server"),
)
parser.add_argument(
    "--model",
    default=os.path.expanduser("~/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument(
    "--llama-spec",
    default="ngram-simple;ngram-mod;ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16",
    help="';'-separated llama-server speculative settings to compare: a --spec-type value, "
         "then any further llama-server arguments")
parser.add_argument("--chat-tokens", type=int, default=256)
parser.add_argument("--write-results")
args = parser.parse_args()

CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, for a curious teenager.",
    "Give me a packing list and some advice for a week of hiking in the mountains.",
    "What are the main differences between renewable and non-renewable energy?",
    "Describe a typical day in the life of a medieval blacksmith.",
    "Write a friendly email inviting my neighbours to a summer barbecue.",
]


def rewrite_prompts():
    base = os.path.join(ROOT, "crates/envs/tasks/coding/repos")
    prompts = []
    for task in sorted(os.listdir(base)):
        with open(os.path.join(base, task, "task.json")) as f:
            issue = json.load(f)["prompt"]
        solution = os.path.join(base, task, "solution")
        for dirpath, _, files in sorted(os.walk(solution)):
            for name in sorted(files):
                fixed_path = os.path.join(dirpath, name)
                rel = os.path.relpath(fixed_path, solution)
                with open(os.path.join(base, task, "repo", rel)) as f:
                    before = f.read()
                with open(fixed_path) as f:
                    after = f.read()
                text = (
                    f"{issue}\n\nHere is `{rel}` as it is in the repository:\n\n"
                    f"```python\n{before}```\n\nRewrite `{rel}` with the fix. "
                    "Answer with the whole file in one ```python block."
                )
                prompts.append((f"{task}/{rel}", text, len(after) // 3 + 64))
    return prompts


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process, url, name):
    for _ in range(1200):
        if process.poll() is not None:
            sys.exit(f"{name} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    process.kill()
    sys.exit(f"{name} did not start")


def start_agentstack():
    port = free_port()
    command = [args.agentstack, "model", "serve", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--threads", str(args.threads), "--name", "m"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, "agentstack model serve")
    return process, url


def start_llama(spec):
    port = free_port()
    command = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.threads), "-tb", str(args.threads), "-c", "8192", "-np", "1",
               "--no-webui"]
    if spec:
        spec_type, *extra = spec.split()
        command += ["--spec-type", spec_type, *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, f"llama-server {spec or ''}")
    return process, url


def run(url, prompt, max_tokens, extra):
    """Streams one greedy chat completion; returns (text, tokens, decode seconds, usage)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    first = last = None
    text = []
    usage = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(content)
    if usage is None:
        sys.exit(f"no usage from {url}")
    tokens = usage["completion_tokens"]
    return "".join(text), tokens, (last - first) if first else 0.0, usage


def main():
    rewrites = rewrite_prompts()
    chats = [(f"chat {i}", p, args.chat_tokens) for i, p in enumerate(CHAT_PROMPTS)]
    workloads = {"rewrite": rewrites, "chat": chats}
    servers = []
    try:
        ours = start_agentstack()
        servers.append(ours[0])
        configs = [
            ("agentstack plain", ours[1], {"speculative": False}),
            ("agentstack speculative", ours[1], {}),
        ]
        plain = start_llama(None)
        servers.append(plain[0])
        configs.append(("llama-server plain", plain[1], {}))
        for spec in [s.strip() for s in args.llama_spec.split(";") if s.strip()]:
            server = start_llama(spec)
            servers.append(server[0])
            configs.append((f"llama-server {spec}", server[1], {}))
        # Warm-up: every configuration once on one prompt of each workload.
        for _, url, extra in configs:
            for items in workloads.values():
                run(url, items[0][1], 16, extra)
        # rates[config][workload] = list over rounds of tok/s
        rates = {name: {w: [] for w in workloads} for name, _, _ in configs}
        accepted = {w: [0, 0, 0] for w in workloads}  # accepted, rejected, completion
        mismatches = []
        for round_ in range(args.rounds):
            order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
            totals = {name: {w: [0, 0.0] for w in workloads} for name, _, _ in configs}
            texts = {}
            for workload, items in workloads.items():
                for label, prompt, max_tokens in items:
                    for name, url, extra in order:
                        text, tokens, seconds, usage = run(url, prompt, max_tokens, extra)
                        totals[name][workload][0] += max(tokens - 1, 0)
                        totals[name][workload][1] += seconds
                        texts[(name, label)] = text
                        if name == "agentstack speculative" and round_ == 0:
                            details = usage.get("completion_tokens_details") or {}
                            accepted[workload][0] += details.get("accepted_prediction_tokens", 0)
                            accepted[workload][1] += details.get("rejected_prediction_tokens", 0)
                            accepted[workload][2] += tokens
                    if texts[("agentstack plain", label)] != texts[("agentstack speculative", label)]:
                        mismatches.append(label)
                    print(f"round {round_ + 1}/{args.rounds} {label}", file=sys.stderr)
            for name in totals:
                for workload, (tokens, seconds) in totals[name].items():
                    rates[name][workload].append(tokens / seconds if seconds else 0.0)
    finally:
        for process in servers:
            process.terminate()
        for process in servers:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()

    lines = []
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"],
                         capture_output=True, text=True).stdout.strip()
    lines.append(f"Decode tok/s (median of {args.rounds} rounds; each round's tok/s over all of "
                 f"the workload's prompts), {os.path.basename(args.model)}, greedy, one request "
                 f"at a time, {args.threads} thread(s), {cpu}, "
                 f"{datetime.now(timezone.utc).strftime('%Y-%m-%d')}:")
    lines.append("")
    lines.append("| configuration | rewrite (a) tok/s | vs plain | chat (b) tok/s | vs plain |")
    lines.append("|---|---|---|---|---|")
    med = {name: {w: statistics.median(v) for w, v in ws.items()} for name, ws in rates.items()}
    for name in med:
        base = "agentstack plain" if name.startswith("agentstack") else "llama-server plain"
        cells = []
        for w in ["rewrite", "chat"]:
            cells.append(f"{med[name][w]:.1f}")
            cells.append(f"{med[name][w] / med[base][w]:.2f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for w, (acc, rej, comp) in accepted.items():
        lines.append(f"- agentstack {w}: {acc} of {comp} completion tokens came from kept drafts; "
                     f"{rej} draft tokens rejected (round 1).")
    ratio = {w: med["agentstack speculative"][w] / med["llama-server plain"][w] for w in workloads}
    lines.append(f"- agentstack speculative vs llama-server plain: rewrite {ratio['rewrite']:.2f}x, "
                 f"chat {ratio['chat']:.2f}x.")
    lines.append(f"- agentstack's outputs with and without speculation: "
                 f"{'identical on every prompt and round' if not mismatches else 'DIFFERENT on ' + ', '.join(sorted(set(mismatches)))}.")
    report = "\n".join(lines)
    print(report)
    if args.write_results:
        with open(args.write_results, "a") as f:
            f.write("\n### Speculative decoding (prompt lookup), bench/inference/speculative.py\n\n")
            f.write(report + "\n")
    if mismatches:
        sys.exit(1)


main()
