"""Tensor, sequence and pipeline parallelism composed with MiCS: layout rules, and equivalence with an
unsharded single-process oracle on 2 emulated hosts x 4 processes."""
import os

import pytest

from trainyard.parallel.layout import check_pipeline, check_tp, stage_layers
from trainyard.engine.components.meter import CommMeter
from trainyard.engine.models.llama.model import MODEL_CONFIGS
from trainyard.parallel.dims import ParallelDims
from trainyard.parallel.parallelism import Parallelism
from trainyard.engine.distributed.pipeline import cut_stage, rank_stages
from trainyard.engine.models.llama.model import build_model
from trainyard.engine.models.llama.spec import spec_for

from .launch import run_on_two_hosts

WORKER = os.path.join(os.path.dirname(__file__), "parallel_worker.py")


def test_stages_cut_layers_evenly_or_by_split():
    assert stage_layers(6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert stage_layers(5, 2, [2, 3]) == [[0, 1], [2, 3, 4]]
    assert rank_stages(1, 2, 2) == [1, 3]  # looped placement for interleaved 1F1B
    with pytest.raises(ValueError, match="6 layers do not split evenly into 4 pipeline stages"):
        stage_layers(6, 4)
    with pytest.raises(ValueError, match=r"sums to 4, the model has 5 layers"):
        stage_layers(5, 2, [2, 2])


def test_stage_models_keep_the_whole_models_names():
    cfg = MODEL_CONFIGS["6l"]
    whole = build_model(cfg)
    split = spec_for(whole).stages
    first, middle, last = (cut_stage(whole, split, s, 3) for s in range(3))
    names = [set(dict(m.named_parameters())) for m in (first, middle, last)]
    assert set().union(*names) == set(dict(whole.named_parameters()))
    assert not names[0] & names[1] and not names[1] & names[2]
    assert "tok_embeddings.weight" in names[0] and "layers.2.attention.wq.weight" in names[1]
    assert "output.weight" in names[2] and "norm.weight" in names[2] and middle.tok_embeddings is None


@pytest.mark.parametrize("kw,text", [
    (dict(tp=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=512), "key/value heads"),
    (dict(tp=2, n_heads=4, n_kv_heads=2, ffn_hidden=351, vocab_size=512), "ffn_hidden = 351"),
    (dict(tp=2, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=511), "vocab_size = 511"),
    (dict(tp=2, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=512, seq_len=15), "seq_len = 15"),
])
def test_tp_checks_name_the_dimension(kw, text):
    with pytest.raises(ValueError, match=text):
        check_tp(**kw)


@pytest.mark.parametrize("kw,text", [
    (dict(pp=3, schedule="1f1b", virtual_stages=1, microbatches=2), "below the pipeline_parallel_degree"),
    (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=3), "multiple of pipeline_parallel"),
    (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=1, microbatches=4), "needs virtual_stages >= 2"),
    (dict(pp=2, schedule="gpipe", virtual_stages=2, microbatches=4), "needs pipeline_schedule"),
    (dict(pp=1, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4), "needs a pipeline"),
    (dict(pp=2, schedule="zb", virtual_stages=1, microbatches=4), "pipeline_schedule must be one of"),
    (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4, n_layers=6), "into 4 pipeline"),
])
def test_pipeline_checks(kw, text):
    with pytest.raises(ValueError, match=text):
        check_pipeline(**kw)


def test_3d_mesh_keeps_tp_inside_a_host_and_pp_outermost():
    dims = Parallelism.parse({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 3,
                              "mics": {"partition_group_size": 2}}).dims(world_size=12, processes_per_host=4)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (3, 1, 2, 2)
    coords = [dims.coords(r) for r in range(12)]
    assert [c["pp"] for c in coords] == [0] * 4 + [1] * 4 + [2] * 4  # one stage per host
    assert [c["dp"] for c in coords] == [0, 0, 1, 1] * 3 and [c["tp"] for c in coords] == [0, 1] * 6
    meter = CommMeter(4, dims)
    assert meter.dimension((0, 1)) == "tp" and meter.dimension((0, 2)) == "dp_shard"
    assert meter.dimension((1, 5)) == "pp" and not meter.spans_hosts((0, 1)) and meter.spans_hosts((1, 5))
    assert meter.dimension(tuple(range(12))) == "world" and meter.dimension((0, 3)) == "dp_shard_intra+tp"
    with pytest.raises(ValueError, match=r"partition_group_size 4 must divide the data-parallel degree 2"):
        Parallelism.parse({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 3,
                           "mics": {"partition_group_size": 4}}).dims(world_size=12, processes_per_host=4)
    with pytest.raises(ValueError, match=r"tp \(4\) must divide the processes per host \(2\)"):
        ParallelDims(dp_replicate=1, dp_shard=1, tp=4, world_size=4, processes_per_host=2)


