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


def test_the_meter_names_the_cp_groups():
    from trainyard.engine.components.meter import CommMeter

    dims = Parallelism.parse({"context_parallel_degree": 2, "mics": {"partition_group_size": 2}}).dims(
        world_size=8, processes_per_host=4)
    meter = CommMeter(4, dims)
    assert dims.shard_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]] and dims.cp_groups()[0] == [0, 1]
    assert meter.dimension((0, 1)) == "cp" and meter.dimension((0, 1, 2, 3)) == "dp_shard_cp"
    assert meter.dimension((0, 4)) == "dp_replicate" and meter.dimension(tuple(range(8))) == "world"


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


# --- the zig-zag layout and the ring's math, one process ------------------------------------------------------

def test_zigzag_gives_each_rank_one_early_and_one_late_chunk():
    import torch

    from trainyard.engine.distributed.context import shard_sequence, unshard_sequence, zigzag_positions

    seq = torch.arange(16).view(1, 16)
    parts = [shard_sequence(seq, 4, r) for r in range(4)]
    assert [p.flatten().tolist() for p in parts] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [zigzag_positions(16, 4, r).tolist() for r in range(4)] == [p.flatten().tolist() for p in parts]
    assert torch.equal(unshard_sequence(parts), seq)
    assert shard_sequence(seq, 1, 0) is seq
    with pytest.raises(ValueError, match=r"seq_len 12 must be divisible by 2 x context_parallel_degree = 8"):
        shard_sequence(torch.zeros(1, 12), 4, 0)
    from trainyard.parallel.layout import check_cp

    with pytest.raises(ValueError, match=r"seq_len 20 / context_parallel_degree 2 = 10 tokens per rank must be "
                                         r"divisible by tensor_parallel_degree 4.*a multiple of 8"):
        check_cp(cp=2, seq_len=20, tp=4)


class ThreadRing:
    """The ring of `size` simulated ranks, one thread each: a message goes into the next rank's mailbox."""

    def __init__(self, rank: int, size: int, boxes: dict) -> None:
        self.rank, self.size, self.boxes = rank, size, boxes

    def start(self, tensor, tag: int = 0):
        self.boxes[(self.rank + 1) % self.size, tag].put(tensor.clone())
        box = self.boxes[self.rank, tag]
        return type("Pending", (), {"wait": lambda _self: box.get(timeout=60)})()


def _run_ranks(size: int, fn):
    """fn(rank, ring) on `size` threads (every rank's forward and backward), its results in rank order."""
    import queue
    import threading

    boxes = {(r, tag): queue.Queue() for r in range(size) for tag in (0, 1)}
    results, errors = [None] * size, []

    def run(rank):
        try:
            results[rank] = fn(rank, ThreadRing(rank, size, boxes))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 4), (4, 4, 2), (3, 6, 1)])
