"""Fine-tuning figures from the built-in trainer itself (`python -m trainyard.engine.train`, task sft, under
torchrun): memory per rank of LoRA against full fine-tuning of the same model, and tokens/s of packed against
padded supervised fine-tuning on chat examples of skewed lengths (examples/finetune/standin.py: 3 in 4 a short
exchange, the rest several long turns).

    python bench/finetune.py [--processes 2] [--steps 12] [--hidden 512] [--json bench/results/finetune.json]

The model: a Hugging Face Llama of `--hidden` width and 4 layers over the stand-in's tokenizer, started from its own
seeded initialisation (no weights in the channel). Each run: `--processes` ranks, MiCS over all of them, fp32,
seq_len 512, global batch 8 sequences. Memory: rank 0's parameter, gradient and optimizer-state bytes
(`model_state_bytes` of the metrics rows) and its peak resident memory. Speed: the tokens of examples a second
(`tokens_per_s` counts them, padding not), median over the steps after the first two.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"full, packed": {"lora_r": 0, "packing": True}, "LoRA r=8, packed": {"lora_r": 8, "packing": True},
        "LoRA r=8, padded": {"lora_r": 8, "packing": False}}


def _standin():
    spec = importlib.util.spec_from_file_location("standin", os.path.join(ROOT, "examples", "finetune", "standin.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_inputs(root: str, hidden: int) -> tuple[str, str]:
    """The model folder (config and tokenizer, no weights) and the chat examples."""
    from transformers import LlamaConfig

    standin = _standin()
    model, data = os.path.join(root, "model"), os.path.join(root, "chat")
    examples = standin.conversations(256)
    os.makedirs(data)
    with open(os.path.join(data, "train.jsonl"), "w") as fh:
        fh.write("\n".join(json.dumps(e) for e in examples) + "\n")
    standin.write_tokenizer(model, [m["content"] for e in examples for m in e.get("messages", [])] + standin.WORDS)
    LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                tie_word_embeddings=False).save_pretrained(model)
    return model, data


def run(name: str, options: dict, model: str, data: str, processes: int, steps: int, root: str) -> dict:
    work = os.path.join(root, name.replace(" ", "_").replace(",", "").replace("=", ""))
    os.makedirs(work)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SM_CHANNEL_MODEL": model, "SM_CHANNEL_TRAIN": data,
           "SM_OUTPUT_DATA_DIR": work, "SM_MODEL_DIR": os.path.join(work, "model")}
    args = ["--model", "hf", "--task", "sft", "--dataset", "train", "--steps", str(steps), "--seq_len", "512",
            "--global_batch_size", "8", "--micro_batch_size", str(8 // processes), "--dtype", "float32",
            "--save_model", "false", "--lr", "0.001"]
    for key, value in options.items():
        args += [f"--{key}", str(value).lower()]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={processes}", "-m", "trainyard.engine.train", *args], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name}: the trainer failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
    timed = rows[2:] or rows
    described = next(line for line in proc.stdout.splitlines() if line.startswith("task sft:"))
    return {"run": name, **options, "data": described.removeprefix("task sft: "),
            "model_state_bytes": rows[-1]["model_state_bytes"], "param_bytes": rows[-1]["param_bytes"],
            "grad_bytes": rows[-1]["grad_bytes"], "optim_bytes": rows[-1]["optim_bytes"],
            "peak_rss_bytes": rows[-1]["cpu_rss_bytes"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_s": statistics.median(r["step_time_s"] for r in timed),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model, data = write_inputs(root, a.hidden)
        rows = [run(name, options, model, data, a.processes, a.steps, root) for name, options in RUNS.items()]
    mb = 2 ** 20
    print(f"{a.processes} processes, MiCS over all, fp32, seq_len 512, global batch 8; rank 0's figures")
    print("| run | params MB | grads MB | optimizer MB | model state MB | peak RSS MB | step s | example tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['param_bytes'] / mb:.1f} | {r['grad_bytes'] / mb:.2f} | {r['optim_bytes'] / mb:.2f} | "
              f"{r['model_state_bytes'] / mb:.1f} | {r['peak_rss_bytes'] / mb:.0f} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:.0f} |")
    full, lora, padded = rows
    summary = {"lora_state_over_full": lora["model_state_bytes"] / full["model_state_bytes"],
               "packed_over_padded_tokens_per_s": lora["tokens_per_s"] / padded["tokens_per_s"]}
    print(f"LoRA's model state is {summary['lora_state_over_full']:.2f}x full fine-tuning's; packed SFT runs "
          f"{summary['packed_over_padded_tokens_per_s']:.2f}x the example tokens a second of padded")
    for r in rows:
        print(f"{r['run']}: {r['data']}; loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
                       "processes": a.processes, "hidden": a.hidden, "rows": rows, **summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
