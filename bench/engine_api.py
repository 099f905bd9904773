"""The engine as a library: what its public API costs a training loop, and the built-in model through the
new model seam against the code before it.

    python bench/engine_api.py [--repeats 20] [--steps 1] [--warmup 3] [--threads 1]
                               [--seam-models tiny,10m] [--seam-repeats 20] [--seam-warmup 3]
                               [--trainer-models tiny] [--trainer-repeats 3] [--trainer-steps 20]
                               [--old-rev ac20671] [--new-rev HEAD] [--skip-overhead] [--skip-seam] [--json PATH]

These machines are shared and noisy: every ratio is taken inside one run, A and B alternating (AB, BA, AB,
...), as the median of the per-pair ratios. Beside wall time, the CPU time of the same steps is reported
(`time.process_time`, one thread per process): the time the loop needs, which other processes' load does
not stretch, so it stays comparable when the wall times do not.

1. Overhead, one process. A plain PyTorch loop (AdamW; per step ACCUM micro-batches of forward,
   cross-entropy and backward, `torch.nn.utils.clip_grad_norm_`, step, zero_grad) against the same loop
   through `trainyard.engine` (`init({})`, `model = transform(model)`, each micro-batch `with
   accumulate(model, i, n)`, `clip_grad_norm_(model, 1.0)`), on two copies of the same weights fed the same
   batches in the same order, for (a) the built-in `Transformer` "10m" and (b) a Hugging Face
   `LlamaForCausalLM` of the same shape. Each loop first takes `--warmup` untimed steps; then `--repeats`
   pairs of `--steps` timed steps each. Reported: median per-step seconds, the median of the per-pair
   ratios API / plain (wall and CPU) and their quartiles; the two copies' loss on one batch at the end
   (`loss_diff_after`: the loops did the same work). Also, apart from whole steps, what the API's own calls
   cost (CPU time): `accumulate` entered and left, and `clip_grad_norm_` against torch's on the gradients of
   one backward. Goal: API / plain <= 1.05 (wall).

2. Seam, 2 processes, the built-in model: `--old-rev` (before the model seam: `parallelize(cfg:
   ModelConfig, dims, ...)` built the model itself) against `--new-rev` (the `Trainer` through the public
   API: a model built on the meta device, `transform(model)` -> `parallelize(model, spec, dims, ...)`).
   MiCS over both ranks, fp32, global batch 8 of 128 tokens, micro-batch 2 (2 micro-batches per rank).
   Each revision is extracted with `git archive` into a temporary folder and laid out as its pyproject
   maps it (before the SDK layering, package-dir: `trainyard` -> api/, `trainyard.engine` -> engine/, ...;
   since, the `trainyard/` folder itself) on PYTHONPATH, which
   Python searches before the editable install's finder, so a process imports that revision's code only
   (checked before the runs: the file `<package>.engine.distributed.parallelize` comes from, and the first
   parameter of its `parallelize`). `--new-rev worktree` takes this checkout as it is.
   a. In one job (primary): one torchrun of 2 ranks imports both revisions, the old one as package
      `trainyard_old` (its extracted copy's imports renamed, nothing else): the new `Trainer(cfg)` and, on
      the same process group, the old train.py's setup (`parallelize(cfg, dims, ...)`, its optimizer,
      schedule, data source and comm meter); then steps alternate, each the body of its own trainer's loop
      (old: `rank_rows` + `train_step` under the meter; new: `Trainer.train_step` under the meter), after
      a barrier. `--seam-warmup` pairs untimed, then `--seam-repeats` pairs. Wall: the slower rank's; CPU:
      both ranks'. Speed = old step time / new step time (> 1: new faster). Both see the same batches:
      their losses agree step for step (`max_loss_diff`).
   b. Trainer launches: `torchrun --nproc_per_node 2 -m trainyard.engine.train` of each revision,
      alternating launches, `--trainer-repeats` pairs; per run the median `tokens_per_s` of metrics.jsonl
      after `--trainer-warmup` steps. The whole trainer, but two launches never share the machine's load:
      on a loaded 2-core machine their ratio spreads several-fold.
   Goal: speed >= 1.0 within the noise (the new path is not slower).

Threads: `--threads 1` (default) for part 1 and OMP_NUM_THREADS=1 for each rank. On a shared 2-core machine
a 2-thread intra-op pool stalls whenever a core is taken away (seconds per step).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine

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
    cursor = {"plain": 0, "api": 0}  # the next batch of each loop: both see the same batches in the same order

    def block(name: str, n: int) -> tuple[float, float]:
        """Mean wall and CPU seconds per step of n steps."""
        wall = cpu = 0.0
        for _ in range(n):
            batch = data[cursor[name]]
            t0, c0 = time.perf_counter(), time.process_time()
            loops[name](batch)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            cursor[name] += 1
        return wall / max(n, 1), cpu / max(n, 1)

    block("plain", a.warmup)
    block("api", a.warmup)
    pairs = []
    for r in range(a.repeats):
        order = ("plain", "api") if r % 2 == 0 else ("api", "plain")
        got = {name: block(name, a.steps) for name in order}
        pairs.append({"first": order[0], "plain_s": got["plain"][0], "api_s": got["api"][0],
                      "plain_cpu_s": got["plain"][1], "api_cpu_s": got["api"][1],
                      "ratio": got["api"][0] / got["plain"][0], "cpu_ratio": got["api"][1] / got["plain"][1]})
    probe = data[0]
    loss_diff = abs(loss_of(plain, probe) - loss_of(api, probe))
    calls = _call_costs(plain, api, data[0], te)
    med = {k: statistics.median(p[k] for p in pairs) for k in ("plain_s", "api_s", "plain_cpu_s", "api_cpu_s",
                                                              "ratio", "cpu_ratio")}
    return {
        "case": case, "model": label, "parameters": params, "threads": torch.get_num_threads(),
        "micro_batches": ACCUM, "rows_per_micro_batch": MICRO_ROWS, "seq_len": SEQ, "warmup_steps": a.warmup,
        "steps_per_block": a.steps, "repeats": a.repeats,
        "plain_step_s": med["plain_s"], "api_step_s": med["api_s"], "ratio": med["ratio"],
        "ratio_q1_q3": _quartiles([p["ratio"] for p in pairs]),
        "plain_step_cpu_s": med["plain_cpu_s"], "api_step_cpu_s": med["api_cpu_s"], "cpu_ratio": med["cpu_ratio"],
        "cpu_ratio_q1_q3": _quartiles([p["cpu_ratio"] for p in pairs]),
        "loss_diff_after": loss_diff, "goal_met": med["ratio"] <= GOAL_OVERHEAD, **calls, "pairs": pairs,
    }


def _call_costs(plain, api, batch, te) -> dict:
    """What the API's own calls cost, apart from the noise of whole steps: `accumulate` entered and left
    (median of 2000), `clip_grad_norm_` against torch's on the gradients of one backward (median of 30 each,
    alternating); CPU time of this process (one thread), which other processes' load does not inflate."""
    import torch

    for model in (plain, api):
        model.zero_grad(set_to_none=True)
        (_loss(model(batch[0][:, :-1]), batch[0][:, 1:])).backward()
    acc = []
    for i in range(2000):
        t0 = time.process_time()
        with te.accumulate(api, i % ACCUM, ACCUM):
            pass
        acc.append(time.process_time() - t0)
    saved = {model: [p.grad.clone() for p in model.parameters()] for model in (plain, api)}

    def restore(model):  # every call clips the gradients of one backward, as in training
        with torch.no_grad():
            for p, g in zip(model.parameters(), saved[model]):
                p.grad.copy_(g)

    torch_clip, api_clip = [], []
    for _ in range(30):
        restore(plain)
        t0 = time.process_time()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
        torch_clip.append(time.process_time() - t0)
        restore(api)
        t0 = time.process_time()
        grad_norm = te.clip_grad_norm_(api, MAX_NORM)
        api_clip.append(time.process_time() - t0)
    for model in (plain, api):
        model.zero_grad(set_to_none=True)
    acc_s, tc, ac = statistics.median(acc), statistics.median(torch_clip), statistics.median(api_clip)
    return {"accumulate_call_us": acc_s * 1e6, "torch_clip_ms": tc * 1e3, "api_clip_ms": ac * 1e3,
            "grad_norm": grad_norm,
            "api_calls_extra_ms_per_step": (ACCUM * acc_s + ac - tc) * 1e3}


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


