"""The planner: memory, step time, tokens/s, MFU and cost of every layout of a job before it runs
(`trainyard plan`, `Estimator.plan()`, `distribution="auto"`; docs/plan.md). Torch-free."""
from trainyard.job.plan.layout import Layout
from trainyard.job.plan.planner import Plan, PlannedLayout, evaluate, layouts, plan
from trainyard.parallel.shapes import ModelShape, resolve_model

__all__ = ["Layout", "ModelShape", "Plan", "PlannedLayout", "evaluate", "layouts", "plan", "resolve_model"]
