"""A local job whose code has a requirements.txt: installed before the script runs, visible to every rank;
a requirement pip cannot install fails the job with pip's message (slow: real jobs)."""
import json

import pytest

from tests.container.wheels import make_wheel
from trainyard import Estimator
from trainyard.errors import JobFailedError

from .helpers import read_tar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN = """\
import json, os
import tinypkg
with open(os.path.join(os.environ["SM_MODEL_DIR"], f"rank-{os.environ['RANK']}.json"), "w") as fh:
    json.dump({"tinypkg": tinypkg.VERSION, "host": os.environ["SM_CURRENT_HOST"]}, fh)
"""


def _source(tmp_path, requirement):
    src = tmp_path / "src"
    make_wheel(str(src / "wheels"))
    (src / "requirements.txt").write_text(requirement + "\n")
    (src / "train.py").write_text(TRAIN)
    return str(src)


def _est(tmp_path, requirement):
    return Estimator(entry_point="train.py", source_dir=_source(tmp_path, requirement), instance_type="local",
                     instance_count=2, processes_per_host=1, max_run=240,
                     distribution={"torch_distributed": {"enabled": True}},  # the script reads torchrun's RANK
                     environment={"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null",
                                  "TRAINYARD_REQUIREMENTS_CACHE": str(tmp_path / "cache")})


def test_requirements_are_installed_before_the_script_runs(tmp_path):
    est = _est(tmp_path, "./wheels/tinypkg-0.1-py3-none-any.whl")
    est.fit(logs=False)
    job = est.latest_training_job
    d = job.describe()
    assert d["TrainingJobStatus"] == "Completed", d.get("FailureReason")
    model = read_tar(d["ModelArtifacts"]["S3ModelArtifacts"])  # the first host's model folder
    assert json.loads(model["rank-0.json"]) == {"tinypkg": "0.1", "host": "algo-1"}
    logs = job.log_text()
    # two hosts on one machine, one cache: one installs, the other waits and reuses
    assert logs.count("driver: requirements.txt: installed 1 package(s) into") == 1, logs[-3000:]
    assert logs.count("driver: requirements.txt: reused") == 1, logs[-3000:]
    assert "driver: pip: Successfully installed tinypkg-0.1" in logs
    assert len(list((tmp_path / "cache").glob("*/.trainyard-complete"))) == 1


def test_a_requirement_pip_cannot_install_fails_the_job_with_pips_message(tmp_path):
    est = _est(tmp_path, "./wheels/tinypkg-9.9-py3-none-any.whl")
    with pytest.raises(JobFailedError):
        est.fit(logs=False)
    d = est.latest_training_job.describe()
    assert d["TrainingJobStatus"] == "Failed"
    reason = d["FailureReason"]
    assert "pip install -r requirements.txt failed (exit 1): ERROR:" in reason, reason
    assert "No such file or directory" in reason and "tinypkg-9.9-py3-none-any.whl" in reason, reason
