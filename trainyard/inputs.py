"""SageMaker's `sagemaker.inputs` import path."""
from trainyard.sdk.inputs import FileSystemInput, ShuffleConfig, TrainingInput

__all__ = ["FileSystemInput", "ShuffleConfig", "TrainingInput"]
