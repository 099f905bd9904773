"""Worker for tests/engine/test_sdc.py (torchrun, gloo): every rank builds the same small model and checks its
replicas; for each case in argv[1] (JSON: name, flip: the rank whose copy gets a flipped bit, or null; groups: the
replica groups, default all ranks one group), rank 0 writes {case name: [what each rank's check raised, "" for nothing]} to argv[2]."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from trainyard.engine.components.process_exit import exit_now
from trainyard.engine.components.sdc import DataCorruption, SdcCheck, inject_from_env


def run(case: dict, check: SdcCheck, marker: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))  # the same weights on every rank
    check.check(model, 1)  # identical copies: nothing raised
    env = {"TRAINYARD_SDC_INJECT": f"{case['flip']}:2:{marker}"} if case["flip"] is not None else {}
    assert inject_from_env(model, dist.get_rank(), 2, env) == (dist.get_rank() == case["flip"])
    dist.barrier()
    assert not inject_from_env(model, dist.get_rank(), 2, env)  # once: the marker exists now
    try:
        check.check(model, 2)
    except DataCorruption as e:
        return str(e)
    return ""


def main() -> None:
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    hosts = [f"algo-{1 + r // 2}" for r in range(world)]
    checks = {}  # by the case's replica groups (each made once: a collective)
    results = {}
    for case in cases:
        groups = case.get("groups") or [list(range(world))]
        key = json.dumps(groups)
        if key not in checks:
            checks[key] = SdcCheck(groups, hosts, torch.device("cpu"))
        said: list = [None] * world
        dist.all_gather_object(said, run(case, checks[key], os.path.join(os.path.dirname(out), case["name"])))
        results[case["name"]] = said
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)