def test_ring_attention_equals_causal_sdpa_forward_and_backward(cp, heads, kv_heads):
    import torch
    import torch.nn.functional as F

    from trainyard.engine.distributed.context import ring_attention, shard_sequence, unshard_sequence

    torch.manual_seed(0)
    b, s, d = 2, 12 * cp, 8
    q, k, v = (torch.randn(b, s, n, d, dtype=torch.float64) for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(b, s, heads, d, dtype=torch.float64)
    # the oracle: SDPA over the whole sequence, keys and values repeated for grouped-query attention
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(leaves[0].transpose(1, 2), leaves[1].repeat_interleave(rep, 2).transpose(1, 2),
                                          leaves[2].repeat_interleave(rep, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    want.backward(grad)

    def rank_work(rank, ring):
        mine = [shard_sequence(t, cp, rank).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, ring)
        out.backward(shard_sequence(grad, cp, rank))
        return out.detach(), [t.grad for t in mine]

    results = _run_ranks(cp, rank_work)
    got = unshard_sequence([o for o, _ in results])
    assert torch.allclose(got, want, atol=1e-12, rtol=0), (got - want).abs().max()
    for n, leaf in enumerate(leaves):
        g = unshard_sequence([grads[n] for _, grads in results])
        assert torch.allclose(g, leaf.grad, atol=1e-12, rtol=0), ("qkv"[n], (g - leaf.grad).abs().max())


def test_ring_attention_is_not_full_attention():
    """The oracle comparison above can fail: without the causal mask by chunk the output differs."""
    import torch
    import torch.nn.functional as F

    from trainyard.engine.distributed.context import ring_attention, shard_sequence, unshard_sequence

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64) for _ in range(3))
    got = unshard_sequence(_run_ranks(2, lambda r, ring: ring_attention(
        *(shard_sequence(t, 2, r) for t in (q, k, v)), ring)))
    full = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert not torch.allclose(got, full, atol=1e-3)


# --- refusals before anything is built -------------------------------------------------------------------------

def _parallelize(model, **dims_kw):
    import torch

    from trainyard.engine.distributed.parallelize import parallelize
    from trainyard.engine.models.registry import resolve_spec

    dims = ParallelDims(dp_replicate=1, dp_shard=1, **dims_kw)
    return parallelize(model, resolve_spec(model), dims, device=torch.device("cpu"))


def test_a_model_whose_attention_cannot_be_split_is_refused_by_name():
    from torch import nn

    with pytest.raises(ValueError, match=r"context_parallel_degree 2: the engine cannot split the attention of "
                                         r"Sequential over the sequence"):
        _parallelize(nn.Sequential(nn.Linear(4, 4)), cp=2, world_size=2, processes_per_host=2)


def _hf(model_type: str, **kw):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, **kw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("model_type,kw,why", [
    ("mistral", {"sliding_window": 4}, r"MistralForCausalLM attends within a sliding window \(sliding_window=4\)"),
    ("gemma2", {"sliding_window": None, "attn_logit_softcapping": 50.0},
     r"Gemma2ForCausalLM soft-caps its attention logits \(attn_logit_softcapping=50.0\)"),
    ("llama", {"attention_dropout": 0.1}, r"LlamaForCausalLM has attention dropout \(attention_dropout=0.1\)"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     r"LlamaForCausalLM's rotary tables depend on the sequence length each rank sees \(rope_type 'dynamic'\)"),
])
def test_an_hf_attention_the_ring_cannot_split_is_refused_by_name(model_type, kw, why):
    from trainyard.engine.models.hf.cp import apply_cp

    with pytest.raises(ValueError, match=r"context_parallel_degree: the engine cannot split the attention of \w+ over "
                                         r"the sequence: " + why + r".*set context_parallel_degree to 1"):
        apply_cp(_hf(model_type, **kw), None)  # refused before any group is used


def test_an_hf_model_whose_positions_ignore_position_ids_is_caught_by_the_zigzag_run(monkeypatch):
    """The run-time check, not the configuration: rotary tables computed from the local order instead of the
    positions passed (as a model with its own position logic would) make the zig-zag run differ."""
    import torch
    from transformers.models.llama import modeling_llama

    from trainyard.engine.models.hf import cp, selfcheck

    monkeypatch.setattr(selfcheck, "_verdicts", {})
    model = _hf("llama")
    assert cp.refusal(model) is None and cp._difference(model) is None  # the family itself splits exactly
    own = modeling_llama.LlamaRotaryEmbedding.forward

    def local_order(self, x, position_ids):
        return own(self, x, torch.arange(position_ids.shape[1]).expand_as(position_ids))

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", local_order)
    with pytest.raises(ValueError, match=r"a small LlamaForCausalLM run on its tokens in zig-zag order, at their "
                                         r"positions, differs from its own forward by .* \(relative\)"):
        cp.apply_cp(model, None)


def test_cp_with_a_pipeline_of_an_hf_model_is_refused_naming_both():
    """An HF model's positions under context parallelism come from a hook on its own forward, which no pipeline
    stage runs (the built-in model's stages take their chunks' positions by themselves: the 2-host oracle)."""
    with pytest.raises(ValueError, match=r"context_parallel_degree 2 with pipeline_parallel_degree 2: "
                                         r"hf:LlamaForCausalLM's pipeline stages cannot run on a rank's chunks of the "
                                         r"sequence .* set one of them to 1"):
        _parallelize(_hf("llama", tie_word_embeddings=False), cp=2, pp=2, world_size=4, processes_per_host=4)


def test_the_trainer_refuses_a_sequence_that_does_not_split_into_zigzag_chunks():
    from trainyard.engine.config import TrainConfig, reconcile_distribution

    par = Parallelism.parse({"context_parallel_degree": 2})
    cfg = TrainConfig(model="tiny", seq_len=30, global_batch_size=4, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"seq_len 30 must be divisible by 2 x context_parallel_degree = 4"):
        reconcile_distribution(cfg, par, world_size=4)
    # the rows split over the data-parallel ranks only: 4 ranks / cp 2 = 2 of them, 4 rows of 2 = 1 micro-batch
    assert reconcile_distribution(TrainConfig(model="tiny", seq_len=32, global_batch_size=4, micro_batch_size=2),
                                  par, world_size=4).accumulation(par.data_parallel_degree(4)) == 1


# --- the oracle: gloo, fp32, against one unsharded process ------------------------------------------------------

def _worker():
    import os

    return os.path.join(os.path.dirname(__file__), "cp_worker.py")


def _assert_exact(results: dict, cases: list[dict]) -> None:
    assert set(results) == {c["name"] for c in cases}
    for name, errors in results.items():
        assert set(errors) == {"loss", "grad_norm", "weights", "evaluate"}, (name, errors)
        assert all(e <= 1e-5 for e in errors.values()), (name, errors)


CP_ALONE = [
    dict(name="cp2-accum2", distribution={"context_parallel_degree": 2}, microbatches=2),
    dict(name="cp2-own-loop-ac-full", distribution={"context_parallel_degree": 2, "activation_checkpointing": "full"},
         microbatches=2, loop="plain"),
    # a Hugging Face Llama at sequence 256: ring attention through transformers' attention interface
    dict(name="hf-llama-cp2", model="hf", distribution={"context_parallel_degree": 2}, microbatches=2),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_alone_matches_the_single_process_oracle(tmp_path):
    from .launch import HF, run_on_two_hosts

    # the HF case also checkpoints step 2, and a run on cp 1 (2 data-parallel ranks) resumes from it: its step 3
    # is the uninterrupted oracle's
    ckpt = str(tmp_path / "ckpt")
    cases = [dict(c, save=ckpt) if c["name"] == "hf-llama-cp2" else c for c in CP_ALONE]
    cases.append(dict(name="hf-llama-cp1-resumed-from-cp2", model="hf", distribution={}, microbatches=1, resume=ckpt))
    # refused rather than trained wrong: a loop that hands every rank the whole sequence, and an HF model's own
    # labels= loss (it would shift the labels inside the rank's chunks)
    refusals = [dict(name="forgot-sequence-shard", refused=True, loop="unsharded", microbatches=1,
                     distribution={"context_parallel_degree": 2}),
                dict(name="hf-labels", refused=True, loop="hf-labels", model="hf", microbatches=1,
                     distribution={"context_parallel_degree": 2})]
    results = run_on_two_hosts(_worker(), cases + refusals, tmp_path, processes_per_host=2, hosts=1, preload=HF)
    forgot = results.pop("forgot-sequence-shard")
    assert "this rank's input has 32 tokens per row, not its chunks of the sequence (te.sequence_shard cut " in \
        forgot and "call x, y = te.sequence_shard(model, x, y) before the forward" in forgot, forgot
    assert "the model's own labels= loss shifts the labels inside this rank's zig-zag chunks" in results.pop(
        "hf-labels")
    _assert_exact(results, cases)


CP_MICS = [
    # the partition group (2 data-parallel ranks x 2 cp ranks) spans the 2 hosts: hierarchical, then flat
    dict(name="cp2-mics-p2-hierarchical", distribution={"context_parallel_degree": 2,
                                                        "mics": {"partition_group_size": 2}}, microbatches=2),
    dict(name="cp2-mics-p2-flat", distribution={"context_parallel_degree": 2, "mics": {
        "partition_group_size": 2, "hierarchical_allgather": False}}, microbatches=1),
    # a partition group per host (its 2 cp ranks), 2 replicas synced across the hosts (2-hop, bucketed)
    dict(name="cp2-mics-p1-2-replicas", distribution={"context_parallel_degree": 2,
                                                      "mics": {"partition_group_size": 1}}, microbatches=2),
    dict(name="hf-llama-cp2-mics-p2", model="hf", distribution={"context_parallel_degree": 2,
                                                               "mics": {"partition_group_size": 2}}, microbatches=1),
    # a pipeline stage per host, its 2 ranks splitting each sequence (the schedule's micro-batches hold chunks)
    dict(name="cp2-pp2", distribution={"context_parallel_degree": 2, "pipeline_parallel_degree": 2},
         microbatches=2),
]


RING_METER = dict(name="cp2-ring-meter", distribution={"context_parallel_degree": 2}, microbatches=2, meter=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_with_mics_on_two_hosts_matches_the_single_process_oracle(tmp_path):
    from .launch import HF, run_on_two_hosts

    results = run_on_two_hosts(_worker(), CP_MICS + [RING_METER], tmp_path, processes_per_host=2, hosts=2, preload=HF)
    ring = results.pop(RING_METER["name"])
    _assert_exact(results, CP_MICS)
    # the comm meter counts the ring's sends, on the cp dimension, inside each host (cp is innermost but for tp):
    # per micro-batch and layer, keys and values go round cp - 1 times forward and again backward, and their
    # float32 gradient accumulator cp times: (2 (cp - 1) + cp) x (2 x rows x tokens/rank x kv heads x head_dim x 4)
    cp, m, layers, tokens = 2, RING_METER["microbatches"], 2, 32 // 2
    block = 2 * 1 * tokens * 4 * 8 * 4  # a micro-batch of one row; 4 kv heads of 8
    want = m * layers * (2 * (cp - 1) + cp) * block
    for rank, got in enumerate(ring):
        assert got["p2p"]["intra_bytes"] == want and got["p2p"]["inter_bytes"] == 0, (rank, got, want)
        assert got["cp"]["intra_bytes"] >= want, (rank, got)  # with the cp group's own all-reduces


CP_TP = [
    dict(name="cp2-tp2", distribution={"context_parallel_degree": 2, "tensor_parallel_degree": 2}, microbatches=2),
    dict(name="hf-llama-cp2-tp2", model="hf", distribution={"context_parallel_degree": 2, "tensor_parallel_degree": 2},
         microbatches=1),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_with_tp2_matches_the_single_process_oracle(tmp_path):
    from .launch import HF, run_on_two_hosts

    _assert_exact(run_on_two_hosts(_worker(), CP_TP, tmp_path, processes_per_host=4, hosts=1, preload=HF), CP_TP)
