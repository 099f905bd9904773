"""Imports a package that only requirements.txt (next to this script) installs, and a library folder
that only `dependencies=[...]` ships next to this script."""
import importlib.metadata
import os

import sm_tinydep_trainyard_test  # installed from requirements.txt before this script starts
from common.helpers import greeting  # copied beside the entry point by dependencies=[".../common"]

line = (f"VALUE={sm_tinydep_trainyard_test.VALUE} "
        f"version={importlib.metadata.version('sm_tinydep_trainyard_test')} greeting={greeting()} "
        f"PIP_NO_INDEX={os.environ.get('PIP_NO_INDEX')}")
print(line, flush=True)
with open(os.path.join(os.environ["SM_MODEL_DIR"], "deps.txt"), "w") as fh:
    fh.write(line)
