"""The Kubernetes backend: the job handed to a cluster (EKS, HyperPod's EKS orchestrator) as a Kubeflow
PyTorchJob, the cluster its control plane.

    Estimator(..., instance_type="ml.p5.48xlarge", image_uri=ECR_URI, output_path="s3://...", backend="kubernetes",
              kubernetes={"namespace": "training", "service_account": "trainyard-job"}).fit()

`check` refuses what the cluster or the operator would, and what a PyTorchJob cannot say (sdk/backends/kubernetes/check.py);
`plan` reads the cluster, changing nothing: the namespace, the operator's `kubeflow.org/v1` PyTorchJob resource,
the service account and any existing claims are there (what the kubeconfig's user may not read is given the
benefit of the doubt), and no PyTorchJob has the job's name; `launch` uploads the
code (to `code_location` or `output_path`, as every backend does), then creates the job's objects in the order
sdk/backends/kubernetes/manifests.py renders them: the contract ConfigMap (which holds the spec: nothing else of the job is
uploaded), the FSx PersistentVolumes and claims, the PyTorchJob last, so that its pods find everything they mount;
then it makes the PyTorchJob the owner of the ConfigMap and the claims, so that deleting the job deletes them. A
failure on the way deletes what was created. The handle is `KubernetesJob` (sdk/backends/kubernetes/job.py).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from trainyard.job import catalog, storage
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec
from trainyard.sdk.jobs.jobstate import job_dir, write_json
from trainyard.sdk.backends.kubernetes import check as k8s_check
from trainyard.sdk.backends.kubernetes.client import Api, api_errors, connect_for, kubeconfig_path, message_of, status_of
from trainyard.sdk.backends.kubernetes.job import KubernetesJob
from trainyard.sdk.backends.kubernetes.manifests import (API_VERSION, GROUP, KIND, PLURAL, VERSION, efa_interfaces, options, render,
                                         resources)


@dataclass
class KubernetesPlan:
    where: str
    manifests: list[dict]

    def describe(self) -> str:
        job = next(m for m in self.manifests if m["kind"] == KIND)
        spec = job["spec"]
        pod = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        hosts = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
        limits = pod["containers"][0]["resources"]["limits"]
        run = spec["runPolicy"]
        lines = [f"Kubeflow PyTorchJob {job['metadata']['namespace']}/{job['metadata']['name']} on {self.where}: "
                 f"{hosts} pod(s) on {pod['nodeSelector']['node.kubernetes.io/instance-type']} nodes, "
                 f"{spec['nprocPerNode']} process(es) each",
                 f"  image:     {pod['containers'][0]['image']}",
                 f"  resources: {', '.join(f'{k}={v}' for k, v in limits.items()) or 'no accelerators'} per pod",
                 f"  account:   {pod.get('serviceAccountName', 'the namespace default')}",
                 f"  objects:   {', '.join(m['kind'] + '/' + m['metadata']['name'] for m in self.manifests)}",
                 f"  retries:   {run['backoffLimit']} ({spec['pytorchReplicaSpecs']['Master']['restartPolicy']}); "
                 f"deadline {run['activeDeadlineSeconds']} s"]
        return "\n".join(lines)


class KubernetesBackend:
    """PyTorchJobs on the cluster of the job's kubeconfig (`kubernetes={"kubeconfig": ..., "context": ...}`)."""
    name = "kubernetes"
    job_class = KubernetesJob

    def __init__(self, session=None, say=print):
        self.session = session  # the boto3 session the code is uploaded with (default: boto3's)
        self.say = say
        self._api: Api | None = None

    def api(self, spec: JobSpec) -> Api:
        if self._api is None:
            self._api = connect_for(spec.kubernetes)
        return self._api

    def check(self, spec: JobSpec) -> None:
        k8s_check.check(spec)

    def plan(self, spec: JobSpec) -> KubernetesPlan:
        """Read-only checks against the cluster (see the module); the objects that launch would create."""
        api, opts = self.api(spec), options(spec)
        ns = opts.namespace
        with _refusals(api):
            if not _found(api.core.read_namespace, ns, forbidden=True):
                raise ConfigError("kubernetes.namespace", f"namespace {ns!r} does not exist on {api.where}: create it "
                                                          f"(kubectl create namespace {ns}) or name another")
            served = _read(api, api.custom.get_api_resources, GROUP, VERSION)
            if served is None or PLURAL not in [r["name"] for r in served.get("resources", [])]:
                raise ConfigError("backend", f"{api.where} does not serve {API_VERSION} {KIND}s: install the Kubeflow "
                                             "Training Operator (v1) in the cluster")
            sa = opts.service_account
            if sa and not _found(api.core.read_namespaced_service_account, sa, ns, forbidden=True):
                raise ConfigError("kubernetes.service_account", f"no service account {sa!r} in namespace {ns!r}: "
                                                                "create it (with its IAM role for IRSA) or name "
                                                                "another")
            for fs_id, fs in opts.fsx.items():
                if fs.claim_name and not _found(api.core.read_namespaced_persistent_volume_claim, fs.claim_name, ns,
                                                forbidden=True):
                    raise ConfigError("kubernetes.fsx", f"{fs_id}: no PersistentVolumeClaim {fs.claim_name!r} in "
                                                        f"namespace {ns!r}")
            if _found(api.custom.get_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, spec.job_name,
                      forbidden=False):
                raise ConfigError("job_name", f"a PyTorchJob named {spec.job_name!r} exists in namespace {ns!r}: "
                                              "choose another name")
        return KubernetesPlan(where=api.where, manifests=render(spec))

    def launch(self, spec: JobSpec, plan: KubernetesPlan, upload_code) -> KubernetesJob:
        """Uploads the code, then creates the job's objects (see the module); the job folder here names them."""
        jobdir = job_dir(spec.job_name)
        if os.path.exists(jobdir):
            raise ConfigError("job_name", f"a job named {spec.job_name!r} already exists; choose another name")
        spec = spec.evolve(code_uri=upload_code(spec, s3=storage.s3_client(self.session)))
        k8s_check.check(spec)  # the code's URI too
        manifests = render(spec)
        api, opts = self.api(spec), options(spec)
        os.makedirs(f"{jobdir}/logs")
        with open(f"{jobdir}/spec.json", "w") as fh:
            fh.write(spec.to_json())
        path = kubeconfig_path(opts.kubeconfig)
        write_json(f"{jobdir}/runtime.json", {
            "backend": self.name, "namespace": opts.namespace, "server": plan.where,
            "kubeconfig": os.path.abspath(path) if os.path.isfile(path) else None, "context": opts.context,
            "persistent_volumes": [m["metadata"]["name"] for m in manifests if m["kind"] == "PersistentVolume"]})
        created: list[dict] = []
        try:
            with _refusals(api, creating=True):
                for m in manifests:
                    answer = _create(api, m)
                    created.append(m)
                    if m["kind"] == KIND:
                        _own(api, manifests, answer["metadata"]["uid"])
        except BaseException:
            for m in reversed(created):  # nothing of the job is left: the name stays free
                try:
                    _delete(api, m)
                except api_errors():
                    pass
            shutil.rmtree(jobdir, ignore_errors=True)
            raise
        itype = catalog.lookup(spec.instance_type)
        self.say(f"[trainyard] PyTorchJob {opts.namespace}/{spec.job_name} created on {plan.where}: "
                 f"{spec.instance_count} x {itype.name} ({json.dumps(resources(spec)['limits'])}, "
                 f"{efa_interfaces(spec)} EFA interface(s) each)")
        return KubernetesJob(spec.job_name, api=api)


