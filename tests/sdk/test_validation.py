"""Bad input is refused with the field named, before anything is uploaded or started."""
import math
import os
import re

import pytest

from trainyard import Estimator, FileSystemInput, HuggingFace, LocalSession, PyTorch, Session, TrainingInput
from trainyard.errors import ConfigError
from trainyard.sdk.jobs.jobstate import jobs_root


def _est(src, **kw):
    args = dict(entry_point="train.py", source_dir=src, instance_type="local", instance_count=1)
    args.update(kw)
    return Estimator(**args)


def _refused(field, fn, *args, **kw):
    with pytest.raises(ConfigError) as e:
        fn(*args, **kw)
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(field + ":")
    return str(e.value)


@pytest.mark.parametrize("count", [0, -1, 2.5, "2", True, None])
def test_instance_count(src, count):
    msg = _refused("instance_count", _est, src, instance_count=count)
    assert "integer >= 1" in msg


def test_unknown_instance_type_suggests_close_names(src):
    msg = _refused("instance_type", _est, src, instance_type="ml.p4d.24xlarg")
    assert "p4d.24xlarge" in msg


def test_known_instance_types_and_ml_prefix(src):
    ddp = {"torch_distributed": {"enabled": True}}
    est = _est(src, instance_type="ml.p5.48xlarge", output_path="s3://bucket/out", distribution=ddp)
    assert est.instance_type == "ml.p5.48xlarge" and est.processes_per_host == 8
    assert _est(src, instance_type="trn1.32xlarge", output_path="s3://bucket/out",
                distribution=ddp).processes_per_host == 32
    # without a distribution a script runs once per host, as plain python (SageMaker's toolkit)
    assert _est(src, instance_type="ml.p5.48xlarge", output_path="s3://bucket/out").processes_per_host == 1
    _refused("output_path", _est, src, instance_type="p4d.24xlarge")
    # SageMaker's rule: one process on a CPU host unless the distribution or processes_per_host says
    assert _est(src).processes_per_host == 1
    assert _est(src, distribution={"torch_distributed": {"enabled": True}}).processes_per_host == 1
    assert _est(src, distribution={"mpi": {"enabled": True, "processes_per_host": 2}}).processes_per_host == 2
    assert _est(src, processes_per_host=3).processes_per_host == 3
    _refused("processes_per_host", _est, src, processes_per_host=3,
             distribution={"mpi": {"enabled": True, "processes_per_host": 2}})


@pytest.mark.parametrize("entry", ["", None, "   "])
def test_missing_entry_point(src, entry):
    _refused("entry_point", _est, src, entry_point=entry)


def test_entry_point_not_in_source_dir(src):
    msg = _refused("entry_point", _est, src, entry_point="nothere.py")
    assert "nothere.py" in msg


def test_missing_source_dir(tmp_path):
    msg = _refused("source_dir", _est, str(tmp_path / "nope"))
    assert "not a directory" in msg


def test_entry_point_neither_file_nor_module():
    _refused("entry_point", Estimator, entry_point="no_such_module_xyz.train")


@pytest.mark.parametrize("hps", [{"": 1}, {"a b": 1}, {"x": object()}, {"x": math.nan}, {"x": {1, 2}}])
def test_bad_hyperparameters(src, hps):
    _refused("hyperparameters", _est, src, hyperparameters=hps)


@pytest.mark.parametrize("uri", ["s3://", "s3://Bad_Bucket/x", "s3:/bucket/x", "s3://ab/x", "s3://bucket//x"])
def test_malformed_s3_uri(src, uri):
    _refused("checkpoint_s3_uri", _est, src, checkpoint_s3_uri=uri)


def test_checkpoint_uri_must_be_s3(src):
    msg = _refused("checkpoint_s3_uri", _est, src, checkpoint_s3_uri="file:///tmp/ckpt")
    assert "s3://" in msg


@pytest.mark.parametrize("uri", ["gs://bucket/out", "/tmp/out", "file://relative/path"])
def test_output_path_scheme(src, uri):
    _refused("output_path", _est, src, output_path=uri)


@pytest.mark.parametrize("max_run", [0, -5, 1.5])
def test_max_run(src, max_run):
    _refused("max_run", _est, src, max_run=max_run)