# --- part 2: the built-in model, old code path against new ----------------------------------------------

def _lay_out(src: str, root: str, name: str) -> None:
    """`src` (a source tree) importable as package `name` under `root`, as pyproject's package-dir maps it: one
    real folder per package, holding links to its source folder's files (and to data folders that are no
    package of their own)."""
    with open(os.path.join(src, "pyproject.toml"), "rb") as fh:
        setup = tomllib.load(fh)["tool"]["setuptools"]
    if "package-dir" not in setup:  # the package is the trainyard/ folder itself (since the SDK layering)
        os.makedirs(root, exist_ok=True)
        os.symlink(os.path.join(src, "trainyard"), os.path.join(root, name))
        return
    dirs = {pkg: os.path.join(src, d) for pkg, d in setup["package-dir"].items()}
    mapped = {os.path.realpath(d) for d in dirs.values()}
    for pkg in setup["packages"]:
        folder = os.path.join(root, name, *pkg.split(".")[1:])
        os.makedirs(folder, exist_ok=True)
        for entry in os.listdir(dirs[pkg]):
            path = os.path.join(dirs[pkg], entry)
            if os.path.isdir(path) and (os.path.realpath(path) in mapped or entry == "__pycache__"):
                continue
            os.symlink(path, os.path.join(folder, entry))


