"""SageMaker's framework estimators on Trainyard's machinery: `PyTorch` and `HuggingFace`.

They are the `Estimator` with SageMaker's signatures (the version arguments first-class and checked
against what runs the job, sdk/versions.py). Trainyard has one image, with PyTorch; the Hugging Face
libraries come from the `trainyard[hf]` extra locally (or a `requirements.txt`).
"""
from __future__ import annotations

from trainyard.errors import ConfigError
from trainyard.sdk.estimator import Estimator


class PyTorch(Estimator):
    """`sagemaker.pytorch.PyTorch`: `PyTorch(entry_point, framework_version=..., py_version=..., ...)`."""

    _framework = {"name": "pytorch"}
    _model_class = "PyTorchModel"

    def __init__(self, entry_point: str | None = None, framework_version: str | None = None,
                 py_version: str | None = None, source_dir: str | None = None, hyperparameters=None,
                 image_uri: str | None = None, distribution: dict | None = None, **kwargs):
        super().__init__(entry_point=entry_point, source_dir=source_dir, hyperparameters=hyperparameters,
                         image_uri=image_uri, distribution=distribution, framework_version=framework_version,
                         py_version=py_version, **kwargs)

    def _model_versions(self) -> dict:
        return {"framework_version": self.framework_version, "py_version": self.py_version}


class HuggingFace(Estimator):
    """`sagemaker.huggingface.HuggingFace(py_version, entry_point, transformers_version=...,
    pytorch_version=..., ...)`."""

    _framework = {"name": "huggingface"}
    _model_class = "HuggingFaceModel"

    def __init__(self, py_version: str | None = None, entry_point: str | None = None,
                 transformers_version: str | None = None, tensorflow_version: str | None = None,
                 pytorch_version: str | None = None, source_dir: str | None = None, hyperparameters=None,
                 image_uri: str | None = None, distribution: dict | None = None, **kwargs):
        if tensorflow_version is not None:
            raise ConfigError("tensorflow_version", "Trainyard runs PyTorch; give pytorch_version instead")
        self.transformers_version, self.pytorch_version = transformers_version, pytorch_version
        super().__init__(entry_point=entry_point, source_dir=source_dir, hyperparameters=hyperparameters,
                         image_uri=image_uri, distribution=distribution, py_version=py_version, **kwargs)

    def _model_versions(self) -> dict:
        return {"transformers_version": self.transformers_version, "pytorch_version": self.pytorch_version,
                "py_version": self.py_version}

    def _versions(self) -> dict[str, tuple[str, str | None]]:
        return {"transformers_version": ("transformers", self.transformers_version),
                "pytorch_version": ("torch", self.pytorch_version)}