def test_distribution_and_environment(src):
    _refused("distribution", _est, src, distribution={"deepspeed": {}})
    msg = _refused("distribution", _est, src, distribution={"tensor_paralel_degree": 2})
    assert "unknown key(s) 'tensor_paralel_degree' (did you mean 'tensor_parallel_degree'?)" in msg
    msg = _refused("distribution", _est, src, distribution={"mics": {"partition_size": 2}})
    assert "unknown key(s) 'mics.partition_size' (did you mean 'mics.partition_group_size'?)" in msg
    # partition groups that neither fit in a host nor span whole hosts, or do not divide the world
    msg = _refused("distribution", _est, src, instance_count=3, processes_per_host=2,
                   distribution={"mics": {"partition_group_size": 3}})
    assert "host of 2 processes" in msg
    _refused("distribution", _est, src, instance_count=2, distribution={"mics": {"partition_group_size": 3}})
    _refused("distribution", _est, src, distribution={"mics": {"partition_group_size": 2, "p": 1}})
    _refused("distribution", _est, src, distribution={"mics": {"hierarchical_allgather": "yes"}})
    # CPU offload on a host without a GPU: refused before anything starts, not by the engine in the job
    msg = _refused("distribution", _est, src, distribution={"mics": {"cpu_offload": True}})
    assert "'local' has no GPU" in msg and "set cpu_offload to false" in msg
    smp = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"sharded_data_parallel_degree": 3}}}}
    _refused("distribution", _est, src, instance_count=2, distribution=smp)
    _refused("environment", _est, src, environment={"A": 1})
    _refused("environment", _est, src, environment={"1A": "x"})


def _jobs() -> set[str]:
    return set(os.listdir(jobs_root())) if os.path.exists(jobs_root()) else set()


def _code_objects() -> set[str]:
    from trainyard.sdk.store import ensure_store

    s3 = ensure_store().client()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="trainyard-default")
    return {o["Key"] for page in pages for o in page.get("Contents", []) if "/trainyard-code/" in f"/{o['Key']}"}


@pytest.fixture
def nothing_started():
    """Asserts that the test started no job and uploaded no code."""
    jobs, code = _jobs(), _code_objects()
    yield
    assert _jobs() == jobs, "a job was started"
    assert _code_objects() == code, "code was uploaded"


@pytest.mark.parametrize("inputs,field", [
    ({"bad name!": "s3://bucket/x"}, "inputs.bad name!"),
    ({"train": "s3://Bad/x"}, "inputs.train"),
    ({"train": "gs://bucket/x"}, "inputs.train"),
    ({"train": TrainingInput("s3://bucket/x", distribution="Sharded")}, "inputs.train"),
    (42, "inputs"),
])
def test_bad_inputs(src, inputs, field, nothing_started):
    est = _est(src)
    _refused(field, est.fit, inputs, wait=False)


def test_an_unknown_logs_mode_is_refused_before_anything_starts(src, nothing_started):
    msg = _refused("logs", _est(src).fit, logs="Everything")
    assert "'All', 'None' or 'Rules'" in msg


def test_inputs_that_do_not_exist(src, tmp_path, nothing_started):
    est = _est(src)
    _refused("inputs.train", est.fit, {"train": f"file://{tmp_path}/missing"}, wait=False)
    msg = _refused("inputs.train", est.fit, {"train": "s3://trainyard-default/no/such/prefix"}, wait=False)
    assert "nothing found" in msg


@pytest.mark.parametrize("source,said", [
    ("def main(:\n    pass\n", r"train.py:1: SyntaxError: invalid syntax"),
    ("if True:\nprint('x')\n", r"train.py:2: IndentationError: expected an indented block"),
])
def test_an_entry_point_that_does_not_compile_is_refused_by_fit(tmp_path, source, said, nothing_started):
    """(issue 34) It used to fail 15 s into the job, on EC2 after the instances launched."""
    (tmp_path / "train.py").write_text(source)
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type="local")
    msg = _refused("entry_point", est.fit, None, wait=False)
    assert re.search(said, msg), msg
    (tmp_path / "alone.py").write_text(source)  # a script shipped alone, without source_dir
    _refused("entry_point", Estimator(entry_point=str(tmp_path / "alone.py"), instance_type="local").fit, None,
             wait=False)


def test_bad_job_name(src, nothing_started):
    est = _est(src)
    _refused("job_name", est.fit, None, wait=False, job_name="bad_name")
    _refused("base_job_name", _est, src, base_job_name="-x")


