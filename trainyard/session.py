"""SageMaker's `sagemaker.session` import path."""
from trainyard.sdk.session import Session, get_execution_role

__all__ = ["Session", "get_execution_role"]
