"""The plan's throughput against training runs (trainyard/job/plan/calibration.py; docs/plan.md): published runs
of other stacks and the built-in trainer's own on one H100, eager and compiled, each within 15% with one
efficiency constant per GPU kind."""
from __future__ import annotations

import pytest

from trainyard.job.plan.calibration import MEASURED, PUBLISHED, RUNS
from trainyard.job.plan.hardware import EFFICIENCY


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_plan_within_15_percent_of_the_run_s_throughput(run):
    predicted = run.predicted_tokens_per_s_per_gpu()
    assert predicted == pytest.approx(run.tokens_per_s_per_gpu, rel=0.15), \
        f"{run.name}: plan {predicted:.0f} tokens/s/GPU, run {run.tokens_per_s_per_gpu:.0f} ({run.source})"


def test_one_constant_per_gpu_kind_and_every_kind_with_a_run_is_calibrated():
    kinds = {"p5.48xlarge": "NVIDIA H100", "p5.4xlarge": "NVIDIA H100", "p4d.24xlarge": "NVIDIA A100"}
    assert {kinds[r.instance_type] for r in RUNS} == {"NVIDIA H100", "NVIDIA A100"}
    assert all(0.3 < e < 0.8 for e in EFFICIENCY.values())
    # eager and compiled are each fitted to published runs and to the engine's own
    for runs in (PUBLISHED, MEASURED):
        assert {r.compiled for r in runs} == {False, True}


def test_the_engine_s_small_batches_are_slower_per_token_as_measured():
    """The per-step overhead is what makes 2 x 2,048 tokens eager 24% slower per token than 4 x 2,048 on one H100
    (23.0% against 30.4% MFU): without it the plan had them equal, at 47.4%."""
    two, four = (next(r for r in MEASURED if f"{n} x 2048, eager" in r.name) for n in (2, 4))
    assert two.tokens_per_s_per_gpu < 0.8 * four.tokens_per_s_per_gpu
    assert two.predicted_tokens_per_s_per_gpu() < 0.8 * four.predicted_tokens_per_s_per_gpu()
