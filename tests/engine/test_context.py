"""Context parallelism: the layout (a `cp` mesh dimension inside the data-parallel group, folded into the MiCS
sharding group), the zig-zag chunks, the ring attention's math in one process (ranks simulated by threads)
against SDPA, and the oracle tests on gloo (slow)."""
import pytest

from trainyard.parallel.dims import ParallelDims
from trainyard.parallel.parallelism import Parallelism


def test_cp_ranks_sit_inside_the_data_parallel_group_and_share_its_shards():
    dims = Parallelism.parse({"context_parallel_degree": 2, "mics": {"partition_group_size": 2}}).dims(
        world_size=4, processes_per_host=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.dp) == (1, 2, 2, 2)
    assert dims.cp_groups() == [[0, 1], [2, 3]]  # a host's two processes split one sequence
    assert [dims.coords(r)["dp"] for r in range(4)] == [0, 0, 1, 1]  # and see the same rows
    assert [dims.coords(r)["cp"] for r in range(4)] == [0, 1, 0, 1]
    # the model states are sharded over p x cp = 4 ranks spanning the 2 hosts, 2 on each
    assert dims.shard_groups() == [[0, 1, 2, 3]] and dims.shard_dim == "dp_shard_cp"
    assert (dims.shard_hosts, dims.shard_per_host, dims.shard_size) == (2, 1, 4)
    replicas = Parallelism.parse({"context_parallel_degree": 2, "mics": {"partition_group_size": 1}}).dims(
        world_size=4, processes_per_host=2)
    assert replicas.shard_groups() == [[0, 1], [2, 3]] and replicas.replicate_groups() == [[0, 2], [1, 3]]
    with_tp = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=2, world_size=4, processes_per_host=4)
    assert with_tp.cp_groups() == [[0, 2], [1, 3]] and with_tp.shard_groups() == [[0, 2], [1, 3]]


def test_cp_1_keeps_every_existing_group():
    for kw in (dict(dp_replicate=2, dp_shard=2, world_size=4, processes_per_host=2),
               dict(dp_replicate=2, dp_shard=4, world_size=8, processes_per_host=2),
               dict(dp_replicate=1, dp_shard=2, tp=2, pp=2, world_size=8, processes_per_host=4)):
        dims = ParallelDims(**kw)
        assert dims.mesh_shape[4] == 1 and dims.shard_dim == "dp_shard" and dims.shard_size == dims.dp_shard
        assert dims.cp_groups() == [[r] for r in range(dims.world_size)]
        assert all(dims.coords(r)["cp"] == 0 for r in range(dims.world_size))


@pytest.mark.parametrize("distribution,world,pph,text", [
    ({"context_parallel_degree": 0}, 4, 2, "context_parallel_degree must be an integer >= 1, got 0"),
    ({"context_parallel_degree": True}, 4, 2, "context_parallel_degree must be an integer >= 1, got True"),
    ({"context_parallel_degree": 3}, 4, 2,
     "tensor_parallel_degree 1 x pipeline_parallel_degree 1 x context_parallel_degree 3 = 3 must divide the world size 4"),
    ({"context_parallel_degree": 4}, 4, 2, "cp (4) x tp (1) = 4 must divide the processes per host (2)"),
    ({"context_parallel_degree": 2, "tensor_parallel_degree": 2}, 8, 2, "cp (2) x tp (2) = 4 must divide"),
    ({"context_parallel_degree": 2, "mics": {"partition_group_size": 4}}, 12, 4,
     "partition_group_size 4 must divide the data-parallel degree 6 = world size 12 / (tensor_parallel_degree 1 x "
     "pipeline_parallel_degree 1 x context_parallel_degree 2)"),
    ({"context_parallel_degree": 2, "mics": {"partition_group_size": 3}}, 12, 4,
     "a partition group (dp_shard 3 x cp 2 x tp 1 = 6 consecutive ranks) must fit inside a host of 4"),
])
def test_cp_refusals_name_the_field_and_the_number(distribution, world, pph, text):
    with pytest.raises(ValueError) as e:
        Parallelism.parse(distribution).dims(world_size=world, processes_per_host=pph)
    assert text in str(e.value)


def test_cp_is_parsed_from_the_typed_form_and_smp_v2():
    par = Parallelism.parse({"context_parallel_degree": 2})
    assert par.cp == 2 and par.data_parallel_degree(8) == 4
    assert Parallelism.parse(json_roundtrip(par.to_env())) == par
    smp = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "hybrid_shard_degree": 2, "context_parallel_degree": 2}}}}
    assert Parallelism.parse(smp).cp == 2
    assert Parallelism.parse({}).to_env() == Parallelism().to_env()  # cp=1 is not written


def json_roundtrip(text: str) -> dict:
    import json

    return json.loads(text)
