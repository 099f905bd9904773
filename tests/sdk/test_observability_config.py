"""TensorBoard output and the profiler as the Estimator takes them: SageMaker's `tensorboard_output_config`,
`profiler_config` and `disable_profiler`, and Trainyard's `profiler={"steps": [...], "ranks": [...]}`. Checked when
the Estimator is built, errors naming the argument and the fix; carried in the JobSpec through JSON. Fast: no job."""
import importlib.util

import pytest

from trainyard import Estimator
from trainyard.debugger import FrameworkProfile, ProfilerConfig, TensorBoardOutputConfig
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec

TRAINER = "trainyard.engine.train"


def _est(src=None, **kw):
    args = dict(entry_point=TRAINER, instance_type="local", instance_count=2, processes_per_host=2,
                hyperparameters={"model": "tiny", "steps": 8})
    if src is not None:
        args.update(entry_point="train.py", source_dir=src, hyperparameters={})
    args.update(kw)
    return Estimator(**args)


def _refused(field, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        _est(**kw)
    assert e.value.field == field, str(e.value)
    return str(e.value)


# ---- TensorBoard


@pytest.mark.parametrize("given", [TensorBoardOutputConfig("s3://bkt/tb", "/opt/ml/output/tensorboard"),
                                   {"s3_output_path": "s3://bkt/tb"},
                                   TensorBoardOutputConfig(s3_output_path="s3://bkt/tb")])
def test_tensorboard_output_config_is_used_not_named(given, capsys):
    est = _est(tensorboard_output_config=given)
    tb = est._spec.tensorboard_output_config
    assert (tb.s3_output_path, tb.container_local_output_path) == ("s3://bkt/tb", "/opt/ml/output/tensorboard")
    assert est.inert_arguments == () and "no effect" not in capsys.readouterr().err
    assert est.tensorboard_output_config is given  # SageMaker's attribute keeps what was given


def test_tensorboard_local_path_and_the_artifacts_path_as_sagemaker_names_it():
    est = _est(tensorboard_output_config=TensorBoardOutputConfig("s3://bkt/tb/", "/opt/ml/output/my-tb"))
    assert est._spec.tensorboard_output_config.container_local_output_path == "/opt/ml/output/my-tb"
    with pytest.raises(ValueError, match="no training job yet"):
        est.latest_job_tensorboard_artifacts_path()
    est.latest_training_job = type("J", (), {"name": "job-1"})()
    assert est.latest_job_tensorboard_artifacts_path() == "s3://bkt/tb/job-1/tensorboard-output"
    assert est.latest_job_profiler_artifacts_path() is None


@pytest.mark.parametrize("given, field, words", [
    (TensorBoardOutputConfig("bkt/tb"), "tensorboard_output_config.s3_output_path", "expected an s3:// URI"),
    (TensorBoardOutputConfig("s3://Bad_Bucket/tb"), "tensorboard_output_config.s3_output_path", "invalid bucket"),
    ({"s3_output_path": "s3://bkt//tb"}, "tensorboard_output_config.s3_output_path", "empty path segment"),
    (TensorBoardOutputConfig("s3://bkt/tb", "opt/ml/output/tensorboard"),
     "tensorboard_output_config.container_local_output_path", "absolute path"),
    ({"container_local_output_path": "/opt/ml/tb"}, "tensorboard_output_config", "s3_output_path is required"),
    ({"s3_output_path": "s3://bkt/tb", "local_path": "/x"}, "tensorboard_output_config",
     "unknown key 'local_path'"),
    ("s3://bkt/tb", "tensorboard_output_config", "TensorBoardOutputConfig(s3_output_path="),
])
def test_bad_tensorboard_output_config_is_refused_by_name(given, field, words):
    assert words in _refused(field, tensorboard_output_config=given)


def test_without_tensorboard_a_local_builtin_job_is_refused_with_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    msg = _refused("tensorboard_output_config", tensorboard_output_config={"s3_output_path": "s3://bkt/tb"})
    assert "pip install 'trainyard[tensorboard]'" in msg


# ---- profiler


def test_sagemaker_framework_profile_names_steps_from_start_step():
    prof = _est(profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile(start_step=5, num_steps=2)))
    assert (prof._spec.profiler.steps, prof._spec.profiler.ranks) == ((5, 6), (0,))
    default = _est(profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile()))
    assert default._spec.profiler.steps == (5,)  # SageMaker's default: detailed profiling at step 5, one step
    only_start = _est(profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile(start_step=3)))
    assert only_start._spec.profiler.steps == (3,)
    placed = _est(profiler_config=ProfilerConfig(s3_output_path="s3://bkt/prof", framework_profile_params=FrameworkProfile(
        start_step=2, num_steps=3, local_path="/opt/ml/output/traces")))
    assert placed._spec.profiler.local_path == "/opt/ml/output/traces"
    placed.latest_training_job = type("J", (), {"name": "job-2"})()
    assert placed.latest_job_profiler_artifacts_path() == "s3://bkt/prof/job-2/profiler-output"


