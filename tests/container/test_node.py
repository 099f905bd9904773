"""The node agent, playing one EC2 instance: moto (S3, EC2, CloudWatch Logs) over HTTP, a fake IMDS per
instance, the agent and the driver as real processes on loopback."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace
import urllib.error
import urllib.request
from datetime import datetime

import boto3
import pytest

from trainyard.container import hostnames, imds, logship, metricship, node, peers, staging
from trainyard.job.storage import shard
from trainyard.sdk import packaging
from trainyard.job.spec import build_spec

from .fake_imds import FakeImds
from tests.waiting import eventually

JOB_TIMEOUT_S = 180  # one agent run: boto3 and torch imports on a busy 2-core machine, then the script

TRAIN = textwrap.dedent('''\
    import argparse, os, signal, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ok")
    p.add_argument("--marker", default="")
    a = p.parse_args()
    host = os.environ["SM_CURRENT_HOST"]
    print(f"hello from {host} of {os.environ['SM_HOSTS']}", flush=True)
    if a.mode == "ok":
        train = os.environ["SM_CHANNEL_TRAIN"]
        for d, _, names in sorted(os.walk(train)):
            for name in sorted(names):
                rel = os.path.relpath(os.path.join(d, name), train)
                print(f"train file {rel}: {open(os.path.join(d, name)).read().strip()}", flush=True)
        if "SM_CHANNEL_REF" in os.environ:
            print("fsx says " + open(os.path.join(os.environ["SM_CHANNEL_REF"], "ref.txt")).read().strip(), flush=True)
        open(os.path.join(os.environ["SM_MODEL_DIR"], "model.txt"), "w").write("weights")
    elif a.mode == "long":
        def on_term(signum, frame):
            open(a.marker, "w").write("SIGTERM")
            print("got SIGTERM: emergency checkpoint written", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        open(a.marker + ".started", "w").write("1")
        for step in range(1200):  # at most ~2 minutes
            print(f"step {step}", flush=True)
            time.sleep(0.1)
    elif a.mode == "fail":
        raise ValueError("boom-7f3a: the data is corrupt")
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def aws(s3_endpoint, tmp_path):
    """A clean moto: a versioned bucket (every status write is kept) and the job's code uploaded."""
    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST"), timeout=30).read()
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="jobs")
    s3.put_bucket_versioning(Bucket="jobs", VersioningConfiguration={"Status": "Enabled"})
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(TRAIN)
    code_uri = packaging.upload(packaging.package(str(src)), "s3://jobs/code")
    return {"endpoint": s3_endpoint, "s3": s3, "ec2": boto3.client("ec2"), "logs": boto3.client("logs"),
            "code_uri": code_uri}


