"""SageMaker's `sagemaker.analytics` import path."""
from trainyard.sdk.analytics import TrainingJobAnalytics

__all__ = ["TrainingJobAnalytics"]
