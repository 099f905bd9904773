"""SageMaker's `sagemaker.model` import path."""
from trainyard.sdk.model import Model

__all__ = ["Model"]
