"""Issue 30's findings, written as attacks: the embedded store refuses requests without its owner's key, a
tampered code archive is refused by the upload and by the driver, object keys that lead out of their folder are
refused, the tar-filter bypass is refused, secrets stay out of argv and readable files, and bad inputs are
refused before anything is created. (Killing the supervisor, a second writer on a checkpoint location and a full
disk are in tests/e2e/test_security_jobs.py: they need real jobs.)"""
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request

import pytest

from trainyard.container import codefetch
from trainyard.job import codearchive, storage
from trainyard.errors import ConfigError
from trainyard.sdk import gitsource, packaging, store
from tests.waiting import within


@pytest.fixture
def own_store(tmp_path, monkeypatch):
    """An embedded store of its own (its own home), stopped afterwards."""
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    ep = store.ensure_store()
    yield ep
    store.stop_store()


def _client(url, key, secret):
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=key,
                        aws_secret_access_key=secret)


def _status(url: str, method: str, headers: dict | None = None) -> int:
    try:
        return urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers or {})).status
    except urllib.error.HTTPError as e:
        return e.code


def test_another_user_without_the_key_is_refused_by_the_store(own_store, tmp_path):
    from botocore.exceptions import ClientError

    owner = own_store.client()
    owner.put_object(Bucket="victim", Key="code/sourcedir.tar.gz", Body=b"the owner's code")
    root = store.store_root()
    creds = json.loads(open(os.path.join(root, "credentials.json")).read())
    attackers = {"the old fixed key": ("trainyard-local", "trainyard-local"),
                 "the right key id, a guessed secret": (creds["access_key_id"], "guess")}
    for what, (key, secret) in attackers.items():
        s3 = _client(own_store.url, key, secret)
        with pytest.raises(ClientError) as e:
            s3.put_object(Bucket="victim", Key="code/sourcedir.tar.gz", Body=b"evil")
        assert e.value.response["Error"]["Code"] in ("InvalidAccessKeyId", "SignatureDoesNotMatch"), what
        with pytest.raises(ClientError):
            s3.get_object(Bucket="victim", Key="code/sourcedir.tar.gz")
    assert _status(f"{own_store.url}/victim/code/sourcedir.tar.gz", "GET") == 403  # unsigned
    assert owner.get_object(Bucket="victim", Key="code/sourcedir.tar.gz")["Body"].read() == b"the owner's code"
    # the reset endpoint is gone (it wiped the store), and no page in a browser may use the store
    assert _status(f"{own_store.url}/moto-api/reset", "POST") == 404
    assert _status(f"{own_store.url}/victim", "OPTIONS", {"Origin": "http://evil.example"}) == 403
    r = owner.get_object(Bucket="victim", Key="code/sourcedir.tar.gz")
    assert not [h for h in r["ResponseMetadata"]["HTTPHeaders"] if h.startswith("access-control")]
    assert len(owner.list_objects_v2(Bucket="victim")["Contents"]) == 1  # nothing was wiped
    # the owner's files only: folders 0700, files 0600, the key file included
    for dirpath, dirnames, filenames in os.walk(root):
        assert os.stat(dirpath).st_mode & 0o077 == 0, dirpath
        for name in filenames:
            assert os.stat(os.path.join(dirpath, name)).st_mode & 0o077 == 0, name
    # a signed request replayed after 15 minutes is refused
    from trainyard.sdk.store_auth import Credentials, Refused, verify

    environ = {"REQUEST_METHOD": "GET", "RAW_URI": "/victim/x", "HTTP_HOST": "127.0.0.1:1",
               "HTTP_X_AMZ_DATE": "20200101T000000Z", "HTTP_X_AMZ_CONTENT_SHA256": hashlib.sha256(b"").hexdigest(),
               "HTTP_AUTHORIZATION": f"AWS4-HMAC-SHA256 Credential={creds['access_key_id']}/20200101/us-east-1/s3/"
                                     "aws4_request, SignedHeaders=host;x-amz-date, Signature=00"}
    with pytest.raises(Refused, match="too old"):
        verify(environ, b"", Credentials(creds["access_key_id"], creds["secret_access_key"]))


