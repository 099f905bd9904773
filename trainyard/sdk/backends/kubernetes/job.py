"""The handle on a job that runs as a Kubeflow PyTorchJob: the cluster is its control plane, this machine only
reads it (and may sleep meanwhile).

`describe()` maps the PyTorchJob's conditions to SageMaker-style statuses (sdk/backends/kubernetes/status.py) beside the job's
facts from its spec; once the job has ended, the last description is kept in the job folder (`status.json`), so
an ended job is described without the cluster (and after its PyTorchJob is deleted). `logs()` and `wait()` read
the pods' logs (label `training.kubeflow.org/job-name`, container `pytorch`), stamped and merged in time order as
every job's log lines are; `stop()` deletes the PyTorchJob (its pods, and through their owner references the
ConfigMap and claims, go with it) and the PersistentVolumes the job made; `metrics()` scrapes the pods' logs with
the job's metric_definitions. The job folder's `runtime.json` names the backend, the namespace and the kubeconfig,
so `attach()` and `trainyard` find the job from any process.
"""
from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import Any

from trainyard.container.contract import hp_json
from trainyard.job.storage import output_prefix
from trainyard.sdk.jobs import metrics
from trainyard.sdk.jobs.job import TrainingJob
from trainyard.sdk.jobs.joblog import stamped
from trainyard.sdk.jobs.jobstate import TERMINAL, now_iso, read_json, write_json
from trainyard.sdk.backends.kubernetes import status as k8s_status
from trainyard.sdk.backends.kubernetes.client import Api, api_errors, connect, message_of, status_of
from trainyard.sdk.backends.kubernetes.manifests import CONTAINER, GROUP, JOB_LABEL, PLURAL, VERSION

STOP_TIMEOUT_S = 300.0
POLL_S = 2.0  # wait(): seconds between two looks at the cluster


