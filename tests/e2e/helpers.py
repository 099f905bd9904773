"""Helpers for end-to-end tests of local jobs."""
import io
import json
import os
import signal
import tarfile
import threading
import time

from tests.waiting import eventually, within


SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def store_client():
    from trainyard.sdk.store import ensure_store

    return ensure_store().client()


def empty_prefix(bucket: str, prefix: str) -> None:
    """Delete the store's objects under `prefix` (if the bucket exists): an example that names a fixed location
    (s3://my-bucket/...) resumes from what an earlier run on the same store left there."""
    s3 = store_client()
    if bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        return
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])


def use_store(monkeypatch) -> None:
    """This test process's s3:// calls go to the embedded store, with its key (as a job's processes do)."""
    from trainyard.sdk.store import ensure_store

    for k, v in ensure_store().env().items():
        monkeypatch.setenv(k, v)


def unuse_store(monkeypatch) -> None:
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)


def read_tar(uri: str) -> dict[str, bytes]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    data = store_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def job_processes(job) -> list[int]:
    """Live processes that belong to `job`: its supervisor, drivers and every rank (by environment)."""
    mark_env = f"TRAINING_JOB_NAME={job.name}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if job.dir.encode() in cmd or mark_env in env:
            found.append(int(pid))
    return found


def host_processes(job, host: str) -> list[int]:
    """Live processes of `job` on emulated host `host`: its driver (by its folder in the command line) and what
    the driver started (by `SM_CURRENT_HOST` in their environment)."""
    folder, mine = f"{job.dir}/hosts/{host}".encode(), f"SM_CURRENT_HOST={host}".encode()
    found = []
    for pid in job_processes(job):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if folder in cmd or mine in env:
            found.append(pid)
    return found


def driver_of(pid: int) -> int:
    """The host's driver above process `pid` (a rank's parent, or with a preload server its grandparent)."""
    while pid > 1:
        with open(f"/proc/{pid}/stat") as fh:
            pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"trainyard.container.driver" in fh.read().split(b"\0"):
                return pid
    raise AssertionError("no driver above the process")


def _halted(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (or the process is gone, or a zombie)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] not in "tTZX":
                    return False
        except OSError:
            continue
    return True


def kill_at_once(job) -> int:
    """SIGKILL every process of `job` at one moment, as a host that loses power ends them: each found is stopped
    first, and once all of them are seen stopped (a fork under way when SIGSTOP came completes first: its child is
    then there to find) the search repeats until it finds none it has not stopped; only then are they all killed.
    Killed one by one instead, a process forked in between would outlive its killed parent. Returns how many."""
    stopped: list[int] = []
    for _ in range(50):
        new = [p for p in job_processes(job) if p not in stopped]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            stopped.append(p)
        within(lambda: all(_halted(p) for p in stopped), 10.0, interval=0.01)
    for p in stopped:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(stopped)


def describe_processes(pids) -> str:
    """One line per process: pid, parent, state, kernel wait channel, age and command line (a failure's evidence)."""
    tick, boot = os.sysconf("SC_CLK_TCK"), time.clock_gettime(time.CLOCK_BOOTTIME)
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/wchan") as fh:
                wchan = fh.read().strip() or "-"
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")[:300]
        except OSError:
            lines.append(f"{pid}: gone")
            continue
        age = boot - int(fields[19]) / tick
        lines.append(f"{pid}: parent {fields[1]}, state {fields[0]}, wchan {wchan}, age {age:.2f} s: {cmd}")
    return "\n".join(lines)


def assert_no_processes_left(job, timeout=10.0):
    within(lambda: not job_processes(job), timeout, interval=0.2)
    left = job_processes(job)
    assert left == [], f"processes of {job.name} survived:\n{describe_processes(left)}"


def wait_for_log(job, text, timeout=120.0):
    eventually(lambda: text in job.log_text(), timeout, interval=0.2,
               what=lambda: f"{text!r} in the logs of {job.name}:\n{job.log_text()[-3000:]}")


def heartbeat(job, host: str, rank: int) -> dict | None:
    """Rank `rank`'s heartbeat on `host` (engine/components/heartbeat.py), or None before its first."""
    try:
        with open(f"{job.dir}/torchrun/{host}/heartbeat/rank-{rank}.json") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def beat_at_step(job, host: str, rank: int, step: int, timeout: float = 180.0) -> dict:
    """Rank `rank`'s heartbeat on `host` once it reports step `step` or later."""
    def reached():
        beat = heartbeat(job, host, rank)
        return beat if beat and (beat.get("step") or 0) >= step and beat.get("pid") else None
    return eventually(reached, timeout, what=lambda: f"{host} rank {rank} at step {step}:\n{job.log_text()[-3000:]}")



class CpuShare:
    """The processes `pids()` names (every thread of each) limited together to `share` of one CPU, as a throttled
    host or a noisy neighbour limits them: a cgroup of their own with a CFS quota (cgroup v1's cpu controller, or
    v2's cpu.max). A thread keeps moving what `pids()` names in (a host's processes start one after another) until
    exit, which puts them all back. Needs root, as the namespace and traffic-shaping tests do."""

    PERIOD_US = 100_000

    def __init__(self, pids, share: float, every_s: float = 0.05):
        self.pids, self.quota, self.every_s = pids, int(share * self.PERIOD_US), every_s
        v1 = "/sys/fs/cgroup/cpu"
        if os.path.isfile(f"{v1}/cpu.cfs_quota_us"):
            self.root, self.limit = v1, {"cpu.cfs_period_us": str(self.PERIOD_US), "cpu.cfs_quota_us": str(self.quota)}
        elif "cpu" in open("/sys/fs/cgroup/cgroup.controllers").read().split():
            self.root, self.limit = "/sys/fs/cgroup", {"cpu.max": f"{self.quota} {self.PERIOD_US}"}
        else:
            raise RuntimeError("no cgroup cpu controller to limit a process's CPU share with (cgroup v1 "
                               "/sys/fs/cgroup/cpu or v2 with cpu in cgroup.controllers)")
        self.path = f"{self.root}/trainyard-test-{os.getpid()}-{id(self)}"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._keep_moving, daemon=True)

    def _move(self, pid: int, into: str) -> None:
        try:
            with open(f"{into}/cgroup.procs", "w") as fh:
                fh.write(str(pid))
        except OSError:  # it has exited
            pass

    def _keep_moving(self) -> None:
        while not self._done.is_set():
            for pid in self.pids():
                self._move(pid, self.path)
            self._done.wait(self.every_s)

    def __enter__(self) -> "CpuShare":
        os.makedirs(self.path)
        for name, value in self.limit.items():
            with open(f"{self.path}/{name}", "w") as fh:
                fh.write(value)
        for pid in self.pids():
            self._move(pid, self.path)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        for _ in range(50):  # threads move one by one; one being created lands in the group it is leaving
            with open(f"{self.path}/cgroup.procs") as fh:
                for task in fh.read().split():
                    self._move(int(task), self.root)
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"could not remove {self.path}")
