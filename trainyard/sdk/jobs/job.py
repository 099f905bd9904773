"""The handle on one training job, whatever ran it: SageMaker's `_TrainingJob` surface over a job folder.

Every backend keeps a job in `$TRAINYARD_HOME/jobs/<job>/` (see `jobstate.py`): the spec, a status
document written by the process that follows the job (local supervisor, EC2 controller), and one log
file per host of time-stamped lines (`joblog.py`). `TrainingJob` reads that folder, so any process can
follow, stop or attach to a job by its name; a backend subclasses it only for what differs (the ARN, the
stop time).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import datetime, timezone

from trainyard.container.contract import hp_json
from trainyard.container.phases import settle
from trainyard.errors import ConfigError, JobFailedError
from trainyard.job.spec import JobSpec
from trainyard.sdk.jobs import metrics
from trainyard.sdk.jobs.joblog import LogReader, job_log_paths
from trainyard.sdk.jobs.live import Follow
from trainyard.sdk.jobs.jobstate import TERMINAL, job_dir, pid_alive, read_json, wait_for
from trainyard.sdk.jobs.report import write_report

STOP_TIMEOUT_S = 60.0
# wait(logs=...): SageMaker's values. "All" and "Rules" print the job's lines; "None" prints nothing.
LOG_MODES = {"All": True, "Rules": True, "None": False, True: True, False: False, None: False}


class TrainingJob:
    """`describe()`, `wait()`, `logs()`, `stop()`, `metrics()` of one job, found by its name."""

    stop_timeout_s = STOP_TIMEOUT_S

    def __init__(self, job_name: str):
        self.name = job_name
        self.dir = job_dir(job_name)
        if not os.path.isdir(self.dir):
            raise ConfigError("job_name", f"no job named {job_name!r} under {os.path.dirname(self.dir)}")
        self.spec = JobSpec.from_json(open(f"{self.dir}/spec.json").read())

    @property
    def job_name(self) -> str:
        """SageMaker's name for `name`."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def _supervisor_pid(self) -> int | None:
        try:
            return read_json(f"{self.dir}/supervisor.json")["pid"]
        except (OSError, ValueError, KeyError):
            return None

    def _status(self) -> dict:
        """The status document. Only the supervisor (or controller) writes it; one that died without a
        word is reported here (not written), so readers never race the writer."""
        doc = read_json(f"{self.dir}/status.json")
        if doc["TrainingJobStatus"] not in TERMINAL and not self._supervisor_alive():
            doc = read_json(f"{self.dir}/status.json")  # it may have finished between the two looks
            if doc["TrainingJobStatus"] not in TERMINAL:
                _ended_silently(doc)
        return doc

    def _supervisor_alive(self) -> bool:
        pid = self._supervisor_pid()
        if pid is not None:
            return pid_alive(pid)
        # not started yet: give it a minute before calling it dead
        return time.time() - os.path.getmtime(f"{self.dir}/status.json") < 60

    def describe(self) -> dict:
        """A SageMaker-shaped description (`DescribeTrainingJob`), times as datetimes. Besides SageMaker's
        keys: `HostPhases`, each host's cold start split into timed phases (trainyard/container/phases.py),
        `HardwareFingerprint` (the first metrics row's `fingerprint`, when the job wrote one), `Warnings` (what the
        metrics rows' `warnings` say, in order: e.g. a straggler the built-in trainer named), `HealthCheck` (the
        pre-flight check's figures per host, and the hosts far below their peers), `Attempts` (each
        attempt, its outcome and, for a failed one, its reason and `RetryClass`), and, from the backend
        (`_usage`), `BillableTimeInSeconds` and `EstimatedCost`."""
        s, spec = self._status(), self.spec
        out = {
            "TrainingJobName": self.name,
            "TrainingJobArn": f"arn:aws:sagemaker:local:000000000000:training-job/{self.name}",
            "TrainingJobStatus": s["TrainingJobStatus"],
            "SecondaryStatus": s["SecondaryStatus"],
            "SecondaryStatusTransitions": [_times(t) for t in s["SecondaryStatusTransitions"]],
            "HostPhases": {host: [_times(p) for p in phases] for host, phases in s.get("HostPhases", {}).items()},
            "HyperParameters": {k: hp_json(v) for k, v in spec.hyperparameters.items()},
            "AlgorithmSpecification": {**({"TrainingImage": spec.image_uri} if spec.image_uri else {}),
                                       "TrainingInputMode": spec.input_mode, "EntryPoint": spec.entry_point,
                                       "MetricDefinitions": [dict(d) for d in spec.metric_definitions],
                                       "EnableSageMakerMetricsTimeSeries": spec.enable_sagemaker_metrics},
            "RoleArn": spec.role,
            "InputDataConfig": [_channel(c) for c in spec.channels],
            "OutputDataConfig": {"S3OutputPath": spec.output_path},
            "ResourceConfig": {"InstanceType": spec.instance_type, "InstanceCount": spec.instance_count,
                               "VolumeSizeInGB": spec.volume_size},
            "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run},
            "Environment": dict(spec.environment),
            "Tags": [{"Key": k, "Value": v} for k, v in spec.tags.items()],
        }
        if spec.checkpoint_s3_uri:
            out["CheckpointConfig"] = {"S3Uri": spec.checkpoint_s3_uri, "LocalPath": spec.checkpoint_local_path}
        final = metrics.final_metric_data_list(self._scraped())
        if final:
            out["FinalMetricDataList"] = final
        # the written rows only: the log was scraped just above, once is enough
        written = self._written()
        fingerprint = next((r["fingerprint"] for r in written if isinstance(r.get("fingerprint"), dict)), None)
        if spec.plan:  # distribution "auto": the layout the planner chose and its predictions
            out["Plan"] = spec.plan
        if fingerprint is not None:  # what the built-in trainer measured on (trainyard/engine/components/fingerprint.py)
            out["HardwareFingerprint"] = fingerprint
        health = next((r["health_check"] for r in reversed(written) if isinstance(r.get("health_check"), dict)), None)
        if health is not None:  # the pre-flight check's figures per host (the latest attempt's)
            out["HealthCheck"] = {"Hosts": health.get("hosts", {}), "SlowHosts": health.get("slow", []),
                                  "UnjudgedHosts": health.get("unjudged", []),
                                  **({"Reason": health["reason"]} if health.get("reason") else {})}
        warnings = list(dict.fromkeys(w for r in written for w in r.get("warnings") or () if isinstance(w, str)))
        if warnings:  # what the job's checks found and training went on with (a straggler named, ...)
            out["Warnings"] = warnings
        for k in ("FailureReason", "ModelArtifacts"):
            if k in s:
                out[k] = s[k]
        if s.get("Attempts"):  # Trainyard's: each attempt of a job that max_retry_attempts restarted
            out["Attempts"] = [_times(a) for a in s["Attempts"]]
        out.update(_times({k: s[k] for k in ("CreationTime", "TrainingStartTime", "TrainingEndTime", "LastModifiedTime") if k in s}))
        out.update(self._usage(s, _until(s)))
        return out

    def _usage(self, s: dict, until: datetime) -> dict:
        """`BillableTimeInSeconds` (and, for a backend that bills, `EstimatedCost`) of the status `s`, counted
        up to `until`. SageMaker's BillableTimeInSeconds is wall-clock seconds of ONE instance: times
        InstanceCount it is the compute SageMaker bills (DescribeTrainingJob's reference). A local job bills
        nothing; its figure, kept for comparison with EC2 jobs, is its wall time from CreationTime to its end
        (now while it runs), not multiplied by the instance count either; it has no EstimatedCost."""
        wall = (until - datetime.fromisoformat(s["CreationTime"])).total_seconds()
        return {"BillableTimeInSeconds": max(0, round(wall))}

    def status(self) -> str:
        return self._status()["TrainingJobStatus"]

    def wait(self, logs="All", poll: float = 0.2) -> dict:
        """Block until the job ends, printing its log lines as they come unless `logs` is "None" (or False).

        Raises JobFailedError (an UnexpectedStatusException) when it Failed. A job that ended Stopped (by
        `stop()`, or by max_run) returns, with a warning on stderr naming why, as SageMaker's SDK warns.
        Ctrl-C stops the job, then re-raises.
        """
        if logs not in LOG_MODES:
            raise ConfigError("logs", f"{logs!r}: use 'All', 'None' or 'Rules' (or True/False)")
        try:
            self._follow(show_lines=LOG_MODES[logs], poll=poll)
        except KeyboardInterrupt:
            print(f"[trainyard] interrupted: stopping {self.name} ...", flush=True)
            self.stop()
            raise
        d = self.describe()
        # a regex that never matched a completed job's lines leaves metrics() without its rows: say so
        if self.spec.metric_definitions and d["TrainingJobStatus"] == "Completed":
            rows = self.metrics()
            silent = [m["Name"] for m in self.spec.metric_definitions if not any(m["Name"] in r for r in rows)]
            if silent:
                print(f"[trainyard] warning: metric_definitions matched no log line of {self.name} for "
                      f"{', '.join(repr(n) for n in silent)}: check the Regex against what the script prints "
                      "(trainyard logs shows it)", file=sys.stderr, flush=True)
        if LOG_MODES[logs]:  # the README's promise: at the end, the way to the job's HTML report
            print(f"[trainyard] {self.name} {d['TrainingJobStatus']}: its HTML report (loss, throughput, memory, "
                  f"timeline, cost): trainyard report {self.name}, or job.report()", file=sys.stderr, flush=True)
        if d["TrainingJobStatus"] == "Failed":
            raise JobFailedError(self.name, "Failed", d.get("FailureReason", ""))
        if d["TrainingJobStatus"] == "Stopped":
            why = d.get("FailureReason") or ("stopped by max_run" if d["SecondaryStatus"] == "MaxRuntimeExceeded"
                                             else "stopped")
            print(f"[trainyard] warning: job {self.name} ended Stopped, not Completed ({why}); its model and "
                  "checkpoints are what it had saved by then", file=sys.stderr, flush=True)
        return d

    def logs(self, wait: bool = True, poll: float = 0.2) -> None:
        """Print the job's log lines: what it printed so far and, with `wait`, the rest as it comes, until
        it ends (SageMaker's `logs_for_job`). Unlike `wait()`, a failed job does not raise here."""
        if not wait:
            for line in self._reader().poll(final=True):
                print(line, flush=True)
            return
        self._follow(show_lines=True, poll=poll)

    def _follow(self, show_lines: bool, poll: float) -> None:
        """Until the job ends: its log lines (when `show_lines`) under its live progress line (sdk/jobs/live.py)."""
        reader = self._reader()
        with Follow(self, show_lines=show_lines) as view:
            while True:
                doc = self._status()  # read once per tick: a SageMaker or EC2 job's status is a service call
                done = doc["TrainingJobStatus"] in TERMINAL
                for line in reader.poll(final=done):
                    view.line(line)
                view.tick(doc=doc)
                if done:
                    return
                time.sleep(poll)

    def log_text(self) -> str:
        """Everything the job printed so far, one story in time order: each line stamped with its UTC time,
        then `[trainyard]` (the supervisor), `[algo-2] driver:` or `[algo-2/3]` (a rank), then the text."""
        return "\n".join(self._reader().poll(final=True))

    def _reader(self) -> LogReader:
        return LogReader(job_log_paths(self.dir, self.spec.hosts))

    def stop(self, wait: bool = True) -> None:
        """Ask the job to stop; every process of it ends. With `wait`, returns once it has."""
        if self.status() in TERMINAL:
            return
        open(f"{self.dir}/stop-requested", "w").close()
        pid = self._supervisor_pid()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
        if wait and not wait_for(lambda: self.status() in TERMINAL, self.stop_timeout_s, 0.1):
            raise TimeoutError(f"job {self.name} did not stop within {self.stop_timeout_s:.0f}s; see {self.dir}/logs")

    def metrics(self) -> list[dict]:
        """The job's metrics, oldest first: the rows it wrote to `$SM_OUTPUT_DATA_DIR/metrics.jsonl` (rank 0
        of algo-1; the built-in trainer writes one per step), then one row per log line that matched the
        `metric_definitions` (`{"timestamp": ..., "<Name>": value}`)."""
        return self._written() + self._scraped()

    def metrics_path(self) -> str:
        """algo-1's metrics.jsonl, here (the EC2 controller mirrors it to the same place)."""
        return f"{self.dir}/hosts/{self.spec.hosts[0]}/output/data/metrics.jsonl"

    def _written(self) -> list[dict]:
        """The rows of algo-1's metrics.jsonl."""
        path = self.metrics_path()
        out = []
        if os.path.exists(path):
            with open(path) as fh:
                for line in fh:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass  # a line being written right now
        return out

    def report(self, path: str | None = None) -> str:
        """Write the job's report, one self-contained HTML file (sdk/jobs/report.py), to `path` (default
        `<job name>-report.html` here); returns its path. Needs plotly: pip install 'trainyard[report]'."""
        return write_report(self, path or f"{self.name}-report.html")

    def _scraped(self) -> list[dict]:
        if not self.spec.metric_definitions:
            return []
        paths = [f"{self.dir}/logs/{h}.log" for h in self.spec.hosts]
        return metrics.scrape_files(paths, self.spec.metric_definitions)


