"""A host's cold start split into timed phases: what `describe()["HostPhases"]` shows for each host.

    capacity    the host was asked for -> it runs. EC2: the instance's LaunchTime -> the user data's first
                line (the node agent's start when the user data did not say); local: the supervisor spawns the
                host's driver -> the driver runs its first line
    image       EC2: the user data's `docker pull` of the training image; local jobs pull nothing (no entry)
    peers       EC2: the node agent waits until every instance of the attempt is there, and names them
    data        the host's channels are staged into `input/data/` (EC2: the node agent; local: the supervisor)
    code        the driver fetches and unpacks `sourcedir.tar.gz` and installs `requirements.txt` (no code to
                fetch, an installed module: no entry)
    probe       the bandwidth probe, when `TRAINYARD_BANDWIDTH_PROBE` asks for one
    health      the pre-flight health check, when the job asks for one (`health_check`: container/health.py)
    first_step  the driver starts torchrun -> the host's first step is seen (container/firststep.py); no entry
                when no step was ever seen
    upload      the first host tars and uploads the model and the output data

One entry is `{"Phase", "StartTime", "EndTime"}`, the times ISO 8601 UTC strings (`describe()` turns them
into datetimes); `EndTime` is absent while the phase runs. A phase that did not happen has no entry: never
a zero-length one. Each process records the phases it performs, where they happen: the driver into a JSON
file of its own (`PhaseLog(path)`), the node agent and the local supervisor in memory; the agent's status
object and the supervisor's status document carry the merged list (`merge`).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from datetime import datetime

from trainyard.job.jsonio import now_iso, write_json

# the supervisor's spawn time of a driver, handed to it in its environment: the start of `capacity`
REQUESTED_ENV = "TRAINYARD_HOST_REQUESTED_AT"
# what an EC2 instance's user data timed before the node agent ran, handed to the agent's container
USERDATA_START_ENV = "TRAINYARD_USERDATA_START"  # its first line: the instance runs (the end of `capacity`)
IMAGE_START_ENV = "TRAINYARD_IMAGE_PULL_START"  # before the registry login and `docker pull`
IMAGE_END_ENV = "TRAINYARD_IMAGE_PULL_END"  # after them
HOST_PHASES_FILE = "output/host-phases.json"  # under the host's root: the driver's own, unless told otherwise
FIRST_STEP = "first_step"


class PhaseLog:
    """The phases one process times, in the order they started; with `path`, saved there (atomically)
    at every change so that another process can read them while this one runs."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.entries: list[dict] = []

    def start(self, phase: str, at: str | None = None) -> None:
        self.entries.append({"Phase": phase, "StartTime": at or now_iso()})
        self._save()

    def end(self, phase: str, at: str | None = None) -> None:
        """End the running entry of `phase` (none running: nothing to end)."""
        for entry in reversed(self.entries):
            if entry["Phase"] == phase and "EndTime" not in entry:
                entry["EndTime"] = at or now_iso()
                self._save()
                return

    def add(self, phase: str, start: str, end: str) -> None:
        """A phase timed elsewhere (the user data's image pull, the supervisor's spawn)."""
        self.entries.append({"Phase": phase, "StartTime": start, "EndTime": end})
        self._save()

    def drop(self, phase: str) -> None:
        """Forget a running entry of `phase` that never ended: it did not happen."""
        self.entries = [e for e in self.entries if e["Phase"] != phase or "EndTime" in e]
        self._save()

    @contextmanager
    def timed(self, phase: str, enabled: bool = True):
        """Time the block as `phase` (ended also when it raises); `enabled=False` times nothing."""
        if not enabled:
            yield
            return
        self.start(phase)
        try:
            yield
        finally:
            self.end(phase)

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            write_json(self.path, {"phases": self.entries})
        except OSError:  # timings are a report: they never fail the job that they time
            pass


def boot_phases(launch_time: str | None, agent_start: str, environ) -> list[dict]:
    """An EC2 host's `capacity` and `image` entries: the instance's LaunchTime -> the user data's first line
    (the agent's start `agent_start` when the user data did not say), and the image pull the user data timed
    (none when it did not). A time that does not parse is treated as missing."""
    def when(value: str | None) -> str | None:
        try:
            return datetime.fromisoformat(value).isoformat() if value else None
        except ValueError:
            return None

    out = []
    running = when(environ.get(USERDATA_START_ENV)) or agent_start
    if when(launch_time):
        out.append({"Phase": "capacity", "StartTime": when(launch_time), "EndTime": running})
    pulled = when(environ.get(IMAGE_START_ENV)), when(environ.get(IMAGE_END_ENV))
    if all(pulled):
        out.append({"Phase": "image", "StartTime": pulled[0], "EndTime": pulled[1]})
    return out


def read_phases(path: str) -> list[dict]:
    """The entries a `PhaseLog` saved at `path`; none when there is no file (yet)."""
    try:
        with open(path) as fh:
            return list(json.load(fh).get("phases", []))
    except (OSError, ValueError, AttributeError):
        return []


def _start(entry: dict) -> datetime:
    return datetime.fromisoformat(entry["StartTime"])


def merge(*lists: list[dict]) -> list[dict]:
    """The entries of several processes for one host, in the order they started."""
    return sorted((dict(e) for entries in lists for e in entries), key=_start)


def settle(entries: list[dict], at: str) -> list[dict]:
    """A host's entries once it has ended (`at`): a `first_step` still waiting for its step never happened and
    is dropped; any other running phase ended with the host."""
    out = []
    for e in entries:
        if "EndTime" not in e:
            if e["Phase"] == FIRST_STEP:
                continue
            e = {**e, "EndTime": max(at, e["StartTime"], key=lambda t: datetime.fromisoformat(t))}
        out.append(e)
    return out
