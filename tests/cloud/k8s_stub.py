"""A stub Kubernetes API server for the Kubernetes backend's tests: plain HTTP on 127.0.0.1, in a thread of the
test's process, serving only what the backend's `kubernetes` client calls, in memory:

    GET    /api/v1/namespaces/{ns}                                  the namespaces of `namespaces`
    GET    /apis/kubeflow.org/v1                                     the operator's resources (pytorchjobs)
    GET    /api/v1/namespaces/{ns}/serviceaccounts/{name}            `service_accounts`
    POST   /api/v1/namespaces/{ns}/configmaps | persistentvolumeclaims, /api/v1/persistentvolumes
    GET    /api/v1/namespaces/{ns}/persistentvolumeclaims/{name}
    PATCH  /api/v1/namespaces/{ns}/configmaps/{name} | persistentvolumeclaims/{name}   (JSON patch, "add" only)
    DELETE the same objects, and /api/v1/persistentvolumes/{name}
    POST   /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs
    GET    /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{name}  plays the job's next status (see `play`)
    DELETE /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{name}  and, as the garbage collector would, the
                                                                    pods and the objects it owns
    GET    /api/v1/namespaces/{ns}/pods?labelSelector=training.kubeflow.org/job-name=JOB
    GET    /api/v1/namespaces/{ns}/pods/{pod}/log?container=pytorch&timestamps=true

Every request must carry the kubeconfig's bearer token (`TOKEN`), or it is answered 401. Status transitions are
the training operator's conditions, one step of the job's script per GET of the job (as a real job moves on
between two looks); pods appear once the job runs, with the log lines the test gave, stamped as the kubelet
stamps them (RFC 3339, nanoseconds).
"""
from __future__ import annotations

import json
import re
import threading
import uuid
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

TOKEN = "stub-token"
T0 = datetime(2026, 11, 24, 8, 0, 0, tzinfo=timezone.utc)
JOBS = "/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs"


