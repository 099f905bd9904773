"""SageMaker's `sagemaker.image_uris` import path: `retrieve(...)` returns the Trainyard image."""
from trainyard.sdk.image_uris import retrieve

__all__ = ["retrieve"]
