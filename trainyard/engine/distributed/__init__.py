"""The engine's parallelisms on torch.distributed. Importing any of them first defers torch._dynamo's import to
the first use that may compile (components/lazy_dynamo.py: 0.9 s of CPU in each training process that never
compiles)."""
from trainyard.engine.components import lazy_dynamo

lazy_dynamo.defer()
