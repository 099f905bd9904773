"""SageMaker's `sagemaker.huggingface.estimator` import path."""
from trainyard.sdk.frameworks import HuggingFace

__all__ = ["HuggingFace"]
