"""torch._dynamo deferred (trainyard/engine/components/lazy_dynamo.py): an eager training process never imports
the package, computes bit for bit what it computes with the package imported, and the first use that may
compile gets torch's own path back. Each case runs in a fresh interpreter: this one has imported dynamo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# one process of FSDP2 over gloo: optimizer steps, activation checkpointing, DTensor, a DCP state dict
EAGER_STEPS = """
import json, os, sys, tempfile
import torch, torch.distributed as dist
import trainyard.engine.distributed  # defers, as every engine process does
from trainyard.engine.components import lazy_dynamo
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
fully_shard(model[0]); fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(3):
    x = torch.randn(5, 8)
    loss = checkpoint(model, x, use_reentrant=False).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
model_sd, optim_sd = get_state_dict(model, opt)
opt.load_state_dict(opt.state_dict())
weights = [p.full_tensor().flatten().tolist() for p in model.parameters()]
print(json.dumps({"deferred": lazy_dynamo.deferred(), "eval_frame": "torch._dynamo.eval_frame" in sys.modules,
                  "weights": weights, "loss": loss.item(), "keys": sorted(model_sd)}))
dist.destroy_process_group()
"""

COMPILE_AFTER = """
import json, sys
import torch
from trainyard.engine.components import lazy_dynamo
covered = lazy_dynamo.defer()
import torch._dynamo.config as config_alone  # alone: the package stays deferred
alone_deferred = lazy_dynamo.deferred()
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
x = torch.randn(6, 4)
eager = model(x)
compiled = torch.compile(model, backend="eager")(x)  # imports the real package: torch's path comes back
opt.step()
import torch._compile
print(json.dumps({
    "covered": covered, "alone_deferred": alone_deferred, "deferred_after": lazy_dynamo.deferred(),
    "same_config": torch._dynamo.config is config_alone, "equal": torch.equal(eager, compiled),
    "decorator_restored": torch._disable_dynamo is torch._compile._disable_dynamo
                          and torch._disable_dynamo.__module__ == "torch._compile",
    "caches_left": len(lazy_dynamo._deferred)}))
"""

SUBMODULE = """
import json, sys
import torch
from trainyard.engine.components import lazy_dynamo
lazy_dynamo.defer()
import torch._dynamo.utils as utils  # any other submodule: the real package first, the submodule executed once
import torch._dynamo.convert_frame as convert_frame
counted_here = convert_frame.counters is utils.counters  # executed twice, they would be two counters
torch._dynamo.reset(); utils.counters.clear()
torch.compile(lambda x: torch.sin(x) + 1, backend="eager")(torch.ones(3))
print(json.dumps({"deferred": lazy_dynamo.deferred(), "same": sys.modules["torch._dynamo.utils"] is utils
                  and torch._dynamo.utils is utils and counted_here, "real": type(sys.modules["torch._dynamo"]).__name__,
                  "spec": type(utils.__spec__.loader).__name__, "graphs": utils.counters["stats"]["unique_graphs"]}))
"""


# what a user's module does while deferred: a disable decorator, another name, a bare find_spec; then a compile
USERS_OWN = """
import importlib.util, json, sys
import torch
from trainyard.engine.components import lazy_dynamo
lazy_dynamo.defer()

@torch.compiler.disable
def kept_out(x):
    return x.sin()

importlib.util.find_spec("torch._dynamo.utils")  # no import follows
import torch._dynamo.utils as utils, torch._dynamo.convert_frame as convert_frame
lookup = callable(torch._dynamo.trace_rules.lookup)  # from here, the real module's
seen = []

def backend(gm, example_inputs):
    seen.append(sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
    return gm

torch.compile(lambda x: kept_out(x) + 1, backend=backend)(torch.ones(3))
print(json.dumps({"graphs": seen, "lookup": lookup, "once": convert_frame.counters is utils.counters}))
"""


def _run(code: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_eager_fsdp2_process_never_imports_dynamo_and_computes_the_same_bits():
    deferred = _run(EAGER_STEPS)
    eager = _run(EAGER_STEPS, TRAINYARD_EAGER_DYNAMO="1")
    assert deferred["deferred"] and not deferred["eval_frame"], "something still imported torch._dynamo"
    assert not eager["deferred"] and eager["eval_frame"], "TRAINYARD_EAGER_DYNAMO=1 must leave torch alone"
    assert deferred["weights"] == eager["weights"] and deferred["loss"] == eager["loss"]
    assert deferred["keys"] == eager["keys"]


def test_the_first_compile_gets_torchs_own_path_back():
    r = _run(COMPILE_AFTER)
    assert r["covered"] > 50, r  # the optimizers' and others' wrapped functions
    assert r["alone_deferred"], "torch._dynamo.config must import without the package"
    assert not r["deferred_after"] and r["decorator_restored"] and r["caches_left"] == 0, r
    assert r["same_config"], "the config module imported alone must be the one the package uses"
    assert r["equal"]


def test_importing_another_submodule_loads_the_package_once():
    r = _run(SUBMODULE)
    assert r == {"deferred": False, "same": True, "real": "module", "spec": "SourceFileLoader", "graphs": 1}


def test_what_a_user_asks_of_dynamo_while_deferred_is_the_real_package():
    """A `@torch.compiler.disable` made while deferred is still one for a later compile (the stand-in answers
    `disable` only for torch's own call sites), other names are the real ones, and a bare find_spec executes
    nothing twice: the same as with dynamo imported."""
    r = _run(USERS_OWN)
    assert r == _run(USERS_OWN, TRAINYARD_EAGER_DYNAMO="1"), r
    assert r["graphs"] and all("sin" not in " ".join(g) for g in r["graphs"]), r  # kept out of the graph
    assert r["lookup"] and r["once"], r