class KubernetesJob(TrainingJob):
    """A handle on a PyTorchJob started by Trainyard (or attached by name)."""

    stop_timeout_s = STOP_TIMEOUT_S

    def __init__(self, job_name: str, api: Api | None = None):
        super().__init__(job_name)
        runtime = read_json(f"{self.dir}/runtime.json")
        self.namespace = runtime["namespace"]
        self.kubeconfig, self.context = runtime.get("kubeconfig"), runtime.get("context")
        self.volumes: list[str] = runtime.get("persistent_volumes", [])
        self._api = api

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = connect(self.kubeconfig, self.context)
        return self._api

    def _call(self, what: str, fn, *args, **kwargs):
        """A call to the cluster; a 404 answers None; any other failure is an OSError naming the job."""
        try:
            return fn(*args, **kwargs)
        except api_errors() as e:
            if status_of(e) == 404:
                return None
            raise OSError(f"Kubernetes job {self.namespace}/{self.name}: {what}: {message_of(e)}") from e

    def _object(self) -> dict | None:
        return self._call("reading the PyTorchJob", self.api.custom.get_namespaced_custom_object, GROUP, VERSION,
                          self.namespace, PLURAL, self.name)

    def pods(self) -> list[dict]:
        """The job's pods, as the API server returns them (dicts)."""
        found = self._call("listing its pods", self.api.core.list_namespaced_pod, self.namespace,
                           label_selector=f"{JOB_LABEL}={self.name}")
        return [] if found is None else self.api.client.sanitize_for_serialization(found).get("items", [])

    def _saved(self) -> dict | None:
        path = f"{self.dir}/status.json"
        return read_json(path) if os.path.exists(path) else None

    def describe(self) -> dict:
        """SageMaker-shaped (times as datetimes): the job's facts, its status from the PyTorchJob's conditions,
        `ReplicaStatuses` (the operator's), and `Namespace`. An unreachable or refusing cluster is an OSError."""
        saved = self._saved()
        if saved is not None and saved["TrainingJobStatus"] in TERMINAL:
            return _times(saved)
        obj = self._object()
        doc = self._gone(saved) if obj is None else self._document(obj)
        write_json(f"{self.dir}/status.json", _iso(doc))
        return doc

    def _document(self, obj: dict) -> dict:
        spec = self.spec
        doc: dict[str, Any] = {
            "TrainingJobName": self.name, "Namespace": self.namespace,
            **k8s_status.job_status(obj),
            "HyperParameters": {k: hp_json(v) for k, v in spec.hyperparameters.items()},
            "AlgorithmSpecification": {"TrainingImage": spec.image_uri, "TrainingInputMode": spec.input_mode,
                                       "EntryPoint": spec.entry_point,
                                       "MetricDefinitions": [dict(d) for d in spec.metric_definitions]},
            "RoleArn": spec.role,
            "InputDataConfig": [{"ChannelName": c.name, "Uri": c.uri, "InputMode": c.input_mode,
                                 "S3DataDistributionType": c.distribution} for c in spec.channels],
            "OutputDataConfig": {"S3OutputPath": spec.output_path},
            "ResourceConfig": {"InstanceType": spec.instance_type, "InstanceCount": spec.instance_count},
            "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run},
            "Environment": dict(spec.environment),
            "Tags": [{"Key": k, "Value": v} for k, v in spec.tags.items()],
        }
        if spec.checkpoint_s3_uri:
            doc["CheckpointConfig"] = {"S3Uri": spec.checkpoint_s3_uri, "LocalPath": spec.checkpoint_local_path}
        if doc["TrainingJobStatus"] == "Completed":
            doc["ModelArtifacts"] = {"S3ModelArtifacts": output_prefix(spec.output_path, self.name) + "/model.tar.gz"}
        if doc["TrainingJobStatus"] == "Failed":
            said = k8s_status.pod_failure(self.pods(), CONTAINER)
            if said:
                doc["FailureReason"] = said[:k8s_status.MAX_REASON]
        return doc

    def _gone(self, saved: dict | None) -> dict:
        """The description of a job whose PyTorchJob no longer exists: Stopped (by stop(), or deleted by someone
        else), as of the stop request (or now)."""
        asked = f"{self.dir}/stop-requested"
        at = datetime.fromtimestamp(os.path.getmtime(asked), timezone.utc) if os.path.exists(asked) else \
            datetime.now(timezone.utc)
        doc = _times(saved) if saved else {"TrainingJobName": self.name, "Namespace": self.namespace,
                                           "SecondaryStatusTransitions": [], "CreationTime": at}
        trans = doc["SecondaryStatusTransitions"]
        if trans and "EndTime" not in trans[-1]:
            trans[-1]["EndTime"] = max(at, trans[-1]["StartTime"])
            at = trans[-1]["EndTime"]
        message = "Training job stopped" if os.path.exists(asked) else \
            f"the PyTorchJob {self.namespace}/{self.name} was deleted outside Trainyard"
        trans.append({"Status": "Stopped", "StartTime": at, "EndTime": at, "StatusMessage": message})
        doc.update(TrainingJobStatus="Stopped", SecondaryStatus="Stopped", TrainingEndTime=at, LastModifiedTime=at)
        if not os.path.exists(asked):
            doc["FailureReason"] = message
        return doc

    def _status(self) -> dict:
        """The status document the follower reads (sdk/jobs/live.py): describe()'s, times as ISO strings."""
        return _iso(self.describe())

    def status(self) -> str:
        return self.describe()["TrainingJobStatus"]

    def wait(self, logs="All", poll: float = POLL_S) -> dict:
        return super().wait(logs=logs, poll=poll)

    def logs(self, wait: bool = True, poll: float = POLL_S) -> None:
        super().logs(wait=wait, poll=poll)

    def _reader(self) -> "PodLogReader":
        return PodLogReader(self)

    def stop(self, wait: bool = True) -> None:
        """Delete the PyTorchJob (its pods end; the ConfigMap and claims go with it) and the job's
        PersistentVolumes; with `wait`, return once the PyTorchJob is gone."""
        if self.status() in TERMINAL:
            return
        with open(f"{self.dir}/stop-requested", "w") as fh:
            fh.write(now_iso())
        self._call("deleting the PyTorchJob", self.api.custom.delete_namespaced_custom_object, GROUP, VERSION,
                   self.namespace, PLURAL, self.name, propagation_policy="Background")
        for pv in self.volumes:
            self._call(f"deleting PersistentVolume {pv}", self.api.core.delete_persistent_volume, pv)
        deadline = time.monotonic() + self.stop_timeout_s
        while wait and self._object() is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the PyTorchJob {self.namespace}/{self.name} was not deleted within "
                                   f"{self.stop_timeout_s:.0f}s")
            time.sleep(1.0)
        self.describe()  # records the end (Stopped) in the job folder

    def metrics(self) -> list[dict]:
        """One row per log line of the pods that the job's metric_definitions match."""
        if not self.spec.metric_definitions:
            return []
        return metrics.scrape(self._reader().poll(final=True), self.spec.metric_definitions)


