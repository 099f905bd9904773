"""The torch-free vocabulary of parallel training, at the bottom of the package: the SDK, the planner, the
container and the engine all speak it, and it imports nothing of theirs.

    parallelism.py  `Parallelism`: a job's `distribution` typed (Trainyard's form and SageMaker's)
    dims.py         `ParallelDims`: the host-aware mesh a layout gives on a world (torch only to build it)
    layout.py       the layout checks (tensor parallelism against the heads, pipelines against the layers)
    shapes.py       a model's shapes, its parameter count, the one model-FLOPs formula and the one peak table
    presets.py      the built-in Transformer's `ModelConfig` and presets (`MODEL_CONFIGS`)

It imports only `trainyard.errors` (the errors a user sees), which sits below it.
"""
