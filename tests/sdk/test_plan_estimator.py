"""Estimator.plan() and distribution="auto", built without running a job (the 2 x 2 job:
tests/e2e/test_plan_auto.py)."""
import pytest

from trainyard import Estimator
from trainyard.job.errors import ConfigError

HPS = {"model": "tiny", "steps": 2, "global_batch_size": 8, "seq_len": 64}


def _est(**kw):
    args = dict(entry_point="trainyard.engine.train", instance_type="local", instance_count=2, processes_per_host=2,
                hyperparameters=HPS)
    return Estimator(**(args | kw))


def test_auto_takes_the_plans_best_layout_and_records_it():
    est = _est(distribution="auto")
    best = est.plan().best
    assert est.distribution == best.layout.distribution()
    assert est.hyperparameters()["micro_batch_size"] == best.layout.micro_batch_size
    assert est._spec.plan["chosen"]["distribution"] == best.layout.distribution()
    assert est._spec.plan["summary"].startswith("distribution 'auto': dp ")


def test_auto_keeps_a_micro_batch_size_the_user_gave():
    est = _est(distribution="auto", hyperparameters={**HPS, "micro_batch_size": 2})
    assert est.hyperparameters()["micro_batch_size"] == 2
    d = est.distribution
    dp = 4 // (d["tensor_parallel_degree"] * d["pipeline_parallel_degree"])
    assert d["gradient_accumulation_steps"] * 2 * dp == 8


def test_plan_lists_layouts_of_the_hyperparameters_model():
    result = _est().plan(train_tokens=1e6)
    assert result.model.name == "tiny" and result.seq_len == 64 and result.global_batch_size == 8
    assert len(result.layouts) > 10 and all(p.layout.world == 4 for p in result.layouts)


def test_auto_for_a_script_or_an_unfitting_model_is_a_config_error(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    with pytest.raises(ConfigError, match="built-in trainer") as e:
        Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type="local", distribution="auto")
    assert e.value.field == "distribution"
    with pytest.raises(ConfigError, match="no layout of llama3-70b fits") as e:
        _est(distribution="auto", hyperparameters={**HPS, "model": "llama3-70b", "seq_len": 8192})
    assert e.value.field == "distribution"
