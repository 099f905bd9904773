"""The SageMaker backend: the job handed to SageMaker as a training job, SageMaker its control plane.

    Estimator(..., instance_type="ml.p4d.24xlarge", role=ROLE_ARN, image_uri=ECR_URI, backend="sagemaker").fit()

`check` refuses what SageMaker would (sdk/backends/sagemaker/request.py); `plan` needs the session's region and
credentials and builds the request (validated by botocore); `launch` uploads the code and the spec (next to
the job's output, `<output_path>/<job>/trainyard/spec.json`) and calls `CreateTrainingJob`. Nothing of the
job runs on this machine: the handle (`SageMakerJob`) reads `DescribeTrainingJob` (SageMaker's own
`describe()`, statuses and `SecondaryStatusTransitions`), follows the job's CloudWatch streams
(`/aws/sagemaker/TrainingJobs`, `<job>/algo-N-<epoch>`) for `logs()` and `wait()`, and `stop()` calls
`StopTrainingJob`. The job folder here holds the spec and the region, so `attach()` and `trainyard` find it
from any process.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime

from trainyard.job import storage
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec
from trainyard.job.uris import join, split_s3
from trainyard.sdk.backends.sagemaker import request as sm_request
from trainyard.sdk.backends.aws.session import check_session, new_session
from trainyard.sdk.jobs.job import TrainingJob
from trainyard.sdk.jobs.joblog import stamped
from trainyard.sdk.jobs.jobstate import TERMINAL, job_dir, read_json, write_json

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
STOP_TIMEOUT_S = 900.0


def spec_uri(spec: JobSpec) -> str:
    return join(spec.output_path, spec.job_name, "trainyard", "spec.json")


@dataclass
class SageMakerPlan:
    region: str
    request: dict

    def describe(self) -> str:
        r = self.request["ResourceConfig"]
        lines = [f"SageMaker training job in {self.region}: {r['InstanceCount']} x {r['InstanceType']}, "
                 f"{r['VolumeSizeInGB']} GB volume each",
                 f"  image:     {self.request['AlgorithmSpecification']['TrainingImage']}",
                 f"  role:      {self.request['RoleArn']}",
                 f"  output:    {self.request['OutputDataConfig']['S3OutputPath']}",
                 f"  channels:  {', '.join(c['ChannelName'] for c in self.request.get('InputDataConfig', [])) or 'none'}",
                 f"  spot:      {'yes' if self.request['EnableManagedSpotTraining'] else 'no'}; retries: "
                 f"{self.request.get('RetryStrategy', {}).get('MaximumRetryAttempts', 0)}"]
        return "\n".join(lines)


class SageMakerJob(TrainingJob):
    """A handle on a SageMaker training job started by Trainyard (or attached by name)."""

    stop_timeout_s = STOP_TIMEOUT_S

    def __init__(self, job_name: str, session=None):
        super().__init__(job_name)
        self.region = read_json(f"{self.dir}/runtime.json")["region"]
        self.session = session or new_session(self.region)

    def __repr__(self) -> str:
        return f"SageMakerJob({self.name!r})"

    def _client(self, service: str):
        return self.session.client(service, endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)

    def describe(self) -> dict:
        """SageMaker's DescribeTrainingJob, as it answers (times as datetimes). An unreachable or refusing
        service is an OSError naming the job (`trainyard jobs` shows such a job as unreadable)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            d = self._client("sagemaker").describe_training_job(TrainingJobName=self.name)
        except (BotoCoreError, ClientError) as e:
            raise OSError(f"SageMaker job {self.name} in {self.region}: {e}") from e
        d.pop("ResponseMetadata", None)
        return d

    def _status(self) -> dict:
        """The status document the follower reads (sdk/jobs/live.py): describe()'s, times as ISO strings."""
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.describe().items()}

    def status(self) -> str:
        return self.describe()["TrainingJobStatus"]

    def wait(self, logs="All", poll: float = 5.0) -> dict:
        return super().wait(logs=logs, poll=poll)

    def _reader(self) -> "CloudWatchReader":
        return CloudWatchReader(self._client("logs"), self.name)

    def stop(self, wait: bool = True) -> None:
        if self.status() in TERMINAL:
            return
        self._client("sagemaker").stop_training_job(TrainingJobName=self.name)
        deadline = time.monotonic() + self.stop_timeout_s
        while wait and self.status() not in TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SageMaker job {self.name} did not stop within {self.stop_timeout_s:.0f}s")
            time.sleep(5.0)

    def metrics(self) -> list[dict]:
        """SageMaker keeps the job's metrics (its metric_definitions) in CloudWatch; the final values are in
        describe()["FinalMetricDataList"]: one row of them."""
        final = self.describe().get("FinalMetricDataList") or []
        return [{m["MetricName"]: m["Value"] for m in final}] if final else []


