"""The README's quickstart script: a script written for SageMaker's contract, nothing Trainyard-specific.

Fits y = w . x + b to the CSV rows of the `train` channel (each host gets its own files: ShardedByS3Key),
with gradients averaged over every process (torch.distributed, as SageMaker's PyTorch containers set it up).
Rank 0 prints `epoch=E loss=L` lines (the Estimator's metric_definitions turn them into metrics), keeps a
checkpoint in /opt/ml/checkpoints (synced to checkpoint_s3_uri; a rerun resumes from it) and writes the
model to $SM_MODEL_DIR (model.tar.gz).
"""
import argparse
import glob
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--train", default=os.environ["SM_CHANNEL_TRAIN"])
parser.add_argument("--model-dir", default=os.environ["SM_MODEL_DIR"])
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
rows = [list(map(float, line.split(","))) for path in sorted(glob.glob(f"{args.train}/*.csv"))
        for line in open(path).read().split()]
data = torch.tensor(rows)
x, y = data[:, :-1], data[:, -1:]
model = torch.nn.Linear(x.shape[1], 1)
opt = torch.optim.SGD(model.parameters(), lr=args.lr * 100)

ckpt = os.path.join(os.environ.get("SM_CHECKPOINT_DIR", "/opt/ml/checkpoints"), "last.pt")
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    start = state["epoch"]
    print(f"resumed after epoch {start}", flush=True)
for epoch in range(start + 1, start + args.epochs + 1):
    for _ in range(50):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # average the gradients over all processes
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
    loss = loss.detach()
    dist.all_reduce(loss)
    if rank == 0:
        print(f"epoch={epoch} loss={loss.item() / dist.get_world_size():.6f}", flush=True)
        os.makedirs(os.path.dirname(ckpt), exist_ok=True)
        torch.save({"model": model.state_dict(), "epoch": epoch}, ckpt)
if rank == 0:
    torch.save(model.state_dict(), os.path.join(args.model_dir, "model.pt"))
dist.barrier()  # leave together: a rank that tears gloo down while another still talks to it can abort
dist.destroy_process_group()
