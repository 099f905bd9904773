"""The plan's throughput against published training runs (trainyard/job/plan/calibration.py; docs/plan.md):
within 15% of each, with one efficiency constant per GPU kind."""
from __future__ import annotations

import pytest

from trainyard.job.plan.calibration import PUBLISHED
from trainyard.job.plan.hardware import EFFICIENCY


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r.name)
def test_plan_within_15_percent_of_the_published_throughput(run):
    predicted = run.predicted_tokens_per_s_per_gpu()
    assert predicted == pytest.approx(run.tokens_per_s_per_gpu, rel=0.15), \
        f"{run.name}: plan {predicted:.0f} tokens/s/GPU, published {run.tokens_per_s_per_gpu:.0f} ({run.source})"


def test_one_constant_per_gpu_kind_and_every_kind_with_a_run_is_calibrated():
    kinds = {"p5.48xlarge": "NVIDIA H100", "p4d.24xlarge": "NVIDIA A100"}
    assert {kinds[r.instance_type] for r in PUBLISHED} == {"NVIDIA H100", "NVIDIA A100"}
    assert all(0.3 < e < 0.8 for e in EFFICIENCY.values())
