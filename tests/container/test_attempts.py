"""The one attempt policy (container/attempts.py), decided in-process with no job: outcome and FailureReason ->
restart, shrink or end, and the SageMaker and Kubernetes translations of max_retry_attempts."""
import pytest

from trainyard.container import attempts

HANG = "Hang: rank 3 (algo-2) stopped in backward at step 41 (SIGSTOP); ranks 0-2 wait in all_reduce #9"
USER = "algo-1 rank 0 (local rank 0) exited with code 1:\nValueError: boom"
KILLED = "algo-2 rank 3 (local rank 1) was killed by SIGKILL"
LOST = "algo-2: the driver exited with status -9 and no report"
SDC = ("algo-1 rank 0 (local rank 0) exited with code 1:\nDataCorruption: data corruption: at step 20 the parameters "
       "of rank 3 (algo-2) differ from the other replicas of their shard (4 copies; layers.0.w first); its GPU or host "
       "memory may be faulty")
SDC_TWO = ("algo-1 rank 0 (local rank 0) exited with code 1:\nDataCorruption: data corruption: at step 20 the 2 "
           "replicas of a shard differ (rank 1 (algo-1), rank 3 (algo-2); w first): with 2 replicas no majority says "
           "which copy is damaged; a GPU or host memory of one of them may be faulty")




def _straggler_reason() -> str:
    """A rank's FailureReason after straggler_remove ended the attempt, from the engine's own message: rank 3 on
    algo-2 twice as slow as its peers for a window."""
    from trainyard.engine.components.stragglers import Detector, removal

    detector = Detector(stages=[0] * 4, hosts=["algo-1", "algo-1", "algo-2", "algo-2"], steps=5)
    for _ in range(5):
        detector.observe([0.1, 0.1, 0.1, 0.2])
    assert removal(Detector(stages=[0] * 2, hosts=["a", "b"]), 10) is None  # nobody slow: nothing ends
    end = removal(detector, 40)
    return f"algo-1 rank 0 (local rank 0) exited with code 1:\n{type(end).__name__}: {end}"


SLOW = _straggler_reason()


def _decide(outcome="Failed", reason=HANG, attempt=1, retries=2, count=2, **kw):
    return attempts.decide(outcome=outcome, reason=reason, attempt=attempt, max_retry_attempts=retries,
                           instance_count=count, **kw)


# (outcome, reason, attempt, max_retry_attempts, lost hosts, elastic min) -> (action, retry class, hosts)
TABLE = [
    ("Completed", "", 1, 2, (), None, "end", None, 2),
    ("Stopped", "", 1, 2, (), None, "end", None, 2),
    ("MaxRuntimeExceeded", "", 1, 2, (), None, "end", None, 2),
    ("Failed", USER, 1, 2, (), None, "end", None, 2),  # the user's error: never retried
    ("Failed", HANG, 1, 2, (), None, "restart", "hang", 2),
    ("Failed", KILLED, 2, 2, (), None, "restart", "killed process", 2),
    ("Failed", KILLED, 3, 2, (), None, "end", "killed process", 2),  # retries spent
    ("Failed", HANG, 1, 0, (), None, "end", "hang", 2),
    ("Failed", LOST, 1, 2, ("algo-2",), None, "restart", "lost host", 2),  # no elastic: the same hosts again
    ("Failed", LOST, 1, 2, ("algo-2",), 1, "shrink", "lost host", 1),
    ("Failed", LOST, 1, 2, ("algo-2",), 2, "restart", "lost host", 2),  # fewer than elastic's minimum left
    ("Failed", HANG, 1, 2, ("algo-2",), 1, "restart", "hang", 2),  # only a lost host shrinks the job
    ("Failed", SDC, 1, 2, (), None, "restart", "data corruption", 2),  # no elastic: the same hosts again
    ("Failed", SDC, 1, 2, (), 1, "shrink", "data corruption", 1),  # elastic: without the outvoted host
    ("Failed", SDC, 1, 2, (), 2, "restart", "data corruption", 2),
    ("Failed", SDC_TWO, 1, 2, (), 1, "restart", "data corruption", 2),  # 2 replicas: no host to blame
    ("Failed", SLOW, 1, 2, (), 1, "shrink", "straggler", 1),  # straggler_remove: without the slow rank's host
    ("Failed", SLOW, 1, 2, (), 2, "restart", "straggler", 2),  # fewer than elastic's minimum would be left
    ("Failed", SLOW, 2, 1, (), 1, "end", "straggler", 2),  # retries spent
    ("Interrupted", "hosts ['algo-1'] interrupted", 1, 1, (), None, "restart", "lost host", 2),
    ("Interrupted", "hosts ['algo-1'] interrupted", 2, 1, (), None, "end", "lost host", 2),
]