def _job(aws, name: str, *, hyperparameters: dict, count: int = 1, channels=(), attempt: int = 1):
    spec = build_spec(job_name=name, entry_point="train.py", entry_kind="script", code_uri=aws["code_uri"],
                      instance_type="g5.xlarge", instance_count=count, processes_per_host=1,
                      hyperparameters=hyperparameters, channels=list(channels), output_path="s3://jobs/out",
                      image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard:test", max_run=600)
    state_uri = f"s3://jobs/out/{name}/trainyard"
    aws["s3"].put_object(Bucket="jobs", Key=f"out/{name}/trainyard/spec.json", Body=spec.to_json().encode())
    r = aws["ec2"].run_instances(
        ImageId="ami-12c6146b", MinCount=count, MaxCount=count, InstanceType="g5.xlarge",
        TagSpecifications=[{"ResourceType": "instance", "Tags": [
            {"Key": "trainyard:job", "Value": name}, {"Key": "trainyard:attempt", "Value": str(attempt)}]}])
    instances = sorted(r["Instances"], key=lambda i: i["AmiLaunchIndex"])
    return spec, state_uri, [i["InstanceId"] for i in instances]


def _start_agent(state_uri: str, fake: FakeImds, root, fsx_root, *, port: int, attempt: int = 1) -> subprocess.Popen:
    """The agent as a process; its hosts file is `<root>.hosts` (the machine's /etc/hosts stays as it is)."""
    env = {**os.environ, "TRAINYARD_IMDS_ENDPOINT": fake.url, "TRAINYARD_MASTER_ADDR": "127.0.0.1",
           "TRAINYARD_MASTER_PORT": str(port), "TRAINYARD_FSX_ROOT": str(fsx_root), "TRAINYARD_SPOT_POLL_S": "0.2",
           "TRAINYARD_PEER_WAIT_S": "60", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainyard.container.node", "--state-uri", state_uri, "--region", "us-east-1",
           "--attempt", str(attempt), "--root", str(root), "--hosts-file", f"{root}.hosts"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the agent did not finish in {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def _statuses(aws, state_uri: str, host: str) -> list[dict]:
    """Every version of the host's status object, oldest first (S3 lists the newest first; a rewrite with new
    host phases keeps its phase's time)."""
    key = state_uri[len("s3://jobs/"):] + f"/hosts/{host}/status.json"
    versions = aws["s3"].list_object_versions(Bucket="jobs", Prefix=key).get("Versions", [])
    docs = [json.loads(aws["s3"].get_object(Bucket="jobs", Key=key, VersionId=v["VersionId"])["Body"].read())
            for v in reversed(versions) if v["Key"] == key]
    return sorted(docs, key=lambda d: d["time"])


def _changes(history: list[dict]) -> list[str]:
    """The phases of the status objects `history`, each once where it was written again (new host phases)."""
    phases = [d["phase"] for d in history]
    return [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]


def _log_lines(aws, stream: str) -> list[str]:
    events, token = [], None
    for _ in range(100):  # bounded paging
        kw = {"nextToken": token} if token else {}
        r = aws["logs"].get_log_events(logGroupName=node.LOG_GROUP, logStreamName=stream, startFromHead=True, **kw)
        events += r["events"]
        if not r["events"] or r.get("nextForwardToken") == token:
            break
        token = r.get("nextForwardToken")
    return [e["message"] for e in events]


def _wait_for(path, timeout: float, proc: subprocess.Popen) -> None:
    def appeared():
        if proc.poll() is not None and not os.path.exists(path):
            out = proc.stdout.read()[-4000:]
            raise AssertionError(f"the agent exited ({proc.returncode}) before {path} appeared:\n{out}")
        return os.path.exists(path)
    eventually(appeared, timeout, what=f"{path} appeared")


# -- end to end on one "instance" ----------------------------------------------------------------


@pytest.mark.slow
def test_agent_downloads_runs_logs_and_reports_completed(aws, tmp_path):
    aws["s3"].put_object(Bucket="jobs", Key="data/train/a.txt", Body=b"alpha")
    aws["s3"].put_object(Bucket="jobs", Key="data/train/sub/b.txt", Body=b"beta")
    fsx = tmp_path / "fsx"
    (fsx / "fs-0123456789abcdef0" / "refdata").mkdir(parents=True)
    (fsx / "fs-0123456789abcdef0" / "refdata" / "ref.txt").write_text("lustre")
    channels = [{"name": "train", "uri": "s3://jobs/data/train"},
                {"name": "ref", "uri": "fsx://fs-0123456789abcdef0/refdata"}]
    spec, state_uri, ids = _job(aws, "node-ok", hyperparameters={"mode": "ok"}, channels=channels)
    root = tmp_path / "ml"
    with FakeImds(0, ids[0]) as fake:
        code, out = _finish(_start_agent(state_uri, fake, root, fsx, port=_free_port()))
    assert code == 0, out[-4000:]

    history = _statuses(aws, state_uri, "algo-1")
    assert _changes(history) == ["Starting", "Downloading", "Training", "Uploading", "Completed"], out
    final = history[-1]
    assert set(final) == {"host", "instance_id", "attempt", "phase", "message", "time", "exit_code", "failure_reason",
                          "phase_times", "phases"}
    assert list(final["phase_times"]) == ["Starting", "Downloading", "Training", "Uploading", "Completed"]
    # the host's phases, each ended, one after the other: no image (no user data ran here), no first step (the
    # script prints no step line and the job has no metric_definitions)
    assert [p["Phase"] for p in final["phases"]] == ["capacity", "peers", "data", "code", "upload"], final["phases"]
    t = datetime.fromisoformat
    assert all(t(a["EndTime"]) <= t(b["StartTime"]) for a, b in zip(final["phases"], final["phases"][1:]))
    # capacity: moto's LaunchTime (whole seconds) -> the agent's start, before it reported Starting
    assert t(final["phases"][0]["StartTime"]) <= t(final["phases"][0]["EndTime"]) <= t(final["phase_times"]["Starting"])
    assert final["host"] == "algo-1" and final["instance_id"] == ids[0] and final["attempt"] == 1
    assert final["exit_code"] == 0 and final["failure_reason"] is None and final["time"].endswith("+00:00")

    assert (root / "input/data/train/a.txt").read_text() == "alpha"
    assert (root / "input/data/train/sub/b.txt").read_text() == "beta"
    assert os.readlink(root / "input/data/ref") == str(fsx / "fs-0123456789abcdef0" / "refdata")
    assert json.loads((root / "input/config/resourceconfig.json").read_text())["hosts"] == ["algo-1"]

    lines = _log_lines(aws, "node-ok/algo-1")
    assert "[algo-1/0] hello from algo-1 of [\"algo-1\"]" in lines
    assert "[algo-1/0] train file a.txt: alpha" in lines and "[algo-1/0] train file sub/b.txt: beta" in lines
    assert "[algo-1/0] fsx says lustre" in lines
    assert any(l.startswith("[algo-1 agent] status Completed") for l in lines)
    assert any(l.startswith("[algo-1] driver: completed") for l in lines)
    assert "[algo-1/0] train file a.txt: alpha" in out  # and on the agent's own output (the console)
    assert aws["s3"].head_object(Bucket="jobs", Key="out/node-ok/output/model.tar.gz")["ContentLength"] > 0


@pytest.mark.slow
def test_spot_notice_stops_the_driver_with_sigterm_and_reports_interrupted(aws, tmp_path):
    marker = tmp_path / "sigterm-marker"
    spec, state_uri, ids = _job(aws, "node-spot", hyperparameters={"mode": "long", "marker": str(marker)})
    with FakeImds(0, ids[0]) as fake:
        proc = _start_agent(state_uri, fake, tmp_path / "ml", tmp_path / "fsx", port=_free_port())
        try:
            _wait_for(f"{marker}.started", JOB_TIMEOUT_S, proc)
            time.sleep(0.5)  # a few steps on the log
            notice = fake.interrupt()
            code, out = _finish(proc, timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert fake.count("/latest/meta-data/spot/instance-action") >= 2
    assert marker.read_text() == "SIGTERM", out[-4000:]  # the signal reached the training process
    assert code == 128 + 15, out[-4000:]
    history = _statuses(aws, state_uri, "algo-1")
    phases = _changes(history)
    assert phases[:3] == ["Starting", "Downloading", "Training"] and phases[-1] == "Interrupted", phases
    assert "Uploading" not in phases  # the artifact upload after the notice does not hide the interruption
    final = history[-1]
    assert final["exit_code"] == 143 and notice["time"] in final["failure_reason"]
    first = next(d for d in history if d["phase"] == "Interrupted")
    assert first is not final and first["exit_code"] is None
    assert notice["time"] in first["message"]  # reported as soon as the notice came, before the driver ended
    # the script's "step N" lines: its first step was seen, and reported while it trained
    assert any(p["Phase"] == "first_step" and "EndTime" in p for d in history if d["phase"] == "Training"
               for p in d["phases"]), [d["phases"] for d in history]
    assert [p["Phase"] for p in final["phases"]] == ["capacity", "peers", "code", "first_step", "upload"]
    lines = _log_lines(aws, "node-spot/algo-1")
    assert "[algo-1/0] step 0" in lines and "[algo-1/0] got SIGTERM: emergency checkpoint written" in lines
    assert lines[-1] == "[algo-1 agent] exiting with status 143"  # the tail was flushed


@pytest.mark.slow
def test_failing_script_reports_failed_with_the_reason(aws, tmp_path):
    spec, state_uri, ids = _job(aws, "node-fail", hyperparameters={"mode": "fail"})
    with FakeImds(0, ids[0]) as fake:
        code, out = _finish(_start_agent(state_uri, fake, tmp_path / "ml", tmp_path / "fsx", port=_free_port()))
    assert code == 1, out[-4000:]
    final = _statuses(aws, state_uri, "algo-1")[-1]
    assert final["phase"] == "Failed" and final["exit_code"] == 1
    assert final["failure_reason"].startswith("algo-1 rank 0 (local rank 0) exited with code 1")
    assert "ValueError: boom-7f3a: the data is corrupt" in final["failure_reason"]
    assert len(final["failure_reason"]) <= 1024
    assert any("ValueError: boom-7f3a" in l for l in _log_lines(aws, "node-fail/algo-1"))


@pytest.mark.slow
def test_two_instances_find_each_other_and_shard_the_data(aws, tmp_path):
    for i in range(4):
        aws["s3"].put_object(Bucket="jobs", Key=f"data/shards/part-{i}.txt", Body=f"shard {i}".encode())
    channels = [{"name": "train", "uri": "s3://jobs/data/shards", "distribution": "ShardedByS3Key"}]
    spec, state_uri, ids = _job(aws, "node-two", hyperparameters={"mode": "ok"}, count=2, channels=channels)
    # the first host's /etc/hosts already has lines of its own, one of them naming algo-2 wrongly
    (tmp_path / "ml0.hosts").write_text("127.0.0.1 localhost\n10.9.9.9 algo-2 stale-name\n")
    port = _free_port()
    with FakeImds(0, ids[0]) as a, FakeImds(1, ids[1]) as b:
        procs = [_start_agent(state_uri, fake, tmp_path / f"ml{i}", tmp_path / "fsx", port=port)
                 for i, fake in enumerate((a, b))]
        results = [_finish(p) for p in procs]
    for code, out in results:
        assert code == 0, out[-4000:]
    assert sorted(os.listdir(tmp_path / "ml0/input/data/train")) == ["part-0.txt", "part-2.txt"]
    assert sorted(os.listdir(tmp_path / "ml1/input/data/train")) == ["part-1.txt", "part-3.txt"]
    for host in ("algo-1", "algo-2"):
        assert _statuses(aws, state_uri, host)[-1]["phase"] == "Completed"
    lines = _log_lines(aws, "node-two/algo-2")
    assert "[algo-2/1] train file part-3.txt: shard 3" in lines
    assert not any("algo-1/" in l for l in lines)  # each stream holds its own host's lines

    # every host's hosts file names all hosts by their private addresses, as DescribeInstances has them
    reply = aws["ec2"].describe_instances(InstanceIds=ids)
    ip = {i["InstanceId"]: i["PrivateIpAddress"] for r in reply["Reservations"] for i in r["Instances"]}
    assert ip[ids[0]] != ip[ids[1]]
    for i in range(2):
        text = (tmp_path / f"ml{i}.hosts").read_text()
        assert hostnames.marked_names(text) == {"algo-1": ip[ids[0]], "algo-2": ip[ids[1]]}, text
    assert (tmp_path / "ml0.hosts").read_text().startswith("127.0.0.1 localhost\n10.9.9.9 stale-name\n")
    assert f"[algo-2 agent] host names in {tmp_path}/ml1.hosts: algo-1 {ip[ids[0]]}, algo-2 {ip[ids[1]]}" in lines


def test_agent_reports_a_bad_spec_as_failed(aws, tmp_path):
    _, state_uri, ids = _job(aws, "node-nospec", hyperparameters={"mode": "ok"})
    aws["s3"].delete_object(Bucket="jobs", Key="out/node-nospec/trainyard/spec.json")
    with FakeImds(0, ids[0]) as fake:
        code, out = _finish(_start_agent(state_uri, fake, tmp_path / "ml", tmp_path / "fsx", port=_free_port()))
    assert code == 1
    final = _statuses(aws, state_uri, "algo-1")[-1]
    assert final["phase"] == "Failed" and "algo-1 agent: NoSuchKey" in final["failure_reason"], final


def test_agent_stopped_while_waiting_for_peers_reports_interrupted(aws, tmp_path):
    spec, state_uri, ids = _job(aws, "node-stop", hyperparameters={"mode": "ok"}, count=2)
    aws["ec2"].terminate_instances(InstanceIds=[ids[1]])  # the second instance never comes
    with FakeImds(0, ids[0]) as fake:
        proc = _start_agent(state_uri, fake, tmp_path / "ml", tmp_path / "fsx", port=_free_port())
        try:
            eventually(lambda: _statuses(aws, state_uri, "algo-1"), 60, what="algo-1's first status")
            time.sleep(0.5)  # into its wait for the peer that never comes (nothing to poll for: it only waits)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # docker stop, or the instance shutting down
            code, out = _finish(proc, timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert time.monotonic() - t0 < 15  # not after the 60 s peer wait
    assert code == 143, out[-3000:]
    final = _statuses(aws, state_uri, "algo-1")[-1]
    assert final["phase"] == "Interrupted" and "SIGTERM" in final["failure_reason"], final


# -- the pieces ----------------------------------------------------------------------------------


def test_agent_adds_host_names_in_place_and_goes_on_without_write_access(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    inode = hosts.stat().st_ino
    agent = node.Agent(state_uri="s3://b/job/trainyard", region="us-east-1", attempt=1, root=str(tmp_path / "ml"),
                       hosts_file=str(hosts))
    agent._add_host_names({"algo-1": "10.0.0.5", "algo-2": "10.0.1.7"})
    agent._add_host_names({"algo-1": "10.0.0.5", "algo-2": "10.0.1.8"})  # a second run replaces the lines
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.5\talgo-1\t# trainyard\n10.0.1.8\talgo-2\t# trainyard\n"
    assert hosts.stat().st_ino == inode  # rewritten in place: Docker bind-mounts /etc/hosts, a rename fails there
    blocked = node.Agent(state_uri="s3://b/job/trainyard", region="us-east-1", attempt=1, root=str(tmp_path / "ml"),
                         hosts_file=str(tmp_path / "missing-dir" / "hosts"))
    blocked._add_host_names({"algo-1": "10.0.0.5"})  # no exception: the job goes on
    out = capsys.readouterr().out
    assert f"host names in {hosts}: algo-1 10.0.0.5, algo-2 10.0.1.8" in out
    assert f"warning: could not add the host names to {tmp_path}/missing-dir/hosts" in out


def test_imds_client_uses_v2_tokens_and_sees_the_notice():
    with FakeImds(3, "i-0abc", local_ipv4="10.1.2.3") as fake:
        with pytest.raises(urllib.error.HTTPError) as e:  # IMDSv1 (no token) is refused
            urllib.request.urlopen(f"{fake.url}/latest/meta-data/instance-id", timeout=5)
        assert e.value.code == 401
        client = imds.Imds(fake.url)
        assert client.require("/latest/meta-data/ami-launch-index") == "3"
        assert client.require("/latest/meta-data/instance-id") == "i-0abc"
        assert client.get("/latest/meta-data/local-ipv4") == "10.1.2.3"
        assert client.get(imds.SpotWatcher.PATH) is None
        notice = fake.interrupt()
        assert json.loads(client.get(imds.SpotWatcher.PATH)) == notice and notice["action"] == "terminate"
        assert fake.count("/latest/api/token") == 1  # one token serves every request
    with pytest.raises(ConnectionError, match="unreachable"):
        imds.Imds(fake.url, timeout=0.5, tries=1).get("/latest/meta-data/instance-id")


def test_spot_watcher_calls_back_once():
    seen = []
    with FakeImds(0, "i-1") as fake:
        w = imds.SpotWatcher(imds.Imds(fake.url), 0.05, seen.append, lambda m: None).start()
        time.sleep(0.3)
        assert seen == []
        fake.interrupt()
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        w.stop()
    assert len(seen) == 1 and seen[0]["action"] == "terminate"


def test_log_batches_respect_cloudwatch_limits():
    ev = lambda ts, n: {"timestamp": ts, "message": "x" * n}
    many = [ev(1, 1) for _ in range(25_000)]
    assert [len(b) for b in logship.plan_batches(many)] == [10_000, 10_000, 5_000]
    big = [ev(1, 200_000) for _ in range(12)]  # 5 of them fill a megabyte
    batches = logship.plan_batches(big)
    assert [len(b) for b in batches] == [5, 5, 2]
    assert all(sum(len(e["message"]) + 26 for e in b) <= 1_048_576 for b in batches)
    day = 24 * 3600 * 1000
    assert [len(b) for b in logship.plan_batches([ev(0, 1), ev(day, 1), ev(day + 1, 1)])] == [2, 1]
    assert logship.plan_batches([]) == []
    clipped = logship.clip_message("é" * 300_000)
    assert len(clipped.encode()) <= logship.CWL_EVENT_BYTES and clipped.endswith("[truncated]")


def test_log_shipper_ships_everything_in_order_and_the_tail_on_close(aws):
    logs = aws["logs"]
    logs.create_log_group(logGroupName=node.LOG_GROUP)  # already there: tolerated
    shipper = logship.LogShipper(logs, node.LOG_GROUP, "ship/algo-1", flush_s=0.2, flush_lines=100).start()
    logship.LogShipper(logs, node.LOG_GROUP, "ship/algo-1").ensure_stream()  # a second agent run: tolerated
    for i in range(1234):
        shipper.write(f"line {i}")
    shipper.write("")  # CloudWatch refuses empty events: skipped
    shipper.write("the last line")
    shipper.close(timeout=30)
    lines = _log_lines(aws, "ship/algo-1")
    assert lines == [f"line {i}" for i in range(1234)] + ["the last line"]
    assert shipper.shipped == 1235 and shipper.lost == 0 and shipper.dropped == 0


def test_log_shipper_flush_ships_what_was_written_before_it_returns(aws):
    logs = aws["logs"]
    shipper = logship.LogShipper(logs, node.LOG_GROUP, "flush/algo-1", flush_s=60, flush_lines=10_000).start()
    for i in range(50):
        shipper.write(f"line {i}")
    assert shipper.flush(timeout=30)  # long before the 60 s batch interval
    assert _log_lines(aws, "flush/algo-1") == [f"line {i}" for i in range(50)]
    shipper.close(timeout=30)
    assert not shipper.flush(timeout=1)  # closed: nothing to wait for


def test_metrics_shipper_ships_complete_lines_as_numbered_parts_and_the_rest_on_close(aws, tmp_path):
    s3, state_uri = aws["s3"], "s3://metrics-late/out/m/trainyard"  # the bucket comes later: S3 "down"
    path = tmp_path / "output/data/metrics.jsonl"
    said = []
    shipper = metricship.MetricsShipper(str(path), state_uri, "algo-1", 2, said.append, interval=0.1)
    row = lambda step: json.dumps({"step": step, "loss": 1.0 / step}) + "\n"
    assert shipper.ship() and said == []  # no file yet: nothing to ship, nothing said
    path.parent.mkdir(parents=True)
    path.write_text(row(1) + row(2) + row(3)[:7])  # step 3's line is being written
    assert not shipper.ship() and not shipper.ship()  # NoSuchBucket, twice: said once
    assert len(said) == 1 and "could not ship metrics to s3://metrics-late/out/m/trainyard/hosts/algo-1/metrics/" \
        "attempt-0002/part-00000001.jsonl: NoSuchBucket" in said[0], said
    s3.create_bucket(Bucket="metrics-late")
    assert shipper.ship() and said[1].startswith("metrics shipping works again")
    assert shipper.ship()  # nothing new: no part
    prefix = "out/m/trainyard/hosts/algo-1/metrics/attempt-0002/"
    keys = lambda: [o["Key"] for o in s3.list_objects_v2(Bucket="metrics-late", Prefix=prefix).get("Contents", [])]
    assert keys() == [prefix + "part-00000001.jsonl"]
    assert s3.get_object(Bucket="metrics-late", Key=keys()[0])["Body"].read().decode() == row(1) + row(2)

    shipper.start()  # the thread's rounds
    with open(path, "a") as fh:
        fh.write(row(3)[7:] + row(4))
    eventually(lambda: len(keys()) >= 2, 30, interval=0.05, what=lambda: f"a second part: {keys()}")
    with open(path, "a") as fh:
        fh.write(row(5).rstrip("\n"))  # a last line without its newline: shipped by close() only
    assert shipper.close()
    assert keys() == [prefix + f"part-{i:08d}.jsonl" for i in (1, 2, 3)]
    assert (shipper.parts, shipper.lines, len(said)) == (3, 5, 2)
    data, last = metricship.read_parts(s3, state_uri, "algo-1", None)  # what the controller mirrors
    assert data.decode() == "".join(row(i) for i in range(1, 6)) and last == prefix + "part-00000003.jsonl"
    assert metricship.read_parts(s3, state_uri, "algo-1", prefix + "part-00000002.jsonl") == (row(5).encode(), last)
    assert metricship.read_parts(s3, state_uri, "algo-1", last) == (b"", last)

    absent = metricship.MetricsShipper(str(tmp_path / "none.jsonl"), state_uri, "algo-9", 1, said.append).start()
    assert absent.close() and absent.parts == 0 and len(said) == 2  # no file: nothing shipped, nothing said
    assert metricship.read_parts(s3, state_uri, "algo-9", None) == (b"", None)


def test_peer_discovery_orders_by_launch_index_and_times_out_clearly(aws):
    ec2 = aws["ec2"]
    tags = lambda job, attempt: [{"ResourceType": "instance", "Tags": [
        {"Key": "trainyard:job", "Value": job}, {"Key": "trainyard:attempt", "Value": str(attempt)}]}]
    r = ec2.run_instances(ImageId="ami-12c6146b", MinCount=3, MaxCount=3, TagSpecifications=tags("peers", 2))
    ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, TagSpecifications=tags("peers", 1))
    ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, TagSpecifications=tags("other", 2))
    found = peers.find_peers(ec2, "peers", 2, 3, timeout=5, poll=0.1)
    by_index = {i["AmiLaunchIndex"]: i for i in r["Instances"]}
    assert [p.launch_index for p in found] == [0, 1, 2]
    assert [p.instance_id for p in found] == [by_index[k]["InstanceId"] for k in range(3)]
    assert [p.private_ip for p in found] == [by_index[k]["PrivateIpAddress"] for k in range(3)]
    ec2.terminate_instances(InstanceIds=[by_index[2]["InstanceId"]])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"only 2 of 3 instances"):
        peers.find_peers(ec2, "peers", 2, 3, timeout=0.5, poll=0.1, say=lambda m: None)
    assert time.monotonic() - t0 < 10


def test_host_index_tag_orders_instances_launched_one_by_one(aws):
    """Terraform launches each instance alone (launch index 0 for all): the trainyard:host-index tag
    names the host; without the tag (the EC2 backend's one RunInstances) the launch index does."""
    from trainyard.job.facts import HOST_INDEX_TAG

    ec2 = aws["ec2"]
    ids = {}
    for index in (2, 0, 1):  # launched out of order, one RunInstances each
        tags = [{"Key": "trainyard:job", "Value": "tf-job"}, {"Key": "trainyard:attempt", "Value": "1"},
                {"Key": HOST_INDEX_TAG, "Value": str(index)}]
        inst = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                                 TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0]
        assert inst["AmiLaunchIndex"] == 0
        ids[index] = inst["InstanceId"]
    found = peers.find_peers(ec2, "tf-job", 1, 3, timeout=5, poll=0.1)
    assert [p.launch_index for p in found] == [0, 1, 2]
    assert [p.instance_id for p in found] == [ids[0], ids[1], ids[2]]
    assert [peers.own_host_index(ec2, ids[i]) for i in range(3)] == [0, 1, 2]

    untagged = ec2.run_instances(ImageId="ami-12c6146b", MinCount=2, MaxCount=2)["Instances"]
    assert sorted(peers.own_host_index(ec2, i["InstanceId"]) for i in untagged) == [0, 1]
    assert peers.host_index({"AmiLaunchIndex": 3, "Tags": [{"Key": "Name", "Value": "x"}]}) == 3
    assert peers.host_index({"AmiLaunchIndex": 0, "Tags": [{"Key": HOST_INDEX_TAG, "Value": "7"}]}) == 7
    with pytest.raises(Exception):  # no such instance: retried, then the error surfaces
        peers.own_host_index(ec2, "i-0123456789abcdef0", tries=2, wait=0.01)


def test_sharding_and_fsx_links(tmp_path):
    files = [(f"s3://b/p/{i}", str(i), 1) for i in range(5)]
    assert shard(files, 1, 2, "ShardedByS3Key") == [files[1], files[3]]
    assert shard(files, 1, 2, "FullyReplicated") == files
    fsx = tmp_path / "fsx"
    dest = tmp_path / "ml/input/data/ref"
    said = []
    with pytest.raises(FileNotFoundError, match="is fs-0123456789abcdef0 mounted"):
        staging.stage_channel("ref", "fsx://fs-0123456789abcdef0/x", str(dest), distribution="FullyReplicated",
                              host_index=0, host_count=1, fsx_root=str(fsx), say=said.append)
    (fsx / "fs-0123456789abcdef0" / "x").mkdir(parents=True)
    dest.mkdir(parents=True)  # an empty folder from the contract is replaced by the link
    assert staging.stage_channel("ref", "fsx://fs-0123456789abcdef0/x", str(dest), distribution="FullyReplicated",
                                 host_index=0, host_count=1, fsx_root=str(fsx), say=said.append) == (0, 0)
    assert os.readlink(dest) == str(fsx / "fs-0123456789abcdef0" / "x")
    assert said == [f"channel ref: linked to {fsx}/fs-0123456789abcdef0/x from fsx://fs-0123456789abcdef0/x"]


def test_state_uri_names_the_job():
    assert node.job_name_from_state_uri("s3://b/out/my-job/trainyard") == "my-job"
    assert node.job_name_from_state_uri("s3://b/my-job/trainyard/") == "my-job"
    for bad in ("s3://b/out/my-job", "s3://trainyard", "s3://b/trainyard"):
        with pytest.raises(ValueError):
            node.job_name_from_state_uri(bad)
    assert node.status_uri("s3://b/j/trainyard", "algo-2") == "s3://b/j/trainyard/hosts/algo-2/status.json"


def test_node_agent_imports_without_torch():
    code = "import sys, trainyard.container.node; assert 'torch' not in sys.modules and 'boto3' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_long_channel_download_says_how_far_it_is(tmp_path, monkeypatch):
    src = tmp_path / "data"
    src.mkdir()
    for i in range(4):
        (src / f"part-{i}.bin").write_bytes(b"x" * (1 << 20))
    clock = iter(float(t) for t in (0, 4, 11, 12, 30, 31))  # start, then after each of the 4 files, then the end
    monkeypatch.setattr(staging, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    said = []
    got = staging.stage_channel("train", f"file://{src}", str(tmp_path / "dest"), distribution="FullyReplicated",
                                host_index=0, host_count=1, say=said.append)
    assert got == (4, 4 << 20)
    # due after 10 s (the 2nd file), then 10 s after that (the 4th is the last: the summary says it)
    assert said == ["channel train: 2/4 files, 2.0 of 4.0 MiB (50%), 0.2 MiB/s, 11 s left",
                    f"channel train: 4 files, 4.0 MiB from file://{src} in 31.0 s"]
