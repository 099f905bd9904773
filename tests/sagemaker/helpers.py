"""Plumbing for the SageMaker-compatibility tests: where the scripts are, reading an artifact back from the
store, building a wheel, and gathering what a run said on its side channels (stderr, logging, warnings).

Nothing here is what a SageMaker user writes; the tests themselves are.
"""
import base64
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import zipfile

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
# the dummy role of the SageMaker local-mode samples (aws-samples/amazon-sagemaker-local-mode)
LOCAL_ROLE = "arn:aws:iam::111111111111:role/service-role/AmazonSageMaker-ExecutionRole-20200101T000001"
# a job that goes wrong must not keep the 2 cores busy after its test gave up
MAX_RUN = 240


def copy_scripts(dest, *names) -> str:
    """Copy scripts from tests/sagemaker/scripts into `dest` (a source_dir); returns `dest`."""
    os.makedirs(dest, exist_ok=True)
    for name in names:
        shutil.copy(os.path.join(SCRIPTS, name), os.path.join(dest, os.path.basename(name)))
    return str(dest)


def read_tar(uri: str) -> dict[str, bytes]:
    """The files of a .tar.gz artifact (`estimator.model_data`) on the store local jobs use."""
    from trainyard.sdk.store import ensure_store

    assert uri and uri.startswith("s3://"), f"not an s3:// URI: {uri!r}"
    bucket, _, key = uri[len("s3://"):].partition("/")
    data = ensure_store().client().get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def decode_hp(value):
    """A hyperparameter as `estimator.hyperparameters()` gives it: SageMaker's framework estimators
    JSON-encode the values ('2'), the generic Estimator keeps them (2). Either way, the value."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def side_channels(captured, caplog, recwarn) -> dict[str, str]:
    """Everything a run said besides the job's own log lines: stderr, stdout, logging records, warnings."""
    return {
        "stderr": captured.err,
        "stdout": captured.out,
        "logging": caplog.text,
        "warnings": "\n".join(str(w.message) for w in recwarn),
    }


def all_text(channels: dict[str, str]) -> str:
    return "\n".join(channels.values())


def marker_json(text: str, marker: str) -> list[dict]:
    """The JSON objects printed after `marker ` on lines of `text` (any log prefix before it)."""
    out = []
    for line in text.splitlines():
        i = line.find(marker + " ")
        if i >= 0:
            out.append(json.loads(line[i + len(marker) + 1:]))
    return out


PROC_LINE = re.compile(r"proc host=(\S+) pid=(\d+) rank=(\S+) local_rank=(\S+)")


def build_wheel(dest_dir, name: str, version: str, module_source: str) -> str:
    """A pure-Python wheel with one module `name`, written with zipfile; returns its path."""
    files = {
        f"{name}/__init__.py": module_source.encode(),
        f"{name}-{version}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: test wheel\n".encode(),
        f"{name}-{version}.dist-info/WHEEL":
            b"Wheel-Version: 1.0\nGenerator: tests-sagemaker\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record_name = f"{name}-{version}.dist-info/RECORD"
    lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    lines.append(f"{record_name},,")
    files[record_name] = ("\n".join(lines) + "\n").encode()
    os.makedirs(dest_dir, exist_ok=True)
    path = os.path.join(dest_dir, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for p, data in files.items():
            zf.writestr(p, data)
    return path
