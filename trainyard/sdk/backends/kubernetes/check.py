"""What Kubernetes (or the Kubeflow training operator) would refuse, or what a PyTorchJob cannot say, found
before anything is uploaded, each with the field named and the fix. Nothing here calls the cluster: the
backend's `plan` does that (sdk/backends/kubernetes/backend.py).
"""
from __future__ import annotations

import re

from trainyard.job import catalog
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec
from trainyard.job.uris import split_fsx
from trainyard.sdk.backends.kubernetes.manifests import CONFIGMAP_MAX_BYTES, INSTANCE_TYPE_LABEL, contract_files, options

# the training operator's rule for a PyTorchJob's name (a DNS-1035 label: it names the job's Services)
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_POD_NAME = 63  # pods and Services are <job>-master-0, <job>-worker-<i>: DNS labels, 63 characters at most
# EC2 arguments a cluster decides for itself, and what to do instead
CLUSTER_DECIDES = {
    "subnets": "the pods run in the cluster's network: the node group's subnets decide; drop subnets",
    "security_group_ids": "the pods get the nodes' security groups (or the cluster's security groups for pods); "
                          "drop security_group_ids",
    "capacity_reservation_id": "the node group's launch template decides which capacity its nodes use; drop "
                               "capacity_reservation_id",
    "network": "the cluster's network decides what the pods reach; drop network",
    "use_spot_instances": "spot capacity is a node group's on Kubernetes: drop use_spot_instances (and max_wait) and "
                          "select spot nodes, e.g. kubernetes={'node_selector': {'eks.amazonaws.com/capacityType': "
                          "'SPOT'}} (Karpenter: 'karpenter.sh/capacity-type': 'spot')",
}
DEFAULT_VOLUME_GB = JobSpec.model_fields["volume_size"].default


def check(spec: JobSpec) -> None:
    """Raise ConfigError for the first thing of `spec` (named) that its PyTorchJob cannot run."""
    itype = catalog.lookup(spec.instance_type)
    if itype.is_local:
        raise ConfigError("instance_type", "Kubernetes runs the job on the cluster's EC2 nodes: give their instance "
                                           "type, such as 'ml.p5.48xlarge' (the pods are pinned to it)")
    if not spec.image_uri:
        raise ConfigError("image_uri", "the pods run the Trainyard image: give its URI (`trainyard image push` "
                                       "prints it)")
    check_job_name(spec.job_name, spec.instance_count)
    for field, fix in CLUSTER_DECIDES.items():
        if getattr(spec, field):
            raise ConfigError(field, fix)
    if spec.volume_size != DEFAULT_VOLUME_GB:
        raise ConfigError("volume_size", "the pods use their node's disk on Kubernetes: size it in the node group "
                                         "and drop volume_size")
    opts = options(spec)
    if opts.efa is True and not itype.efa_supported:
        raise ConfigError("kubernetes.efa", f"{itype.name} has no EFA interfaces: pick a type with EFA (p4d, p5, "
                                            "g5.8xlarge and larger, trn1.32xlarge) or drop efa")
    pinned = opts.node_selector.get(INSTANCE_TYPE_LABEL)
    if pinned is not None and pinned != itype.name:
        raise ConfigError("kubernetes.node_selector", f"{INSTANCE_TYPE_LABEL}={pinned!r} contradicts instance_type "
                                                      f"{spec.instance_type!r}; drop it (Trainyard sets it)")
    for field in ("output_path", "code_uri"):
        uri = getattr(spec, field)
        if uri is not None and not uri.startswith("s3://"):
            raise ConfigError(field, f"{uri!r} is on this machine, which the pods cannot read: give an s3:// prefix")
    _check_channels(spec)
    size = sum(len(k.encode()) + len(v.encode()) for k, v in contract_files(spec).items())
    if size > CONFIGMAP_MAX_BYTES:
        raise ConfigError("hyperparameters", f"the job's contract ConfigMap would hold {size} bytes and Kubernetes "
                                             f"keeps at most {CONFIGMAP_MAX_BYTES}: pass large values as a file in a "
                                             "channel")


def check_job_name(name: str | None, instance_count: int) -> None:
    """A PyTorchJob's name: a lower-case DNS-1035 label, short enough for its pods' and Services' names."""
    if name is None:
        return
    if not DNS1035_LABEL.match(name):
        fixed = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
        fixed = fixed if fixed[:1].isalpha() else f"job-{fixed}"
        raise ConfigError("job_name", f"{name!r}: a PyTorchJob's name is lower-case letters, digits and '-', "
                                      f"starting with a letter; give job_name={fixed!r} (or a lower-case "
                                      "base_job_name)")
    longest = f"-worker-{instance_count - 2}" if instance_count > 1 else "-master-0"
    if len(name) + len(longest) > MAX_POD_NAME:
        raise ConfigError("job_name", f"{name!r} has {len(name)} characters: the operator names pods and Services "
                                      f"<job>{longest}, {MAX_POD_NAME} characters at most, so give at most "
                                      f"{MAX_POD_NAME - len(longest)} (a shorter job_name or base_job_name)")


def _check_channels(spec: JobSpec) -> None:
    opts = options(spec)
    for ch in spec.channels:
        field = f"inputs.{ch.name}"
        if ch.uri.startswith("file://"):
            raise ConfigError(field, f"{ch.uri} is on this machine, which the pods cannot read; upload it to s3:// "
                                     "(or use an FSx file system) and pass that URI")
        if ch.uri.startswith("fsx://"):
            fs_id = split_fsx(ch.uri)[0]
            if fs_id not in opts.fsx:
                raise ConfigError("kubernetes.fsx", f"channel {ch.name!r} reads FSx file system {fs_id}: say how the "
                                                    f"pods mount it, kubernetes={{'fsx': {{'{fs_id}': {{'dns_name': "
                                                    "..., 'mount_name': ...}}}} (or {'claim_name': an existing "
                                                    "PersistentVolumeClaim})")
            if ch.distribution != "FullyReplicated":
                raise ConfigError(field, "an FSx channel is mounted whole in every pod; ShardedByS3Key is for S3 "
                                         "channels (drop distribution)")
        elif ch.s3_data_type != "S3Prefix":
            raise ConfigError(field, f"s3_data_type {ch.s3_data_type!r} is SageMaker's own: the pods stage the "
                                     "objects under an S3 prefix; give the prefix (S3Prefix)")