@pytest.mark.parametrize("outcome,reason,attempt,retries,lost,elastic_min,action,cls,hosts", TABLE)
def test_decide(outcome, reason, attempt, retries, lost, elastic_min, action, cls, hosts):
    d = _decide(outcome, reason, attempt, retries, lost_hosts=lost, elastic_min=elastic_min)
    assert (d.action, d.retry_class, d.hosts) == (action, cls, hosts), d


def test_a_shrink_after_data_corruption_names_the_host_left_out():
    assert attempts.corrupt_hosts(SDC) == ["algo-2"] and attempts.corrupt_hosts(SDC_TWO) == []
    assert "leaving out algo-2, whose copy differed" in _decide(reason=SDC, elastic_min=1).why


def test_a_shrink_after_a_straggler_names_its_host():
    assert attempts.straggler_hosts(SLOW) == ["algo-2"] and attempts.straggler_hosts(SDC) == []
    assert "rank 3 (algo-2) still slow at step 40's committed checkpoint" in SLOW
    assert "leaving out algo-2, whose rank(s) straggled, going on with 1 host(s)" in _decide(reason=SLOW,
                                                                                             elastic_min=1).why


def test_the_reasons_read_as_the_logs_say_them():
    assert _decide(reason=USER).why == "attempt 1 failed with an error a retry does not cure: not retried"
    assert _decide(reason=USER, retries=0).why == ""  # nothing to say when no retry was asked for
    assert _decide(reason=HANG).why == f"attempt 1 failed (hang): {HANG}"
    assert _decide(reason=LOST, lost_hosts=("algo-2",), elastic_min=1).why.endswith(
        "; elastic: algo-2 lost for good, going on with 1 host(s)")
    assert _decide("Interrupted", "hosts ['algo-1'] interrupted", attempt=3).why == \
        "hosts ['algo-1'] interrupted and no retry is left (max_retry_attempts=2)"


def test_a_stop_ends_the_job_whatever_failed():
    assert _decide(stopping=True).action == "end"


class _Status:
    def __init__(self):
        self.doc = {}

    def update(self, **kw):
        self.doc.update(kw)


def test_record_appends_each_attempt():
    st = _Status()
    attempts.record(st, 1, "Failed", "x" * 2000, "hang", InstanceCount=2)
    attempts.record(st, 2, "Completed")
    first, second = st.doc["Attempts"]
    assert first["Attempt"] == 1 and first["Outcome"] == "Failed" and first["RetryClass"] == "hang"
    assert len(first["FailureReason"]) == 1024 and first["InstanceCount"] == 2
    assert second == {"Attempt": 2, "Outcome": "Completed"}


def test_sagemaker_and_kubernetes_translations():
    assert attempts.sagemaker_retry(0) == {}
    assert attempts.sagemaker_retry(3) == {"RetryStrategy": {"MaximumRetryAttempts": 3}}
    assert attempts.kubernetes_retry(0) == {"restartPolicy": "Never", "backoffLimit": 0}
    assert attempts.kubernetes_retry(2) == {"restartPolicy": "OnFailure", "backoffLimit": 2}


def test_the_one_line_why_of_a_failed_rank_names_its_exception_not_a_bare_colon():
    from trainyard.container.failure import headline

    d = _decide(reason=KILLED + ":\n[rank3]: Traceback (most recent call last):\n  ...\nMemoryError", attempt=1)
    assert d.why == ("attempt 1 failed (killed process): algo-2 rank 3 (local rank 1) was killed by SIGKILL: "
                     "MemoryError")
    assert headline(USER) == "algo-1 rank 0 (local rank 0) exited with code 1: ValueError: boom"
    assert headline(HANG) == HANG and headline(KILLED) == KILLED and headline("  \n") == ""