def _time(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeCluster:
    def __init__(self):
        self.namespaces = {"default", "training"}
        self.service_accounts = {("training", "trainyard-job")}
        self.serves_pytorchjobs = True
        self.refuse_kind: dict[str, tuple[int, str]] = {}  # kind -> (status, message) for its POSTs
        self.forbidden: set[str] = set()  # paths the kubeconfig's user may not read (403)
        self.objects: dict[tuple[str, str, str], dict] = {}  # (kind, namespace or "", name) -> object
        self.scripts: dict[str, list] = {}  # job -> [condition type or (type, message), ...]
        self.played: dict[str, int] = {}
        self.logs: dict[str, list[str]] = {}  # "master-0" / "worker-0" -> lines
        self.failed_pod: dict[str, tuple[str, str]] = {}  # job -> (pod suffix, termination message)
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    # -- the test's side --------------------------------------------------------------------------------------

    def play(self, job: str, script: list) -> None:
        """The conditions the job `job` goes through, one per GET of it; the last one stays."""
        self.scripts[job] = script

    def start(self) -> str:
        cluster = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, body, content_type: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._answer(401, _status(401, "Unauthorized", "Unauthorized"))
                url = urlparse(self.path)
                with cluster.lock:
                    cluster.requests.append((method, url.path))
                    status, answer, kind = cluster.route(method, url.path, parse_qs(url.query), body,
                                                         self.headers.get("Content-Type", ""))
                self._answer(status, answer, kind)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

            def do_PATCH(self):
                self._serve("PATCH")

            def do_DELETE(self):
                self._serve("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def kubeconfig(self, path, url: str, token: str = TOKEN) -> str:
        """A kubeconfig whose current context is this server with `token` (written to `path`)."""
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "stub",
               "clusters": [{"name": "stub", "cluster": {"server": url}}],
               "users": [{"name": "tester", "user": {"token": token}}],
               "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "tester"}}]}
        with open(path, "w") as fh:
            json.dump(doc, fh)  # JSON is YAML
        return str(path)

    def get(self, kind: str, name: str, namespace: str = "") -> dict | None:
        return self.objects.get((kind, namespace, name))

    # -- the server's side ------------------------------------------------------------------------------------

    def route(self, method: str, path: str, query: dict, body, content_type: str):
        if path in self.forbidden:
            return 403, _status(403, "Forbidden", f"{method} {path} is forbidden"), "application/json"
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)", path)
        if m and method == "GET":
            ns = m.group(1)
            return (200, {"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": ns}}, "application/json") \
                if ns in self.namespaces else _missing("namespaces", ns)
        if path == "/apis/kubeflow.org/v1" and method == "GET":
            if not self.serves_pytorchjobs:
                return 404, _status(404, "NotFound", "the server could not find the requested resource"), \
                    "application/json"
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "kubeflow.org/v1",
                         "resources": [{"name": "pytorchjobs", "singularName": "pytorchjob", "namespaced": True,
                                        "kind": "PyTorchJob", "verbs": ["create", "delete", "get", "list"]}]}, \
                "application/json"
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/serviceaccounts/([^/]+)", path)
        if m and method == "GET":
            ns, name = m.groups()
            if (ns, name) not in self.service_accounts:
                return _missing("serviceaccounts", name)
            return 200, {"kind": "ServiceAccount", "apiVersion": "v1", "metadata": {"name": name, "namespace": ns}}, \
                "application/json"
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path)
        if m and method == "GET":
            job = query.get("labelSelector", [""])[0].removeprefix("training.kubeflow.org/job-name=")
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": self.pods(m.group(1), job)}, \
                "application/json"
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log", path)
        if m and method == "GET":
            return self.log(m.group(1), m.group(2), query)
        m = re.fullmatch(r"/apis/kubeflow.org/v1/namespaces/([^/]+)/pytorchjobs(?:/([^/]+))?", path)
        if m:
            return self.pytorchjob(method, m.group(1), m.group(2), body)
        m = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/(configmaps|persistentvolumeclaims|persistentvolumes)"
                         r"(?:/([^/]+))?", path)
        if m:
            kind = {"configmaps": "ConfigMap", "persistentvolumeclaims": "PersistentVolumeClaim",
                    "persistentvolumes": "PersistentVolume"}[m.group(2)]
            return self.plain(method, kind, m.group(1) or "", m.group(3), body, content_type)
        return 404, _status(404, "NotFound", f"no route for {method} {path}"), "application/json"

    def _create(self, kind: str, ns: str, body: dict):
        name = body["metadata"]["name"]
        if kind in self.refuse_kind:
            status, message = self.refuse_kind[kind]
            return status, _status(status, "Invalid", message), "application/json"
        if (kind, ns, name) in self.objects:
            return 409, _status(409, "AlreadyExists", f"{kind} {name!r} already exists"), "application/json"
        obj = json.loads(json.dumps(body))
        obj["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_time(0), resourceVersion="1")
        self.objects[(kind, ns, name)] = obj
        return 201, obj, "application/json"

    def plain(self, method: str, kind: str, ns: str, name: str | None, body, content_type: str):
        if method == "POST":
            return self._create(kind, ns, body)
        obj = self.objects.get((kind, ns, name))
        if obj is None:
            return _missing(kind.lower() + "s", name)
        if method == "GET":
            return 200, obj, "application/json"
        if method == "DELETE":
            del self.objects[(kind, ns, name)]
            return 200, _status(200, "", "deleted"), "application/json"
        if method == "PATCH":
            if content_type != "application/json-patch+json" or not isinstance(body, list):
                return 415, _status(415, "UnsupportedMediaType", f"this stub takes JSON patches, got {content_type}"), \
                    "application/json"
            for op in body:
                if op["op"] != "add" or not op["path"].startswith("/metadata/"):
                    return 422, _status(422, "Invalid", f"unsupported patch {op}"), "application/json"
                obj["metadata"][op["path"].rsplit("/", 1)[1]] = op["value"]
            return 200, obj, "application/json"
        return 405, _status(405, "MethodNotAllowed", method), "application/json"

    def pytorchjob(self, method: str, ns: str, name: str | None, body):
        if method == "POST":
            status, obj, kind = self._create("PyTorchJob", ns, body)
            if status == 201:
                self.played[obj["metadata"]["name"]] = 0
            return status, obj, kind
        obj = self.objects.get(("PyTorchJob", ns, name))
        if obj is None:
            return _missing("pytorchjobs.kubeflow.org", name)
        if method == "DELETE":
            uid = obj["metadata"]["uid"]
            del self.objects[("PyTorchJob", ns, name)]
            for key, other in list(self.objects.items()):  # the garbage collector: what the job owns goes too
                if any(o.get("uid") == uid for o in other["metadata"].get("ownerReferences", [])):
                    del self.objects[key]
            self.scripts.pop(name, None)
            return 200, _status(200, "", "deleted"), "application/json"
        script = self.scripts.get(name, ["Created"])
        step = min(self.played.get(name, 0), len(script) - 1)
        self.played[name] = step + 1
        obj["status"] = _job_status(script[: step + 1])
        return 200, obj, "application/json"

    def running(self, job: str) -> list[str]:
        """The types the job's script reached so far."""
        script = self.scripts.get(job, [])
        steps = script[: max(0, min(self.played.get(job, 0), len(script)))]
        return [s if isinstance(s, str) else s[0] for s in steps]

    def pods(self, ns: str, job: str) -> list[dict]:
        obj = self.objects.get(("PyTorchJob", ns, job))
        if obj is None or not set(self.running(job)) & {"Running", "Succeeded", "Failed"}:
            return []
        specs = obj["spec"]["pytorchReplicaSpecs"]
        out = []
        for kind, spec in specs.items():
            for i in range(spec["replicas"]):
                suffix = f"{kind.lower()}-{i}"
                container = {"name": "pytorch", "ready": True, "restartCount": 0, "image": "x", "imageID": "",
                             "state": {"running": {"startedAt": _time(2)}}}
                failed = self.failed_pod.get(job)
                if failed and failed[0] == suffix and "Failed" in self.running(job):
                    container["state"] = {"terminated": {"exitCode": 1, "reason": "Error", "message": failed[1],
                                                         "startedAt": _time(2), "finishedAt": _time(5)}}
                out.append({"metadata": {"name": f"{job}-{suffix}", "namespace": ns, "labels": {
                    "training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-type": kind.lower(),
                    "training.kubeflow.org/replica-index": str(i)}},
                    "status": {"phase": "Running", "containerStatuses": [container]}})
        return out

    def log(self, ns: str, pod: str, query: dict):
        job, _, suffix = pod.rpartition("-")
        job, _, kind = job.rpartition("-")
        if query.get("container") != ["pytorch"] or [v.lower() for v in query.get("timestamps", [])] != ["true"]:
            return 400, _status(400, "BadRequest", "this stub serves container=pytorch&timestamps=true"), \
                "application/json"
        if not any(p["metadata"]["name"] == pod for p in self.pods(ns, job)):
            return _missing("pods", pod)
        lines = self.logs.get(f"{kind}-{suffix}", [])
        # the kubelet's stamps: RFC 3339 with nanoseconds, trailing zeros dropped
        return 200, "".join(f"{_stamp(T0 + timedelta(seconds=3, milliseconds=10 * i))} {line}\n"
                            for i, line in enumerate(lines)), "text/plain"


def _stamp(t: datetime) -> str:
    """The kubelet's stamp of a log line: RFC 3339 with nanoseconds, trailing zeros (and a bare '.') dropped."""
    frac = f"{t.microsecond:06d}000".rstrip("0")
    return t.strftime("%Y-%m-%dT%H:%M:%S") + (f".{frac}" if frac else "") + "Z"


def _job_status(steps: list) -> dict:
    """The operator's status after `steps` (condition types, or (type, message)), one second apart."""
    conditions: list[dict] = []
    status: dict = {"replicaStatuses": {"Master": {}}}
    for i, step in enumerate(steps):
        kind, message = (step, "") if isinstance(step, str) else step
        conditions = [c for c in conditions if c["type"] != kind and {c["type"], kind} != {"Running", "Restarting"}]
        if kind in ("Succeeded", "Failed"):
            for c in conditions:
                if c["type"] == "Running":
                    c["status"] = "False"
            status["completionTime"] = _time(i)
        if kind == "Running":
            status.setdefault("startTime", _time(i))
            status["replicaStatuses"] = {"Master": {"active": 1}, "Worker": {"active": 1}}
        conditions.append({"type": kind, "status": "True", "reason": f"PyTorchJob{kind}",
                           "message": message or f"PyTorchJob is {kind.lower()}.",
                           "lastUpdateTime": _time(i), "lastTransitionTime": _time(i)})
    status["conditions"] = conditions
    return status


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
            "message": message, "reason": reason, "code": code}


def _missing(resource: str, name: str | None):
    return 404, _status(404, "NotFound", f'{resource} "{name}" not found'), "application/json"
