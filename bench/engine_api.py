"""The engine as a library: what its public API costs a training loop, and the built-in model through the
new model seam against the code before it.

    python bench/engine_api.py [--repeats 10] [--steps 3] [--warmup 3] [--threads 1]
                               [--trainer-models tiny,10m] [--trainer-repeats 3] [--trainer-steps 20]
                               [--old-rev ac20671] [--new-rev HEAD] [--skip-overhead] [--skip-seam] [--json PATH]

1. Overhead, one process. A plain PyTorch loop (AdamW; per step `accum` micro-batches of forward, cross-entropy
   and backward, `torch.nn.utils.clip_grad_norm_`, step, zero_grad) against the same loop through
   `trainyard.engine` (`init({})`, `model = transform(model)`, each micro-batch `with accumulate(model, i, n)`,
   `clip_grad_norm_(model, 1.0)`), on two copies of the same weights, fed the same batches, in this one
   process, for (a) the built-in `Transformer` ("10m") and (b) a Hugging Face `LlamaForCausalLM` of the same
   shape. Each copy first takes `--warmup` steps (not timed); then `--repeats` pairs of blocks of `--steps`
   timed steps each, plain and API alternating (AB, BA, AB, ...). Per pair: the API block's mean step time
   over the plain block's; reported: the median of those ratios and the median per-step seconds. Both
   copies see the same batches in the same order, so their losses agree step for step (`max_loss_diff`):
   the two loops do the same work. Goal: ratio <= 1.05.

2. Seam, 2 processes. The built-in trainer (`torchrun --nproc_per_node 2 -m trainyard.engine.train`, MiCS
   over both ranks, fp32, global batch 8 of 128 tokens, micro-batch 2) at `--old-rev` (before the model seam:
   `parallelize(cfg: ModelConfig, dims, ...)` built the model itself) and at `--new-rev` (`Trainer` through
   the public API: `transform(model)` of a model built on the meta device). Each revision is extracted with
   `git archive` into a temporary folder and laid out as pyproject's package-dir maps it (`trainyard` ->
   api/, `trainyard.engine` -> engine/, ...) on PYTHONPATH, which Python searches before the editable
   install's finder: each run imports that revision's code only (checked before the runs: the file
   `trainyard.engine.distributed.parallelize` comes from, and its `parallelize` signature). `--new-rev
   worktree` takes this checkout as it is. Old and new alternate (old first, then new first, ...); per run
   the median `tokens_per_s` of metrics.jsonl over the steps after `--trainer-warmup`; per pair new / old;
   reported: the median of those ratios. Goal: >= 1.0 within the noise (not slower).

Threads: `--threads 1` (default) for the loops of part 1 and OMP_NUM_THREADS=1 for each trainer rank. On a
shared 2-core machine a 2-thread intra-op pool stalls whenever a core is taken away (seconds per step);
one thread per process keeps the step times stable enough to compare.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_OVERHEAD = 1.05
SEQ = 128  # tokens per row (part 1)
MICRO_ROWS = 1  # rows per micro-batch (part 1)
ACCUM = 2  # micro-batches per step (part 1)
MAX_NORM = 1.0
TRAINER = {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 128, "dtype": "float32"}


# --- part 1: overhead of the API in one process ------------------------------------------------------------

def _builtin():
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, init_weights

    cfg = MODEL_CONFIGS["10m"]
    model = build_model(cfg)
    init_weights(model, 0, device="cpu")
    return model, cfg.vocab_size, "built-in Transformer 10m"


def _hf():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # the built-in 10m's shape: 10 blocks of width 256, 8 heads (4 key/value), SwiGLU 768, vocabulary 4096
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=10,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return model, config.vocab_size, "HF LlamaForCausalLM (10m shape, sdpa)"


def _loss(output, targets):
    import torch.nn.functional as F

    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def overhead(case: str, a) -> dict:
    import torch

    import trainyard.engine as te

    te.init({})  # one plain process: a group of one, no mesh dimension above 1
    plain, vocab, label = _builtin() if case == "builtin" else _hf()
    plain.train()
    api = te.transform(copy.deepcopy(plain))  # the same weights (transform keeps a real model's values)
    params = sum(p.numel() for p in plain.parameters())
    total_steps = a.warmup + a.repeats * a.steps
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (total_steps, ACCUM, MICRO_ROWS, SEQ + 1), generator=gen)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=3e-4, weight_decay=0.1)
    opt_api = torch.optim.AdamW(api.parameters(), lr=3e-4, weight_decay=0.1)

    def plain_step(batch):
        for mb in batch:
            (_loss(plain(mb[:, :-1]), mb[:, 1:]) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
        opt_plain.step()
        opt_plain.zero_grad(set_to_none=True)

    def api_step(batch):
        for i, mb in enumerate(batch):
            with te.accumulate(api, i, ACCUM):
                (_loss(api(mb[:, :-1]), mb[:, 1:]) / ACCUM).backward()
        te.clip_grad_norm_(api, MAX_NORM)
        opt_api.step()
        opt_api.zero_grad(set_to_none=True)

    def loss_of(model, batch):  # same-work check, outside the timed steps
        with torch.no_grad():
            return sum(_loss(model(mb[:, :-1]), mb[:, 1:]).item() for mb in batch) / ACCUM

    loops = {"plain": plain_step, "api": api_step}
    models = {"plain": plain, "api": api}
    cursor = {"plain": 0, "api": 0}  # the next batch of each loop: both see the same batches in the same order

    def block(name: str, n: int, timed: bool) -> list[float]:
        times = []
        for _ in range(n):
            batch = data[cursor[name]]
            t0 = time.perf_counter()
            loops[name](batch)
            if timed:
                times.append(time.perf_counter() - t0)
            cursor[name] += 1
        return times

    block("plain", a.warmup, False)
    block("api", a.warmup, False)
    pairs, loss_diffs = [], []
    for r in range(a.repeats):
        order = ("plain", "api") if r % 2 == 0 else ("api", "plain")
        got = {name: block(name, a.steps, True) for name in order}
        pairs.append({"first": order[0], "plain_s": statistics.fmean(got["plain"]),
                      "api_s": statistics.fmean(got["api"]),
                      "ratio": statistics.fmean(got["api"]) / statistics.fmean(got["plain"])})
        probe = data[r % len(data)]
        loss_diffs.append(abs(loss_of(models["plain"], probe) - loss_of(models["api"], probe)))
    return {
        "case": case, "model": label, "parameters": params, "threads": torch.get_num_threads(),
        "micro_batches": ACCUM, "rows_per_micro_batch": MICRO_ROWS, "seq_len": SEQ, "warmup_steps": a.warmup,
        "steps_per_block": a.steps, "repeats": a.repeats,
        "plain_step_s": statistics.median(p["plain_s"] for p in pairs),
        "api_step_s": statistics.median(p["api_s"] for p in pairs),
        "ratio": statistics.median(p["ratio"] for p in pairs),
        "ratio_min": min(p["ratio"] for p in pairs), "ratio_max": max(p["ratio"] for p in pairs),
        "max_loss_diff": max(loss_diffs), "goal_met": statistics.median(p["ratio"] for p in pairs) <= GOAL_OVERHEAD,
        "pairs": pairs,
    }


# --- part 2: the built-in trainer, old code path against new ---------------------------------------------

def _lay_out(src: str, root: str) -> None:
    """`src` (a source tree) as an importable `trainyard` under `root`, as pyproject's package-dir maps it:
    one real folder per package, holding links to its source folder's files (and to data folders that are
    no package of their own)."""
    with open(os.path.join(src, "pyproject.toml"), "rb") as fh:
        setup = tomllib.load(fh)["tool"]["setuptools"]
    dirs = {pkg: os.path.join(src, d) for pkg, d in setup["package-dir"].items()}
    mapped = set(os.path.realpath(d) for d in dirs.values())
    for pkg in setup["packages"]:
        folder = os.path.join(root, *pkg.split("."))
        os.makedirs(folder, exist_ok=True)
        for entry in os.listdir(dirs[pkg]):
            path = os.path.join(dirs[pkg], entry)
            if os.path.isdir(path) and (os.path.realpath(path) in mapped or entry == "__pycache__"):
                continue
            os.symlink(path, os.path.join(folder, entry))


def materialise(rev: str, where: str) -> tuple[str, str]:
    """(PYTHONPATH root, commit) of `rev` extracted under `where`; "worktree": this checkout as it is."""
    root = os.path.join(where, "pkg")
    if rev == "worktree":
        src, commit = REPO, "worktree"
    else:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", rev], check=True, capture_output=True,
                                text=True).stdout.strip()
        src = os.path.join(where, "src")
        os.makedirs(src)
        archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", commit], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    _lay_out(src, root)
    return root, commit


PROBE = ("import inspect, os, trainyard.engine.distributed.parallelize as p; "
         "print(os.path.realpath(p.__file__)); print(next(iter(inspect.signature(p.parallelize).parameters)))")


def probe(root: str, cwd: str) -> dict:
    """Which code a run on `root` imports: the real file of the parallelize module and its first parameter."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = root
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    return {"parallelize_file": out[0], "parallelize_first_param": out[1]}