class PodLogReader:
    """New lines of a job's pods, stamped with the time the kubelet gave each (`timestamps=true`), prefixed with
    the pod's host (`[algo-2] ...`) unless the line names its host already (the driver's and the ranks' lines do),
    merged in time order; each line once. `poll()` has LogReader's interface (sdk/jobs/joblog.py)."""

    SINCE_MARGIN_S = 5  # after the first read, ask for the last seconds only, this much more than needed

    def __init__(self, job: KubernetesJob):
        self.job = job
        self.last: dict[str, int] = {}  # pod -> the newest line's time seen, ns since the epoch

    def poll(self, final: bool = False) -> list[str]:
        out = []
        for pod in self.job.pods():
            name = pod["metadata"]["name"]
            if (pod.get("status") or {}).get("phase") == "Pending":
                continue  # no container has started: no log yet
            host = k8s_status.host_of(pod)
            seen = self.last.get(name)
            kw = {"container": CONTAINER, "timestamps": True}
            if seen is not None:
                kw["since_seconds"] = max(1, int(time.time() - seen / 1e9) + self.SINCE_MARGIN_S)
            try:  # the raw answer: the client would deserialize the text (as JSON where it parses, or bytes' repr)
                answer = self.job.api.core.read_namespaced_pod_log(name, self.job.namespace, _preload_content=False,
                                                                   **kw)
                text = answer.data.decode("utf-8", "replace")
            except api_errors():
                continue  # the container is not running yet, or the pod just went away
            for line in text.splitlines():
                stamp, _, message = line.partition(" ")
                at = _nanoseconds(stamp)
                if at is None or (seen is not None and at <= seen):
                    continue
                self.last[name] = max(self.last.get(name, 0), at)
                text_line = message if message.startswith(f"[{host}") else f"[{host}] {message}"
                out.append((at, stamped(text_line, at / 1e9)))
        return [line for _, line in sorted(out)]


def _nanoseconds(stamp: str) -> int | None:
    """An RFC 3339 time with up to nanoseconds (`2026-11-24T08:01:02.123456789Z`) as ns since the epoch."""
    try:
        whole, _, frac = stamp.rstrip("Z").partition(".")
        seconds = datetime.fromisoformat(whole).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
    digits = frac[:9].ljust(9, "0")
    return int(seconds) * 1_000_000_000 + (int(digits) if digits.isdigit() else 0)


def _iso(doc: dict) -> dict:
    """A description with its times as ISO strings (the job folder's, and the follower's, form)."""
    def conv(v):
        if isinstance(v, datetime):
            return v.isoformat()
        if isinstance(v, list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return conv(doc)


def _times(doc: dict) -> dict:
    """The inverse of `_iso` for the keys that hold times."""
    out = {k: datetime.fromisoformat(v) if k.endswith("Time") and isinstance(v, str) else v for k, v in doc.items()}
    out["SecondaryStatusTransitions"] = [
        {k: datetime.fromisoformat(v) if k.endswith("Time") and isinstance(v, str) else v for k, v in t.items()}
        for t in doc.get("SecondaryStatusTransitions", [])]
    return out