@pytest.mark.parametrize("make,wrong,right", [
    (lambda src, **kw: Estimator(entry_point="train.py", source_dir=src, **kw), "instance_cout", "instance_count"),
    (lambda src, **kw: PyTorch(entry_point="train.py", source_dir=src, **kw), "framwork_version",
     "framework_version"),
    (lambda src, **kw: HuggingFace(entry_point="train.py", source_dir=src, **kw), "transformer_version",
     "transformers_version"),
    (lambda src, **kw: PyTorch(entry_point="train.py", source_dir=src, **kw), "keep_alive_period",
     "keep_alive_period_in_seconds"),  # an argument accepted with no effect is suggested too
    (lambda src, **kw: _est(src).fit(**kw), "job_nmae", "job_name"),
    (lambda src, **kw: TrainingInput("s3://bucket/x", **kw), "distrbution", "distribution"),
    (lambda src, **kw: FileSystemInput("fs-0123456789abcdef0", **kw), "directory", "directory_path"),
    (lambda src, **kw: Session(**kw), "default_bukcet", "default_bucket"),
    (lambda src, **kw: LocalSession(**kw), "default_bucket_prefx", "default_bucket_prefix"),
])
def test_unknown_keyword_suggests_the_closest_argument(src, make, wrong, right, nothing_started):
    with pytest.raises(TypeError) as e:  # a TypeError, as Python's own, and a ConfigError naming the keyword
        make(src, **{wrong: "x"})
    assert isinstance(e.value, ConfigError) and e.value.field == wrong
    assert str(e.value).startswith(f"{wrong}: ") and f"did you mean {right!r}?" in str(e.value)


def test_unknown_keywords_without_a_close_name_and_sagemakers_own_are_accepted(src):
    msg = _refused("zzz, instance_cout", _est, src, zzz=1, instance_cout=2)
    assert "Estimator() got unexpected keyword arguments" in msg and \
        "did you mean 'instance_count' for 'instance_cout'?" in msg and "docs/sdk.md" in msg
    assert "PyTorch()" in _refused("zzz", PyTorch, entry_point="train.py", source_dir=src, zzz=1)
    assert "it takes: boto_session, default_bucket," in _refused("zzz", LocalSession, zzz=1)
    # SageMaker's Session keywords, and its positional order (default_bucket fifth)
    s = Session(None, None, None, None, "my-bucket", None, None, {"SchemaVersion": "1.0"}, "team")
    assert (s.default_bucket(), s.default_bucket_prefix) == ("my-bucket", "team")
    Session(sagemaker_featurestore_runtime_client=None, settings=None, sagemaker_metrics_client=None)


@pytest.mark.parametrize("hps,text", [
    ({"stepz": 3}, "--stepz (did you mean '--steps'?)"),
    ({"global_batch_sise": 16}, "--global_batch_sise (did you mean '--global_batch_size'?)"),
    ({"model": "huge"}, "unknown model 'huge'"),
    ({"steps": 0}, "steps must be >= 1"),
    ({"global_batch_size": 6, "micro_batch_size": 2}, "multiple of 8"),
])
def test_builtin_trainer_hyperparameters_checked_up_front(hps, text):
    msg = _refused("hyperparameters", Estimator, entry_point="trainyard.engine.train", instance_type="local",
                   instance_count=2, processes_per_host=2, hyperparameters=hps)
    assert text in msg


@pytest.mark.parametrize("distribution,hps,text", [
    ({"mixed_precision": "fp16"}, {}, "mixed_precision must be one of"),
    ({"activation_checkpointing": "some"}, {}, "activation_checkpointing must be one of"),
    ({"gradient_accumulation_steps": 0}, {}, "gradient_accumulation_steps must be an integer"),
    ({"gradient_clipping": -1}, {}, "gradient_clipping must be a number"),
    ({"mixed_precision": "bf16"}, {"dtype": "float32"}, "contradicts distribution mixed_precision"),
    ({"gradient_accumulation_steps": 4}, {"global_batch_size": 8, "micro_batch_size": 2},
     "set micro_batch_size to 1"),
    ({"mics": {"partition_group_size": 1, "replica_compression": "bf16"}}, {"dtype": "float16"},
     "dtype float16 with mics.replica_compression 'bf16'"),
])
def test_distribution_settings_checked_against_the_builtin_trainer(distribution, hps, text):
    msg = _refused("distribution", Estimator, entry_point="trainyard.engine.train", instance_type="local",
                   instance_count=1, processes_per_host=2, hyperparameters=hps, distribution=distribution)
    assert text in msg


