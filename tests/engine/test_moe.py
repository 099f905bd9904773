"""The built-in mixture of experts and expert parallelism: the routing's maths in one process (the output against a
per-token reference, grouped GEMM against the loop, capacity, the load-balancing loss's gradient and weight,
auxiliary-loss-free balancing), the shapes and the refusals, and the oracle tests on gloo (slow)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trainyard.engine.distributed.experts import aux_weight
from trainyard.engine.models.llama import moe
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, init_weights
from trainyard.parallel.parallelism import Parallelism

TINY = MODEL_CONFIGS["moe-tiny"]


def _layer(**kw) -> moe.MoE:
    torch.manual_seed(0)
    from trainyard.engine.models.llama.model import FeedForward

    cfg = dataclasses.replace(TINY, **kw)
    layer = moe.MoE(cfg, FeedForward(cfg.dim, cfg.moe_hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def test_the_output_is_each_token_s_gate_weighted_experts_plus_the_shared_one():
    layer = _layer(aux_loss_coef=0.0)
    x = torch.randn(2, 5, TINY.dim)
    got = layer(x)
    t = x.reshape(-1, TINY.dim)
    probs = (t @ layer.router.weight.t()).softmax(-1)
    want = []
    for i in range(t.shape[0]):
        top = probs[i].topk(TINY.top_k)
        gates = top.values / top.values.sum()
        e = layer.experts
        y = sum(g * _swiglu(t[i], e.w1[j], e.w2[j], e.w3[j]) for g, j in zip(gates, top.indices.tolist()))
        want.append(y + layer.shared(t[i]))
    assert torch.allclose(got.reshape(-1, TINY.dim), torch.stack(want), rtol=1e-5, atol=1e-4)
    raw = _layer(aux_loss_coef=0.0, norm_topk=False)  # the softmax weights themselves: a different output
    assert not torch.allclose(raw(x), got, atol=1e-3)


def test_grouped_gemm_equals_the_loop_forward_and_backward(monkeypatch):
    """The path CUDA bf16 takes (torch._grouped_mm) against the CPU loop, with an expert that gets no token."""
    experts = moe.Experts(3, 16, 24)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(7, 16)
    counts, grad = [3, 0, 4], torch.randn(7, 16)
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(moe, "USE_GROUPED_MM", grouped)
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        out.backward(grad)
        results.append((out.detach(), xi.grad, [p.grad.clone() for p in experts.parameters()]))
    (a, ga, pa), (b, gb, pb) = results
    assert torch.allclose(a, b, atol=1e-4) and torch.allclose(ga, gb, atol=1e-4)
    assert all(torch.allclose(u, v, atol=1e-4) for u, v in zip(pa, pb))
    assert all(float(p[1].abs().max()) == 0.0 for p in pa)  # the idle expert: a zero gradient, not none


def test_capacity_drops_an_expert_s_assignments_past_it_in_token_order():
    layer = _layer(aux_loss_coef=0.0, capacity_factor=0.5, n_shared_experts=0)
    with torch.no_grad():  # every token prefers expert 0, then expert 1
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 3.0, 2.0
    x = torch.randn(1, 8, TINY.dim).abs() + 0.1  # feature 0 positive: the same order for every token
    out = layer(x)
    capacity = 2  # ceil(0.5 x 8 tokens x top 2 / 4 experts)
    stats = moe.router_stats(torch.nn.ModuleList([layer]))
    assert stats["dropped_assignments"] == 2 * (8 - capacity)
    # the first `capacity` tokens got both experts, the others nothing (no shared expert)
    assert out[0, :capacity].abs().sum() > 0 and out[0, capacity:].abs().sum() == 0
    assert stats["expert_load"][:2] == [0.5, 0.5]  # the load counts the router's choice, dropped or not


def test_the_load_balancing_loss_joins_the_gradient_weighted_like_the_micro_batch():
    x = torch.randn(2, 6, TINY.dim)
    ref = _layer(aux_loss_coef=0.0)
    layer = _layer(aux_loss_coef=0.3)
    with aux_weight(0.5):
        out = layer(x)
    out.square().mean().mul(0.5).backward()
    # by hand: the same output with no auxiliary loss, plus the loss's own term, both at weight 0.5
    out_ref = ref(x)
    t = x.reshape(-1, TINY.dim)
    probs = (t @ ref.router.weight.t()).softmax(-1)
    counts = torch.bincount(probs.topk(TINY.top_k).indices.flatten(), minlength=TINY.n_experts).float()
    aux = 0.3 * TINY.n_experts * (counts / (t.shape[0] * TINY.top_k) * probs.mean(0)).sum()
    (0.5 * (out_ref.square().mean() + aux)).backward()
    assert torch.allclose(out, out_ref)
    assert torch.allclose(layer.router.weight.grad, ref.router.weight.grad, atol=1e-6)
    assert not torch.allclose(layer.router.weight.grad, torch.zeros_like(ref.router.weight.grad))
    stats = moe.router_stats(torch.nn.ModuleList([layer]))
    assert stats["aux_loss"] == pytest.approx(aux.item(), rel=1e-5)


def test_bias_balancing_moves_the_bias_towards_the_mean_load_and_steers_the_choice():
    layer = _layer(aux_loss_coef=0.0, bias_update_rate=0.1)
    model = torch.nn.ModuleList([layer])
    x = torch.randn(4, 8, TINY.dim)
    layer(x)
    load = layer.step_load.clone()
    moe.balance(model)
    assert torch.equal(layer.expert_bias, 0.1 * torch.sign(load.mean() - load).float())
    assert float(layer.step_load.sum()) == 0  # counted again from the next step
    with torch.no_grad():
        layer.expert_bias.zero_()
        layer.expert_bias[3] = 10.0  # a large bias wins the choice for every token
        _, idx, gates = layer._route(x.reshape(-1, TINY.dim))
    assert (idx == 3).any(-1).all() and torch.allclose(gates.sum(-1), torch.ones(idx.shape[0]))


def test_router_statistics_of_a_model_step():
    model = build_model(TINY)
    init_weights(model, 1, device="cpu")
    assert moe.router_stats(build_model(MODEL_CONFIGS["tiny"])) is None
    model(torch.randint(0, TINY.vocab_size, (2, 16))).float().mean().backward()
    stats = moe.router_stats(model)
    assert sum(stats["expert_load"]) == pytest.approx(1.0, abs=1e-3) and stats["expert_imbalance"] >= 1.0
    assert stats["dropped_assignments"] == 0 and stats["aux_loss"] > 0
    assert moe.router_stats(model)["expert_load"] == [0.0] * 4  # read once: counted again from there


def test_the_presets_shapes_count_total_and_active_parameters():
    from trainyard.parallel.shapes import from_preset

    mixtral = from_preset("mixtral-8x7b")  # Mistral's published 46.7B total, 12.9B active
    assert round(mixtral.total_params / 1e9, 1) == 46.7
    assert round((mixtral.matmul_params + mixtral.embedding_params) / 1e9, 1) == 12.9
    tiny = from_preset("moe-tiny")
    assert tiny.total_params == sum(p.numel() for p in build_model(TINY).parameters())


@pytest.mark.parametrize("config", ["MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig", "OlmoeConfig"])
def test_the_planner_counts_an_hf_mixture_of_experts_as_built(config):
    """The shape the planner reads from an HF MoE model (its default config, built on the meta device: no memory)
    counts its parameters: exactly for Mixtral, within the per-head norms, biases and Qwen2-MoE's shared-expert gate
    (1.4e-5) for the others; read as dense, Mixtral 8x7B was 7.2B parameters."""
    import transformers

    from trainyard.parallel.shapes import from_module

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)())
    built = sum(p.numel() for p in model.parameters())
    shape = from_module(model)
    assert shape.n_experts > 1 and shape.top_k >= 1
    assert shape.total_params == (built if config == "MixtralConfig" else pytest.approx(built, rel=5e-5))


@pytest.mark.parametrize("kw,text", [
    ({"n_experts": 4, "top_k": 5}, "top_k must be an integer in 1..n_experts (4), got 5"),
    ({"n_experts": 4, "capacity_factor": 0}, "capacity_factor must be positive or None (dropless), got 0"),
    ({"n_experts": -1}, "n_experts must be an integer >= 0, got -1"),
])
def test_a_bad_mixture_of_experts_config_is_refused_by_name(kw, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        dataclasses.replace(MODEL_CONFIGS["tiny"], **kw)


@pytest.mark.parametrize("model,distribution,text", [
    ("tiny", {"expert_parallel_degree": 2}, "expert_parallel_degree 2: tiny is dense (no experts to spread)"),
    ("moe-tiny", {"expert_parallel_degree": 4, "mics": {"partition_group_size": 1}}, None),
    ("moe-tiny", {"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, None),
    ("moe-tiny", {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2}, None),
])
def test_the_trainer_checks_experts_against_the_layout_before_anything_starts(model, distribution, text):
    from trainyard.engine.config import TrainConfig, reconcile_distribution

    cfg = TrainConfig(model=model, seq_len=32, global_batch_size=8, micro_batch_size=2)
    par = Parallelism.parse(distribution)
    if text is None:
        assert reconcile_distribution(cfg, par, world_size=4).model == model
        return
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
        reconcile_distribution(cfg, par, world_size=4)


def _hf_moe(model_type: str, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_hf_mixtures_of_experts_qualify_by_a_small_run_or_are_refused_by_name(monkeypatch):
    """Mixtral's, Qwen3-MoE's, Qwen2-MoE's (with its shared expert) and OLMoE's packed experts compute the same
    logits with Trainyard's experts forward; GPT-OSS's (biased, interleaved) are refused, and so is a class whose
    experts forward differs (here: the activation swapped behind the check's back)."""
    from types import SimpleNamespace

    from trainyard.engine.models.hf import moe as hf_moe, selfcheck

    monkeypatch.setattr(selfcheck, "_verdicts", {})
    for model_type, kw in [("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
                           ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              head_dim=16)),
                           ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=64)),
                           ("olmoe", dict(num_experts=4, num_experts_per_tok=2, eos_token_id=2, pad_token_id=1))]:
        model = _hf_moe(model_type, **kw)
        assert len(hf_moe.experts_modules(model)) == 2 and hf_moe._difference(model) is None, model_type
    layout = SimpleNamespace(ep=2)
    with pytest.raises(ValueError, match=r"expert_parallel_degree 2: the engine cannot spread the experts of "
                                         r"GptOssForCausalLM: they are not packed as gate_up_proj / down_proj"):
        hf_moe.apply_moe(_hf_moe("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16), layout, None,
                         lambda: layout)
    monkeypatch.setattr(hf_moe, "_compute", lambda module, x, counts: torch.zeros_like(x))  # a wrong forward
    with pytest.raises(ValueError, match=r"the engine cannot spread the experts of MixtralForCausalLM: a small "
                                         r"MixtralForCausalLM with Trainyard's experts forward differs from its own"):
        hf_moe.apply_moe(_hf_moe("mixtral", num_local_experts=4, num_experts_per_tok=2), layout, None, lambda: layout)


class _TwoRanks:
    """torch.distributed as `switch_loss` sees it on one of two ranks: the all-reduce records what this rank sends
    and adds what the other rank sent (`other`)."""

    def __init__(self, other: torch.Tensor | None = None):
        self.other, self.sent = other, None

    def get_world_size(self, group=None):
        return 2

    def all_reduce(self, t, group=None):
        self.sent = t.clone()
        if self.other is not None:
            t += self.other


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def test_an_hf_load_balancing_loss_counted_over_two_ranks_is_the_whole_batch_s(model_type, monkeypatch):
    """Each family's own load_balancing_loss_func is switch_loss on one process; with the rows split over two
    ranks, the mean of the ranks' losses and of their gradients is the family's own on all the rows (each
    rank's own loss alone is not: the loss is not linear in the tokens)."""
    import importlib

    from trainyard.engine.models.hf import moe as hf_moe

    family = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    own = family.load_balancing_loss_func
    assert hf_moe._aux_difference(own) is None
    torch.manual_seed(1)
    logits = [torch.randn(16, 6, requires_grad=True) for _ in range(3)]  # 3 layers, 16 rows
    want = own(tuple(logits), 6, 2)
    want.backward()
    expected = [g.grad.clone() for g in logits]
    halves = [tuple(g[r * 8:(r + 1) * 8] for g in logits) for r in range(2)]
    for g in logits:
        g.grad = None
    sent = []  # each rank's own counts and rows: what its all-reduce sends
    for r in range(2):
        fake = _TwoRanks()
        monkeypatch.setattr(hf_moe, "dist", fake)
        hf_moe.switch_loss(halves[r], 6, 2, group="g")
        sent.append(fake.sent)
    losses = []
    for r in range(2):
        monkeypatch.setattr(hf_moe, "dist", _TwoRanks(other=sent[1 - r]))
        losses.append(hf_moe.switch_loss(halves[r], 6, 2, group="g"))
    mean = (losses[0] + losses[1]) / 2
    mean.backward()
    assert torch.allclose(mean, want, rtol=1e-6), (mean, want)
    assert all(torch.allclose(g.grad, e, rtol=1e-5, atol=1e-8) for g, e in zip(logits, expected))
    alone = (own(halves[0], 6, 2) + own(halves[1], 6, 2)) / 2
    assert not torch.allclose(alone, want, rtol=1e-3), "the check cannot tell the rank-local loss from the global"


def test_an_hf_load_balancing_loss_that_cannot_be_counted_over_the_ranks_is_refused_by_name(monkeypatch):
    """Under pipeline parallelism (its stages never run the forward that computes it), and for a family whose
    loss is not Switch Transformer's, `output_router_logits` is refused by name; on one process the family's own
    function stays."""
    from types import SimpleNamespace

    from transformers.models.mixtral import modeling_mixtral

    from trainyard.engine.models.hf import moe as hf_moe, selfcheck

    monkeypatch.setattr(selfcheck, "_verdicts", {})
    model = _hf_moe("mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    with pytest.raises(ValueError, match=r"output_router_logits with pipeline_parallel_degree 2: MixtralForCausalLM's "
                                         r"load-balancing loss is computed by its own forward, which no pipeline stage "
                                         r"runs; set output_router_logits=False"):
        hf_moe.apply_moe(model, SimpleNamespace(pp=2, ep=1), "group", None)
    own = modeling_mixtral.load_balancing_loss_func
    hf_moe.apply_moe(model, SimpleNamespace(pp=1, ep=1), None, None)  # one process: nothing changes
    assert modeling_mixtral.load_balancing_loss_func is own
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", lambda g, n, k, m=None: own(g, n, k, m) * 2)
    with pytest.raises(ValueError, match=r"output_router_logits: the engine cannot count MixtralForCausalLM's "
                                         r"load-balancing loss over the ranks' tokens \(its load_balancing_loss_func "
                                         r"differs from Switch Transformer's loss by 5.00e-01"):
        hf_moe.apply_moe(model, SimpleNamespace(pp=1, ep=1), "group", None)


def test_expert_parallel_groups_are_consecutive_data_parallel_ranks():
    dims = Parallelism.parse({"expert_parallel_degree": 2, "mics": {"partition_group_size": 2}}).dims(
        world_size=8, processes_per_host=2)
    assert dims.ep_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.expert_replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError,
                       match=r"ep \(3\) must divide the data-parallel degree 4.*ep is expert_parallel_degree"):
        Parallelism.parse({"expert_parallel_degree": 3}).dims(world_size=4, processes_per_host=2)
    # under context parallelism an ep group is at one cp index; the ranks holding the same experts span them all
    cp = Parallelism.parse({"expert_parallel_degree": 2, "context_parallel_degree": 2}).dims(
        world_size=8, processes_per_host=4)
    assert sorted(cp.ep_groups()) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert cp.expert_replica_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # under tensor parallelism too (each tp rank routes its own sequence shard)
    tp = Parallelism.parse({"expert_parallel_degree": 2, "tensor_parallel_degree": 2}).dims(
        world_size=8, processes_per_host=4)
    assert sorted(tp.ep_groups()) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tp.expert_replica_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert Parallelism.parse({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "expert_parallel_degree": 2}}}}).ep == 2


