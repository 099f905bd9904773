"""The cloud tests' AWS: a moto server over HTTP on 127.0.0.1, with a small fake of our own in front of it
for what moto 5.2 does not implement: EC2 placement groups (CreatePlacementGroup answers HTTP 500).

The fake is WSGI middleware, so every process that talks to the server (the SDK, the job's detached
controller, the node agents) sees the same placement groups. It overrides the `moto_server` fixture of
tests/conftest.py for the tests in this folder; `s3_endpoint` points boto3 at it as usual.
"""
import json
import threading
import urllib.request
import uuid
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

import boto3
import pytest
from botocore.exceptions import ClientError

_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"
_ACTIONS = ("CreatePlacementGroup", "DeletePlacementGroup", "DescribePlacementGroups")


class PlacementGroups:
    """Serves the three placement-group actions of the EC2 query API; passes everything else to moto."""

    def __init__(self, app):
        self.app, self.groups, self.lock = app, {}, threading.Lock()

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO", "").startswith("/moto-api/reset"):
            with self.lock:
                self.groups.clear()
        if environ.get("REQUEST_METHOD") != "POST" or "/ec2/" not in environ.get("HTTP_AUTHORIZATION", ""):
            return self.app(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length)
        form = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        if form.get("Action") not in _ACTIONS:
            import io

            environ["wsgi.input"] = io.BytesIO(body)
            return self.app(environ, start_response)
        with self.lock:
            status, xml = getattr(self, "_" + form["Action"])(form)
        start_response(status, [("Content-Type", "text/xml"), ("Content-Length", str(len(xml)))])
        return [xml]

    @staticmethod
    def _reply(action: str, inner: str) -> tuple[str, bytes]:
        text = f'<?xml version="1.0" encoding="UTF-8"?><{action}Response xmlns="{_NS}"><requestId>{uuid.uuid4()}' \
               f"</requestId>{inner}</{action}Response>"
        return "200 OK", text.encode()

    @staticmethod
    def _error(code: str, message: str) -> tuple[str, bytes]:
        text = f"<Response><Errors><Error><Code>{code}</Code><Message>{escape(message)}</Message></Error></Errors>" \
               f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
        return "400 Bad Request", text.encode()

    @staticmethod
    def _item(group: dict) -> str:
        tags = "".join(f"<item><key>{escape(k)}</key><value>{escape(v)}</value></item>" for k, v in group["tags"].items())
        return f"<groupName>{escape(group['name'])}</groupName><strategy>{group['strategy']}</strategy>" \
               f"<state>available</state><groupId>{group['id']}</groupId><tagSet>{tags}</tagSet>"

    def _CreatePlacementGroup(self, form: dict) -> tuple[str, bytes]:
        name = form.get("GroupName", "")
        if name in self.groups:
            return self._error("InvalidPlacementGroup.Duplicate", f"The placement group '{name}' already exists.")
        tags, i = {}, 1
        while f"TagSpecification.1.Tag.{i}.Key" in form:
            tags[form[f"TagSpecification.1.Tag.{i}.Key"]] = form.get(f"TagSpecification.1.Tag.{i}.Value", "")
            i += 1
        group = {"name": name, "strategy": form.get("Strategy", "cluster"), "id": f"pg-{uuid.uuid4().hex[:17]}",
                 "tags": tags}
        self.groups[name] = group
        return self._reply("CreatePlacementGroup", f"<placementGroup>{self._item(group)}</placementGroup>")

    def _DeletePlacementGroup(self, form: dict) -> tuple[str, bytes]:
        name = form.get("GroupName", "")
        if self.groups.pop(name, None) is None:
            return self._error("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        return self._reply("DeletePlacementGroup", "<return>true</return>")

    def _DescribePlacementGroups(self, form: dict) -> tuple[str, bytes]:
        names = [v for k, v in form.items() if k.startswith("GroupName.")]
        groups = [g for g in self.groups.values() if not names or g["name"] in names]
        i = 1
        while f"Filter.{i}.Name" in form:
            key = form[f"Filter.{i}.Name"]
            values = [v for k, v in form.items() if k.startswith(f"Filter.{i}.Value.")]
            if key == "tag-key":
                groups = [g for g in groups if any(v in g["tags"] for v in values)]
            elif key.startswith("tag:"):
                groups = [g for g in groups if g["tags"].get(key[4:]) in values]
            i += 1
        items = "".join(f"<item>{self._item(g)}</item>" for g in groups)
        return self._reply("DescribePlacementGroups", f"<placementGroupSet>{items}</placementGroupSet>")


@pytest.fixture(scope="session")
def moto_server():
    """moto behind the placement-group fake, on a free loopback port."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class Quiet(MotoRequestHandler):
        def log_request(self, *args, **kwargs):  # one line per request would bury the test's own output
            pass

    server = make_server("127.0.0.1", 0, PlacementGroups(DomainDispatcherApplication(create_backend_app)), True,
                         request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    thread.join()


IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard:1"
TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


@pytest.fixture
def account(s3_endpoint, monkeypatch):
    """A fresh moto account with what a job needs: a bucket, a role EC2 may assume, the image in ECR."""
    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST")).read()
    monkeypatch.setenv("TRAINYARD_AMI_ID", "ami-12c6146b")
    monkeypatch.setenv("TRAINYARD_CONTROLLER_POLL_S", "0.5")
    boto3.client("s3").create_bucket(Bucket="ty-out")
    role = boto3.client("iam").create_role(RoleName="trainyard-job", AssumeRolePolicyDocument=json.dumps(TRUST))
    ecr = boto3.client("ecr")
    ecr.create_repository(repositoryName="trainyard")
    ecr.put_image(repositoryName="trainyard", imageTag="1", imageManifest=json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
         "config": {"digest": "sha256:" + "0" * 64, "size": 1, "mediaType": "application/vnd.docker.container.image.v1+json"},
         "layers": []}))
    return {"role": role["Role"]["Arn"], "endpoint": s3_endpoint}


class Recorder:
    """botocore hooks on a session: records each operation's parameters, and can fail one."""

    def __init__(self):
        self.session = boto3.Session()
        self.calls: list[tuple[str, dict]] = []
        self.fail: dict[str, str] = {}  # operation -> error code to answer with
        self.session.events.register("before-call.*.*", self._before_call)

    def _before_call(self, params, model, **kwargs):
        body = params.get("body", {})  # the query API's flat form: values as they will be sent
        self.calls.append((model.name, {k: str(v) for k, v in body.items()} if isinstance(body, dict) else {}))
        code = self.fail.get(model.name)
        if code:
            raise ClientError({"Error": {"Code": code, "Message": f"injected {code}"}}, model.name)

    def params(self, operation: str) -> list[dict]:
        return [p for name, p in self.calls if name == operation]

    def created(self) -> list[str]:
        return [name for name, _ in self.calls if name.startswith(("Create", "Run", "Authorize", "Add", "Put"))]


def leftovers(job: str) -> dict[str, list]:
    """The job's tagged resources still there (terminated instances do not count)."""
    from trainyard.sdk.backends.ec2.provision import find_tagged

    found = find_tagged(boto3.Session(), job)
    found["instance"] = [i for i in found["instance"] if i["state"] != "terminated"]
    return {k: v for k, v in found.items() if v}


def reachable_vpc(vpc: str | None = None, region: str = "us-east-1") -> str:
    """Give a VPC (default: the default VPC) what a user's subnets need to pass preflight's reachability check
    (a network a platform team would have set up): an S3 gateway endpoint on its main route table and interface
    endpoints with private DNS for ecr.api, ecr.dkr, logs and ec2. Returns the VPC's id. Idempotent."""
    from trainyard.sdk.backends.ec2 import network

    ec2 = boto3.client("ec2", region_name=region)
    vpc = vpc or ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    have = {e["ServiceName"] for e in ec2.describe_vpc_endpoints(
        Filters=[{"Name": "vpc-id", "Values": [vpc]}])["VpcEndpoints"] if e["State"].lower() != "deleted"}
    main = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                              {"Name": "association.main", "Values": ["true"]}])["RouteTables"][0]
    if network.service_name(region, "s3") not in have:
        ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=network.service_name(region, "s3"), VpcEndpointType="Gateway",
                                RouteTableIds=[main["RouteTableId"]])
    subnet = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"][0]["SubnetId"]
    for service in network.INTERFACE_SERVICES:
        if network.service_name(region, service) not in have:
            ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=network.service_name(region, service),
                                    VpcEndpointType="Interface", SubnetIds=[subnet], PrivateDnsEnabled=True)
    return vpc