class _refusals:
    """Turns the cluster's refusals into ConfigErrors naming what to fix (no answer at all: the kubeconfig)."""

    def __init__(self, api: Api, creating: bool = False):
        self.api, self.creating = api, creating

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, ConfigError) or not isinstance(e, api_errors()):
            return False
        status = status_of(e)
        if status in (401, 403):
            raise ConfigError("kubernetes", f"{self.api.where} refused ({status}): {message_of(e)}; the kubeconfig's "
                                            "user needs to read namespaces, service accounts and pods, and to create "
                                            "ConfigMaps, claims, PersistentVolumes and PyTorchJobs") from None
        if status is None:
            raise ConfigError("kubernetes.kubeconfig", f"cannot reach {self.api.where}: {message_of(e)}") from None
        if self.creating and status == 409:
            raise ConfigError("job_name", f"{self.api.where}: {message_of(e)}: an object of an earlier job of this "
                                          "name is left; delete it (kubectl delete) or choose another job name") from None
        if self.creating and status in (400, 422):
            raise ConfigError("kubernetes", f"{self.api.where} refused an object of the job: {message_of(e)}") from None
        return False


def _read(api: Api, fn, *args) -> dict | None:
    """A read of one object, as a dict (the API's field names); None when it does not exist."""
    try:
        found = fn(*args)
    except api_errors() as e:
        if status_of(e) == 404:
            return None
        raise
    return api.client.sanitize_for_serialization(found)


def _found(fn, *args, forbidden: bool) -> bool:
    """Whether an object exists; `forbidden` is the answer when the kubeconfig's user may not read it (a user
    with rights in one namespace only may not read namespaces: the creation then says what is wrong)."""
    try:
        fn(*args)
    except api_errors() as e:
        if status_of(e) in (403, 404):
            return forbidden and status_of(e) == 403
        raise
    return True


def _create(api: Api, m: dict) -> dict:
    ns = m["metadata"].get("namespace")
    if m["kind"] == KIND:
        return api.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, m)
    if m["kind"] == "ConfigMap":
        api.core.create_namespaced_config_map(ns, m)
    elif m["kind"] == "PersistentVolume":
        api.core.create_persistent_volume(m)
    elif m["kind"] == "PersistentVolumeClaim":
        api.core.create_namespaced_persistent_volume_claim(ns, m)
    else:
        raise ValueError(f"no way to create a {m['kind']}")
    return m


def _delete(api: Api, m: dict) -> None:
    name, ns = m["metadata"]["name"], m["metadata"].get("namespace")
    if m["kind"] == KIND:
        api.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    elif m["kind"] == "ConfigMap":
        api.core.delete_namespaced_config_map(name, ns)
    elif m["kind"] == "PersistentVolume":
        api.core.delete_persistent_volume(name)
    elif m["kind"] == "PersistentVolumeClaim":
        api.core.delete_namespaced_persistent_volume_claim(name, ns)


def _own(api: Api, manifests: list[dict], uid: str) -> None:
    """The PyTorchJob (of `uid`) becomes the owner of the job's ConfigMap and claims: deleting it deletes them.
    (A PersistentVolume is cluster-wide and cannot be owned by a namespaced object: stop() deletes those.)"""
    job = next(m for m in manifests if m["kind"] == KIND)
    owner = {"apiVersion": API_VERSION, "kind": KIND, "name": job["metadata"]["name"], "uid": uid}
    patch = [{"op": "add", "path": "/metadata/ownerReferences", "value": [owner]}]  # a JSON patch (a list)
    for m in manifests:
        if m["kind"] == "ConfigMap":
            api.core.patch_namespaced_config_map(m["metadata"]["name"], m["metadata"]["namespace"], patch)
        elif m["kind"] == "PersistentVolumeClaim":
            api.core.patch_namespaced_persistent_volume_claim(m["metadata"]["name"], m["metadata"]["namespace"], patch)