# --- the oracle: gloo, fp32, against one unsharded process ------------------------------------------------------

def _worker():
    import os

    return os.path.join(os.path.dirname(__file__), "moe_worker.py")


def _assert_exact(results: dict, names) -> None:
    assert set(results) == set(names), results
    for name in names:
        errors = {k: v for k, v in results[name].items() if k != "stats"}
        assert set(errors) == {"loss", "grad_norm", "weights"}, (name, errors)
        assert all(e <= 1e-5 for e in errors.values()), (name, errors)
        stats = results[name]["stats"]
        if not name.startswith("hf-"):  # the built-in model's routing; an HF model's router is its own
            assert len(stats["expert_load"]) == TINY.n_experts and stats["aux_loss"] > 0, (name, stats)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep2_alone_matches_the_single_process_oracle(tmp_path):
    """1 host x 2: each rank holds 2 of the 4 experts (the rest of the model ZeRO-3 over the 2); a dense model
    under expert parallelism is refused by name."""
    from .launch import HF, run_on_two_hosts

    cases = [dict(name="ep2-accum2", distribution={"expert_parallel_degree": 2}, microbatches=2),
             dict(name="dense-ep2", dense=True, refused=True, distribution={"expert_parallel_degree": 2},
                  microbatches=1),
             dict(name="meter", meter=True, distribution={"expert_parallel_degree": 2}, microbatches=2),
             # the mixture of experts under context parallelism: the load-balancing loss counts both ranks' tokens
             dict(name="moe-cp2", distribution={"context_parallel_degree": 2}, microbatches=2),
             dict(name="hf-mixtral-ep2", hf="mixtral", distribution={"expert_parallel_degree": 2}, microbatches=2)]
    results = run_on_two_hosts(_worker(), cases, tmp_path, processes_per_host=2, hosts=1, preload=HF)
    assert "expert_parallel_degree 2: llama has no mixture-of-experts layers" in results.pop("dense-ep2")
    # the comm meter against the formula: with every token routed to experts 0 and 1 (rank 0's), rank 1 sends its
    # T x top_k rows to rank 0 and rank 0 sends them back, forward, and the same again backward (the gradients):
    # each rank sends 2 x T x k x dim x 4 bytes per layer and micro-batch, plus the count exchange (the E / ep
    # counts of the other rank's experts, int64)
    meter = results.pop("meter")
    t, k, m, layers = 1 * 32, 2, 2, TINY.n_layers
    want = m * layers * (2 * t * k * TINY.dim * 4 + TINY.n_experts // 2 * 8)
    for rank, got in enumerate(meter):
        assert got["all_to_all"]["intra_bytes"] == want and got["all_to_all"]["inter_bytes"] == 0, (rank, got, want)
        assert got["ep"]["intra_bytes"] >= want, (rank, got)  # here the ep group is also the partition group
    _assert_exact(results, ["ep2-accum2", "moe-cp2", "hf-mixtral-ep2"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep2_with_mics_on_two_hosts_matches_the_oracle_and_resumes_across_ep_degrees(tmp_path):
    """2 hosts x 2: EP 2 x MiCS p=2 (2 copies of each expert, one per ep group; the dense parts in 2 partition
    groups of 2), EP 4, PP 2 x EP 2, EP 2 x CP 2, EP 2 x TP 2 and TP 2 x MiCS (resumed from it), an HF Qwen3-MoE under EP 2 x MiCS with its own load-balancing loss (counted
    over the 4 ranks' tokens); an HF model's load-balancing loss under pipeline parallelism and its experts under
    tensor parallelism are refused; checkpoints saved on EP 2 resume on EP 1 and
    the reverse, on the uninterrupted curve."""
    from .launch import HF, run_on_two_hosts

    on2, on1, on_tp = (str(tmp_path / f"saved-on-{name}") for name in ("ep2", "ep1", "ep2-tp2"))
    mics = {"mics": {"partition_group_size": 2}}
    cases = [dict(name="ep2-mics-p2", distribution={"expert_parallel_degree": 2, **mics}, microbatches=2, save=on2),
             dict(name="ep1-resumed-from-ep2", distribution=mics, microbatches=2, resume=on2),
             dict(name="ep1-mics-p2", distribution=mics, microbatches=1, save=on1),
             dict(name="ep2-resumed-from-ep1", distribution={"expert_parallel_degree": 2, **mics}, microbatches=1,
                  resume=on1),
             dict(name="ep4", distribution={"expert_parallel_degree": 4}, microbatches=1),
             dict(name="hf-qwen3-moe-ep2-mics-p2", hf="qwen3_moe", distribution={"expert_parallel_degree": 2, **mics},
                  microbatches=2),
             # a pipeline stage per host, each host's 2 ranks spreading that stage's experts
             dict(name="pp2-ep2", distribution={"pipeline_parallel_degree": 2, "expert_parallel_degree": 2},
                  microbatches=2),
             # each host's 2 ranks split the sequences (cp innermost); an ep group spans the hosts at one cp index
             dict(name="ep2-cp2", distribution={"expert_parallel_degree": 2, "context_parallel_degree": 2},
                  microbatches=2),
             # tensor parallelism inside each host: each rank routes its sequence shard, the experts spread over the
             # hosts (ep 2), or whole on every rank (ep 1) with the rest in MiCS groups of 2 spanning the hosts; the
             # second resumes the first's checkpoint (the same 2 data-parallel ranks: the same micro-batches)
             dict(name="ep2-tp2", distribution={"expert_parallel_degree": 2, "tensor_parallel_degree": 2},
                  microbatches=2, save=on_tp),
             dict(name="tp2-mics-p2-resumed-from-ep2-tp2", distribution={"tensor_parallel_degree": 2, **mics},
                  microbatches=2, resume=on_tp),
             # an HF model's own load-balancing loss is computed by a forward no pipeline stage runs; its experts
             # take no tensor parallelism
             dict(name="hf-mixtral-pp2", hf="mixtral", refused=True, distribution={"pipeline_parallel_degree": 2},
                  microbatches=2),
             dict(name="hf-mixtral-tp2", hf="mixtral", refused=True,
                  distribution={"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, microbatches=1)]
    results = run_on_two_hosts(_worker(), cases, tmp_path, processes_per_host=2, hosts=2, preload=HF)
    assert results.pop("hf-mixtral-pp2").startswith("output_router_logits with pipeline_parallel_degree 2: "
                                                    "MixtralForCausalLM's load-balancing loss")
    assert results.pop("hf-mixtral-tp2").startswith("tensor_parallel_degree 2 with MixtralForCausalLM's 4 experts: "
                                                    "a Hugging Face mixture of experts has no tensor-parallel plan")
    del cases[-2:]
    _assert_exact(results, [c["name"] for c in cases])