@pytest.mark.parametrize("instance_type,said", [
    ("local", "local has no GPU"),
    ("ml.c5.xlarge", "c5.xlarge has no GPU"),
    ("ml.g4dn.xlarge", "g4dn.xlarge's NVIDIA T4 has compute capability 7.5"),
    ("ml.p4d.24xlarge", "p4d.24xlarge's NVIDIA A100 has compute capability 8.0"),
    ("ml.g6e.xlarge", None),  # L40S: 8.9
    ("ml.p5.48xlarge", None),  # H100: 9.0
])
def test_dtype_float8_is_refused_where_the_gpus_have_no_fp8_before_the_job_starts(instance_type, said):
    args = dict(entry_point="trainyard.engine.train", instance_type=instance_type, output_path="s3://my-bucket/out",
                hyperparameters={"model": "tiny", "dtype": "float8", "global_batch_size": 16, "micro_batch_size": 2})
    if said is None:
        Estimator(**args)
        return
    msg = _refused("hyperparameters", Estimator, **args)
    assert "dtype 'float8' needs" in msg and said in msg and "compute capability 8.9 or newer" in msg
    assert "set dtype to 'bfloat16'" in msg and "ml.p5" in msg and "ml.g6e" in msg and "ml.p4d" not in msg


def test_emulated_network_without_root_is_refused(src, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    msg = _refused("emulated_network", _est, src, emulated_network={"bandwidth_mbit": 100})
    assert "needs root" in msg


# ---- tensor and pipeline parallelism -------------------------------------------------------------------------

def _smp(**params):
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}}}


def _builtin(instance_count=1, processes_per_host=2, hps=None, **distribution):
    return Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=instance_count,
                     processes_per_host=processes_per_host, hyperparameters={"model": "tiny", **(hps or {})},
                     distribution=distribution)


def test_typed_form_has_the_3d_keys_with_defaults():
    from trainyard.job.distribution import normalize

    typed = normalize({}, world_size=4, processes_per_host=2)
    assert {k: typed[k] for k in ("tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_schedule",
                                  "virtual_stages", "microbatches", "pipeline_split")} == {
        "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "pipeline_schedule": "1f1b",
        "virtual_stages": 1, "microbatches": None, "pipeline_split": None}
    assert typed["mics"]["partition_group_size"] == 4
    d = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "pipeline_schedule": "interleaved_1f1b",
         "virtual_stages": 2, "microbatches": 4, "pipeline_split": [3, 2, 2, 3], "mics": {"partition_group_size": 2}}
    typed = normalize(d, world_size=8, processes_per_host=4)
    assert {k: typed[k] for k in d if k != "mics"} == {k: v for k, v in d.items() if k != "mics"}
    assert typed["mics"]["partition_group_size"] == 2
    # the default partition group is the data-parallel degree, not the world
    assert normalize({"tensor_parallel_degree": 2}, world_size=8, processes_per_host=4)["mics"][
        "partition_group_size"] == 4
    assert normalize(typed, world_size=8, processes_per_host=4) == typed  # the typed form is a fixed point


def test_sagemaker_model_parallel_forms_map():
    from trainyard.job.distribution import normalize

    v2 = normalize(_smp(hybrid_shard_degree=2, tensor_parallel_degree=2), world_size=8, processes_per_host=4)
    assert v2["tensor_parallel_degree"] == 2 and v2["mics"]["partition_group_size"] == 2
    v1 = normalize(_smp(partitions=2, microbatches=4, pipeline="simple", tensor_parallel_degree=2),
                   world_size=8, processes_per_host=4)
    assert (v1["pipeline_parallel_degree"], v1["microbatches"], v1["pipeline_schedule"],
            v1["tensor_parallel_degree"], v1["mics"]["partition_group_size"]) == (2, 4, "gpipe", 2, 2)
    v1 = normalize(_smp(pipeline_parallel_degree=2, pipeline="interleaved"), world_size=4, processes_per_host=2)
    assert (v1["pipeline_parallel_degree"], v1["pipeline_schedule"]) == (2, "1f1b")
    # explicit typed keys win over mapped ones
    both = normalize({**_smp(partitions=2, pipeline="interleaved", microbatches=4), "pipeline_schedule": "gpipe",
                      "microbatches": 8}, world_size=4, processes_per_host=2)
    assert (both["pipeline_parallel_degree"], both["pipeline_schedule"], both["microbatches"]) == (2, "gpipe", 8)
    # and the SageMaker forms are accepted by the Estimator
    _builtin(2, 2, **_smp(partitions=2, microbatches=2, pipeline="simple"))


