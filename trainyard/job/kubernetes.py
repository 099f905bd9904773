"""Kubernetes options of a job (`Estimator(..., kubernetes={...})`): where its Kubeflow PyTorchJob goes and what
its pods get from the cluster. Part of the JobSpec (`JobSpec.kubernetes`); the manifests are rendered from it by
trainyard/sdk/backends/kubernetes/manifests.py.

    kubernetes={"namespace": "training", "service_account": "trainyard-job",
                "fsx": {"fs-0123456789abcdef0": {"dns_name": "fs-0123....fsx.us-east-1.amazonaws.com",
                                                 "mount_name": "abcdefgh"}},
                "node_selector": {"eks.amazonaws.com/capacityType": "SPOT"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}

Names follow Kubernetes' own rules (a DNS-1123 label for the namespace, a DNS-1123 subdomain for a service
account or claim, label syntax for node selectors), checked here so that a bad one fails before anything is
uploaded.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

# RFC 1123 as Kubernetes applies it: a label is 1-63 lower-case letters, digits and '-', starting and ending
# with a letter or digit; a subdomain is labels joined by '.', 253 characters at most
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# a label key's name part, and a label value: 63 characters of [A-Za-z0-9-_.], alphanumeric at both ends
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_FSX_ID = re.compile(r"^fs-[0-9a-f]{8,17}$")
# the FSx for Lustre CSI driver's mount name: 8 characters (`fsx` for SCRATCH_1 file systems)
_MOUNT_NAME = re.compile(r"^[A-Za-z0-9_]{1,8}$")
TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
FSX_MIN_GIB = 1200  # the smallest FSx for Lustre file system (1.2 TiB); a PV's capacity is informational


def is_label(name: str) -> bool:
    return len(name) <= 63 and bool(DNS1123_LABEL.match(name))


def is_subdomain(name: str) -> bool:
    return len(name) <= 253 and bool(DNS1123_SUBDOMAIN.match(name))


def label_key_problem(key: str) -> str | None:
    """Why `key` is not a label key (`[prefix/]name`, prefix a DNS subdomain, name 63 characters), or None."""
    prefix, _, name = key.rpartition("/")
    if prefix and not is_subdomain(prefix):
        return f"its prefix {prefix!r} is not a DNS subdomain (lower-case letters, digits, '-' and '.')"
    if not (len(name) <= 63 and _LABEL_NAME.match(name)):
        return "its name must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    return None


def label_value_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"values are strings, got {value!r}"
    if value and not (len(value) <= 63 and _LABEL_NAME.match(value)):
        return f"{value!r}: up to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    return None


class FsxVolume(BaseModel):
    """How the pods reach one FSx for Lustre file system that an `fsx://` channel names: its DNS and mount
    names (Trainyard renders a PersistentVolume for the fsx.csi.aws.com driver and a claim bound to it), or a
    PersistentVolumeClaim that already exists in the namespace (`claim_name`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dns_name: str | None = None
    mount_name: str | None = None
    claim_name: str | None = None
    storage_gib: int = FSX_MIN_GIB
    """The PersistentVolume's capacity (the file system's size; the CSI driver does not enforce it)."""

    @model_validator(mode="after")
    def _either(self) -> "FsxVolume":
        given = self.dns_name is not None or self.mount_name is not None
        if self.claim_name is not None:
            if given:
                raise ValueError("give claim_name (an existing PersistentVolumeClaim) or dns_name and mount_name, "
                                 "not both")
            if not is_subdomain(self.claim_name):
                raise ValueError(f"claim_name {self.claim_name!r} is not a Kubernetes name (lower-case letters, "
                                 "digits, '-' and '.')")
            return self
        if not (self.dns_name and self.mount_name):
            raise ValueError("give dns_name and mount_name (`aws fsx describe-file-systems` shows DNSName and "
                             "LustreConfiguration.MountName), or claim_name")
        if not re.match(r"^[A-Za-z0-9.-]{1,253}$", self.dns_name):
            raise ValueError(f"dns_name {self.dns_name!r} is not a DNS name")
        if not _MOUNT_NAME.match(self.mount_name):
            raise ValueError(f"mount_name {self.mount_name!r}: FSx for Lustre mount names are up to 8 letters, "
                             "digits or '_' (SCRATCH_1 file systems: 'fsx')")
        return self

    @field_validator("storage_gib", mode="before")
    @classmethod
    def _storage(cls, v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < FSX_MIN_GIB:
            raise ValueError(f"a whole number of GiB, at least {FSX_MIN_GIB} (FSx for Lustre's "
                             f"smallest size), got {v!r}")
        return v


class KubernetesOptions(BaseModel):
    """Where a job's PyTorchJob is created and what its pods get from the cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    namespace: str = "default"
    service_account: str | None = None
    """The pods' service account: with IRSA (or EKS Pod Identity) it holds the job's AWS role (S3 access)."""
    kubeconfig: str | None = None
    """`fit()`: the kubeconfig file (default: $KUBECONFIG, then ~/.kube/config; in a pod, the pod's account)."""
    context: str | None = None
    """`fit()`: the kubeconfig's context (default: its current-context)."""
    node_selector: dict[str, str] = {}
    """Added to `node.kubernetes.io/instance-type` (e.g. {"eks.amazonaws.com/capacityType": "SPOT"})."""
    tolerations: tuple[dict[str, Any], ...] = ()
    fsx: dict[str, FsxVolume] = {}
    """FSx file system id -> how to mount it, for every `fsx://` channel."""
    efa: bool | None = None
    """None: `vpc.amazonaws.com/efa` as the instance type has EFA interfaces; True: require them; False: none."""

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not is_label(v):
            raise ValueError(f"namespace {v!r} is not a Kubernetes namespace name: 1-63 lower-case letters, digits "
                             "and '-', starting and ending with a letter or digit")
        return v

    @field_validator("service_account")
    @classmethod
    def _service_account(cls, v: str | None) -> str | None:
        if v is not None and not is_subdomain(v):
            raise ValueError(f"service_account {v!r} is not a Kubernetes name: lower-case letters, digits, '-' "
                             "and '.', up to 253 characters")
        return v

    @field_validator("node_selector", mode="before")
    @classmethod
    def _node_selector(cls, v: object) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"expected a dict of label to value, got {v!r}")
        for key, value in v.items():
            why = label_key_problem(key) if isinstance(key, str) else f"keys are strings, got {key!r}"
            why = why or label_value_problem(value)
            if why:
                raise ValueError(f"{key!r}: {why}")
        return dict(v)

    @field_validator("tolerations", mode="before")
    @classmethod
    def _tolerations(cls, v: object) -> tuple:
        if v is None:
            return ()
        if isinstance(v, dict) or not isinstance(v, (list, tuple)):
            raise ValueError(f"expected a list of {{'key', 'operator', 'value', 'effect'}}, got {v!r}")
        for t in v:
            extra = set(t) - TOLERATION_KEYS if isinstance(t, dict) else None
            if extra is None or extra:
                raise ValueError(f"{t!r}: a dict of {sorted(TOLERATION_KEYS)}")
            if t.get("operator", "Equal") not in ("Equal", "Exists"):
                raise ValueError(f"operator {t['operator']!r}: 'Equal' or 'Exists'")
            if t.get("effect", "") not in ("", *TOLERATION_EFFECTS):
                raise ValueError(f"effect {t['effect']!r}: one of {', '.join(TOLERATION_EFFECTS)}")
            if t.get("operator") == "Exists" and t.get("value"):
                raise ValueError(f"{t!r}: operator 'Exists' takes no value")
        return tuple(dict(t) for t in v)

    @field_validator("fsx", mode="before")
    @classmethod
    def _fsx(cls, v: object) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"expected {{file system id: {{'dns_name', 'mount_name'}}}}, got {v!r}")
        for fs_id in v:
            if not isinstance(fs_id, str) or not _FSX_ID.match(fs_id):
                raise ValueError(f"{fs_id!r} is not an FSx file system id (fs- and 8 or 17 hex digits)")
        return dict(v)
