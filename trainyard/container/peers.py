"""Peer discovery for the node agent: which instances make up a job's attempt, in host order.

Every instance of a job carries the tags `trainyard:job` and `trainyard:attempt`; its host index (host
`algo-<index+1>`) is its `trainyard:host-index` tag when it has one (Terraform launches each instance
alone, so all have launch index 0), else its AMI launch index (one RunInstances, as the EC2 backend
launches them). `ec2` is a boto3 EC2 client; nothing here imports boto3 itself.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainyard.job.facts import HOST_INDEX_TAG, TAG_KEY

PEER_WAIT_S = 600.0  # RunInstances starts every instance at once; 10 min covers slow "pending" states
PEER_POLL_S = 5.0  # DescribeInstances is throttled per account: poll gently


def host_name(index: int) -> str:
    """The SageMaker name of the host with this index: `algo-<index+1>`."""
    return f"algo-{index + 1}"


@dataclass(frozen=True, slots=True)
class Peer:
    instance_id: str
    launch_index: int
    private_ip: str | None


def host_index(instance: dict) -> int:
    """The host index of a DescribeInstances record: its `trainyard:host-index` tag when it has one
    (instances launched one at a time, as Terraform does, all have launch index 0), else its AMI launch
    index (all instances in one RunInstances, as the EC2 backend launches them)."""
    tag = next((t["Value"] for t in instance.get("Tags") or [] if t["Key"] == HOST_INDEX_TAG), None)
    return int(tag) if tag is not None else int(instance.get("AmiLaunchIndex", 0))


def own_instance(ec2, instance_id: str, tries: int = 3, wait: float = 2.0) -> dict:
    """This instance's DescribeInstances record (its tags, launch index, LaunchTime); retried, as a
    just-launched instance may not be visible to the API yet."""
    for attempt in range(tries):
        try:
            reply = ec2.describe_instances(InstanceIds=[instance_id])
            break
        except Exception:  # botocore's ClientError (InvalidInstanceID.NotFound) or a throttle
            if attempt + 1 == tries:
                raise
            time.sleep(wait)
    return reply["Reservations"][0]["Instances"][0]


def own_host_index(ec2, instance_id: str, tries: int = 3, wait: float = 2.0) -> int:
    """This instance's host index (see `host_index`), from DescribeInstances of its own id (`own_instance`)."""
    return host_index(own_instance(ec2, instance_id, tries, wait))


def list_peers(ec2, job_name: str, attempt: int) -> list[Peer]:
    """The job's live instances of this attempt, by host index (`Peer.launch_index`: see `host_index`)."""
    filters = [{"Name": f"tag:{TAG_KEY}", "Values": [job_name]},
               {"Name": "tag:trainyard:attempt", "Values": [str(attempt)]},
               {"Name": "instance-state-name", "Values": ["pending", "running"]}]
    peers = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for res in page.get("Reservations", []):
            for i in res.get("Instances", []):
                peers.append(Peer(i["InstanceId"], host_index(i), i.get("PrivateIpAddress")))
    return sorted(peers, key=lambda p: (p.launch_index, p.instance_id))


def find_peers(ec2, job_name: str, attempt: int, count: int, *, timeout: float = PEER_WAIT_S,
               poll: float = PEER_POLL_S, say: Callable[[str], None] = print,
               stop: Callable[[], str | None] = lambda: None, wake: threading.Event | None = None) -> list[Peer]:
    """Wait until the `count` instances of the job's attempt are there, each with its private address
    (the master's for the rendezvous, every one for the `algo-N` names in /etc/hosts). `stop()`
    returning a reason ends the wait with InterruptedError; setting `wake` cuts a pause short."""
    wake = wake or threading.Event()
    deadline = time.monotonic() + timeout
    seen: list[Peer] = []
    for _ in range(int(timeout / max(poll, 0.01)) + 2):  # bounded in count as well as in time
        seen = list_peers(ec2, job_name, attempt)
        indexes = [p.launch_index for p in seen]
        if len(seen) > count or len(set(indexes)) != len(indexes):
            raise RuntimeError(f"job {job_name} attempt {attempt}: {len(seen)} live instances "
                               f"(host indexes {indexes}) where {count} were launched")
        if len(seen) == count and indexes == list(range(count)) and all(p.private_ip for p in seen):
            return seen
        if time.monotonic() + poll > deadline:
            break
        say(f"waiting for peers: {len(seen)} of {count} instances of attempt {attempt} seen")
        wake.wait(poll)
        why = stop()
        if why:
            raise InterruptedError(why)
    raise TimeoutError(f"job {job_name} attempt {attempt}: after {timeout:.0f} s only {len(seen)} of {count} "
                       f"instances are pending or running ({[p.instance_id for p in seen]}); "
                       "the others failed to start or were terminated")