_IMPORT = re.compile(r"^(\s*(?:from|import)\s+)trainyard\b", re.MULTILINE)


def materialise(rev: str, where: str, name: str = "trainyard") -> tuple[str, str]:
    """(PYTHONPATH root, commit) of `rev`, extracted with `git archive` under `where` and importable as `name`
    (another name than trainyard: the extracted copy's own imports renamed, so it loads beside the other
    revision in one process). "worktree": this checkout as it is (as trainyard only)."""
    root = os.path.join(where, "pkg")
    if rev == "worktree":
        if name != "trainyard":
            raise ValueError("the checkout is importable as trainyard only")
        src, commit = REPO, "worktree"
    else:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", rev], check=True, capture_output=True,
                                text=True).stdout.strip()
        src = os.path.join(where, "src")
        os.makedirs(src)
        archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", commit], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        if name != "trainyard":
            for folder, _, files in os.walk(src):
                for f in files:
                    if f.endswith(".py"):
                        path = os.path.join(folder, f)
                        with open(path) as fh:
                            text = fh.read()
                        renamed = _IMPORT.sub(rf"\g<1>{name}", text)
                        if renamed != text:
                            with open(path, "w") as fh:
                                fh.write(renamed)
    _lay_out(src, root, name)
    return root, commit


PROBE = ("import importlib, inspect, os, sys; "
         "p = importlib.import_module(sys.argv[1] + '.engine.distributed.parallelize'); "
         "print(os.path.realpath(p.__file__)); print(next(iter(inspect.signature(p.parallelize).parameters)))")


