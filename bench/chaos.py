"""Chaos suite: faults injected into a 2 hosts x 2 processes local job of the built-in trainer, with retries.

    python bench/chaos.py [--faults rank_sigkill,...] [--steps 40] [--json PATH]

One clean run gives the reference weights; then, for each fault, the same job (checkpoint every 5 steps,
`max_retry_attempts=1`, `hang_timeout_s=10`) has the fault injected once rank 3 reaches a random step
between 8 and 20 (seeded), and the suite measures:

  detect_s     the fault -> the end of the attempt it broke (the job noticed and stopped it); none when the
               attempt rode the fault out (then nothing is lost: steps_lost 0)
  recover_s    the fault -> the next attempt's first new metrics row (training again; within 0.2 s)
  steps_lost   the last step done at the fault (rank 0's last metrics row) - the step the next attempt resumed
               from (0 when the ranks went on past the fault: an orphaned host trains until it is stopped)
  identical    the final weights equal the clean run's, bit for bit (fp32 on CPU)
  left         processes of the job and network namespaces left once it ended (0 expected)

Faults:
  rank_sigkill   SIGKILL of rank 3 (the OOM killer)
  host_sigkill   SIGKILL of algo-2's driver (torchrun with it): the host is lost, its ranks orphaned
  rank_sigstop   SIGSTOP of rank 3: a hang, found by the heartbeats
  ckpt_corrupt   the newest committed checkpoint damaged, then rank 3 killed: the retry skips the step
  link_cut       algo-2's link down for 15 s (emulated network, root only): a hang in a collective
  store_down     the object store unreachable for 30 s (every connection closed unanswered, by a proxy in
                 front of the embedded store that the job is pointed at), spanning the next checkpoint save
  disk_full      the file system of the job folder (a 256 MiB tmpfs as TRAINYARD_HOME, root only) filled for
                 5 s; this fault gets max_retry_attempts=2
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone

from trainyard.container.failure import headline
from trainyard.engine.components.fingerprint import this_machine

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo: tests.e2e's proxy

FAULTS = ("rank_sigkill", "host_sigkill", "rank_sigstop", "ckpt_corrupt", "link_cut", "store_down", "disk_full")
HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 5, "lr": 0.01,
       "warmup_steps": 2, "checkpoint_every": 5, "log_every": 10}
HANG_TIMEOUT_S = 10


def _s3():
    from trainyard.sdk.store import ensure_store

    return ensure_store().client()  # with this store's own key: it refuses any other


def _weights(uri: str) -> dict:
    import torch

    bucket, key = uri[len("s3://"):].split("/", 1)
    data = _s3().get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return torch.load(io.BytesIO(tar.extractfile("model.pt").read()), weights_only=True)


def _estimator(ckpt: str, steps: int, **kw):
    from trainyard import Estimator

    return Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                     processes_per_host=2, max_run=900, checkpoint_s3_uri=ckpt,
                     hyperparameters={**HPS, "steps": steps, "decay_steps": steps}, **kw)


def _beat(job, host: str, rank: int) -> dict:
    try:
        with open(f"{job.dir}/torchrun/{host}/heartbeat/rank-{rank}.json") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _job_processes(name: str) -> int:
    mark = f"TRAINING_JOB_NAME={name}".encode()
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if mark in fh.read().split(b"\0"):
                    n += 1
        except OSError:
            pass
    return n


def _corrupt_newest(ckpt: str) -> int | None:
    """Flip bytes in a data file of the newest committed step; returns that step."""
    from trainyard.engine.components.checkpoint import latest_committed_step, step_uri

    s3 = _s3()
    saved = dict(os.environ)
    from trainyard.sdk.store import ensure_store

    os.environ.update(ensure_store().env())  # the store's endpoint and its own key (it refuses any other)
    try:  # the engine's reader, pointed at the embedded store for this call only
        step = latest_committed_step(ckpt)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if step is None:
        return None
    bucket, prefix = step_uri(ckpt, step)[len("s3://"):].split("/", 1)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
            if o["Key"].endswith(".distcp")]
    body = bytearray(s3.get_object(Bucket=bucket, Key=keys[0])["Body"].read())
    for i in range(0, len(body), max(1, len(body) // 16)):
        body[i] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=keys[0], Body=bytes(body))
    return step


def _cut_link(pid: int, seconds: float) -> None:
    """algo-2's link down for `seconds`, from a helper process (the suite keeps measuring)."""
    ns = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()
    if not ns:
        raise RuntimeError(f"process {pid} is in no named network namespace")
    script = (f"ip netns exec {ns} ip link set eth0 down; sleep {seconds}; ip netns exec {ns} ip link set eth0 up")
    subprocess.Popen(["sh", "-c", script], start_new_session=True)


