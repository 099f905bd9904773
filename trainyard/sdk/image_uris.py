"""`trainyard.image_uris.retrieve` (SageMaker's `sagemaker.image_uris.retrieve`): the image a training job runs.

Trainyard has one training image for every framework estimator (trainyard/container/Dockerfile, PyTorch with the
engine); SageMaker's per-framework Deep Learning Containers are not used. `retrieve` returns the reference that
`trainyard image push` gives for this checkout's image: `<account>.dkr.ecr.<region>.amazonaws.com/trainyard:<tag>`
when an AWS session is at hand (`sagemaker_session=Session(boto_session=...)`), else the local `trainyard:<tag>`
(`trainyard image build`). The tag is the content hash of the image's build context (sdk/image.py), so it names
exactly what would be built; pushing it is `trainyard image push`'s job, not this function's.
"""
from __future__ import annotations

import os

import trainyard
from trainyard.errors import ConfigError
from trainyard.sdk import image

FRAMEWORKS = ("pytorch", "huggingface", "pytorch-training", "huggingface-training")


def retrieve(framework: str, region: str | None = None, version: str | None = None, py_version: str | None = None,
             instance_type: str | None = None, accelerator_type=None, image_scope: str | None = None,
             container_version=None, distribution=None, base_framework_version: str | None = None,
             training_compiler_config=None, model_id=None, model_version=None, sdk_version=None, inference_tool=None,
             serverless_inference_config=None, sagemaker_session=None, config_name=None) -> str:
    if framework not in FRAMEWORKS:
        raise ConfigError("framework", f"{framework!r}: Trainyard's image runs PyTorch (and Hugging Face on it); use "
                                       "'pytorch' or 'huggingface'")
    if image_scope not in (None, "training"):
        raise ConfigError("image_scope", f"{image_scope!r}: Trainyard trains and does not host endpoints; its one "
                                         "image is a training image (image_scope='training')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(trainyard.__file__)))
    if not os.path.isfile(os.path.join(root, image.DOCKERFILE)):
        raise ConfigError("image_uris.retrieve", f"this installation has no image build context ({image.DOCKERFILE} "
                                                 "beside the trainyard package): run `trainyard image push` in the "
                                                 "Trainyard repository and pass the reference it prints as image_uri")
    tag = image.image_tag(root)
    boto_session = getattr(sagemaker_session, "boto_session", None)
    if boto_session is None:
        return f"{image.DEFAULT_REPOSITORY}:{tag}"
    if region is not None and region != boto_session.region_name:
        import boto3

        boto_session = boto3.Session(region_name=region)
    return f"{image.default_registry(boto_session, image.DEFAULT_REPOSITORY)}:{tag}"


__all__ = ["FRAMEWORKS", "retrieve"]
