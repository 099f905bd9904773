"""Shared fixtures: a real moto S3 server over HTTP on 127.0.0.1, and an isolated Trainyard home."""
import os

import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto server on a free loopback port, for tests that need S3 without the SDK's store.

    Sets AWS_ENDPOINT_URL and fake credentials for this test process (and so for the processes it
    spawns); boto3 and s3fs both honour AWS_ENDPOINT_URL.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in _AWS_VARS}
    os.environ.update(
        AWS_ENDPOINT_URL=url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


_AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A fresh bucket on the session's moto server; returns its name."""
    import re

    import boto3

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") or "bucket"
    boto3.client("s3").create_bucket(Bucket=name)
    return name