def test_trainyards_profiler_names_steps_and_ranks_and_defaults_to_the_output_path():
    est = _est(profiler={"steps": [6, 2, 3], "ranks": [3, 0]}, output_path="s3://bkt/out")
    prof = est._spec.profiler
    assert (prof.steps, prof.ranks, prof.runs()) == ((2, 3, 6), (0, 3), [(2, 3), (6, 6)])
    est.latest_training_job = type("J", (), {"name": "job-3"})()
    assert est.latest_job_profiler_artifacts_path() == "s3://bkt/out/job-3/profiler-output"
    assert JobSpec.from_json(est._spec.to_json()) == est._spec  # carried through JSON as it is


def test_disable_profiler_turns_either_form_off(capsys):
    assert _est(profiler={"steps": [2]}, disable_profiler=True)._spec.profiler is None
    assert "disable_profiler=True: no profiler runs" in capsys.readouterr().err
    fp = FrameworkProfile(start_step=2, num_steps=1)
    assert _est(profiler_config=ProfilerConfig(framework_profile_params=fp), disable_profiler=True)._spec.profiler is None
    off = ProfilerConfig(framework_profile_params=fp, disable_profiler=True)
    assert _est(profiler_config=off)._spec.profiler is None
    capsys.readouterr()
    assert _est(disable_profiler=True)._spec.profiler is None and "no profiler runs" not in capsys.readouterr().err
    # turned off, still checked: flipping disable_profiler never hides a mistake
    assert "0 is not a whole number" in _refused("profiler.steps", profiler={"steps": [0]}, disable_profiler=True)


def test_a_profiler_config_for_the_system_monitor_only_is_named_inert(capsys):
    est = _est(profiler_config=ProfilerConfig(system_monitor_interval_millis=500))
    assert est._spec.profiler is None and est.inert_arguments == ("profiler_config",)
    assert "accepted with no effect on local jobs: profiler_config" in capsys.readouterr().err


@pytest.mark.parametrize("kw, field, words", [
    (dict(profiler={"steps": []}), "profiler.steps", "at least one step"),
    (dict(profiler={"steps": [0, 1]}), "profiler.steps", "0 is not a whole number >= 1"),
    (dict(profiler={"steps": [2, 2]}), "profiler.steps", "[2] given more than once"),
    (dict(profiler={"steps": "5"}), "profiler.steps", "list of whole numbers"),
    (dict(profiler={"steps": [True]}), "profiler.steps", "True is not a whole number"),
    (dict(profiler={"steps": list(range(1, 60))}), "profiler.steps", "profile at most 50"),
    (dict(profiler={"steps": [1], "ranks": [-1]}), "profiler.ranks", "-1 is not a whole number >= 0"),
    (dict(profiler={"steps": [1], "ranks": [4]}), "profiler", "rank 4 is not in the job: it has 4 process(es)"),
    (dict(profiler={"step": [1]}), "profiler", "did you mean 'steps'?"),
    (dict(profiler={"steps": [1], "s3_output_path": "bkt/p"}), "profiler.s3_output_path", "expected a URI"),
    (dict(profiler=[5, 6]), "profiler", "expected a dict such as {'steps': [5, 6]"),
    (dict(profiler={"steps": [9]}), "profiler", "after the job's last step 8"),
    (dict(profiler={"steps": [1]}, profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile())),
     "profiler", "not both"),
    (dict(profiler_config={"framework_profile_params": {}}), "profiler_config", "expected ProfilerConfig("),
    (dict(profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile(start_unix_time=1, duration=5))),
     "profiler_config.framework_profile_params", "not a time range"),
    (dict(profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile(python_profiling_config={}))),
     "profiler_config.framework_profile_params", "python_profiling_config is not supported"),
    (dict(profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile(start_step=0))),
     "profiler_config.framework_profile_params.start_step", "the first step is 1"),
    (dict(profiler_config=ProfilerConfig(framework_profile_params=FrameworkProfile(local_path="traces"))),
     "profiler_config.local_path", "absolute path"),
])
def test_bad_profiler_requests_are_refused_by_name(kw, field, words):
    assert words in _refused(field, **kw)


def test_a_script_job_takes_any_steps(src):
    """Only the built-in trainer's last step is known when the Estimator is built."""
    est = _est(src, profiler={"steps": [500]})
    assert est._spec.profiler.steps == (500,)
