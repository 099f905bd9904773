"""A JobSpec as Kubernetes objects: the Kubernetes backend's one translation (pure: no cluster, no I/O).

`render(spec)` returns, in the order they are created,

    ConfigMap  <job>-contract        spec.json (the whole JobSpec) and the contract's job-wide files:
                                     hyperparameters.json, resourceconfig.json (every host; `current_host` is
                                     each pod's own, filled in by the image's entry), inputdataconfig.json, ...
    PersistentVolume  <ns>-<job>-<fs-id>   per FSx for Lustre file system with dns_name/mount_name given:
                                     the fsx.csi.aws.com driver, static, pre-bound to the claim below
    PersistentVolumeClaim  <job>-<fs-id>   bound to that volume (an existing claim_name is used as it is)
    PyTorchJob  <job>                kubeflow.org/v1: Master (1 replica) and Worker (N-1), nprocPerNode,
                                     runPolicy from max_run and max_retry_attempts

Every pod runs the Trainyard image's Kubernetes entry (`python -m trainyard.container.kubernetes`, in the
container named `pytorch`, the name the training operator looks for): it reads the ConfigMap at
`/etc/trainyard` and the operator's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, stages the S3 channels
itself, writes the contract and runs the same driver as every other backend (container/kubernetes.py). FSx
channels need no staging: each is the claim, mounted read-only (its folder as `subPath`) at
`/opt/ml/input/data/<channel>`, where the contract has the channel. Resources come from the instance catalog:
`nvidia.com/gpu` (or `aws.amazon.com/neuron`) and `vpc.amazonaws.com/efa` limits of the whole instance, cpu and
memory requests of most of it; the pods are pinned to the instance type by `node.kubernetes.io/instance-type`
and get a memory-backed `/dev/shm` for NCCL.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

import yaml

from trainyard.container import attempts
from trainyard.container.contract import CONFIG_DIR, JOB_FILE, KUBERNETES_CONFIG_DIR, render_contract
from trainyard.job import catalog
from trainyard.job.kubernetes import KubernetesOptions
from trainyard.job.spec import JobSpec
from trainyard.job.uris import split_fsx

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
API_VERSION = f"{GROUP}/{VERSION}"
CONTAINER = "pytorch"  # the training operator sets its variables and finds the port in the container of this name
PORT_NAME = "pytorchjob-port"  # the operator's MASTER_PORT is the master container's port of this name
MASTER_PORT = 23456  # the training operator's default port
ENTRY = ["python", "-m", "trainyard.container.kubernetes"]
SPEC_FILE = "spec.json"
JOB_LABEL = "training.kubeflow.org/job-name"  # the operator's label on the job's pods
TRAINYARD_LABEL = "trainyard.io/job"
TAGS_ANNOTATION = "trainyard.io/tags"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
FSX_DRIVER = "fsx.csi.aws.com"
# share of an instance's vCPUs and memory the pod requests: the rest is the kubelet's and the system's reserve and
# the node's DaemonSets' (VPC CNI, kube-proxy, the NVIDIA and EFA device plugins, the FSx CSI node); a request for
# the whole instance would never be scheduled
CPU_SHARE = 0.9
MEMORY_SHARE = 0.85
CONFIGMAP_MAX_BYTES = 1024 * 1024  # Kubernetes keeps at most 1 MiB of data in one ConfigMap
MANIFEST_FILE = "pytorchjob.yaml"
CODE_ARCHIVE = "sourcedir.tar.gz"


def options(spec: JobSpec) -> KubernetesOptions:
    return spec.kubernetes or KubernetesOptions()


def configmap_name(job: str) -> str:
    return f"{job}-contract"


def claim_name(spec: JobSpec, fs_id: str) -> str:
    given = options(spec).fsx.get(fs_id)
    return given.claim_name if given is not None and given.claim_name else f"{spec.job_name}-{fs_id}"


def volume_name(spec: JobSpec, fs_id: str) -> str:
    """A PersistentVolume's name: cluster-wide, so the namespace is in it."""
    return f"{options(spec).namespace}-{spec.job_name}-{fs_id}"


def fsx_ids(spec: JobSpec) -> list[str]:
    """The FSx file systems the channels read, in channel order, each once."""
    return list(dict.fromkeys(split_fsx(c.uri)[0] for c in spec.channels if c.uri.startswith("fsx://")))