CASES = [
    dict(name="tp2-sp-mics2x2", tp=2, dp_shard=2, microbatches=2),
    dict(name="tp4-dp2", tp=4, microbatches=1),
    dict(name="pp2-gpipe-dp4", pp=2, schedule="gpipe", microbatches=2),
    dict(name="pp2-1f1b-dp4", pp=2, schedule="1f1b", microbatches=4),
    dict(name="pp2-interleaved-v2-dp4", pp=2, schedule="interleaved_1f1b", v=2, microbatches=4),
    dict(name="3d-pp2-dp2-tp2-ac", pp=2, tp=2, microbatches=2, ac="full"),
]


@pytest.fixture(scope="module")
def two_hosts_of_4(tmp_path_factory) -> dict:
    """One launch on 2 hosts x 4 processes serves the oracle and the meter tests below (each launch starts 10
    processes)."""
    return run_on_two_hosts(WORKER, CASES + METER_CASES, tmp_path_factory.mktemp("parallel3d"), processes_per_host=4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_3d_layouts_match_the_single_process_oracle(two_hosts_of_4):
    errors = {k: v for k, v in two_hosts_of_4.items() if k not in {c["name"] for c in METER_CASES}}
    assert set(errors) == {c["name"] for c in CASES}
    assert all(e <= 1e-5 for e in errors.values()), errors


METER_CASES = [
    dict(name="pp2-dp4", pp=2, microbatches=2, meter=True),
    dict(name="pp2-tp2-dp2", pp=2, tp=2, microbatches=2, meter=True),
    dict(name="tp2-mics2x2", tp=2, dp_shard=2, microbatches=2, meter=True),
]
SEQ, DIM, LAYERS = 16, 64, 4  # parallel_worker's model and sequence (one sequence per micro-batch)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_comm_meter_and_memory_cover_every_dimension(two_hosts_of_4):
    results = two_hosts_of_4
    for case in METER_CASES:
        tp, pp, m = case.get("tp", 1), case.get("pp", 1), case["microbatches"]
        dp_shard = case.get("dp_shard", 8 // (tp * pp))
        for got in results[case["name"]]:
            by_dim = got["by_dim"]
            # activations (fp32, sequence-sharded under tp) cross the pipeline between hosts: forward
            # outputs from the first stage, their gradients from the last, one per micro-batch
            if pp > 1:
                assert (by_dim["pp"]["intra_bytes"], by_dim["pp"]["inter_bytes"]) == (0, m * SEQ // tp * DIM * 4), got
            if tp > 1:
                # per micro-batch, each block all-gathers its attention and MLP inputs and reduce-scatters
                # their outputs in forward, and the reverse in backward; the embedding and the head one of
                # each (a stage of two holds one of them); every collective sends M (tp-1)/tp of the full
                # activation M
                blocks, ends = LAYERS // pp, 2 if pp == 1 else 1
                ag_rs = 2 * m * (4 * blocks + ends) * SEQ * DIM * 4 * (tp - 1) // tp
                assert by_dim["tp"]["inter_bytes"] == 0  # tensor parallelism stays inside a host
                tp_collectives = got["by_kind"]["all_gather"]["intra_bytes"] + got["by_kind"]["reduce_scatter"][
                    "intra_bytes"] - by_dim.get("dp_shard", {}).get("intra_bytes", 0)
                assert tp_collectives == ag_rs, got
            # every parameter is stored once per replica; norm weights are replicated over tp
            states = 16 * (got["params"] + (tp - 1) * got["norm_params"]) * (8 // (tp * pp * dp_shard))
            assert got["model_state_bytes_all_ranks"] == pytest.approx(states, rel=0.01), got


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_reshard_across_layouts(tmp_path):
    """MiCS 2x2 on 2 hosts x 2 saves; 4x1, tp2 x dp2, pp2 x dp2 and 1 process load it: every model and
    optimizer tensor identical."""
    import torch

    from trainyard.engine.components import checkpoint as ckpt
    from trainyard.engine.models.llama.model import build_model, init_weights

    from .parallel_worker import CFG, STEPS, optimizer

    case = dict(name="reshard", dir=str(tmp_path / "ckpt"), source=dict(name="mics-2x2", dp_shard=2, microbatches=2),
                targets=[dict(name="ddp-4x1", dp_shard=1, microbatches=2),
                         dict(name="tp2-dp2", tp=2, microbatches=2),
                         dict(name="pp2-dp2", pp=2, schedule="1f1b", microbatches=2)])
    results = run_on_two_hosts(WORKER, [case], tmp_path)["reshard"]
    assert set(results) == {"ddp-4x1", "tp2-dp2", "pp2-dp2"}
    for name, r in results.items():
        assert r["worst_abs_diff"] == 0.0 and r["tensors_checked"] > 0, (name, r)
    # one process, no process group: the sharded checkpoint loads whole
    model = build_model(CFG)
    init_weights(model, 0, device="cpu")
    opt = optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    assert ckpt.load_checkpoint(case["dir"], STEPS, model, opt, sched) == STEPS
    reference = torch.load(f"{case['dir']}/reference.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[f"model.{name}"]), name
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    tensors = {k: v for k, v in optim.items() if isinstance(v, torch.Tensor)}
    assert tensors and all(torch.equal(v, reference[f"optim.{k}"]) for k, v in tensors.items())
