"""distribution="auto" on a 2 x 2 local job: the plan's best layout runs, is printed before launch, is recorded
in describe(), and the memory the engine reports is the plan's (slow: a real multi-process job)."""
import pytest

from trainyard import Estimator
from trainyard.job.plan import memory

from .helpers import assert_no_processes_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_auto_runs_the_best_layout_of_the_plan(capfd):
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=2, distribution="auto", max_run=400,
                    hyperparameters={"model": "tiny", "steps": 3, "global_batch_size": 8, "seq_len": 32})
    best = est.plan().best
    assert est.distribution == best.layout.distribution()
    assert est.hyperparameters()["micro_batch_size"] == best.layout.micro_batch_size
    est.fit(logs=False)
    job = est.latest_training_job
    assert "distribution 'auto': dp" in capfd.readouterr().err  # printed before launch
    recorded = job.describe()["Plan"]
    assert recorded["chosen"]["distribution"] == best.layout.distribution() and recorded["layouts_fitting"] > 1
    rows = job.metrics()
    assert [r["step"] for r in rows] == [1, 2, 3]
    planned = memory.estimate(est.plan().model, best.layout, 32, fused_optimizer=False)
    assert rows[-1]["model_state_bytes"] == pytest.approx(planned.model_states, rel=0.05)
    assert_no_processes_left(job)