def test_another_user_s_server_on_the_store_s_old_port_is_not_taken_for_the_store(own_store):
    """The owner's store died without cleaning up (server.json left); another user serves its old port and
    answers the health check with the owner's key id (which is no secret). The SDK asks for proof of the secret
    (an HMAC of a fresh nonce): the impostor has none, so a new store is started and the impostor is not used."""
    import http.server
    import signal
    import threading

    root = store.store_root()
    info = json.loads(open(os.path.join(root, "server.json")).read())
    key_id = json.loads(open(os.path.join(root, "credentials.json")).read())["access_key_id"]
    os.kill(info["pid"], signal.SIGKILL)
    within(lambda: not store.healthy(info["url"], timeout=0.2), 10, interval=0.05)

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"pid": info["pid"], "key": key_id, "proof": "0" * 64}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    fake = http.server.HTTPServer(("127.0.0.1", info["port"]), Impostor)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    try:
        assert store.healthy(info["url"])  # it answers...
        ep = store.ensure_store()
        assert ep.url != info["url"]  # ...but is not taken for the owner's store
        assert ep.client().list_buckets()["ResponseMetadata"]["HTTPStatusCode"] == 200
    finally:
        fake.shutdown()


def test_requests_signed_for_another_address_or_without_a_key_are_refused_before_their_body(own_store):
    import socket

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    creds = json.loads(open(os.path.join(store.store_root(), "credentials.json")).read())
    port = int(own_store.url.rsplit(":", 1)[1])
    # a GET the owner signed for another server (an impostor's port), replayed here with that Host header
    req = AWSRequest(method="GET", url="http://127.0.0.1:1/", headers={"x-amz-content-sha256": hashlib.sha256(b"").hexdigest()})
    S3SigV4Auth(BotoCredentials(creds["access_key_id"], creds["secret_access_key"]), "s3", "us-east-1").add_auth(req)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in req.headers.items())
                     + b"Host: 127.0.0.1:1\r\nConnection: close\r\n\r\n")
        answer = b"".join(iter(lambda: sock.recv(4096), b""))
    assert b" 403 " in answer.split(b"\r\n")[0] and b"signed for another address" in answer
    # 1 GB announced and never sent: refused at once, nothing read
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"PUT /victim/x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {1 << 30}\r\n"
                     "Connection: close\r\n\r\n".encode())
        answer = sock.recv(4096)
    assert b" 403 " in answer.split(b"\r\n")[0] and time.monotonic() - started < 3



def test_ec2_and_logs_requests_are_checked_against_their_bodys_hash(own_store):
    """EC2 and CloudWatch Logs (the node agent's calls) sign their body's hash without sending it in a header."""
    import boto3
    from botocore.exceptions import ClientError

    creds = json.loads(open(os.path.join(store.store_root(), "credentials.json")).read())
    kw = dict(endpoint_url=own_store.url, region_name="us-east-1", aws_access_key_id=creds["access_key_id"],
              aws_secret_access_key=creds["secret_access_key"])
    ec2, logs = boto3.client("ec2", **kw), boto3.client("logs", **kw)
    run = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="g5.xlarge")
    assert ec2.describe_instances()["Reservations"][0]["Instances"][0]["InstanceId"] == run["Instances"][0]["InstanceId"]
    logs.create_log_group(logGroupName="g")
    assert [g["logGroupName"] for g in logs.describe_log_groups()["logGroups"]] == ["g"]
    # the body changed after signing (a request captured and replayed with other parameters): refused
    victim = run["Instances"][0]["InstanceId"]
    other = victim[:-1] + ("0" if victim[-1] != "0" else "1")
    tampered = boto3.client("ec2", **kw)
    tampered.meta.events.register("before-send.ec2.TerminateInstances",
                                  lambda request, **_: setattr(request, "body", request.body.replace(other, victim)))
    with pytest.raises(ClientError) as e:
        tampered.terminate_instances(InstanceIds=[other])
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert ec2.describe_instances()["Reservations"][0]["Instances"][0]["State"]["Name"] == "running"
    with pytest.raises(ClientError):  # another key
        boto3.client("ec2", **{**kw, "aws_secret_access_key": "x" * 40}).describe_instances()

