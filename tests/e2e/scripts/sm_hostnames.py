"""A SageMaker script that finds its peers by host name, as many do: resolves every name in SM_HOSTS, then
brings up torch.distributed itself at `tcp://<SM_HOSTS[0]>:<port>` with one rank per host (no torchrun
variables), all-reduces once, and the first host writes what every host saw to SM_MODEL_DIR."""
import datetime
import json
import os
import socket

import torch
import torch.distributed as dist

hosts = json.loads(os.environ["SM_HOSTS"])
current = os.environ["SM_CURRENT_HOST"]
resolved = {name: socket.gethostbyname(name) for name in hosts}
print(f"resolved {json.dumps(resolved, sort_keys=True)}", flush=True)

# torchrun's store listens on MASTER_PORT and the bandwidth probe's on MASTER_PORT + 1: take the next one.
# Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes every rank a client of a `tcp://` store (torchrun's
# own, it assumes); a script with a store of its own must unset it, or nobody listens on the port.
port = int(os.environ["MASTER_PORT"]) + 2
os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
rank = hosts.index(current)
dist.init_process_group("gloo", init_method=f"tcp://{hosts[0]}:{port}", rank=rank, world_size=len(hosts),
                        timeout=datetime.timedelta(seconds=90))
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
seen = [None] * len(hosts)
dist.all_gather_object(seen, {"host": current, "resolved": resolved})
if rank == 0:
    with open(os.path.join(os.environ["SM_MODEL_DIR"], "hostnames.json"), "w") as fh:
        json.dump({"sum": total.item(), "world": dist.get_world_size(), "seen": seen}, fh)
dist.destroy_process_group()