def _channel(c) -> dict:
    """One channel as DescribeTrainingJob shows it."""
    source = {"S3DataType": c.s3_data_type, "S3Uri": c.uri, "S3DataDistributionType": c.distribution}
    if c.attribute_names:
        source["AttributeNames"] = list(c.attribute_names)
    out = {"ChannelName": c.name, "DataSource": {"S3DataSource": source}, "InputMode": c.input_mode,
           "RecordWrapperType": c.record_wrapping or "None", "CompressionType": c.compression or "None"}
    if c.content_type:
        out["ContentType"] = c.content_type
    return out


def _until(s: dict) -> datetime:
    """The end of the job of status `s` (now while it runs)."""
    end = s.get("TrainingEndTime") if s["TrainingJobStatus"] in TERMINAL else None
    return datetime.fromisoformat(end) if end else datetime.now(timezone.utc)


def _ended_silently(doc: dict) -> None:
    """The status `doc` of a job whose supervisor (or controller) died without a word: Failed, as of the last
    time it wrote (the open transition ends there, a Failed one starts there; a host phase still running
    ended there too)."""
    t = doc.get("LastModifiedTime") or doc["CreationTime"]
    trans = doc["SecondaryStatusTransitions"]
    if trans and "EndTime" not in trans[-1]:
        trans[-1]["EndTime"] = max(t, trans[-1]["StartTime"], key=datetime.fromisoformat)
        t = trans[-1]["EndTime"]
    reason = ("the job's supervisor process ended unexpectedly (was it killed?); each host's driver stops its "
              "ranks when that happens; see logs/supervisor.log")
    trans.append({"Status": "Failed", "StartTime": t, "EndTime": t, "StatusMessage": reason})
    doc["HostPhases"] = {h: settle(p, t) for h, p in doc.get("HostPhases", {}).items()}
    doc.update(TrainingJobStatus="Failed", SecondaryStatus="Failed", FailureReason=reason, TrainingEndTime=t)


def _times(d: dict) -> dict:
    return {k: (datetime.fromisoformat(v) if k.endswith("Time") and isinstance(v, str) else v) for k, v in d.items()}