def trainer_run(root: str, model: str, a, where: str) -> dict:
    """One torchrun of the built-in trainer on `root`'s code; its metrics."""
    out = tempfile.mkdtemp(dir=where)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "TRAINYARD_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", SM_OUTPUT_DATA_DIR=os.path.join(out, "output"),
               SM_MODEL_DIR=os.path.join(out, "model"), SM_INPUT_CONFIG_DIR=os.path.join(out, "config"))
    hp = {"model": model, "steps": a.trainer_steps, "save_model": "false", "log_every": a.trainer_steps, **TRAINER}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "trainyard.engine.train"] + [x for k, v in hp.items() for x in (f"--{k}", str(v))]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"trainer on {root} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(out, "output", "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh]
    shutil.rmtree(out, ignore_errors=True)
    kept = [m["tokens_per_s"] for m in metrics[a.trainer_warmup:]]
    layout = next((line for line in proc.stdout.splitlines() if line.startswith("model ")), "")
    return {"tokens_per_s": statistics.median(kept), "steps": len(metrics), "wall_s": wall,
            "final_loss": metrics[-1]["loss"], "layout": layout}


def seam(a, where: str) -> dict:
    roots, code = {}, {}
    for side, rev in (("old", a.old_rev), ("new", a.new_rev)):
        folder = os.path.join(where, side)
        os.makedirs(folder)
        roots[side], commit = materialise(rev, folder)
        code[side] = {"rev": rev, "commit": commit, **probe(roots[side], folder)}
    if code["old"]["parallelize_first_param"] != "cfg" or code["new"]["parallelize_first_param"] != "model":
        raise RuntimeError(f"the revisions do not import the expected code: {code}")
    models = []
    for model in a.trainer_models:
        pairs = []
        for r in range(a.trainer_repeats):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            got = {side: trainer_run(roots[side], model, a, where) for side in order}
            pairs.append({"first": order[0], "old": got["old"], "new": got["new"],
                          "ratio": got["new"]["tokens_per_s"] / got["old"]["tokens_per_s"]})
            print(f"  {model} pair {r + 1}/{a.trainer_repeats}: old {got['old']['tokens_per_s']:.0f} tok/s, "
                  f"new {got['new']['tokens_per_s']:.0f} tok/s", flush=True)
        models.append({
            "model": model, "repeats": a.trainer_repeats, "steps": a.trainer_steps, "warmup_steps": a.trainer_warmup,
            "old_tokens_per_s": statistics.median(p["old"]["tokens_per_s"] for p in pairs),
            "new_tokens_per_s": statistics.median(p["new"]["tokens_per_s"] for p in pairs),
            "ratio": statistics.median(p["ratio"] for p in pairs),
            "ratio_min": min(p["ratio"] for p in pairs), "ratio_max": max(p["ratio"] for p in pairs),
            "same_final_loss": all(p["old"]["final_loss"] == p["new"]["final_loss"] for p in pairs),
            "old_layout": pairs[0]["old"]["layout"], "new_layout": pairs[0]["new"]["layout"], "pairs": pairs,
        })
    return {"code": code, "trainer": {"processes": 2, **TRAINER}, "models": models}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trainer-models", type=lambda s: s.split(","), default=["tiny", "10m"])
    p.add_argument("--trainer-repeats", type=int, default=3)
    p.add_argument("--trainer-steps", type=int, default=20)
    p.add_argument("--trainer-warmup", type=int, default=2)
    p.add_argument("--old-rev", default="ac20671")
    p.add_argument("--new-rev", default="HEAD")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-seam", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    t_start, load = time.perf_counter(), [os.getloadavg()[0]]
    cases = [] if a.skip_overhead else [overhead(case, a) for case in ("builtin", "hf")]
    result_seam = None
    if not a.skip_seam:
        where = tempfile.mkdtemp(prefix="engine_api_bench.")
        try:
            result_seam = seam(a, where)
        finally:
            shutil.rmtree(where, ignore_errors=True)
    load.append(os.getloadavg()[0])
    total = time.perf_counter() - t_start

    if cases:
        print(f"\n1. engine API overhead, one process, {a.threads} thread(s), {ACCUM} micro-batches of "
              f"{MICRO_ROWS} x {SEQ} tokens; {a.repeats} interleaved pairs of {a.steps} steps after {a.warmup} warm-up")
        print(f"{'model':<42}{'params':>8}{'plain s':>9}{'API s':>9}{'ratio':>7}{'min':>7}{'max':>7}{'loss diff':>11}  goal")
        for c in cases:
            print(f"{c['model']:<42}{c['parameters'] / 1e6:>7.2f}M{c['plain_step_s']:>9.3f}{c['api_step_s']:>9.3f}"
                  f"{c['ratio']:>7.3f}{c['ratio_min']:>7.3f}{c['ratio_max']:>7.3f}{c['max_loss_diff']:>11.1e}"
                  f"  {'met' if c['goal_met'] else 'MISSED'}")
        print(f"goal API / plain <= {GOAL_OVERHEAD}: {sum(c['goal_met'] for c in cases)}/{len(cases)} met")
    if result_seam:
        code = result_seam["code"]
        print(f"\n2. built-in trainer, 2 processes: old {code['old']['commit'][:7]} (parallelize({code['old']['parallelize_first_param']}, ...)) "
              f"vs new {code['new']['commit'][:7]} (parallelize({code['new']['parallelize_first_param']}, ...))")
        print(f"{'model':<8}{'old tok/s':>11}{'new tok/s':>11}{'new/old':>9}{'min':>7}{'max':>7}  same loss")
        for m in result_seam["models"]:
            print(f"{m['model']:<8}{m['old_tokens_per_s']:>11.0f}{m['new_tokens_per_s']:>11.0f}{m['ratio']:>9.3f}"
                  f"{m['ratio_min']:>7.3f}{m['ratio_max']:>7.3f}  {m['same_final_loss']}")
    print(f"total {total:.0f} s; 1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"name": "engine_api", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                                  f"{platform.python_version()}, torch {torch.__version__}",
                       "total_seconds": total, "load_average_1min": load, "goal_overhead": GOAL_OVERHEAD,
                       "overhead": cases, "seam": result_seam}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
