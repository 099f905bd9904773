"""Estimator.plan() and distribution="auto", built without running a job (the 2 x 2 job:
tests/e2e/test_plan_auto.py)."""
import re

import pytest

from trainyard import Estimator
from trainyard.errors import ConfigError

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


def test_the_plan_is_compiled_when_the_job_is(tmp_path):
    assert not _est().plan().compiled
    est = _est(distribution="auto", hyperparameters={**HPS, "compile": True})
    assert est.plan().compiled and est._spec.plan["compile"] is True
    assert not est.plan(compile=False).compiled  # an argument of plan() overrides
    # a script of your own says so in the auto form (or to plan())
    (tmp_path / "train.py").write_text("print('hi')\n")
    mine = Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type="local", instance_count=1,
                     processes_per_host=2, distribution={"auto": {"model": "10m", "seq_len": 64,
                                                                  "global_batch_size": 8, "compile": True}})
    assert mine._spec.plan["compile"] is True and not mine.plan(compile=False).compiled
    assert mine._spec.plan["summary"].endswith("predicted (compiled)")
    with pytest.raises(ConfigError, match=r"auto: compile must be true or false \(a bool\), got 'true'") as e:
        Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type="local", instance_count=1,
                  distribution={"auto": {"model": "10m", "seq_len": 64, "global_batch_size": 8, "compile": "true"}})
    assert e.value.field == "distribution"


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


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
             "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 2048, "max_position_embeddings": 512, "tie_word_embeddings": False}


def _hf_folder(tmp_path):
    import json

    d = tmp_path / "my-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    return d


def test_auto_with_model_hf_reads_the_local_model_uris_config(tmp_path):
    d = _hf_folder(tmp_path)
    est = _est(distribution="auto", model_uri=f"file://{d}", hyperparameters={**HPS, "model": "hf"})
    result = est.plan()
    assert result.model.name == "my-llama" and result.model.dim == 256 and result.model.n_kv_heads == 2
    assert est.distribution == result.best.layout.distribution()
    assert est.hyperparameters()["micro_batch_size"] == result.best.layout.micro_batch_size
    # an S3 model channel cannot be read before the job: the config named in the auto form instead
    est = _est(distribution={"auto": {"model": str(d / "config.json")}}, model_uri="s3://bucket/my-llama",
               hyperparameters={**HPS, "model": "hf"})
    assert est.plan().model.name == "my-llama"
    with pytest.raises(ConfigError, match="model_uri as file://") as e:
        _est(distribution="auto", model_uri="s3://bucket/my-llama", hyperparameters={**HPS, "model": "hf"})
    assert e.value.field == "distribution"


def test_auto_for_a_script_of_your_own_takes_the_shapes_in_the_auto_form(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    script = dict(entry_point="train.py", source_dir=str(tmp_path), instance_type="local", instance_count=2,
                  processes_per_host=2, hyperparameters={"epochs": 1})
    d = _hf_folder(tmp_path)
    est = Estimator(**script, distribution={"auto": {"model": str(d), "seq_len": 64, "global_batch_size": 8,
                                                     "micro_batch_size": 2}})
    best = est.plan().best
    assert est.distribution == best.layout.distribution() and best.layout.micro_batch_size == 2
    assert est.hyperparameters() == {"epochs": 1}  # a script's own arguments are left as they are
    assert est._spec.plan["model"] == "my-llama"
    # without the auto form, plan() takes the shapes as arguments
    plain = Estimator(**script)
    assert plain.plan(model="10m", seq_len=64, global_batch_size=8).model.name == "10m"
    for distribution, text in [("auto", "give ['model', 'seq_len', 'global_batch_size']"),
                               ({"auto": {"model": "10m"}}, "give ['seq_len', 'global_batch_size']"),
                               ({"auto": {"model": "10m", "seq_len": 64, "global_batch": 8}},
                                "auto: unknown key(s) ['global_batch']"),
                               ({"auto": {}, "mics": {}}, "alone")]:
        with pytest.raises(ConfigError, match=re.escape(text)) as e:
            Estimator(**script, distribution=distribution)
        assert e.value.field == "distribution"


def test_an_unfitting_model_is_a_config_error():
    with pytest.raises(ConfigError, match="no layout of llama3-70b fits") as e:
        _est(distribution="auto", hyperparameters={**HPS, "model": "llama3-70b", "seq_len": 8192})
    assert e.value.field == "distribution"
