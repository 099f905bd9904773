"""SageMaker's `sagemaker.huggingface` import path (and `sagemaker.huggingface.estimator`, `.model`)."""
from trainyard.sdk.frameworks import HuggingFace
from trainyard.sdk.model import HuggingFaceModel

__all__ = ["HuggingFace", "HuggingFaceModel"]