@pytest.mark.parametrize("instance_count,pph,distribution,texts", [
    # tensor parallelism stays inside a host
    (2, 2, {"tensor_parallel_degree": 4}, ["tp (4) must divide the processes per host (2)", "inside a host"]),
    (3, 2, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2},
     ["tensor_parallel_degree 2 x pipeline_parallel_degree 2 = 4 must divide the world size 6"]),
    (2, 4, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "mics": {"partition_group_size": 4}},
     ["partition_group_size 4 must divide the data-parallel degree 2", "choose a divisor of 2"]),
    (1, 2, {"pipeline_parallel_degree": 2, "pipeline_schedule": "zero_bubble"}, ["pipeline_schedule must be one of"]),
    (1, 2, {"pipeline_parallel_degree": 2, "virtual_stages": 2},
     ["virtual_stages 2 needs pipeline_schedule 'interleaved_1f1b'"]),
    (1, 2, {"pipeline_parallel_degree": 2, "pipeline_schedule": "interleaved_1f1b"},
     ["interleaved_1f1b needs virtual_stages >= 2"]),
    (1, 2, {"pipeline_parallel_degree": 2, "microbatches": 1},
     ["1 micro-batch(es) per step", "below the pipeline_parallel_degree (2)"]),
    (1, 2, {"pipeline_parallel_degree": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2,
            "microbatches": 3}, ["micro-batches per step (3) to be a multiple of pipeline_parallel_degree (2)"]),
    (1, 2, {"pipeline_parallel_degree": 2, "pipeline_split": [1, 1, 1]},
     ["pipeline_split has 3 entries", "pipeline_parallel_degree 2 x virtual_stages 1 = 2"]),
    (1, 2, {"pipeline_parallel_degree": 2, "pipeline_split": [1, 0]}, ["pipeline_split must be a list"]),
    (1, 2, {"tensor_parallel_degree": 0}, ["tensor_parallel_degree must be an integer >= 1, got 0"]),
    (1, 2, {"pipeline_parallel_degree": 1.5}, ["pipeline_parallel_degree must be an integer >= 1, got 1.5"]),
    (1, 2, {"virtual_stages": True}, ["virtual_stages must be an integer >= 1, got True"]),
    (1, 2, {"microbatches": "4"}, ["microbatches must be an integer >= 1 or null"]),
    (1, 2, _smp(partitions=2, pipeline="fast"), ["pipeline must be one of ['simple', 'interleaved']"]),
    (1, 2, _smp(partitions=2, pipeline_parallel_degree=1), ["partitions (2) is an alias of pipeline_parallel_degree"]),
    (2, 2, _smp(tensor_parallel_degree=4), ["tp (4) must divide the processes per host (2)"]),
])
def test_impossible_3d_layouts_are_refused(src, instance_count, pph, distribution, texts, nothing_started):
    msg = _refused("distribution", _est, src, instance_count=instance_count, processes_per_host=pph,
                   distribution=distribution)
    for text in texts:
        assert text in msg


@pytest.mark.parametrize("instance_count,pph,hps,distribution,texts", [
    # the model's shape: "tiny" has 2 layers, 4 heads, 2 key/value heads
    (1, 2, {}, {"pipeline_parallel_degree": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2},
     ["2 layers do not split evenly into 4 pipeline stages"]),
    (3, 2, {"global_batch_size": 12}, {"pipeline_parallel_degree": 3},
     ["2 layers do not split evenly into 3 pipeline stages"]),
    (1, 2, {}, {"pipeline_parallel_degree": 2, "pipeline_split": [1, 2]}, ["sums to 3, the model has 2 layers"]),
    (1, 4, {}, {"tensor_parallel_degree": 4}, ["tensor_parallel_degree 4 must divide the model's key/value heads",
                                               "n_kv_heads = 2"]),
    (1, 2, {"seq_len": 127}, {"tensor_parallel_degree": 2}, ["seq_len = 127"]),
    # micro-batches: global_batch_size / (micro_batch_size x data-parallel degree 1) = 1 < 2 stages
    (1, 2, {"global_batch_size": 2, "micro_batch_size": 2}, {"pipeline_parallel_degree": 2},
     ["1 micro-batch(es) per step", "below the pipeline_parallel_degree (2)"]),
    (1, 2, {"global_batch_size": 8, "micro_batch_size": 2}, {"pipeline_parallel_degree": 2, "microbatches": 2},
     ["microbatches 2 does not match", "data-parallel degree (1)) = 4"]),
])
def test_3d_layouts_checked_against_the_builtin_trainer(instance_count, pph, hps, distribution, texts,
                                                       nothing_started):
    msg = _refused("distribution", _builtin, instance_count, pph, hps, **distribution)
    for text in texts:
        assert text in msg


