"""A short script-mode job for the job-handle test: a few epochs over the 'training' channel, ~1.5 s."""
import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--model-dir", type=str, default=os.environ["SM_MODEL_DIR"])
parser.add_argument("--data-dir", type=str, default=os.environ["SM_CHANNEL_TRAINING"])
args = parser.parse_args()

files = sorted(os.listdir(args.data_dir))
for epoch in range(1, args.epochs + 1):
    print(f"epoch {epoch}/{args.epochs} files={','.join(files)}", flush=True)
    time.sleep(0.75)
with open(os.path.join(args.model_dir, "model.txt"), "w") as fh:
    fh.write(f"epochs={args.epochs}")
print("training finished", flush=True)
