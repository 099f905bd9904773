"""Says which process this is, so the test can count the processes a job started on each host.

A process launched by mpirun knows its rank from OMPI_COMM_WORLD_RANK (Open MPI), one launched by torchrun
from RANK; a plain `python train.py` has neither.
"""
import os
import time

host = os.environ["SM_CURRENT_HOST"]
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "none"))
local_rank = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("LOCAL_RANK", "none"))
print(f"proc host={host} pid={os.getpid()} rank={rank} local_rank={local_rank}", flush=True)
time.sleep(0.5)
