"""The detached controller of one EC2 job (`python -m trainyard.sdk.backends.ec2.controller <jobdir>`): it plays
the part SageMaker's service plays. Started by `fit()` once the instances are launched, it

- follows the job: each node's status object in S3 (`<state_uri>/hosts/algo-N/status.json`, written by
  the node agent) and the instances' states; the least advanced node sets the secondary status
  (DownloadingTrainingImage, PreparingTrainingStack, Downloading, Training, Uploading), each dated by the
  nodes' own times (trainyard/sdk/backends/ec2/progress.py), and the nodes' timed phases become the job's
  `HostPhases`; when each instance ends is recorded for the job's instance-hours (trainyard/sdk/backends/ec2/billing.py);
- mirrors each node's CloudWatch Logs stream into the job folder (`logs/algo-N.log`), so that
  `wait()`, `logs()` and `attach()` work as for local jobs, and the first host's `metrics.jsonl` (the
  parts its node agent ships, trainyard/container/metricship.py) into
  `hosts/algo-1/output/data/metrics.jsonl`, where `metrics()` reads it;
- brings a spot job back after an interruption (up to `max_retry_attempts` times, within `max_wait`):
  the interrupted attempt's instances are terminated and all N are launched again; the engine resumes
  from its newest committed checkpoint;
- ends the job: Completed when every node completed; Failed when one failed or an instance vanished
  with no retry left; Stopped on `stop()` (SIGTERM) or past `max_run`; and in every case terminates
  the instances and deletes everything the job created (`ledger.json`).

The instances also end themselves: the user data shuts the instance down when the container exits
(the launch template terminates on shutdown), so a controller that dies costs no GPU hours;
`trainyard gc` removes what it would have deleted.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

from trainyard.container import attempts
from trainyard.container.failure import ECHO_SETTLE_S, cause_rank, first_cause, headline
from trainyard.container.metricship import METRICS_FILE, read_parts
from trainyard.job.spec import JobSpec
from trainyard.job.uris import join, split_s3
from trainyard.container.phases import settle
from trainyard.sdk.backends.ec2 import billing
from trainyard.sdk.backends.ec2 import progress
from trainyard.sdk.backends.ec2.provision import Cluster, Ledger
from trainyard.sdk.backends.aws.userdata import render_user_data
from trainyard.sdk.jobs.joblog import stamped
from trainyard.sdk.jobs.jobstate import Status, now_iso, read_json, record_outcome, write_json

LOG_GROUP = "/trainyard/jobs"
POLL_S = float(os.environ.get("TRAINYARD_CONTROLLER_POLL_S", "5"))
PHASES = progress.NODE_PHASES
GONE = ("shutting-down", "terminated", "stopping", "stopped")
INTERRUPT_GRACE_S = 150  # a spot notice comes two minutes before the instance is reclaimed


def _log(msg: str) -> None:
    print(stamped(f"[trainyard] {msg}"), flush=True)


class Controller:
    def __init__(self, jobdir: str):
        import boto3

        self.jobdir = jobdir
        self.spec = JobSpec.from_json(open(f"{jobdir}/spec.json").read())
        self.runtime = read_json(f"{jobdir}/runtime.json")
        self.status = Status(f"{jobdir}/status.json")
        # the user's session, recreated (sdk/backends/ec2/backend.py `controller_session`): its region, its profile, and
        # the keys of a session built from keys, which fit() put in this process's environment
        self.session = boto3.Session(region_name=self.runtime["region"], profile_name=self.runtime.get("profile"))
        self.cluster = Cluster(self.session, self.spec.job_name, ledger=Ledger.load(f"{jobdir}/ledger.json"), say=_log,
                               tags=self.spec.tags)
        self.s3, self.logs = self.session.client("s3"), self.session.client("logs")
        self.log_tokens: dict[str, str | None] = {}
        self.metrics_after: str | None = None  # the key of the last metrics part mirrored
        self.metrics_failing = False
        self.stopping = False
        self.interrupted_at: float | None = None  # when the current attempt's first node reported a notice

    # ---- what the nodes say -----------------------------------------------------------------------------

    def host_status(self, host: str, attempt: int) -> dict | None:
        bucket, key = split_s3(join(self.runtime["state_uri"], "hosts", host, "status.json"))
        try:
            doc = json.loads(self.s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except Exception as e:  # noqa: BLE001 - not written yet (NoSuchKey), or a transient error
            if "NoSuchKey" not in str(e) and "404" not in str(e):
                _log(f"reading {host}'s status failed: {e}")
            return None
        return doc if doc.get("attempt") == attempt else None

    def mirror_logs(self) -> None:
        """Append each node's new CloudWatch Logs events to `logs/algo-N.log`."""
        for host in self.spec.hosts:
            stream = f"{self.spec.job_name}/{host}"
            lines: list[str] = []
            while True:
                kwargs = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
                if self.log_tokens.get(host):
                    kwargs["nextToken"] = self.log_tokens[host]
                try:
                    reply = self.logs.get_log_events(**kwargs)
                except Exception as e:  # noqa: BLE001 - the stream appears when the node starts
                    if "ResourceNotFound" not in str(e):
                        _log(f"reading {stream} from CloudWatch Logs failed: {e}")
                    break
                lines += [stamped(event["message"].rstrip("\n"), event["timestamp"] / 1000)  # the event's own time
                          for event in reply["events"]]
                token = reply.get("nextForwardToken")
                if not reply["events"] or token == self.log_tokens.get(host):
                    self.log_tokens[host] = token
                    break
                self.log_tokens[host] = token
            if lines:
                with open(f"{self.jobdir}/logs/{host}.log", "a") as fh:
                    fh.write("\n".join(lines) + "\n")

    def mirror_metrics(self) -> None:
        """Append the first host's new metrics parts to `hosts/<host>/output/data/metrics.jsonl`. The file is
        replaced (a copy with the new lines, then os.replace), so a reader never sees half a line. A failure
        is said once and tried again at the next poll."""
        host = self.spec.hosts[0]
        path = f"{self.jobdir}/hosts/{host}/output/data/{METRICS_FILE}"
        try:
            data, after = read_parts(self.s3, self.runtime["state_uri"], host, self.metrics_after)
            if data:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as fh:
                    if os.path.exists(path):
                        with open(path, "rb") as old:
                            shutil.copyfileobj(old, fh)
                    fh.write(data)
                os.replace(tmp, path)
            self.metrics_after, self.metrics_failing = after, False
        except Exception as e:  # noqa: BLE001 - S3 or the disk: the next poll tries again from the same part
            if not self.metrics_failing:
                _log(f"mirroring {host}'s metrics failed: {e}")
            self.metrics_failing = True

    def instance_states(self, attempt: int) -> dict[str, str]:
        """The states of the attempt's instances; one seen ending is recorded as ended (billing.py)."""
        ids = [i["id"] for i in self.cluster.ledger.items if i["kind"] == "instance" and i.get("attempt") == attempt]
        if not ids:
            return {}
        reply = self.cluster.ec2.describe_instances(InstanceIds=ids)
        states = {i["InstanceId"]: i["State"]["Name"] for r in reply["Reservations"] for i in r["Instances"]}
        billing.ended(self.status, [i for i, state in states.items() if state in GONE])
        return states

    def follow(self, docs: dict[str, dict | None]) -> None:
        """The transitions every node has reached since the last look, dated by the nodes, and their phases."""
        for status, at, message in progress.steps(docs, self.status.doc["SecondaryStatus"]):
            self.status.transition(status, message, at=at)
        phases = {**self.status.doc.get("HostPhases", {}), **progress.host_phases(docs)}
        if phases != self.status.doc.get("HostPhases", {}):
            self.status.update(HostPhases=phases)

    # ---- the loop ---------------------------------------------------------------------------------------

    def run(self) -> int:
        write_json(f"{self.jobdir}/supervisor.json", {"pid": os.getpid(), "started": now_iso()})
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        spec, attempt = self.spec, self.runtime.get("attempt", 1)
        started = time.monotonic()
        training_started: float | None = None
        failed_at: float | None = None  # when a host of this attempt first reported a failure
        outcome, reason = "Failed", ""
        try:
            while True:
                self.mirror_logs()
                self.mirror_metrics()
                if self.stopping or os.path.exists(f"{self.jobdir}/stop-requested"):
                    outcome = "Stopped"
                    break
                docs = {h: self.host_status(h, attempt) for h in spec.hosts}
                states = self.instance_states(attempt)
                phases = [d["phase"] if d else "Starting" for d in docs.values()]
                failed = [d for d in docs.values() if d and d["phase"] == "Failed"]
                if failed:
                    reason = first_cause([d.get("failure_reason") or f"{d['host']} failed" for d in failed])
                    failed_at = failed_at or time.monotonic()
                    if (cause_rank(reason) > 1 and len(failed) < len(docs)
                            and time.monotonic() - failed_at < ECHO_SETTLE_S):
                        time.sleep(POLL_S)  # an echo, or a hang seen from a host that only waits: the host
                        continue            # that holds the cause may report it in a moment
                    if reason.startswith("MaxRuntimeExceeded"):  # the node's own guard fired first
                        outcome = "MaxRuntimeExceeded"
                        break
                    decision = self.decide(attempt, "Failed", reason)
                    if decision.action == "end" or not self.retry(
                            attempt, f"{headline(reason)[:120]} ({decision.retry_class})", started,
                            status="Restarting"):
                        if decision.why and decision.retry_class is None:
                            _log(decision.why)
                        break
                    attempt, failed_at = attempt + 1, None
                    continue
                least = min(phases, key=PHASES.index) if all(p in PHASES for p in phases) else "Starting"
                self.follow(docs)
                if least == "Completed":
                    outcome = "Completed"
                    break
                interrupted = [h for h, d in docs.items() if d and d["phase"] == "Interrupted"]
                vanished = [i for i, s in states.items() if s in GONE]
                if interrupted and not vanished and not self.settled(docs, interrupted):
                    # the engine is writing its emergency checkpoint: let it finish (EC2 gives 2 minutes)
                    time.sleep(POLL_S)
                    continue
                if interrupted or vanished:
                    what = f"hosts {interrupted} interrupted" if interrupted else f"instances {vanished} ended"
                    when = progress.interrupted_at([docs[h] for h in interrupted])
                    decision = self.decide(attempt, "Interrupted", what)
                    if decision.action == "end" or not self.retry(attempt, what, started, when):
                        if self.stopping:  # stop() while the job was interrupted: it ends Stopped
                            outcome = "Stopped"
                        else:
                            reason = decision.why or f"{what}: no new capacity came before max_wait"
                        break
                    attempt += 1
                    continue
                if least == "Training" and training_started is None:
                    training_started = time.monotonic()
                if training_started is not None and time.monotonic() - training_started > spec.max_run:
                    outcome = "MaxRuntimeExceeded"
                    break
                if spec.max_wait is not None and time.monotonic() - started > spec.max_wait:
                    outcome, reason = "Failed", f"MaxWaitTimeExceeded: max_wait={spec.max_wait}s passed"
                    break
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - the job fails with the reason; teardown still runs
            outcome, reason = "Failed", f"controller: {type(e).__name__}: {e}"
        return self.finish(outcome, reason)

    def settled(self, docs: dict, interrupted: list[str]) -> bool:
        """Every interrupted node has finished (its agent wrote an exit code), or the notice is old."""
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
        done = all(docs[h].get("exit_code") is not None for h in interrupted)
        if done or time.monotonic() - self.interrupted_at > INTERRUPT_GRACE_S:
            self.interrupted_at = None
            return True
        return False

    def decide(self, attempt: int, outcome: str, reason: str) -> attempts.Decision:
        """What follows the attempt (container/attempts.py; new instances replace lost ones: the job never
        shrinks here), recorded in the status document's `Attempts`."""
        spec = self.spec
        decision = attempts.decide(outcome=outcome, reason=reason, attempt=attempt, instance_count=spec.instance_count,
                                   max_retry_attempts=spec.max_retry_attempts, stopping=self.stopping)
        attempts.record(self.status, attempt, outcome, reason, decision.retry_class, EndTime=now_iso())
        return decision

    def retry(self, attempt: int, what: str, started: float, when: str | None = None,
              status: str = "Interrupted") -> bool:
        """Launch the next attempt on new capacity (new instances: a vanished one is replaced), as `decide`
        said. Returns False when none came (a stop, or max_wait passed). `when`: the time of the
        interruption, when a node reported it; `status`: Interrupted (spot, lost instances) or Restarting
        (a failure a retry may cure)."""
        spec = self.spec
        self.status.transition(status, f"{what}; launching attempt {attempt + 1} of "
                                        f"{spec.max_retry_attempts + 1} on new capacity", at=when)
        ids = list(self.instance_states(attempt))
        billing.ended(self.status, ids)
        self.cluster.terminate(ids, wait=False)
        user_data = render_user_data(spec, state_uri=self.runtime["state_uri"], region=self.runtime["region"],
                                     attempt=attempt + 1, fsx_mounts=self.runtime.get("fsx_mounts", []))
        self.status.transition("LaunchingMLInstances", f"attempt {attempt + 1}: launching {spec.instance_count} "
                                                       f"x {spec.instance_type} on new capacity")
        while not self.stopping:
            instances = self.cluster.relaunch(user_data, attempt=attempt + 1, count=spec.instance_count,
                                              use_spot=spec.use_spot_instances)
            if instances:
                billing.launched(self.status, instances, attempt + 1)
                self.runtime["attempt"] = attempt + 1
                write_json(f"{self.jobdir}/runtime.json", self.runtime)
                return True
            if spec.max_wait is not None and time.monotonic() - started > spec.max_wait:
                return False
            time.sleep(max(POLL_S, 30))
        return False

    def finish(self, outcome: str, reason: str) -> int:
        spec, st = self.spec, self.status
        billing.ended(st, billing.running(st))  # the teardown terminates them now
        left = self.cluster.teardown()
        if left:
            _log("WARNING: left behind: " + "; ".join(left))
        try:  # after the teardown: the nodes' last lines have had the time to arrive
            self.mirror_logs()
        except Exception as e:  # noqa: BLE001
            _log(f"reading the last log lines failed: {e}")
        self.mirror_metrics()
        docs = {h: self.host_status(h, self.runtime.get("attempt", 1)) for h in spec.hosts}
        first = docs[spec.hosts[0]] or {}
        artifacts = first.get("phase") in ("Uploading", "Completed", "Failed")  # its driver uploads at the end
        try:  # the nodes' last phases; one still running (a node that never reported its end) ended now
            phases = {**st.doc.get("HostPhases", {}), **progress.host_phases(docs)}
            st.update(HostPhases={h: settle(p, now_iso()) for h, p in phases.items()})
        except Exception as e:  # noqa: BLE001 - never lose the job's final status over its timings
            _log(f"recording the hosts' phases failed: {e}")
        record_outcome(st, spec, outcome, reason, artifacts=artifacts, log=_log)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _log(f"controller pid {os.getpid()} for {argv[0]}")
    return Controller(argv[0]).run()


if __name__ == "__main__":
    sys.exit(main())
