"""Checkpoint throughput to the object store against raw s3fs, and what async saving saves the loop.

    python bench/checkpoint.py [--model 10m] [--repeats 7] [--json PATH]

One process, the built-in model with AdamW state after one step (fp32: parameters, two moments and the
step counters), saved to and loaded from the embedded store (the moto S3 server over HTTP on 127.0.0.1,
objects written through to disk) through `trainyard/engine/components/checkpoint.py` (DCP + s3fs, checksums, tensors only).
The raw baseline puts and gets the same files, same sizes, with s3fs directly (`pipe`: 50 MiB parts; `cat`: ranged
GETs in parallel). The checkpoint sends 8 MiB parts and reads each file in one streamed GET: the same transfers
made raw ("raw, as the checkpoint") show what the checkpoint's own work costs over them (`vs same`). Per entry: `bytes`,
`seconds` (median of the repeats), `ratio_to_raw` (throughput / raw throughput, the median over the
repeats of each repeat's ratio: the pair runs back to back, so machine noise cancels; goal >= 0.95),
`blocking_seconds` (the time the training loop waits: all of a synchronous save; for an async one, the call
plus what the next step's optimizer step waits for the background copy of the state, after the step's forward
and backward on 2 x 128 tokens (`step` in the runs); one saver makes every repeat's async save, as in a loop;
goal: async <= 2% of sync) and `rank_gbps` (the rank's
own GB/s of its share, as the metrics rows' `checkpoint_io` report it: its bytes over the time from the first
byte written or requested to the last).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="10m")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    from trainyard.sdk.store import ensure_store

    os.environ.update(ensure_store().env())
    import boto3
    import fsspec
    import torch

    from trainyard.engine.components import checkpoint as ckpt
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, init_weights
    from trainyard.engine.components.optim import build_optimizer, build_scheduler

    bucket = f"bench-ckpt-{int(time.time())}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    model = build_model(MODEL_CONFIGS[a.model])
    init_weights(model, 0, device="cpu")
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    sched = build_scheduler(opt, warmup_steps=1, total_steps=10, min_lr_ratio=0.1)
    model(torch.zeros(1, 8, dtype=torch.long)).float().pow(2).mean().backward()
    opt.step()
    sched.step()

    fs = fsspec.filesystem("s3", **ckpt.storage_options("s3://x"))
    runs: dict[str, list[float]] = {k: [] for k in ("save", "load", "raw_put", "raw_get", "same_put", "same_get",
                                                     "async_blocking", "async_total", "save_gbps", "load_gbps",
                                                     "step")}
    from fsspec.asyn import sync

    from trainyard.engine.components.checkpoint.io import _get_whole, put_in_parts
    batch = torch.randint(0, MODEL_CONFIGS[a.model].vocab_size, (2, 128))  # the step after an async save
    nbytes = 0
    # one saver for all repeats, as a loop has one for the job: its threads outlive a save (the first save starts
    # them, once a job: in the median only as one repeat of seven)
    saver = ckpt.AsyncSaver(f"s3://{bucket}/async", keep_last=2, say=lambda m: None)
    for r in range(a.repeats):
        uri = f"s3://{bucket}/run-{r}"
        t = time.perf_counter()
        moved: list = []
        ckpt.save_checkpoint(uri, 1, model, opt, sched, keep_last=2, moved=moved)
        runs["save"].append(time.perf_counter() - t)
        runs["save_gbps"].append(moved[0][0] / moved[0][1] / 1e9)
        files = {name: info["size"] for name, info in fs.find(ckpt.step_uri(uri, 1), detail=True).items()}
        nbytes = sum(files.values())
        t = time.perf_counter()
        moved.clear()
        ckpt.load_checkpoint(uri, 1, model, opt, sched, moved=moved)
        runs["load"].append(time.perf_counter() - t)
        runs["load_gbps"].append(moved[0][0] / moved[0][1] / 1e9)
        # raw: the same files (same names and sizes, random content) with s3fs alone
        blobs = {f"{bucket}/raw-{r}/{os.path.basename(n)}": os.urandom(size) for n, size in files.items()}
        t = time.perf_counter()
        for key, blob in blobs.items():
            fs.pipe(key, blob)
        runs["raw_put"].append(time.perf_counter() - t)
        fs.invalidate_cache()
        t = time.perf_counter()
        for key in blobs:
            fs.cat(key)
        runs["raw_get"].append(time.perf_counter() - t)
        # the checkpoint's transfers, made raw: 8 MiB parts, one streamed GET a file; other random bytes (the store
        # keeps one copy on disk of equal contents: the same bytes again would skip its write)
        blobs = {key: os.urandom(len(blob)) for key, blob in blobs.items()}
        t = time.perf_counter()
        for key, blob in blobs.items():
            put_in_parts(fs, f"{key}.same", blob)
        runs["same_put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for key in blobs:
            sync(fs.loop, _get_whole, fs, f"{key}.same")
        runs["same_get"].append(time.perf_counter() - t)
        t = time.perf_counter()
        blocked = saver.save(r + 1, model, opt, sched)
        # the next step, as a loop runs it: its forward and backward overlap the background copy of the state, and
        # its optimizer step waits for what is left of the copy (`held`): the loop's cost is both
        start = time.perf_counter()
        model(batch).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        runs["step"].append(time.perf_counter() - start)
        runs["async_blocking"].append(blocked + saver.take_held())
        assert saver.wait(), "async save failed"
        runs["async_total"].append(time.perf_counter() - t)
    for bucket_key in fs.find(bucket):  # the user's store keeps what is left: leave nothing
        fs.rm_file(bucket_key)
    fs.rmdir(bucket)
    med = {k: statistics.median(v) for k, v in runs.items()}

    def ratio(raw: str, ours: str) -> float:
        return statistics.median(r / o for r, o in zip(runs[raw], runs[ours]))

    entries = [
        {"name": "raw s3fs put", "bytes": nbytes, "seconds": med["raw_put"], "ratio_to_raw": 1.0,
         "blocking_seconds": med["raw_put"]},
        {"name": "checkpoint save (sync)", "bytes": nbytes, "seconds": med["save"],
         "ratio_to_raw": ratio("raw_put", "save"), "blocking_seconds": med["save"], "rank_gbps": med["save_gbps"]},
        {"name": "checkpoint save (async)", "bytes": nbytes, "seconds": med["async_total"],
         "ratio_to_raw": ratio("raw_put", "async_total"), "blocking_seconds": med["async_blocking"]},
        {"name": "raw put, as the checkpoint", "bytes": nbytes, "seconds": med["same_put"],
         "ratio_to_raw": ratio("raw_put", "same_put"), "blocking_seconds": med["same_put"]},
        {"name": "raw s3fs get", "bytes": nbytes, "seconds": med["raw_get"], "ratio_to_raw": 1.0,
         "blocking_seconds": med["raw_get"]},
        {"name": "raw get, as the checkpoint", "bytes": nbytes, "seconds": med["same_get"],
         "ratio_to_raw": ratio("raw_get", "same_get"), "blocking_seconds": med["same_get"]},
        {"name": "checkpoint load (verified)", "bytes": nbytes, "seconds": med["load"],
         "ratio_to_raw": ratio("raw_get", "load"), "blocking_seconds": med["load"], "rank_gbps": med["load_gbps"]},
    ]
    print(f"\nmodel {a.model}, {nbytes / 1e6:.1f} MB of checkpoint, embedded store, median of {a.repeats}")
    print(f"{'entry':<28}{'MB':>8}{'s':>8}{'MB/s':>8}{'vs raw':>8}{'blocking s':>12}{'rank GB/s':>11}")
    for e in entries:
        gbps = f"{e['rank_gbps']:>11.3f}" if "rank_gbps" in e else f"{'':>11}"
        print(f"{e['name']:<28}{e['bytes'] / 1e6:>8.1f}{e['seconds']:>8.2f}{e['bytes'] / 1e6 / e['seconds']:>8.1f}"
              f"{e['ratio_to_raw']:>8.2f}{e['blocking_seconds']:>12.3f}{gbps}")
    share = statistics.median(b / s for b, s in zip(runs["async_blocking"], runs["save"]))
    save, load = (next(e for e in entries if e["name"] == n) for n in ("checkpoint save (sync)",
                                                                      "checkpoint load (verified)"))
    print(f"goal save and load >= 0.95 x raw: {save['ratio_to_raw']:.2f}, {load['ratio_to_raw']:.2f}; "
          f"async blocking <= 2% of sync: {share:.1%} (the step it overlaps: {med['step']:.3f} s); vs the same "
          f"transfers made raw: save {ratio('same_put', 'save'):.2f}, load {ratio('same_get', 'load'):.2f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"name": "checkpoint", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "fingerprint": this_machine(), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": a.model,
                       "runs": runs, "entries": entries}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
