"""A PyTorchJob's conditions as a SageMaker-style status (sdk/backends/kubernetes/status.py), and the pods' names and stamps."""
from datetime import datetime, timezone

from trainyard.sdk.backends.kubernetes.job import _nanoseconds
from trainyard.sdk.backends.kubernetes.status import host_of, job_status, pod_failure


def cond(kind, t, status="True", message=""):
    at = f"2026-11-24T08:00:{t:02d}Z"
    return {"type": kind, "status": status, "reason": f"PyTorchJob{kind}", "message": message,
            "lastTransitionTime": at, "lastUpdateTime": at}


def job(*conditions, **status):
    return {"metadata": {"name": "j", "creationTimestamp": "2026-11-24T08:00:00Z"},
            "status": {"conditions": list(conditions), **status}}


def test_no_conditions_yet_is_starting():
    s = job_status({"metadata": {"creationTimestamp": "2026-11-24T08:00:00Z"}})
    assert (s["TrainingJobStatus"], s["SecondaryStatus"]) == ("InProgress", "Starting")
    assert s["SecondaryStatusTransitions"] == []
    assert s["CreationTime"] == datetime(2026, 11, 24, 8, tzinfo=timezone.utc)


def test_running_then_succeeded():
    s = job_status(job(cond("Created", 0), cond("Running", 3, "False"), cond("Succeeded", 9, message="done"),
                       startTime="2026-11-24T08:00:03Z", completionTime="2026-11-24T08:00:09Z"))
    assert (s["TrainingJobStatus"], s["SecondaryStatus"]) == ("Completed", "Completed")
    trans = s["SecondaryStatusTransitions"]
    assert [t["Status"] for t in trans] == ["Starting", "Training", "Completed"]
    assert trans[0]["EndTime"] == trans[1]["StartTime"] and trans[-1]["EndTime"] == trans[-1]["StartTime"]
    assert s["TrainingStartTime"].second == 3 and s["TrainingEndTime"].second == 9 and "FailureReason" not in s


def test_restarting_and_the_deadline():
    s = job_status(job(cond("Created", 0), cond("Restarting", 4)))
    assert (s["TrainingJobStatus"], s["SecondaryStatus"]) == ("InProgress", "Restarting")
    late = job_status(job(cond("Created", 0), cond("Running", 1, "False"), cond(
        "Failed", 7, message="PyTorchJob j has failed because it was active longer than specified deadline")))
    assert (late["TrainingJobStatus"], late["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    assert late["SecondaryStatusTransitions"][-1]["Status"] == "MaxRuntimeExceeded"
    failed = job_status(job(cond("Created", 0), cond("Failed", 2, message="1 Worker replica(s) failed.")))
    assert (failed["TrainingJobStatus"], failed["FailureReason"]) == ("Failed", "1 Worker replica(s) failed.")


def pod(name, labels=None, exit_code=None, message="", finished="2026-11-24T08:00:05Z", last=False):
    state = {"terminated": {"exitCode": exit_code, "message": message, "finishedAt": finished}} \
        if exit_code is not None else {"running": {}}
    cs = {"name": "pytorch", "lastState" if last else "state": state}
    return {"metadata": {"name": name, "labels": labels or {}}, "status": {"containerStatuses": [cs]}}


def test_hosts_and_the_first_failure():
    assert host_of(pod("j-master-0", {"training.kubeflow.org/replica-type": "master",
                                      "training.kubeflow.org/replica-index": "0"})) == "algo-1"
    assert host_of(pod("j-worker-2")) == "algo-4"  # from the name when the labels are missing
    pods = [pod("j-master-0", exit_code=0, message="fine"),
            pod("j-worker-1", exit_code=1, message="rank 12 exited: NCCL timeout", finished="2026-11-24T08:00:09Z"),
            pod("j-worker-0", exit_code=137, message="algo-2 rank 9 exited: killed", last=True)]
    assert pod_failure(pods, "pytorch") == "algo-2 rank 9 exited: killed"  # the earliest, said with its host
    assert pod_failure(pods[:2], "pytorch") == "algo-3: rank 12 exited: NCCL timeout"
    assert pod_failure(pods[:1], "pytorch") is None


def test_the_kubelets_stamps():
    assert _nanoseconds("2026-11-24T08:00:03Z") == 1795507203 * 10**9
    assert _nanoseconds("2026-11-24T08:00:03.5Z") - _nanoseconds("2026-11-24T08:00:03.45Z") == 50_000_000
    assert _nanoseconds("2026-11-24T08:00:03.123456789Z") % 10**9 == 123456789
    assert _nanoseconds("not-a-time") is None