def probe(pythonpath: str, cwd: str, name: str) -> dict:
    """Which code package `name` imports on `pythonpath`: the real file of its parallelize module and that
    function's first parameter (old: cfg, new: model)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", PROBE, name], cwd=cwd, env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    return {"parallelize_file": out[0], "parallelize_first_param": out[1]}


def _clean_env(pythonpath: str, out: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "TRAINYARD_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PYTHONPATH"))}
    env.update(PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", SM_OUTPUT_DATA_DIR=os.path.join(out, "output"),
               SM_MODEL_DIR=os.path.join(out, "model"), SM_INPUT_CONFIG_DIR=os.path.join(out, "config"))
    return env


def seam_worker(a) -> None:
    """One rank of the in-job comparison (under torchrun): the new Trainer's `train_step` and the old train.py's
    setup and `train_step` (package trainyard_old) on the same process group, steps alternating."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import trainyard_old.engine.train as old
    from trainyard.engine import api
    from trainyard.engine.components.meter import CommMeter
    from trainyard.engine.config import TrainConfig
    from trainyard.engine.trainer import Trainer

    hp = {"model": a.worker_model, "steps": a.seam_warmup + a.seam_repeats, "save_model": False, **TRAINER}
    # new: init (group, mesh) -> the model on the meta device -> transform -> AdamW + schedule -> data
    trainer = Trainer(TrainConfig(**hp))
    new_meter = CommMeter(trainer.layout.dims.processes_per_host, trainer.layout.dims)
    # old: old train.py's _train up to its loop (parallelize(cfg, dims, ...) builds the model)
    cfg = old.TrainConfig(**hp)
    d = old.init_distributed()  # the group exists: reads the environment only
    torch.manual_seed(cfg.seed)
    accum = old.reconcile_distribution(cfg, {}, d.world_size)
    mcfg = old.MODEL_CONFIGS[cfg.model]
    source = old.build_source(cfg.dataset, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                              seq_len=cfg.seq_len, vocab_size=mcfg.vocab_size, token_dtype=cfg.token_dtype)
    dims = old.dims_from_distribution({}, world_size=d.world_size, processes_per_host=d.processes_per_host)
    dims.build_mesh(d.device.type)
    mics = old.MiCSConfig(param_dtype=None, reduce_dtype=torch.float32, hierarchical=None, reshard_after_forward=True)
    par = old.parallelize(mcfg, dims, seed=cfg.seed, device=d.device, ac="none", mics=mics, pipeline=None,
                          seq_len=cfg.seq_len, two_hop=True)
    optimizer = old.build_optimizer(par.model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = old.build_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.schedule_steps,
                                    min_lr_ratio=cfg.min_lr_ratio)
    old_meter = old.CommMeter(dims.processes_per_host, dims)
    dp_rank = dims.coords(d.rank)["dp"]

    def old_step(step: int) -> float:  # old train.py's loop body
        rows = old.rank_rows(source.global_batch(step), dp_rank, dims.dp).to(d.device, non_blocking=True)
        old_meter.reset()
        with old_meter.active():
            loss, _, _ = old.train_step(par, rows, accum, optimizer, scheduler, cfg, {})
        return loss

    def new_step(step: int) -> float:  # Trainer.run's loop body
        new_meter.reset()
        with new_meter.active():
            return trainer.train_step(step)["loss"]

    steps = {"old": old_step, "new": new_step}
    cursor = {"old": 1, "new": 1}
    losses: dict = {"old": [], "new": []}

    def one(side: str) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses[side].append(steps[side](cursor[side]))
        cursor[side] += 1
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(a.seam_warmup):
        one("old")
        one("new")
    rows = []
    for r in range(a.seam_repeats):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        got = {side: one(side) for side in order}
        rows.append([got["old"][0], got["new"][0], got["old"][1], got["new"][1]])
    t = torch.tensor(rows, dtype=torch.float64)
    wall, cpu = t[:, :2].clone(), t[:, 2:].clone()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends on the slowest rank
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)  # CPU seconds of both ranks
    if d.rank == 0:
        with open(a.worker_out, "w") as fh:
            json.dump({"wall": wall.tolist(), "cpu": cpu.tolist(), "losses": losses,
                       "old_layout": f"partition groups of {dims.dp_shard} x {dims.dp_replicate}",
                       "new_layout": f"partition groups of {trainer.layout.dims.dp_shard} x "
                                     f"{trainer.layout.dims.dp_replicate}",
                       "new_sharded": trainer.layout.sharded}, fh)
    api.finish()


def seam_in_job(model: str, pythonpath: str, a, where: str) -> dict:
    out = tempfile.mkdtemp(dir=where)
    result = os.path.join(out, "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), "--seam-worker", "--worker-model", model, "--worker-out", result,
           "--seam-repeats", str(a.seam_repeats), "--seam-warmup", str(a.seam_warmup)]
    proc = subprocess.run(cmd, cwd=out, env=_clean_env(pythonpath, out), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"in-job comparison failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(result) as fh:
        r = json.load(fh)
    wall_ratio = [n / o for o, n in r["wall"]]  # new / old step time: > 1 is slower
    cpu_ratio = [n / o for o, n in r["cpu"]]
    tokens = TRAINER["global_batch_size"] * TRAINER["seq_len"]
    return {
        "model": model, "pairs": a.seam_repeats, "warmup_steps": a.seam_warmup,
        "old_step_s": statistics.median(o for o, _ in r["wall"]),
        "new_step_s": statistics.median(n for _, n in r["wall"]),
        "old_tokens_per_s": tokens / statistics.median(o for o, _ in r["wall"]),
        "new_tokens_per_s": tokens / statistics.median(n for _, n in r["wall"]),
        "speed_ratio": statistics.median(1 / x for x in wall_ratio),
        "speed_ratio_q1_q3": sorted(1 / x for x in _quartiles(wall_ratio)),
        "old_step_cpu_s": statistics.median(o for o, _ in r["cpu"]),
        "new_step_cpu_s": statistics.median(n for _, n in r["cpu"]),
        "cpu_speed_ratio": statistics.median(1 / x for x in cpu_ratio),
        "cpu_speed_ratio_q1_q3": sorted(1 / x for x in _quartiles(cpu_ratio)),
        "max_loss_diff": max(abs(o - n) for o, n in zip(r["losses"]["old"], r["losses"]["new"])),
        "old_layout": r["old_layout"], "new_layout": r["new_layout"], "new_sharded": r["new_sharded"],
        "wall": r["wall"], "cpu": r["cpu"],
    }


def trainer_run(pythonpath: str, model: str, a, where: str) -> dict:
    """One torchrun of the built-in trainer on `pythonpath`'s code; its metrics."""
    out = tempfile.mkdtemp(dir=where)
    hp = {"model": model, "steps": a.trainer_steps, "save_model": "false", "log_every": a.trainer_steps, **TRAINER}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "trainyard.engine.train"] + [x for k, v in hp.items() for x in (f"--{k}", str(v))]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out, env=_clean_env(pythonpath, out), capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"trainer on {pythonpath} failed ({proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(out, "output", "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh]
    shutil.rmtree(out, ignore_errors=True)
    kept = [m["tokens_per_s"] for m in metrics[a.trainer_warmup:]]
    layout = next((line for line in proc.stdout.splitlines() if line.startswith("model ")), "")
    return {"tokens_per_s": statistics.median(kept), "steps": len(metrics), "wall_s": wall,
            "final_loss": metrics[-1]["loss"], "layout": layout}


