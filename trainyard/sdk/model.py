"""SageMaker's `Model` (and `PyTorchModel`, `HuggingFaceModel`): a trained artifact and what would serve it, as
`estimator.create_model()` returns it. Trainyard trains and does not host endpoints: the object carries the
artifact's location (`model_data`, the job's `model.tar.gz`) and the serving arguments a notebook passes, so that
code which creates one and hands `model_data` on keeps working; `deploy()` (and the other hosting calls) refuse
with what to do instead."""
from __future__ import annotations

from typing import Any

_HOSTING = "Trainyard trains; it does not host endpoints. Load model_data ({data}) with your serving stack"


class Model:
    """`sagemaker.model.Model(image_uri, model_data, role, ...)`."""

    def __init__(self, image_uri: str | None = None, model_data: str | None = None, role: str | None = None,
                 predictor_cls=None, env: dict | None = None, name: str | None = None, vpc_config=None,
                 sagemaker_session=None, enable_network_isolation: bool = False, model_kms_key=None,
                 image_config=None, source_dir: str | None = None, code_location: str | None = None,
                 entry_point: str | None = None, container_log_level=None, dependencies=None, git_config=None,
                 **kwargs: Any):
        self.image_uri, self.model_data, self.role = image_uri, model_data, role
        self.predictor_cls, self.env, self.name, self.vpc_config = predictor_cls, dict(env or {}), name, vpc_config
        self.sagemaker_session = sagemaker_session
        self.entry_point, self.source_dir, self.dependencies = entry_point, source_dir, dependencies
        self.enable_network_isolation = enable_network_isolation
        self.other_arguments = kwargs  # e.g. framework_version, py_version, transformers_version

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_data={self.model_data!r}, image_uri={self.image_uri!r})"

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(_HOSTING.format(data=self.model_data))

    deploy = register = transformer = create = _refuse


class PyTorchModel(Model):
    """`sagemaker.pytorch.model.PyTorchModel(model_data, role, entry_point, framework_version, py_version, ...)`."""

    def __init__(self, model_data: str | None = None, role: str | None = None, entry_point: str | None = None,
                 framework_version: str | None = None, py_version: str | None = None, image_uri: str | None = None,
                 **kwargs: Any):
        super().__init__(image_uri=image_uri, model_data=model_data, role=role, entry_point=entry_point,
                         framework_version=framework_version, py_version=py_version, **kwargs)


class HuggingFaceModel(Model):
    """`sagemaker.huggingface.model.HuggingFaceModel(role, model_data, entry_point, transformers_version, ...)`."""

    def __init__(self, role: str | None = None, model_data: str | None = None, entry_point: str | None = None,
                 transformers_version: str | None = None, pytorch_version: str | None = None,
                 py_version: str | None = None, image_uri: str | None = None, **kwargs: Any):
        super().__init__(image_uri=image_uri, model_data=model_data, role=role, entry_point=entry_point,
                         transformers_version=transformers_version, pytorch_version=pytorch_version,
                         py_version=py_version, **kwargs)


__all__ = ["HuggingFaceModel", "Model", "PyTorchModel"]
