"""SageMaker's `sagemaker.local` import path (local mode)."""
from trainyard.sdk.session import LocalSession

__all__ = ["LocalSession"]
