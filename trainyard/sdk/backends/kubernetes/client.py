"""The connection to a cluster: the official `kubernetes` client, an extra (`pip install 'trainyard[kubernetes]'`)
imported here only, when a job talks to a cluster, so that the SDK imports without it.

The kubeconfig is `kubernetes={"kubeconfig": PATH}`, else the first file of $KUBECONFIG, else ~/.kube/config
(`aws eks update-kubeconfig --name CLUSTER` writes it); inside a pod with none of those, the pod's own service
account. Its context is `kubernetes={"context": NAME}`, else the file's current-context.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from trainyard.errors import ConfigError
from trainyard.job.kubernetes import KubernetesOptions

INSTALL = "pip install 'trainyard[kubernetes]'"


def kubeconfig_path(given: str | None) -> str:
    """The kubeconfig file to read (it may not exist)."""
    if given:
        return os.path.expanduser(given)
    env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return os.path.expanduser(env or "~/.kube/config")


@dataclass
class Api:
    """The client's APIs a job uses, on one ApiClient; `where` says which cluster (for messages)."""

    client: Any
    where: str

    @property
    def core(self):
        from kubernetes.client import CoreV1Api

        return CoreV1Api(self.client)

    @property
    def custom(self):
        from kubernetes.client import CustomObjectsApi

        return CustomObjectsApi(self.client)


def connect(kubeconfig: str | None = None, context: str | None = None) -> Api:
    """An Api on the cluster of `kubeconfig`'s `context` (see the module); ConfigError when there is none."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ConfigError("backend", f"backend='kubernetes' talks to the cluster with the kubernetes package: "
                                     f"{INSTALL}") from None
    path = kubeconfig_path(kubeconfig)
    configuration = client.Configuration()
    if os.path.isfile(path):
        try:
            config.load_kube_config(config_file=path, context=context, client_configuration=configuration,
                                    persist_config=False)
        except config.ConfigException as e:
            raise ConfigError("kubernetes.kubeconfig", f"{path}: {e}") from None
        where = f"{configuration.host} ({path}{', context ' + context if context else ''})"
    elif kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
        where = f"{configuration.host} (this pod's service account)"
    else:
        raise ConfigError("kubernetes.kubeconfig", f"no kubeconfig at {path}: write one (aws eks update-kubeconfig "
                                                   "--name CLUSTER), set KUBECONFIG, or pass "
                                                   "kubernetes={'kubeconfig': PATH}")
    return Api(client.ApiClient(configuration), where)


def connect_for(opts: KubernetesOptions | None) -> Api:
    opts = opts or KubernetesOptions()
    return connect(opts.kubeconfig, opts.context)


def status_of(e: Exception) -> int | None:
    """The HTTP status of the client's ApiException, None for any other error (no answer at all)."""
    from kubernetes.client.exceptions import ApiException  # its subclasses too (NotFoundException, ...)

    status = getattr(e, "status", None)
    return status if isinstance(e, ApiException) and isinstance(status, int) else None


def message_of(e: Exception) -> str:
    """What the API server said (its Status object's message), else the error itself, one line."""
    body = getattr(e, "body", None)
    try:
        said = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        said = None
    text = said or (f"{e.status} {e.reason}" if status_of(e) else f"{type(e).__name__}: {e}")
    return " ".join(str(text).split())[:500]


def api_errors() -> tuple[type[BaseException], ...]:
    """The errors a call to the cluster may raise: the client's ApiException, urllib3's (no answer) and OSError."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return ApiException, HTTPError, OSError
