"""The built-in trainer's step with trainyard.kernels swapped in (`kernels=eager-chunked`) against without
(`kernels=off`): peak memory and tokens/s, alternating runs of one process each, in the same invocation.

    python bench/kernels_step.py [--model 10m] [--steps 6] [--seq-len 256] [--batch 8] [--repeats 2] [--json PATH]

Each run is `python -m trainyard.engine.train` in a fresh process (one rank, no torchrun, no checkpoints, no
model written): its peak resident memory is the process's ru_maxrss, read at its exit; tokens/s is the median
of its steps after the first (from its metrics.jsonl). The figures are medians over the repeats; the ratio
`eager-chunked / off` is taken per repeat pair, so that machine noise hits both sides alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine

# runs the trainer's command line and reports the process's peak RSS (KiB on Linux) when it exits
CHILD = """
import atexit, resource, runpy, sys
atexit.register(lambda: print("MAXRSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True))
sys.argv = ["trainyard.engine.train", *sys.argv[1:]]
runpy.run_module("trainyard.engine.train", run_name="__main__")
"""


def one_run(kernels: str, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-c", CHILD, "--model", args.model, "--steps", str(args.steps),
               "--seq_len", str(args.seq_len), "--global_batch_size", str(args.batch),
               "--micro_batch_size", str(args.batch), "--save_model", "false", "--kernels", kernels]
        env = {**os.environ, "SM_OUTPUT_DATA_DIR": out, "SM_MODEL_DIR": out}
        env.pop("TRITON_INTERPRET", None)  # eager-chunked: the ops' references, never the interpreter
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"kernels={kernels} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rss_kib = int(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("MAXRSS_KIB")))
    return {"kernels": kernels, "peak_rss_mib": rss_kib / 1024,
            "tokens_per_s": statistics.median(row["tokens_per_s"] for row in rows[1:]),
            "losses": [round(row["loss"], 6) for row in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="10m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    pairs = []
    for i in range(args.repeats):
        off = one_run("off", args)
        fused = one_run("eager-chunked", args)
        pairs.append((off, fused))
        print(f"repeat {i + 1}: off {off['peak_rss_mib']:.0f} MiB {off['tokens_per_s']:.0f} tok/s; eager-chunked "
              f"{fused['peak_rss_mib']:.0f} MiB {fused['tokens_per_s']:.0f} tok/s", flush=True)
    rows = []
    for name, side in (("off", 0), ("eager-chunked", 1)):
        runs = [pair[side] for pair in pairs]
        rows.append({"kernels": name, "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs), "losses": runs[0]["losses"]})
    ratio = {"peak_rss": statistics.median(f["peak_rss_mib"] / o["peak_rss_mib"] for o, f in pairs),
             "tokens_per_s": statistics.median(f["tokens_per_s"] / o["tokens_per_s"] for o, f in pairs)}
    print(f"\n{'kernels':<15}{'peak RSS MiB':>14}{'tok/s':>10}")
    for r in rows:
        print(f"{r['kernels']:<15}{r['peak_rss_mib']:>14.0f}{r['tokens_per_s']:>10.0f}")
    print(f"eager-chunked / off: peak RSS {ratio['peak_rss']:.3f}, tok/s {ratio['tokens_per_s']:.3f} "
          f"(model {args.model}, {args.batch} x {args.seq_len} tokens per step, {args.repeats} pair(s))")
    print(f"losses off {rows[0]['losses']}\nlosses eager-chunked {rows[1]['losses']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"bench": "kernels_step", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "fingerprint": this_machine(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                       "args": vars(args), "rows": rows, "ratio": ratio, "pairs": pairs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
