"""A job's log read back as one story: `trainyard logs JOB` (and `-f`) of a 2 x 2 job is in time order,
every line stamped and whole, with none of the torch notes that engine/quiet.py lists (slow: a real job)."""
import re
import subprocess
import sys

import pytest

from trainyard import Estimator
from trainyard.engine.quiet import HARMLESS
from trainyard.sdk.jobs.joblog import parse

from .helpers import assert_no_processes_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# TP 2 x MiCS p=2 on 2 hosts x 2 processes: the layout whose runs printed device-mesh, DTensor
# redistribution and deprecated-collective notes before they were filtered or fixed
LAYOUT = {"tensor_parallel_degree": 2, "mics": {"partition_group_size": 2}}
PREFIX = re.compile(r"^\[(trainyard|algo-[12](/[0-3])?)\] ")


def _cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "trainyard.sdk.cli", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_trainyard_logs_tells_one_time_ordered_story_without_harmless_torch_notes():
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=2, distribution=LAYOUT, max_run=300,
                    checkpoint_s3_uri="s3://e2e-logs/ckpt",
                    hyperparameters={"model": "tiny", "steps": 3, "global_batch_size": 4, "micro_batch_size": 1,
                                     "seq_len": 32})
    est.fit(logs=False)
    job = est.latest_training_job
    assert job.status() == "Completed"

    text = _cli("logs", job.name)
    lines = text.splitlines()
    stamped = [parse(line) for line in lines]
    assert all(t is not None for t, _ in stamped), [ln for ln, (t, _) in zip(lines, stamped) if t is None][:3]
    times = [t for t, _ in stamped]
    assert times == sorted(times)
    said = [msg for _, msg in stamped]
    bad = [m for m in said if not PREFIX.match(m)]  # a line two writers shared would lose its prefix
    assert not bad, bad[:5]
    # the story: the supervisor starts it, both hosts train, the steps in order, the supervisor ends it
    assert said[0].startswith("[trainyard] supervisor pid")
    assert said[-1] == f"[trainyard] job {job.name}: Completed"
    steps = [int(m.split("step ")[1].split("/")[0]) for m in said if re.match(r"\[algo-1/0\] step \d+/3 loss", m)]
    assert steps == [1, 2, 3]
    assert {m.split("]")[0] for m in said} >= {"[algo-1", "[algo-2", "[algo-1/0", "[trainyard"}
    for h in HARMLESS:
        hits = [m for m in said if re.search(h.message, m)]
        assert not hits, (h.message, hits[:2])
    assert "Warning:" not in text, [m for m in said if "Warning:" in m][:3]

    # -f of an ended job: the same story and the job's last progress line, then it returns
    followed = _cli("logs", "--follow", job.name)
    assert followed.startswith(text) and re.fullmatch(r"\[progress\] Completed \| step 3/3 \| loss [0-9.]+ \| .*\n",
                                                      followed[len(text):]), followed[len(text):]
    assert_no_processes_left(job)