def test_a_replaced_code_archive_is_uploaded_again_and_refused_by_the_driver(own_store, tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('mine')\n")
    pkg = packaging.package(str(src))
    for k, v in own_store.env().items():
        monkeypatch.setenv(k, v)
    uri = packaging.upload(pkg, "s3://code-bucket")
    assert uri.endswith(f"trainyard-code/{pkg.sha256}/sourcedir.tar.gz")
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        data = b"import os; os.system('id')\n"
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    storage.put_bytes(uri, evil.getvalue())  # whoever could write to the bucket replaced it
    with pytest.raises(codearchive.TamperedCode, match="was changed after it was uploaded"):
        codefetch.fetch_code(uri, str(tmp_path / "code"))
    assert not (tmp_path / "code").exists()  # nothing was extracted
    assert packaging.upload(pkg, "s3://code-bucket") == uri  # the next fit() puts the right one back
    assert "does not hold the code its name says" in capsys.readouterr().err
    codefetch.fetch_code(uri, str(tmp_path / "code"))
    assert (tmp_path / "code" / "train.py").read_text() == "print('mine')\n"
    with pytest.raises(codearchive.TamperedCode, match="is not named by its SHA-256"):
        codefetch.fetch_code("s3://code-bucket/any/sourcedir.tar.gz", str(tmp_path / "other"))


def _archive(*members: tarfile.TarInfo, data: bytes = b"x") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(data) if m.isreg() else None)
    return raw.getvalue()


def _member(name: str, kind=tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname, m.size = kind, linkname, 1 if kind == tarfile.REGTYPE else 0
    return m


def test_crafted_code_archives_are_refused_before_anything_is_written(tmp_path):
    """CVE-2025-4517 escapes Python 3.11.7's 'data' filter with chains of symbolic links and long paths: the
    driver extracts regular files and folders only, and no absolute or '..' path."""
    dest = tmp_path / "code"
    deep = "/".join(["d" * 250] * 16)
    crafted = {
        "a symbolic link": [_member("a", tarfile.SYMTYPE, "/etc"), _member("a/passwd")],
        "a hard link": [_member("h", tarfile.LNKTYPE, "/etc/passwd")],
        "a '..' path": [_member("../escape.py")],
        "an absolute path": [_member("/tmp/escape.py")],
        "a long path": [_member(f"{deep}/x.py")],
        "a FIFO": [_member("fifo", tarfile.FIFOTYPE)],
        "a folder that is also a file": [_member("a", tarfile.DIRTYPE), _member("a/b"), _member("a")],
        "a file twice": [_member("x.py"), _member("x.py")],
    }
    for what, members in crafted.items():
        with pytest.raises(codefetch.UnsafeArchive):
            codefetch.extract(_archive(*members), str(dest))
        assert not dest.exists() or not any(dest.iterdir()), what
    codefetch.extract(_archive(_member("pkg/train.py")), str(dest))
    assert (dest / "pkg" / "train.py").read_bytes() == b"x"


def test_object_keys_that_lead_out_of_their_folder_are_refused(tmp_path):
    src = tmp_path / "bucket"
    (src / "ok").mkdir(parents=True)
    (src / "ok" / "a.txt").write_text("a")
    dest = tmp_path / "dest"
    outside = tmp_path / "outside"
    for rel in ("../outside/x", "a//b", "/etc/x", "a/./b", "a/../../x", "x\x00y"):
        with pytest.raises(storage.UnsafeKey, match="would be written outside"):
            storage.download_tree("file://unused", str(dest), [(f"file://{src}/ok/a.txt", rel, 1), ])
    dest.mkdir()
    os.symlink(tmp_path, dest / "link")  # a folder already there that points elsewhere
    with pytest.raises(storage.UnsafeKey, match="through a symbolic link"):
        storage.download_tree("file://unused", str(dest), [(f"file://{src}/ok/a.txt", "link/outside/x", 1)])
    assert not outside.exists()
    assert storage.download_tree(f"file://{src}", str(dest)) == 1 and (dest / "ok" / "a.txt").read_text() == "a"
    with pytest.raises(storage.UnsafeKey, match="'d/ok' and 'd/ok/x' cannot both be written"):
        storage.download_tree("file://unused", str(dest), [(f"file://{src}/ok/a.txt", "d/ok", 1),
                                                           (f"file://{src}/ok/a.txt", "d/ok/x", 1)])


def test_a_link_planted_while_a_download_runs_does_not_lead_a_write_out(tmp_path, monkeypatch):
    """The keys are checked first; a symbolic link made in the target afterwards (in a folder another user can
    write) is still not followed: every write goes through folder descriptors opened with O_NOFOLLOW."""
    import shutil as shutil_module

    src = tmp_path / "bucket"
    src.mkdir()
    (src / "big").write_text("first")
    (src / "payload").write_text("evil")
    dest, victim = tmp_path / "shared", tmp_path / "victim"
    dest.mkdir()
    victim.mkdir()
    real_copy = shutil_module.copyfileobj

    def copy_then_plant(fsrc, fdst, *a, **k):
        real_copy(fsrc, fdst, *a, **k)
        if not (dest / "zsub").exists():
            os.symlink(victim, dest / "zsub")  # mallory, between the check and the second write

    monkeypatch.setattr(storage.shutil, "copyfileobj", copy_then_plant)
    with pytest.raises(storage.UnsafeKey, match="'zsub' in .* is a symbolic link"):
        storage.download_tree("file://unused", str(dest), [(f"file://{src}/big", "a000", 5),
                                                           (f"file://{src}/payload", "zsub/payload", 4)])
    assert list(victim.iterdir()) == []


def test_the_git_token_never_reaches_a_command_line(tmp_path, monkeypatch):
    """A `git` that records how it is called: the token is in no argument, the askpass helper gives it to git,
    the repository comes after `--`, and a failed clone leaves no folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    (bin_dir / "git").write_text(f"""#!{sys.executable}
import json, os, subprocess, sys
askpass = os.environ.get("GIT_ASKPASS")
answer = subprocess.run([askpass, "Username for 'https://example.com': "], capture_output=True, text=True).stdout \\
    if askpass else ""
with open({str(calls)!r}, "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "askpass_user": answer.strip(),
                          "protocols": os.environ.get("GIT_ALLOW_PROTOCOL")}}) + "\\n")
