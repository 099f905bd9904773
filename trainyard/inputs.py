"""SageMaker's `sagemaker.inputs` import path."""
from trainyard.sdk.inputs import TrainingInput, FileSystemInput

__all__ = ["TrainingInput", "FileSystemInput"]
