"""Helpers for end-to-end tests of local jobs."""
import io
import os
import tarfile
import time


SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def store_client():
    from trainyard.sdk.store import ensure_store

    return ensure_store().client()


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


def assert_no_processes_left(job, timeout=10.0):
    deadline = time.monotonic() + timeout
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_processes(job) == [], f"processes of {job.name} survived"


def wait_for_log(job, text, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in job.log_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in the logs of {job.name}:\n{job.log_text()[-3000:]}")
