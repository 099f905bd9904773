"""(5) `requirements.txt` in source_dir is installed before the entry point runs (SageMaker's training
toolkit: `pip install -r requirements.txt` in the code folder, so relative paths in it resolve there), and
`dependencies=[...]` folders are shipped beside the entry point (sagemaker Framework docs: "The library
folders will be copied to SageMaker in the same folder where the entrypoint is copied").

No network: the requirement is a wheel built here, referenced by a relative path, and
environment={"PIP_NO_INDEX": "1"} keeps pip off any index.
"""
import subprocess
import sys

import pytest

from .helpers import MAX_RUN, LOCAL_ROLE, build_wheel, copy_scripts, read_tar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PACKAGE = "sm_tinydep_trainyard_test"


def _importable_here() -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({PACKAGE!r}) else 1)"
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_requirements_txt_and_dependencies(tmp_path):
    from trainyard.pytorch import PyTorch

    assert not _importable_here(), f"{PACKAGE} is already installed in this environment; uninstall it first"
    src = tmp_path / "code"
    copy_scripts(src, "uses_requirements.py")
    build_wheel(src / "wheels", PACKAGE, "0.1", "VALUE = 42\n")
    (src / "requirements.txt").write_text(f"./wheels/{PACKAGE}-0.1-py3-none-any.whl\n")
    common = tmp_path / "libs" / "common"
    common.mkdir(parents=True)
    (common / "__init__.py").write_text("")
    (common / "helpers.py").write_text("def greeting():\n    return 'hello-from-common'\n")

    estimator = PyTorch(
        entry_point="uses_requirements.py",
        source_dir=str(src),
        dependencies=[str(common)],
        role=LOCAL_ROLE,
        framework_version="2.0.0",
        py_version="py310",
        instance_count=1,
        instance_type="local",
        environment={"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        max_run=MAX_RUN,
    )
    try:
        estimator.fit()
        deps = read_tar(estimator.model_data)["deps.txt"].decode()
        assert deps == "VALUE=42 version=0.1 greeting=hello-from-common PIP_NO_INDEX=1", deps
    finally:
        # the job's installs belong to the job (a SageMaker container is thrown away), not to the
        # environment that launched it
        leaked = _importable_here()
        if leaked:  # undo what this test caused before failing
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", PACKAGE], check=False)
    assert not leaked, f"the job installed {PACKAGE} into the launching environment ({sys.prefix})"