def labels(spec: JobSpec) -> dict[str, str]:
    return {TRAINYARD_LABEL: spec.job_name, "app.kubernetes.io/managed-by": "trainyard"}


def render(spec: JobSpec) -> list[dict[str, Any]]:
    """The objects of `spec` (named), in the order they are to be created (see the module)."""
    if spec.job_name is None:
        raise ValueError("the spec has no job_name yet")
    out = [contract_configmap(spec)]
    for fs_id in fsx_ids(spec):
        if not options(spec).fsx[fs_id].claim_name:
            out += [fsx_volume(spec, fs_id), fsx_claim(spec, fs_id)]
    return out + [pytorchjob(spec)]


def contract_files(spec: JobSpec) -> dict[str, str]:
    """The ConfigMap's data: the spec, and the contract files every host shares (host 0's, less `current_host`)."""
    contract = render_contract(spec, 0)
    data = {SPEC_FILE: spec.to_json()}
    for rel, text in sorted(contract.files.items()):
        if rel == JOB_FILE or not rel.startswith(f"{CONFIG_DIR}/"):
            continue  # the launch facts are each pod's own (container/kubernetes.py writes them)
        name = rel[len(CONFIG_DIR) + 1:]
        if name == "resourceconfig.json":
            text = json.dumps({k: v for k, v in json.loads(text).items() if k != "current_host"})
        data[name] = text
    return data


def contract_configmap(spec: JobSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": configmap_name(spec.job_name), "namespace": options(spec).namespace,
                         "labels": labels(spec)},
            "data": contract_files(spec)}


def fsx_volume(spec: JobSpec, fs_id: str) -> dict[str, Any]:
    """A static PersistentVolume of the FSx for Lustre CSI driver, reserved for the job's claim (claimRef)."""
    fs = options(spec).fsx[fs_id]
    return {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": volume_name(spec, fs_id), "labels": labels(spec)},
            "spec": {"capacity": {"storage": f"{fs.storage_gib}Gi"}, "volumeMode": "Filesystem",
                     "accessModes": ["ReadWriteMany"], "persistentVolumeReclaimPolicy": "Retain",
                     "storageClassName": "",  # static: no class provisions it
                     "claimRef": {"namespace": options(spec).namespace, "name": claim_name(spec, fs_id)},
                     "csi": {"driver": FSX_DRIVER, "volumeHandle": fs_id,
                             "volumeAttributes": {"dnsname": fs.dns_name, "mountname": fs.mount_name}}}}


def fsx_claim(spec: JobSpec, fs_id: str) -> dict[str, Any]:
    fs = options(spec).fsx[fs_id]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim_name(spec, fs_id), "namespace": options(spec).namespace,
                         "labels": labels(spec)},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume_name(spec, fs_id),
                     "resources": {"requests": {"storage": f"{fs.storage_gib}Gi"}}}}


def resources(spec: JobSpec) -> dict[str, dict[str, str]]:
    """The pod's limits (accelerators and EFA interfaces of the whole instance) and requests (cpu, memory)."""
    itype = catalog.lookup(spec.instance_type)
    limits: dict[str, str] = {}
    if itype.num_gpus:
        limits["nvidia.com/gpu"] = str(itype.num_gpus)
    if itype.accelerator_kind == "neuron":
        limits["aws.amazon.com/neuron"] = str(itype.accelerator_count)  # Neuron devices, as the device plugin counts
    efa = efa_interfaces(spec)
    if efa:
        limits["vpc.amazonaws.com/efa"] = str(efa)
    requests = {"cpu": str(max(1, int(itype.vcpus * CPU_SHARE)))}
    if itype.memory_mib:
        requests["memory"] = f"{int(itype.memory_mib * MEMORY_SHARE)}Mi"
    return {"limits": limits, "requests": requests}


def efa_interfaces(spec: JobSpec) -> int:
    itype = catalog.lookup(spec.instance_type)
    if options(spec).efa is False or not itype.efa_supported:
        return 0
    return itype.max_efa_interfaces