class CloudWatchReader:
    """New lines of a SageMaker job's CloudWatch streams, time-ordered and stamped as a job's log lines are
    (`[algo-2] ...`); each event once. `poll()` has LogReader's interface (sdk/jobs/joblog.py)."""

    def __init__(self, logs, job_name: str):
        self.logs, self.job = logs, job_name
        self.seen: set[str] = set()
        self.since = 0

    def poll(self, final: bool = False) -> list[str]:
        out, token = [], None
        while True:
            kw = dict(logGroupName=LOG_GROUP, logStreamNamePrefix=f"{self.job}/", startTime=self.since)
            try:
                page = self.logs.filter_log_events(**kw, **({"nextToken": token} if token else {}))
            except self.logs.exceptions.ResourceNotFoundException:
                return []  # no stream yet: the instances are still starting
            for e in page.get("events", []):
                if e["eventId"] in self.seen:
                    continue
                self.seen.add(e["eventId"])
                host = e["logStreamName"].split("/", 1)[-1].rsplit("-", 1)[0]  # <job>/algo-1-1700000000
                out.append((e["timestamp"], stamped(f"[{host}] {e['message'].rstrip()}", e["timestamp"] / 1000)))
            token = page.get("nextToken")
            if not token:
                break
        if out:
            self.since = max(t for t, _ in out)
        return [line for _, line in sorted(out)]


class SageMakerBackend:
    """SageMaker training jobs, through the user's boto3 session."""
    name = "sagemaker"
    job_class = SageMakerJob

    def __init__(self, session=None, say=print):
        self.session = session or new_session()
        self.say = say

    def check(self, spec: JobSpec) -> None:
        sm_request.check(spec)

    def plan(self, spec: JobSpec) -> SageMakerPlan:
        check_session(self.session)
        region = self.session.region_name
        request = sm_request.create_training_job_request(spec, spec_uri=spec_uri(spec), region=region)
        sm_request.validate(request)
        return SageMakerPlan(region=region, request=request)

    def launch(self, spec: JobSpec, plan: SageMakerPlan, upload_code) -> SageMakerJob:
        """Uploads the code and the spec, then creates the training job; the job folder here names it."""
        if os.path.exists(job_dir(spec.job_name)):
            raise ConfigError("job_name", f"a job named {spec.job_name!r} already exists; choose another name")
        s3 = storage.s3_client(self.session)
        spec = spec.evolve(code_uri=upload_code(spec, s3=s3))
        bucket, key = split_s3(spec_uri(spec))
        s3.put_object(Bucket=bucket, Key=key, Body=spec.to_json().encode(), ContentType="application/json")
        request = sm_request.create_training_job_request(spec, spec_uri=spec_uri(spec), region=plan.region)
        sm_request.validate(request)
        jobdir = job_dir(spec.job_name)
        os.makedirs(f"{jobdir}/logs")
        with open(f"{jobdir}/spec.json", "w") as fh:
            fh.write(spec.to_json())
        write_json(f"{jobdir}/runtime.json", {"backend": self.name, "region": plan.region})
        sm = self.session.client("sagemaker", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)
        try:
            sm.create_training_job(**request)
        except Exception:
            shutil.rmtree(jobdir, ignore_errors=True)  # nothing was created: the name stays free
            raise
        self.say(f"[trainyard] SageMaker training job {spec.job_name} created in {plan.region}: "
                 f"{json.dumps(request['ResourceConfig'])}")
        return SageMakerJob(spec.job_name, session=self.session)
