"""The Estimator's argument triage (sdk/arguments.py) as a table: argument -> used, without effect (named), or
refused naming it; no job, no files."""
import pytest

from trainyard.errors import ConfigError
from trainyard.sdk import arguments


def _triage(instance_type="local", backend=None, ec2=None, profiler_inert=False, **sagemaker_only):
    return arguments.triage(instance_type=instance_type, backend=backend, sagemaker_only=sagemaker_only,
                            ec2=ec2 or {}, profiler_inert=profiler_inert)


# (instance type, backend, SageMaker-only arguments, EC2 arguments) -> (inert, EC2 fields that differ from the
# defaults, keep_alive)
CASES = [
    ("local", None, {"rules": [object()]}, {}, ("rules",), {}, None),
    ("local", None, {"rules": []}, {}, (), {}, None),  # a value that asks for nothing is not named
    ("local", None, {"debugger_hook_config": False, "enable_network_isolation": None}, {}, (), {}, None),
    ("local", None, {"keep_alive_period_in_seconds": 600}, {}, ("keep_alive_period_in_seconds",), {}, None),
    ("ml.p4d.24xlarge", "sagemaker", {"keep_alive_period_in_seconds": 600}, {}, (), {}, 600),
    ("ml.p4d.24xlarge", None, {"keep_alive_period_in_seconds": 600}, {}, ("keep_alive_period_in_seconds",), {},
     None),
    ("local", None, {}, {"subnets": ["subnet-1"], "use_spot_instances": True}, ("subnets", "use_spot_instances"),
     {}, None),
    ("local", None, {}, {"subnets": []}, (), {}, None),
    ("local", None, {}, {"image_uri": "trainyard:cpu"}, (), {"image_uri": "trainyard:cpu"}, None),
    ("p4d.24xlarge", None, {}, {"subnets": ["subnet-1"], "volume_size": 200}, (),
     {"subnets": ["subnet-1"], "volume_size": 200}, None),
    ("local", None, {"volume_kms_key": "k"}, {"max_wait": 10}, ("volume_kms_key", "max_wait"), {}, None),
]


@pytest.mark.parametrize("itype,backend,sm,ec2,inert,ec2_fields,keep_alive", CASES)
def test_each_argument_is_used_or_named(itype, backend, sm, ec2, inert, ec2_fields, keep_alive):
    t = _triage(itype, backend, ec2, **sm)
    assert t.inert == inert
    assert {k: v for k, v in t.ec2.items() if v != arguments.EC2_DEFAULTS[k]} == ec2_fields
    assert set(t.ec2) == set(arguments.EC2_ONLY)
    assert t.keep_alive == keep_alive


def test_a_profiler_for_the_system_monitor_only_is_named_before_the_ec2_arguments():
    assert _triage(ec2={"subnets": ["s"]}, profiler_inert=True).inert == ("profiler_config", "subnets")


def test_image_uri_on_a_local_type_other_than_local_is_refused(monkeypatch):
    from trainyard.job import catalog

    monkeypatch.setattr(catalog, "local_gpus", lambda: 1)  # local_gpu needs a visible GPU
    with pytest.raises(ConfigError, match="image_uri: .*instance_type='local'"):
        _triage("local_gpu", ec2={"image_uri": "x:1"})


@pytest.mark.parametrize("kwargs,field", [
    ({"training_recipe": "llama"}, "training_recipe"),
    ({"recipe_overrides": {"a": 1}}, "training_recipe"),
    ({"instance_groups": [object()]}, "instance_groups"),
    ({"input_mode": "Pipe"}, "input_mode"),
])
def test_what_trainyard_does_not_do_is_refused_by_name(kwargs, field):
    given = {"training_recipe": None, "recipe_overrides": None, "instance_groups": None, "input_mode": "File",
             **kwargs}
    with pytest.raises(ConfigError, match=f"^{field}: "):
        arguments.refuse_unsupported(**given)


