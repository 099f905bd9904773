"""A script-mode training script that reports what SageMaker's training toolkit promises it: the
hyperparameters as command-line arguments (parsed the way SageMaker's examples parse them), every SM_*
variable, MASTER_ADDR/MASTER_PORT (set by SageMaker's PyTorch container), the algo-N host names, and the
files of each channel. One line `SMENV {json}` per host; algo-1 also writes it to SM_MODEL_DIR.
"""
import argparse
import ast
import json
import os
import socket
import sys

parser = argparse.ArgumentParser()
# hyperparameters sent by the client are passed as command-line arguments to the script.
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--flag", type=lambda s: s == "True", default=False)
parser.add_argument("-k", type=int, default=0)
parser.add_argument("--layers", type=ast.literal_eval, default=[])
parser.add_argument("--learning_rate", type=str, default=5e-5)
parser.add_argument("--model_name", type=str)
parser.add_argument("--opts", type=str, default="")
parser.add_argument("--use-cuda", type=lambda s: s == "True", default=True)

# Data, model, and output directories
parser.add_argument("--hosts", type=list, default=json.loads(os.environ["SM_HOSTS"]))
parser.add_argument("--current-host", type=str, default=os.environ["SM_CURRENT_HOST"])
parser.add_argument("--model-dir", type=str, default=os.environ["SM_MODEL_DIR"])
parser.add_argument("--output-data-dir", type=str, default=os.environ["SM_OUTPUT_DATA_DIR"])
parser.add_argument("--num-gpus", type=int, default=os.environ["SM_NUM_GPUS"])
parser.add_argument("--train", type=str, default=os.environ["SM_CHANNEL_TRAIN"])
parser.add_argument("--test", type=str, default=os.environ["SM_CHANNEL_TEST"])
parser.add_argument("--extra", type=str, default=os.environ["SM_CHANNEL_EXTRA"])

args = parser.parse_args()  # strict: an argument the toolkit would not pass fails here

resolved, resolve_errors = {}, {}
for host in args.hosts:  # what sagemaker_pytorch_container.training._dns_lookup does first
    try:
        resolved[host] = socket.gethostbyname(host)
    except OSError as e:
        resolve_errors[host] = repr(e)
bind_error = None
try:  # this host's own name is an address of this host
    with socket.socket() as s:
        s.bind((socket.gethostbyname(args.current_host), 0))
except OSError as e:
    bind_error = repr(e)

with open(os.path.join(args.output_data_dir, "written-by-" + args.current_host), "w") as fh:
    fh.write("ok")

report = {
    "host": args.current_host,
    "argv": sys.argv[1:],
    "args": vars(args),
    "env": {k: v for k, v in os.environ.items()
            if k.startswith("SM_") or k in ("MASTER_ADDR", "MASTER_PORT", "TRAINING_JOB_NAME")},
    "resolved": resolved,
    "resolve_errors": resolve_errors,
    "bind_error": bind_error,
    "channels": {name: sorted(os.listdir(path)) for name, path in
                 (("train", args.train), ("test", args.test), ("extra", args.extra))},
    "model_dir_is_dir": os.path.isdir(args.model_dir),
}
print("SMENV " + json.dumps(report, sort_keys=True), flush=True)
if args.current_host == args.hosts[0]:
    with open(os.path.join(args.model_dir, "env.json"), "w") as fh:
        json.dump(report, fh)
