"""SageMaker's `sagemaker.estimator` import path."""
from trainyard.sdk.estimator import Estimator

__all__ = ["Estimator"]