def test_fastfile_is_accepted():
    arguments.refuse_unsupported(training_recipe=None, recipe_overrides=None, instance_groups=None,
                                 input_mode="FastFile")


@pytest.mark.parametrize("distribution,options", [
    (None, None), ({"torch_distributed": {"enabled": True}}, None), ("auto", {}),
    ({"auto": {"model": "tiny", "seq_len": 64}}, {"model": "tiny", "seq_len": 64}),
])
def test_auto_options(distribution, options):
    assert arguments.auto_options(distribution) == options


@pytest.mark.parametrize("distribution,match", [
    ({"auto": {"model": "tiny"}, "mics": {}}, "alone"),
    ({"auto": {"modle": "tiny"}}, "unknown key"),
])
def test_auto_options_refused(distribution, match):
    with pytest.raises(ConfigError, match=f"distribution: .*{match}"):
        arguments.auto_options(distribution)


def test_processes_per_host_follows_sagemakers_rule():
    from trainyard.job import catalog

    p4d = catalog.lookup("ml.p4d.24xlarge")
    assert arguments.processes_per_host(p4d, None, None) == 8  # one per GPU
    assert arguments.processes_per_host(p4d, {"mpi": {"enabled": True, "processes_per_host": 4}}, None) == 4
    assert arguments.processes_per_host(p4d, None, 2) == 2
    with pytest.raises(ConfigError, match="processes_per_host: 2 contradicts"):
        arguments.processes_per_host(p4d, {"mpi": {"enabled": True, "processes_per_host": 4}}, 2)
    # a script without a distribution runs once per host (SageMaker's toolkit), unless the argument says more
    assert arguments.processes_per_host(p4d, None, None, plain=True) == 1
    assert arguments.processes_per_host(p4d, None, 4, plain=True) == 4


@pytest.mark.parametrize("entry,distribution,plain", [
    ("train.py", None, True),
    ("train.py", {}, True),
    ("my.module", {"torch_distributed": {"enabled": False}}, True),
    ("train.py", {"smdistributed": {"dataparallel": {"enabled": False}}}, True),
    ("train.py", {"pytorchddp": {}}, True),
    ("train.py", {"torch_distributed": {"enabled": True}}, False),
    ("train.py", {"pytorchddp": {"enabled": True}}, False),
    ("train.py", {"mpi": {"enabled": True, "processes_per_host": 2}}, False),
    ("train.py", {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {}}}}, False),
    ("train.py", {"smdistributed": {"dataparallel": {"enabled": True}}}, False),
    ("train.py", {"instance_groups": [{"name": "a"}]}, False),
    ("train.py", {"tensor_parallel_degree": 2}, False),
    ("train.py", {"mics": {"partition_group_size": 2}}, False),
    ("train.py", {"tensor_parallel_degree": None}, True),
    ("trainyard.engine.train", None, False),  # the built-in trainer: torchrun always
], ids=lambda v: repr(v) if not isinstance(v, bool) else ("plain" if v else "launcher"))
def test_which_jobs_run_as_plain_python(entry, distribution, plain):
    assert arguments.launches_plain(entry, distribution) is plain


def test_the_spec_launches_plain_python_for_one_process_per_host_only():
    from trainyard.job.spec import build_spec

    base = dict(entry_point="train.py", entry_kind="script", instance_type="local", instance_count=2, role="r",
                output_path="s3://bkt/out")
    plain = build_spec(**base, processes_per_host=1)
    # each host's one process is a world of its own: the engine gets no partition group spanning the hosts
    assert plain.launcher == "python" and plain.parallelism.partition_group_size == 1
    assert build_spec(**base, processes_per_host=2).launcher == "torchrun"  # more than one: torchrun starts them
    assert build_spec(**base, processes_per_host=1, distribution={"torch_distributed": {"enabled": True}}
                      ).launcher == "torchrun"
    assert build_spec(**{**base, "entry_point": "trainyard.engine.train", "entry_kind": "module"},
                      processes_per_host=1).launcher == "torchrun"
