"""Worker for the sharded weights-load tests (2 emulated hosts x 2 processes, two torchrun agents).

For every case in argv[1] (JSON list: name, source, layout "fsdp4" or "fsdp2xtp2", the model config; "mixtral":
true for a Mixtral whose folder transformers wrote with its experts one by one, compared with the model of seed 0
that wrote it) it builds the HF model with another seed than the one that wrote `source`, shards it (TP colwise q/k/v/gate/up
and rowwise o/down over "tp", then FSDP2 per decoder layer and the root over "dp"), loads with
`load_pretrained_into`, and compares every parameter, gathered with `full_tensor()`, with the file's
tensor. Rank 0 writes {name: {"max_diff", "bytes_read" (per rank), "tensors", "placements"}} to argv[2].
"""
import json
import sys

import torch
import torch.distributed as dist
from fsspec.core import url_to_fs
from safetensors.torch import load as load_safetensors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from trainyard.engine.components.checkpoint import storage_options
from trainyard.engine.models.hf.weights import load_pretrained_into
from trainyard.engine.components.process_exit import exit_now

TP_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
           "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
           "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def sharded_model(case: dict) -> LlamaForCausalLM:
    torch.manual_seed(1000 + dist.get_rank())  # other values than the files hold, on every rank
    model = _build(case)
    world = dist.get_world_size()
    if case["layout"] == "fsdp2xtp2":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], TP_PLAN)
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _build(case: dict):
    if case.get("mixtral"):
        return MixtralForCausalLM(MixtralConfig(**case["config"]))
    return LlamaForCausalLM(LlamaConfig(**case["config"]))


def file_tensors(source: str) -> dict[str, torch.Tensor]:
    fs, root = url_to_fs(source, **storage_options(source))
    tensors = {}
    for path in fs.glob(f"{root}/*.safetensors"):
        tensors.update(load_safetensors(fs.cat_file(path)))
    return tensors


def run(case: dict) -> dict:
    model = sharded_model(case)
    report = load_pretrained_into(model, case["source"], model_type=model.config.model_type)
    if case.get("mixtral"):
        torch.manual_seed(0)
        expected = _build(case).state_dict()
    else:
        expected = file_tensors(case["source"])
    worst, placements = 0.0, set()
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            placements.add(str(tuple(param.placements)))
        full = param.full_tensor() if isinstance(param, DTensor) else param
        want = expected[name] if name in expected else expected["model.embed_tokens.weight"]  # tied lm_head
        worst = max(worst, (full.float() - want.float()).abs().max().item())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (worst, report["bytes_read"], report["tensors"], sorted(placements)))
    return {"max_diff": max(e[0] for e in every), "bytes_read": [e[1] for e in every],
            "tensors": every[0][2], "placements": sorted({p for e in every for p in e[3]})}


def main() -> None:
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    results = {case["name"]: run(case) for case in cases}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
