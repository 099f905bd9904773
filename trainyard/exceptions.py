"""SageMaker's `sagemaker.exceptions` import path: what a notebook catches around `fit()` and `wait()`."""
from trainyard.errors import ConfigError, JobFailedError, UnexpectedStatusException

__all__ = ["ConfigError", "JobFailedError", "UnexpectedStatusException"]
