"""(1) The import paths of SageMaker Python SDK v2, with `sagemaker` replaced by `trainyard`."""
import importlib

import pytest

# (module, names) as SageMaker's docs and notebooks import them
IMPORTS = [
    ("trainyard.pytorch", ["PyTorch"]),                       # from sagemaker.pytorch import PyTorch
    ("trainyard.estimator", ["Estimator"]),                   # from sagemaker.estimator import Estimator
    ("trainyard.inputs", ["TrainingInput", "FileSystemInput"]),
    ("trainyard", ["Session", "get_execution_role"]),         # sagemaker.Session(), sagemaker.get_execution_role()
    ("trainyard.local", ["LocalSession"]),                    # from sagemaker.local import LocalSession
    ("trainyard.debugger", ["TensorBoardOutputConfig", "ProfilerConfig", "DebuggerHookConfig", "Rule",
                            "rule_configs"]),
    ("trainyard.huggingface", ["HuggingFace"]),               # from sagemaker.huggingface import HuggingFace
    ("trainyard.analytics", ["TrainingJobAnalytics"]),        # from sagemaker.analytics import TrainingJobAnalytics
    ("trainyard.pytorch.estimator", ["PyTorch"]),             # from sagemaker.pytorch.estimator import PyTorch
    ("trainyard.pytorch.model", ["PyTorchModel"]),
    ("trainyard.huggingface.estimator", ["HuggingFace"]),
    ("trainyard.huggingface.model", ["HuggingFaceModel"]),
    ("trainyard.model", ["Model"]),
    ("trainyard.exceptions", ["UnexpectedStatusException"]),
    ("trainyard.utils", ["name_from_base", "base_from_name", "unique_name_from_base", "sagemaker_timestamp"]),
    ("trainyard.s3", ["S3Uploader", "S3Downloader", "parse_s3_url", "s3_path_join"]),
    ("trainyard.image_uris", ["retrieve"]),
]


@pytest.mark.parametrize("module,names", IMPORTS, ids=[m for m, _ in IMPORTS])
def test_sagemaker_import_paths(module, names):
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"`from {module} import {', '.join(missing)}` fails"


def test_notebook_top_level_idioms():
    """Cells of huggingface/notebooks sagemaker/06_sagemaker_metrics copied verbatim:
    `import sagemaker.huggingface` then `from sagemaker import TrainingJobAnalytics`."""
    import trainyard.huggingface  # noqa: F401
    from trainyard import TrainingJobAnalytics  # noqa: F401
    from trainyard.analytics import TrainingJobAnalytics as Analytics

    assert TrainingJobAnalytics is Analytics
