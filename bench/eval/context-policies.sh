#!/usr/bin/env bash
# How the context policy changes the score on a multi-turn environment: SmolLM2 on
# connect_four (random opponent, constrained JSON moves, up to 21 moves), 20 games per
# setting, the same seed for all, then `eval compare` (table + PNG). The budget, 512
# tokens, is below the longest games' prompts (up to ~850 tokens at full context), so
# each policy acts on most games; at 1024 none did and all four runs were identical.
# Usage: bench/eval/context-policies.sh [MODEL] [RUNS_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-$HOME/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf}
runs=${2:-target/bench-eval-context}
bin=target/debug/agentstack
common=(--env connect_four --model "$model" --options '{"strength": 0}' --constrain
        --episodes 20 --max-turns 21 --max-tokens 12 --seed 5 --concurrency 4 --runs-dir "$runs")
"$bin" eval "${common[@]}" --run-id full
"$bin" eval "${common[@]}" --run-id stop-512 --context-tokens 512 --overflow stop
"$bin" eval "${common[@]}" --run-id truncate-512 --context-tokens 512 --overflow truncate
"$bin" eval "${common[@]}" --run-id compact-512 --context-tokens 512 --overflow compact
"$bin" eval compare full stop-512 truncate-512 compact-512 --runs-dir "$runs" --png "$runs/context-policies.png"
