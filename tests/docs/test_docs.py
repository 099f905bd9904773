"""Every fenced block of README.md and docs/*.md is checked or run as the page says (tests/docs/mdblocks.py),
so an example can never drift from the code. The pages run as a user would: each in its own work folder,
in page order, on the test session's embedded store; blocks marked cloud=1 against a moto server. docs/engine.md
runs beside the others, in a thread of its own (BESIDE, below)."""
import json
import os
import threading
import urllib.request

import pytest

from .mdblocks import ROOT, DocError, blocks, check_tagged, pages, run_block, work_folder

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "broken.md")
TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


def _name(path: str) -> str:
    return os.path.relpath(path, ROOT)


def test_every_block_is_tagged_and_copies_match(tmp_path):
    """Fast: every block names its language, blocks that copy a file still do, and data blocks parse."""
    found = 0
    for page in pages():
        for b in blocks(page):
            check_tagged(b)
            if "same-as" in b.directives or b.lang in ("json", "hcl"):
                run_block(b, str(tmp_path), {})
            found += 1
    assert found > 20


def test_a_broken_example_fails_with_its_page_and_line(tmp_path):
    fine, broken, stale, untagged = blocks(FIXTURE)
    assert run_block(fine, str(tmp_path), {}) == "fine\n"
    with pytest.raises(DocError) as e:
        run_block(broken, str(tmp_path), {})
    assert str(e.value).startswith("tests/docs/fixtures/broken.md:11: python block exited with status 1")
    assert "ImportError: cannot import name 'Estimatr'" in str(e.value)
    with pytest.raises(DocError, match=r"^tests/docs/fixtures/broken.md:16: the block is no longer the same"):
        run_block(stale, str(tmp_path), {})
    with pytest.raises(DocError, match=r"^tests/docs/fixtures/broken.md:20: the block's language is 'missing'"):
        check_tagged(untagged)


@pytest.fixture(scope="module")
def cloud(moto_server):
    """The test cloud the AWS pages run against: the account, role, image and bucket their examples name."""
    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")).read()
    env = {"AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "TRAINYARD_AMI_ID": "ami-12c6146b"}
    kw = {"endpoint_url": moto_server, "region_name": "us-east-1", "aws_access_key_id": "testing",
          "aws_secret_access_key": "testing"}
    s3 = boto3.client("s3", **kw)
    s3.create_bucket(Bucket="my-bucket")
    s3.put_object(Bucket="my-bucket", Key="tokens/shard-00000.bin", Body=bytes(64))  # aws.md's channel
    boto3.client("iam", **kw).create_role(RoleName="trainyard-training", AssumeRolePolicyDocument=json.dumps(TRUST))
    ecr = boto3.client("ecr", **kw)
    ecr.create_repository(repositoryName="trainyard")
    ecr.put_image(repositoryName="trainyard", imageTag="0.1.0", imageManifest=json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
         "config": {"digest": "sha256:" + "0" * 64, "size": 1,
                    "mediaType": "application/vnd.docker.container.image.v1+json"}, "layers": []}))
    return env


# docs/engine.md's examples take 87 s on the CI machine, one core idle for half of it (one-process examples): the
# page runs in a thread of its own from the first page's case on, beside the other pages (which run in this
# process's main thread, in page order, as before), and its own case, the last, waits for it. It runs no
# cloud=1 block and is the only page that runs torchrun (whose default port would clash).
BESIDE = os.path.join(ROOT, "docs", "engine.md")


def _run_page(page: str, cwd: str, cloud_env) -> None:
    for b in blocks(page):
        run_block(b, cwd, cloud_env() if b.directives.get("cloud") else {})


@pytest.fixture(scope="module")
def beside(request, tmp_path_factory):
    """engine.md's run in a thread, started where its own case is among those selected (and not under pytest-xdist,
    whose every worker lists every case): (thread, outcome), joined at the module's end whatever ended it first."""
    if os.environ.get("PYTEST_XDIST_WORKER") or \
            not any(item.nodeid.endswith(f"[{_name(BESIDE)}]") for item in request.session.items):
        yield None
        return
    cwd = work_folder(str(tmp_path_factory.mktemp("beside") / "work"))
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            _run_page(BESIDE, cwd, lambda: pytest.fail(f"{_name(BESIDE)} runs beside the others: no cloud blocks"))
        except BaseException as e:  # noqa: BLE001 - raised again in the page's own case
            outcome["error"] = e

    thread = threading.Thread(target=run, name="docs-engine-md", daemon=True)
    thread.start()
    yield thread, outcome
    thread.join(1400)  # a session that stops early still waits for the page's processes


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", [p for p in pages() if p != BESIDE] + [BESIDE], ids=_name)
def test_page_runs_as_written(page, tmp_path, request, beside):
    if page == BESIDE and beside is not None:
        thread, outcome = beside
        thread.join(1400)
        assert not thread.is_alive(), f"{_name(page)} still runs after 1400 s"
        if "error" in outcome:
            raise outcome["error"]
        return
    _run_page(page, work_folder(str(tmp_path / "work")), lambda: request.getfixturevalue("cloud"))
