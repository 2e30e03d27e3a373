"""TRL's GRPOTrainer on CPU: the peer side of bench/rl.

The configuration of ../shared/reference/rl.md section 4: SmolLM2-135M-Instruct from
the Q4_1 GGUF dequantized to fp32, 64 prompts "What is {a} + {b}? Answer with just the
number." from random.Random(1234) (not shuffled), one prompt x 8 samples per step,
temperature 1, <= 32 new tokens, LoRA r 8 / alpha 16 on q_proj and v_proj, AdamW lr
1e-5 linear to 0 over the steps, clip 1.0, loss "dapo", epsilon 0.2, beta 0, one
iteration per batch. Prints one JSON object: seconds per step, and the part of each
step spent generating (timed around the trainer's generation call).
"""

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

import torch  # noqa: E402

torch.set_num_threads(args.threads)
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

directory, name = os.path.split(os.path.abspath(args.model))
started = time.perf_counter()
tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=torch.float32)
if getattr(model, "hf_quantizer", None) is not None:
    model.hf_quantizer.remove_quantization_config(model)
load_s = time.perf_counter() - started

rng = random.Random(1234)
rows = []
for _ in range(64):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    rows.append(
        {
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}],
            "answer": a + b,
        }
    )
dataset = Dataset.from_list(rows)


def reward(completions, answer, **_):
    out = []
    for completion, want in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        match = re.search(r"-?\d+", text)
        out.append(1.0 if match and int(match.group()) == want else 0.0)
    return out


config = GRPOConfig(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=8,
    num_generations=8,
    gradient_accumulation_steps=1,
    max_completion_length=32,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    learning_rate=1e-5,
    lr_scheduler_type="linear",
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_steps=args.steps,
    seed=42,
    loss_type="dapo",
    epsilon=0.2,
    beta=0.0,
    num_iterations=1,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    bf16=False,
    fp16=False,
    gradient_checkpointing=False,
    shuffle_dataset=False,
    save_strategy="no",
)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=reward,
    args=config,
    train_dataset=dataset,
    processing_class=tokenizer,
    peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
)

generation = []
original = trainer._generate_and_score_completions


def timed(*a, **k):
    t = time.perf_counter()
    result = original(*a, **k)
    generation.append(time.perf_counter() - t)
    return result


trainer._generate_and_score_completions = timed


class Steps(TrainerCallback):
    def __init__(self):
        self.times = []
        self.t = None

    def on_step_begin(self, *_, **__):
        self.t = time.perf_counter()

    def on_step_end(self, *_, **__):
        self.times.append(time.perf_counter() - self.t)


steps = Steps()
trainer.add_callback(steps)
trainer.train()
json.dump(
    {
        "torch": torch.__version__,
        "threads": args.threads,
        "load_s": load_s,
        "step_s": steps.times,
        "generate_s": generation,
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    },
    sys.stdout,
)
print()
