"""`make demo`: a real local job on the embedded defaults.

The built-in trainer trains the ~10M-parameter Llama-style model on 2 emulated hosts x 1 process each
(FSDP2 over gloo), checkpoints to s3:// on the embedded object store, and uploads model.tar.gz.
"""
import os
import time
from datetime import datetime, timezone

from trainyard import Estimator
from trainyard.sdk.store import store_root

STEPS = 20


def _megabytes(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files) / 1e6


job_name = "demo-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
checkpoints = f"s3://trainyard-demo/{job_name}/checkpoints"

est = Estimator(
    entry_point="trainyard.engine.train",
    instance_type="local",
    instance_count=2,
    hyperparameters={"model": "10m", "steps": STEPS, "checkpoint_every": 10, "seq_len": 128,
                     "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3},
    checkpoint_s3_uri=checkpoints,
    max_run=900,
)
print(f"Trainyard demo: job {job_name}, {STEPS} steps on 2 local hosts x {est.processes_per_host} process(es)\n",
      flush=True)
start = time.monotonic()
est.fit(job_name=job_name)
job = est.latest_training_job
m = job.metrics()
d = job.describe()
print(f"\n{d['TrainingJobName']}: {d['TrainingJobStatus']} in {time.monotonic() - start:.0f}s")
print(f"loss: step {m[0]['step']} {m[0]['loss']:.4f} -> step {m[-1]['step']} {m[-1]['loss']:.4f}")
print(f"model artifact: {d['ModelArtifacts']['S3ModelArtifacts']}")
print(f"checkpoints:    {checkpoints}/step-00000010/, step-00000020/ (each committed by its .metadata)")
print(f"job folder:     {job.dir}")
print(f"store:          the embedded S3 endpoint keeps these objects under {store_root()} ({_megabytes(store_root()):,.0f} "
      "MB now); `trainyard store` shows its address")
print(f"clean up:       trainyard store rm -r s3://trainyard-demo/{job_name} && "
      f"trainyard store rm -r s3://trainyard-default/{job_name} && trainyard rm {job_name}")