sys.exit(1 if "clone" in sys.argv else 0)
""")
    os.chmod(bin_dir / "git", 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    made = set(os.listdir("/tmp"))
    with pytest.raises(ConfigError, match="git_config: git could not clone"):
        gitsource.clone({"repo": "https://example.com/org/repo.git", "token": "ghp_SECRET123"})
    call = json.loads(calls.read_text().splitlines()[0])
    assert not any("ghp_SECRET123" in a for a in call["argv"])
    assert call["argv"][-3:-1] == ["--", "https://example.com/org/repo.git"]
    assert call["askpass_user"] == "ghp_SECRET123" and call["protocols"] == gitsource.PROTOCOLS
    left = {n for n in set(os.listdir("/tmp")) - made if n.startswith(("trainyard-git-", "trainyard-askpass-"))}
    assert left == set()  # the clone's folder and the helper's are gone
    with pytest.raises(ConfigError, match="branch '--upload-pack=x'"):
        gitsource.clone({"repo": "https://example.com/r.git", "branch": "--upload-pack=x"})


def test_local_job_folders_and_specs_are_the_owner_s_alone(tmp_path, monkeypatch):
    from trainyard.sdk.backends.local.backend import launch
    from trainyard.job.spec import build_spec

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    spec = build_spec(job_name="private-job", entry_point="trainyard.engine.train", entry_kind="module",
                      instance_type="local", processes_per_host=1, output_path="s3://bkt-out/x",
                      environment={"API_TOKEN": "secret"})
    ep = store.Endpoint("http://127.0.0.1:9", embedded=False)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: None)  # no supervisor: only the folder is looked at
    job = launch(spec, ep)
    assert os.stat(job.dir).st_mode & 0o777 == 0o700
    assert os.stat(os.path.dirname(job.dir)).st_mode & 0o077 == 0
    for name in ("spec.json", "runtime.json", "status.json"):
        assert os.stat(os.path.join(job.dir, name)).st_mode & 0o777 == 0o600, name


BAD_INPUTS = {
    "entry_point outside source_dir": (dict(entry_point="/etc/hostname.py", source_dir="SRC"), "entry_point"),
    "checkpoint_local_path with '..'": (dict(checkpoint_s3_uri="s3://bkt-c/x", checkpoint_local_path="/opt/ml/../../x"),
                                        "checkpoint_local_path"),
    "a channel named '..'": ("fit", {"..": "file:///tmp"}),
    "enabled given as a string": (dict(distribution={"torch_distributed": {"enabled": "false"}}), "distribution"),
    "an environment value with NUL": (dict(environment={"A": "x\x00y"}), "environment"),
    "a hyperparameter past Linux's argument limit": (dict(hyperparameters={"a": "x" * 200_000}), "hyperparameters"),
    "1000 local hosts": (dict(instance_count=1000), "instance_count"),
    "a checkpoint path outside /opt/ml on local hosts": (dict(checkpoint_s3_uri="s3://bkt-c/x",
                                                              checkpoint_local_path="/tmp/shared"),
                                                         "checkpoint_local_path"),
}
TRAINER = dict(entry_point="trainyard.engine.train", source_dir=None)
BAD_TRAINER = {
    "checkpoint_uri with one slash": ({"checkpoint_uri": "s3:/b/x"}, "two slashes"),
    "an http checkpoint_uri": ({"checkpoint_uri": "http://x/y"}, "not a checkpoint location"),
    "a relative checkpoint_uri": ({"checkpoint_uri": "ckpt"}, "relative path"),
    "checkpoint_every without a location": ({"checkpoint_every": 2}, "no checkpoint location"),
    "kernels=triton on a CPU": ({"kernels": "triton"}, "runs on GPUs"),
    "dtype=float8 on a CPU": ({"dtype": "float8"}, "FP8 tensor cores"),
    "a dataset channel the job does not have": ({"dataset": "train"}, "names an input channel"),
}


def _refused_at_once(tmp_path, monkeypatch, make, field_or_text) -> None:
    """`make()` raises ConfigError naming `field_or_text`, within a second, with nothing created."""
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=field_or_text):
        make()
    assert time.monotonic() - started < 1.0
    assert not (tmp_path / "home").exists()  # no job folder, no store (so no bucket), no process


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_refused_before_anything_starts(case, tmp_path, monkeypatch):
    from trainyard import Estimator

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print(1)\n")
    kwargs, field = BAD_INPUTS[case]
    base = dict(entry_point="train.py", source_dir=str(tmp_path / "src"), instance_type="local", instance_count=1,
                processes_per_host=1)
    if kwargs == "fit":
        _refused_at_once(tmp_path, monkeypatch, lambda: Estimator(**base).fit(field, wait=False), "inputs")
        return
    kwargs = {k: (str(tmp_path / "src") if v == "SRC" else v) for k, v in kwargs.items()}
    _refused_at_once(tmp_path, monkeypatch, lambda: Estimator(**{**base, **kwargs}).fit(wait=False), field)


@pytest.mark.parametrize("case", list(BAD_TRAINER))
def test_bad_trainer_hyperparameters_are_refused_before_anything_starts(case, tmp_path, monkeypatch):
    from trainyard import Estimator

    import trainyard.engine.config  # noqa: F401  (torch's import is not the check's time)

    hps, text = BAD_TRAINER[case]
    base = dict(entry_point="trainyard.engine.train", instance_type="local", instance_count=1, processes_per_host=1,
                hyperparameters={"model": "tiny", "steps": 4, **hps})
    _refused_at_once(tmp_path, monkeypatch, lambda: Estimator(**base).fit(wait=False), text)


def test_plan_refuses_meaningless_token_counts(capsys):
    from trainyard.sdk.cli import main

    for value in ("-1", "nan", "0", "inf"):
        with pytest.raises(SystemExit) as e:
            main(["plan", "--model", "llama3.2-1b", "--seq-len", "2048", "--global-batch-size", "8",
                  "--instance-type", "ml.p5.48xlarge", "--train-tokens", value])
        assert e.value.code == 2
        assert f"argument --train-tokens: '{value}': expected a number > 0" in capsys.readouterr().err


def test_requirements_that_change_the_package_index_are_named(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print(1)\n")
    (src / "requirements.txt").write_text("numpy\n--extra-index-url https://pkgs.example.com/simple\n"
                                          "--trusted-host pkgs.example.com\n")
    packaging.package(str(src))
    err = capsys.readouterr().err
    assert "requirements.txt changes where pip finds packages: --extra-index-url https://pkgs.example.com/simple, " \
           "--trusted-host pkgs.example.com" in err
