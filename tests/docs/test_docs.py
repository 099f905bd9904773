"""Every fenced block of README.md and docs/*.md is checked or run as the page says (tests/docs/mdblocks.py),
so an example can never drift from the code. The pages run as a user would: each in its own work folder,
in page order, on the test session's embedded store; blocks marked cloud=1 against a moto server."""
import json
import os
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


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", pages(), ids=_name)
def test_page_runs_as_written(page, tmp_path, request):
    cwd = work_folder(str(tmp_path / "work"))
    for b in blocks(page):
        env = request.getfixturevalue("cloud") if b.directives.get("cloud") else {}
        run_block(b, cwd, env)
