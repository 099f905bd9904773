"""A training script written for SageMaker, with nothing Trainyard-specific in it.

--mode ok: all-reduce once, write the model; --mode raise: rank --fail_rank raises; --mode sleep: wait
(at most --max_wait seconds) until stopped; --mode bandwidth: also time an 8 MiB all-reduce. With a
checkpoint location, local rank 0 of each host writes host-<host>.txt into $SM_CHECKPOINT_DIR, saying
what the previous run left there.
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--use_extra", type=lambda s: s.lower() == "true", default=True)
parser.add_argument("--mode", default="ok")
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--max_wait", type=float, default=120)
parser.add_argument("--model-dir", default=os.environ["SM_MODEL_DIR"])
parser.add_argument("--train", default=os.environ["SM_CHANNEL_TRAIN"])
parser.add_argument("--hosts", type=json.loads, default=os.environ["SM_HOSTS"])
args = parser.parse_args()

with open("/opt/ml/input/config/resourceconfig.json") as fh:  # hard-coded, as many scripts do
    resource = json.load(fh)
assert resource["hosts"] == args.hosts and resource["current_host"] == os.environ["SM_CURRENT_HOST"]

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
files = sorted(os.listdir(args.train))
print(f"rank={rank} world={world} host={resource['current_host']} epochs={args.epochs} "
      f"use_extra={args.use_extra} files={','.join(files)}", flush=True)

ckpt_dir = os.environ.get("SM_CHECKPOINT_DIR")
if ckpt_dir and os.environ["LOCAL_RANK"] == "0":
    path = os.path.join(ckpt_dir, f"host-{resource['current_host']}.txt")
    previous = open(path).read() if os.path.exists(path) else "none"
    with open(path, "w") as fh:
        fh.write(f"epochs={args.epochs} previous=[{previous}]")

if args.mode == "raise" and rank == args.fail_rank:
    time.sleep(0.5)
    raise ValueError(f"boom on rank {rank}")
if args.mode == "sleep":
    deadline = time.monotonic() + args.max_wait
    while time.monotonic() < deadline:
        time.sleep(0.2)
if args.mode == "bandwidth":  # time an all-reduce of 8 MiB: it crosses the hosts' links
    payload = torch.ones(2 * 1024 * 1024)
    dist.all_reduce(payload.clone())
    start = time.perf_counter()
    dist.all_reduce(payload)
    master = os.environ["SM_MASTER_ADDR"]
    print(f"allreduce_s={time.perf_counter() - start:.3f} master={master} at={socket.gethostbyname(master)}",
          flush=True)
t = torch.ones(1) * rank
dist.all_reduce(t)
if rank == 0:
    with open(os.path.join(args.model_dir, "model.json"), "w") as fh:
        json.dump({"sum_of_ranks": t.item(), "world": world}, fh)
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "notes.txt"), "w") as fh:
        fh.write("done")
dist.destroy_process_group()