def _fill(path: str, seconds: float) -> None:
    """Fill the file system of `path` for `seconds`, from a helper process."""
    script = f"dd if=/dev/zero of={path} bs=1M 2>/dev/null; sleep {seconds}; rm -f {path}"
    subprocess.Popen(["sh", "-c", script], start_new_session=True)


@contextlib.contextmanager
def _world(fault: str, tag: str):
    """What a fault needs around its job: the store behind a proxy it can take down, or a small disk."""
    saved = dict(os.environ)
    proxy = mount = server = None
    try:
        if fault == "store_down":
            # a moto server of its own behind the proxy: the embedded store refuses a request signed for another
            # address than its own (the proxy's), as it should
            import boto3
            from moto.server import ThreadedMotoServer

            from tests.e2e.faulty_proxy import FaultyProxy
            from trainyard.sdk.store_server import DEFAULT_BUCKET

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            proxy = FaultyProxy(f"http://{host}:{port}", rate=0.0).__enter__()
            os.environ.update({"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
            s3 = boto3.client("s3")
            for bucket in (f"chaos-{tag}", DEFAULT_BUCKET):
                s3.create_bucket(Bucket=bucket)
        elif fault == "disk_full":
            mount = f"/tmp/chaos-disk-{tag}"
            os.makedirs(mount, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", mount], check=True)
            os.environ["TRAINYARD_HOME"] = mount
        yield {"proxy": proxy, "mount": mount}
    finally:
        if proxy is not None:
            proxy.__exit__(None, None, None)
        if server is not None:
            server.stop()
        os.environ.clear()
        os.environ.update(saved)
        if mount is not None:
            from trainyard.sdk.store import stop_store

            os.environ["TRAINYARD_HOME"] = mount
            stop_store()  # the store of that home
            os.environ.clear()
            os.environ.update(saved)
            subprocess.run(["umount", "-l", mount], check=False)


def inject(fault: str, job, ckpt: str, world: dict) -> dict:
    pid = _beat(job, "algo-2", 3)["pid"]
    info = {}
    if fault == "rank_sigkill":
        os.kill(pid, signal.SIGKILL)
    elif fault == "host_sigkill":
        os.kill(_ppid(pid), signal.SIGKILL)  # the rank's parent: the driver, which runs torchrun in-process
    elif fault == "rank_sigstop":
        os.kill(pid, signal.SIGSTOP)
    elif fault == "ckpt_corrupt":
        info["corrupted_step"] = _corrupt_newest(ckpt)
        os.kill(pid, signal.SIGKILL)
    elif fault == "link_cut":
        _cut_link(pid, 15)
    elif fault == "store_down":
        world["proxy"].down(30)
    elif fault == "disk_full":
        _fill(os.path.join(world["mount"], "fill"), 5)
    else:
        raise ValueError(fault)
    rows = job._written()  # rank 0 writes a row after each step: the step the job was at
    info["fault_step"] = rows[-1]["step"] if rows else 0
    return info


def run_fault(fault: str, steps: int, at_step: int, clean: dict, tag: str) -> dict:
    with _world(fault, tag) as world:
        return _run_fault(fault, steps, at_step, clean, tag, world)


def _run_fault(fault: str, steps: int, at_step: int, clean: dict, tag: str, world: dict) -> dict:
    import torch

    from trainyard.sdk.backends.local import netem

    ckpt = f"s3://chaos-{tag}/{fault}"
    extra = {"emulated_network": {"bandwidth_mbit": 1000, "delay_ms": 0.2}} if fault == "link_cut" else {}
    retries = 2 if fault == "disk_full" else 1
    est = _estimator(ckpt, steps, max_retry_attempts=retries, hang_timeout_s=HANG_TIMEOUT_S, **extra)
    job = est.fit(wait=False, logs="None")
    deadline = time.monotonic() + 240
    while (_beat(job, "algo-2", 3).get("step") or 0) < at_step:
        if time.monotonic() > deadline or job.status() != "InProgress":
            raise RuntimeError(f"{fault}: rank 3 never reached step {at_step}:\n{job.log_text()[-2000:]}")
        time.sleep(0.05)
    t_fault = time.time()
    info = inject(fault, job, ckpt, world)
    recovered, rows_at_end = None, None  # the rows when the broken attempt ended; a new one is training again
    while job.status() == "InProgress":
        if rows_at_end is None and job._status().get("Attempts"):
            rows_at_end = len(job.metrics())
        elif rows_at_end is not None and recovered is None and len(job.metrics()) > rows_at_end:
            recovered = time.time()
        time.sleep(0.2)
    d = job.describe()
    attempts = d.get("Attempts", [])
    text = job.log_text()
    resumed = [int(line.split("resumed from step ")[1].split()[0]) for line in text.splitlines()
               if "resumed from step " in line]
    weights = _weights(d["ModelArtifacts"]["S3ModelArtifacts"]) if d["TrainingJobStatus"] == "Completed" else {}
    time.sleep(1.0)  # the supervisor's last kills
    left = _job_processes(job.name) + len(netem.leftovers() if fault == "link_cut" else [])
    return {
        "fault": fault, "job": job.name, "outcome": d["TrainingJobStatus"], **info,
        "attempts": len(attempts), "retry_class": attempts[0].get("RetryClass") if attempts else None,
        # a fault the attempt rode out (no retry): nothing detected, recovered or lost
        "detect_s": round(attempts[0]["EndTime"].timestamp() - t_fault, 2) if len(attempts) > 1 else None,
        "recover_s": round(recovered - t_fault, 2) if recovered and len(attempts) > 1 else None,
        "resumed_from": resumed[-1] if resumed else None,
        "steps_lost": (max(0, info["fault_step"] - (resumed[-1] if resumed else 0)) if len(attempts) > 1 else 0)
        if info.get("fault_step") else None,
        "skipped_damaged": "is damaged and is skipped" in text,
        "identical": bool(weights) and weights.keys() == clean.keys() and all(torch.equal(weights[k], clean[k])
                                                                               for k in clean),
        "left": left,
        "reason": headline(attempts[0].get("FailureReason", ""))[:160] if attempts else "",
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    faults = [f for f in a.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; choose from {','.join(FAULTS)}")
    from trainyard.sdk.backends.local import netem

    t0 = time.time()
    tag = datetime.now(timezone.utc).strftime("%Y%m%d%H%M%S")
    rng = random.Random(a.seed)
    clean_est = _estimator(f"s3://chaos-{tag}/clean", a.steps)
    clean_est.fit(logs="None")
    clean = _weights(clean_est.model_data)
    rows, skipped = [], {}
    for fault in faults:
        if fault == "link_cut" and netem.unavailable_reason():
            skipped[fault] = netem.unavailable_reason()
            continue
        if fault == "disk_full" and os.geteuid() != 0:
            skipped[fault] = "mounting a size-limited tmpfs needs root"
            continue
        at = rng.randint(8, 20)
        print(f"[chaos] {fault} at step {at} ...", flush=True)
        rows.append(run_fault(fault, a.steps, at, clean, tag))
        print(f"[chaos] {json.dumps(rows[-1])}", flush=True)
    cols = ("fault", "outcome", "retry_class", "fault_step", "resumed_from", "steps_lost", "detect_s", "recover_s",
            "identical", "left")
    print(f"\nchaos suite: local 2 hosts x 2 processes, tiny model, {a.steps} steps, checkpoint every 5, "
          f"hang_timeout_s={HANG_TIMEOUT_S}; {os.cpu_count()} cores")
    print("".join(f"{c:>17}" for c in cols))
    for r in rows:
        print("".join(f"{str(r[c]):>17}" for c in cols))
    for name, why in skipped.items():
        print(f"{name:>14}  not run: {why}")
    result = {"name": "chaos", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "fingerprint": this_machine(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
              "steps": a.steps, "hang_timeout_s": HANG_TIMEOUT_S, "rows": rows, "not_run": skipped,
              "seconds": round(time.time() - t0, 1)}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0 if all(r["outcome"] == "Completed" and r["identical"] and r["left"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