def test_builtin_trainer_batch_splits_over_the_data_parallel_degree():
    # 4 ranks, tensor-parallel pairs: 2 data-parallel ranks, so 4 sequences of 2 split (over 4 ranks they would not)
    _builtin(2, 2, {"global_batch_size": 4, "micro_batch_size": 2}, tensor_parallel_degree=2)
    msg = _refused("hyperparameters", _builtin, 2, 2, {"global_batch_size": 6, "micro_batch_size": 2},
                   tensor_parallel_degree=2)
    assert "data-parallel ranks (2) = 4" in msg


def test_a_3d_layout_is_accepted():
    from trainyard.job.distribution import normalize

    # 2 hosts x 4 processes: tp 2 inside a host, 2 pipeline stages, 2 data-parallel ranks in one partition group;
    # 8 sequences / (2 per micro-batch x 2 data-parallel ranks) = 2 micro-batches for 2 stages
    d = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "mics": {"partition_group_size": 2},
         "microbatches": 2}
    est = _builtin(2, 4, {"global_batch_size": 8, "micro_batch_size": 2}, **d)
    typed = normalize(est.distribution, world_size=8, processes_per_host=4)
    assert (typed["tensor_parallel_degree"], typed["pipeline_parallel_degree"], typed["mics"]["partition_group_size"],
            typed["microbatches"]) == (2, 2, 2, 2)
    from trainyard.parallel.parallelism import Parallelism

    dims = Parallelism.parse(typed).dims(world_size=8, processes_per_host=4)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 1, 2, 2)


@pytest.mark.parametrize("bad", [0, -5, "60", True, math.nan])
def test_hang_timeout(src, bad):
    msg = _refused("hang_timeout_s", _est, src, hang_timeout_s=bad)
    assert "number of seconds > 0 (or None to turn hang detection off)" in msg
    assert _est(src, hang_timeout_s=None).hang_timeout_s is None
    assert _est(src).hang_timeout_s == 300.0 and _est(src, hang_timeout_s=2.5).hang_timeout_s == 2.5


@pytest.mark.parametrize("bad,field,text", [
    ({"min_ratio": 1.5}, "health_check.min_ratio", "must be a number strictly between 0 and 1"),
    ({"on_failure": "retry"}, "health_check.on_failure", "'fail' or 'continue'"),
    ({"threshold": 0.5}, "health_check.threshold", "Extra inputs are not permitted"),
    ("yes", "health_check", "must be True, False or a dict")])
def test_health_check(src, bad, field, text):
    assert text in _refused(field, _est, src, health_check=bad)
    assert _est(src).health_check is None and _est(src, health_check=False).health_check is None
    on = _est(src, health_check=True).health_check
    assert (on.on_failure, on.min_ratio) == ("fail", 0.7)
    go_on = _est(src, health_check={"on_failure": "continue", "min_ratio": 0.5}).health_check
    assert (go_on.on_failure, go_on.min_ratio) == ("continue", 0.5)


def test_elastic(src):
    assert _est(src, instance_count=2, max_retry_attempts=1,
                elastic={"min_instance_count": 1}).elastic.min_instance_count == 1
    assert "at most 2" in _refused("elastic", _est, src, instance_count=2, max_retry_attempts=1,
                                   elastic={"min_instance_count": 3})
    assert "set max_retry_attempts >= 1" in _refused("elastic", _est, src, instance_count=2,
                                                     elastic={"min_instance_count": 1})
    assert "integer >= 1" in _refused("elastic.min_instance_count", _est, src, instance_count=2, max_retry_attempts=1,
                                      elastic={"min_instance_count": 0})