def seam(a, where: str) -> dict:
    roots, code = {}, {}
    for side, rev, name in (("old", a.old_rev, "trainyard"), ("old_renamed", a.old_rev, "trainyard_old"),
                            ("new", a.new_rev, "trainyard")):
        folder = os.path.join(where, side)
        os.makedirs(folder)
        roots[side], commit = materialise(rev, folder, name)
        code[side] = {"rev": rev, "commit": commit, "package": name, **probe(roots[side], folder, name)}
    expected = {"old": "cfg", "old_renamed": "cfg", "new": "model"}
    if any(code[side]["parallelize_first_param"] != want for side, want in expected.items()):
        raise RuntimeError(f"the revisions do not import the expected code: {code}")
    in_job = []
    for model in a.seam_models:
        in_job.append(seam_in_job(model, os.pathsep.join([roots["old_renamed"], roots["new"]]), a, where))
        m = in_job[-1]
        print(f"  in-job {model}: old {m['old_tokens_per_s']:.0f} tok/s, new {m['new_tokens_per_s']:.0f} tok/s, "
              f"new/old speed {m['speed_ratio']:.3f} (CPU {m['cpu_speed_ratio']:.3f})", flush=True)
    launches = []
    for model in a.trainer_models:
        pairs = []
        for r in range(a.trainer_repeats):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            got = {side: trainer_run(roots[side], model, a, where) for side in order}
            pairs.append({"first": order[0], "old": got["old"], "new": got["new"],
                          "ratio": got["new"]["tokens_per_s"] / got["old"]["tokens_per_s"]})
            print(f"  trainer {model} pair {r + 1}/{a.trainer_repeats}: old {got['old']['tokens_per_s']:.0f} tok/s, "
                  f"new {got['new']['tokens_per_s']:.0f} tok/s", flush=True)
        launches.append({
            "model": model, "repeats": a.trainer_repeats, "steps": a.trainer_steps, "warmup_steps": a.trainer_warmup,
            "old_tokens_per_s": statistics.median(p["old"]["tokens_per_s"] for p in pairs),
            "new_tokens_per_s": statistics.median(p["new"]["tokens_per_s"] for p in pairs),
            "ratio": statistics.median(p["ratio"] for p in pairs),
            "ratio_min": min(p["ratio"] for p in pairs), "ratio_max": max(p["ratio"] for p in pairs),
            "same_final_loss": all(p["old"]["final_loss"] == p["new"]["final_loss"] for p in pairs),
            "old_layout": pairs[0]["old"]["layout"], "new_layout": pairs[0]["new"]["layout"], "pairs": pairs,
        })
    return {"code": code, "trainer": {"processes": 2, "omp_threads": 1, **TRAINER}, "in_job": in_job,
            "launches": launches}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20, help="part 1: interleaved pairs")
    p.add_argument("--steps", type=int, default=1, help="part 1: steps per block of a pair")
    p.add_argument("--warmup", type=int, default=3, help="part 1: untimed steps of each loop first")
    p.add_argument("--threads", type=int, default=1, help="part 1: torch intra-op threads")
    p.add_argument("--seam-models", type=lambda s: [m for m in s.split(",") if m], default=["tiny", "10m"])
    p.add_argument("--seam-repeats", type=int, default=20, help="part 2 in-job: interleaved pairs of steps")
    p.add_argument("--seam-warmup", type=int, default=3)
    p.add_argument("--trainer-models", type=lambda s: [m for m in s.split(",") if m], default=["tiny"])
    p.add_argument("--trainer-repeats", type=int, default=3, help="part 2 launches: pairs of trainer runs")
    p.add_argument("--trainer-steps", type=int, default=20)
    p.add_argument("--trainer-warmup", type=int, default=2)
    p.add_argument("--old-rev", default="ac20671")
    p.add_argument("--new-rev", default="HEAD")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-seam", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--seam-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-model", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.seam_worker:
        seam_worker(a)
        return 0

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
        print(f"\n1. engine API overhead, one process, {a.threads} thread(s), {ACCUM} micro-batches of {MICRO_ROWS} x "
              f"{SEQ} tokens; median of {a.repeats} interleaved pairs of {a.steps} step(s), after {a.warmup} warm-up")
        print(f"{'model':<40}{'params':>8}{'plain s':>9}{'API s':>8}{'API/plain':>10}{'q1-q3':>13}"
              f"{'CPU ratio':>10}{'q1-q3':>13}  goal")
        for c in cases:
            print(f"{c['model']:<40}{c['parameters'] / 1e6:>7.2f}M{c['plain_step_s']:>9.3f}{c['api_step_s']:>8.3f}"
                  f"{c['ratio']:>10.3f}{c['ratio_q1_q3'][0]:>7.3f}-{c['ratio_q1_q3'][1]:<5.3f}{c['cpu_ratio']:>10.3f}"
                  f"{c['cpu_ratio_q1_q3'][0]:>7.3f}-{c['cpu_ratio_q1_q3'][1]:<5.3f}"
                  f"  {'met' if c['goal_met'] else 'MISSED'}")
        print(f"goal API / plain <= {GOAL_OVERHEAD}: {sum(c['goal_met'] for c in cases)}/{len(cases)} met")
        for c in cases:
            print(f"  {c['case']}: accumulate {c['accumulate_call_us']:.1f} us per micro-batch, clip_grad_norm_ "
                  f"{c['api_clip_ms']:.2f} ms (torch's {c['torch_clip_ms']:.2f} ms): the API's calls add "
                  f"{c['api_calls_extra_ms_per_step']:+.2f} ms to a {c['plain_step_cpu_s'] * 1e3:.0f} ms step")
    if result_seam:
        code = result_seam["code"]
        print(f"\n2. built-in model, 2 processes (MiCS over both, fp32, global batch {TRAINER['global_batch_size']} x "
              f"{TRAINER['seq_len']}): old {code['old']['commit'][:7]} (parallelize(cfg, ...)) vs new "
              f"{code['new']['commit'][:7]} (transform -> parallelize(model, ...)); speed = new/old tokens/s")
        print(f"{'measure':<34}{'model':<7}{'old tok/s':>10}{'new tok/s':>10}{'speed':>7}{'q1-q3 / min-max':>17}"
              f"{'CPU':>7}  same loss")
        for m in result_seam["in_job"]:
            print(f"{'in one job, steps alternating':<34}{m['model']:<7}{m['old_tokens_per_s']:>10.0f}"
                  f"{m['new_tokens_per_s']:>10.0f}{m['speed_ratio']:>7.3f}{m['speed_ratio_q1_q3'][0]:>10.3f}-"
                  f"{m['speed_ratio_q1_q3'][1]:<6.3f}{m['cpu_speed_ratio']:>7.3f}  {m['max_loss_diff'] == 0}")
        for m in result_seam["launches"]:
            print(f"{'trainer launches, alternating':<34}{m['model']:<7}{m['old_tokens_per_s']:>10.0f}"
                  f"{m['new_tokens_per_s']:>10.0f}{m['ratio']:>7.3f}{m['ratio_min']:>10.3f}-{m['ratio_max']:<6.3f}"
                  f"{'':>7}  {m['same_final_loss']}")
    print(f"total {total:.0f} s; 1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"name": "engine_api", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "fingerprint": this_machine(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                                  f"{platform.python_version()}, torch {torch.__version__}",
                       "total_seconds": total, "load_average_1min": load, "goal_overhead": GOAL_OVERHEAD,
                       "overhead": cases, "seam": result_seam}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