def pod_template(spec: JobSpec) -> dict[str, Any]:
    """The PodTemplateSpec of every replica (master and workers run the same container)."""
    opts = options(spec)
    mounts: list[dict[str, Any]] = [{"name": "contract", "mountPath": KUBERNETES_CONFIG_DIR, "readOnly": True},
                                    {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "contract", "configMap": {"name": configmap_name(spec.job_name)}},
        # NCCL's shared-memory transport between the ranks of a pod; the container runtime's default is 64 MiB
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    ids = fsx_ids(spec)
    for fs_id in ids:
        volumes.append({"name": f"fsx-{ids.index(fs_id)}",
                        "persistentVolumeClaim": {"claimName": claim_name(spec, fs_id), "readOnly": True}})
    for ch in spec.channels:
        if ch.uri.startswith("fsx://"):
            fs_id, path = split_fsx(ch.uri)
            mount = {"name": f"fsx-{ids.index(fs_id)}", "mountPath": f"/opt/ml/input/data/{ch.name}", "readOnly": True}
            if path.strip("/"):
                mount["subPath"] = path.strip("/")
            mounts.append(mount)
    container = {"name": CONTAINER, "image": spec.image_uri, "imagePullPolicy": "IfNotPresent", "command": list(ENTRY),
                 "ports": [{"name": PORT_NAME, "containerPort": MASTER_PORT, "protocol": "TCP"}],
                 "resources": resources(spec), "volumeMounts": mounts}
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes,
                           "nodeSelector": {INSTANCE_TYPE_LABEL: catalog.lookup(spec.instance_type).name,
                                            **opts.node_selector}}
    if opts.service_account:
        pod["serviceAccountName"] = opts.service_account
    if opts.tolerations:
        pod["tolerations"] = [dict(t) for t in opts.tolerations]
    return {"metadata": {"labels": labels(spec)}, "spec": pod}


def pytorchjob(spec: JobSpec) -> dict[str, Any]:
    """The Kubeflow PyTorchJob: 1 Master and N-1 Workers; a failed pod restarts (OnFailure) up to
    max_retry_attempts times in all (backoffLimit), or the job fails at once (Never); max_run is its deadline."""
    retry = attempts.kubernetes_retry(spec.max_retry_attempts)
    template = pod_template(spec)

    def replicas(n: int) -> dict[str, Any]:
        # a copy each: a YAML dump would otherwise write the second as an alias of the first
        return {"replicas": n, "restartPolicy": retry["restartPolicy"], "template": copy.deepcopy(template)}

    specs = {"Master": replicas(1)}
    if spec.instance_count > 1:
        specs["Worker"] = replicas(spec.instance_count - 1)
    metadata: dict[str, Any] = {"name": spec.job_name, "namespace": options(spec).namespace, "labels": labels(spec)}
    if spec.tags:
        metadata["annotations"] = {TAGS_ANNOTATION: json.dumps(spec.tags, sort_keys=True)}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
            "spec": {"runPolicy": {"cleanPodPolicy": "None",  # the pods stay after the end: their logs stay readable
                                   "backoffLimit": retry["backoffLimit"], "activeDeadlineSeconds": spec.max_run},
                     "nprocPerNode": str(spec.processes_per_host),
                     "pytorchReplicaSpecs": specs}}


class _Dumper(yaml.SafeDumper):
    """YAML with multi-line strings (the ConfigMap's spec.json) as literal blocks, readable as the file is."""


_Dumper.add_representer(str, lambda d, text: d.represent_scalar("tag:yaml.org,2002:str", text,
                                                                style="|" if "\n" in text else None))


def to_yaml(manifests: list[dict[str, Any]], header: str = "") -> str:
    """The objects as one YAML stream (`kubectl apply -f`), `header` as comment lines first."""
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


def write(manifests: list[dict[str, Any]], path: str, *, code_uri: str | None = None,
          code_archive: bytes | None = None) -> list[str]:
    """Write `pytorchjob.yaml` (and the code archive, when there is code to ship) into the folder `path`;
    returns the files written."""
    os.makedirs(path, exist_ok=True)
    job = next(m for m in manifests if m["kind"] == KIND)
    lines = [f"The Trainyard job {job['metadata']['name']} as a Kubeflow PyTorchJob (trainyard/sdk/backends/kubernetes/manifests.py).",
             f"kubectl apply -f {MANIFEST_FILE}    (the Kubeflow Training Operator must be installed)"]
    written = []
    if code_archive is not None:
        archive = os.path.join(path, CODE_ARCHIVE)
        with open(archive, "wb") as fh:
            fh.write(code_archive)
        written.append(archive)
        lines.insert(1, f"First upload the code: aws s3 cp {CODE_ARCHIVE} {code_uri}")
    target = os.path.join(path, MANIFEST_FILE)
    with open(target, "w") as fh:
        fh.write(to_yaml(manifests, "\n".join(lines)))
    return [target, *written]
