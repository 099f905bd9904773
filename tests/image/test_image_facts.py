"""The CPU image as built: its Python, torch and Trainyard, its entry points, and nothing of the machine that
built it (no credentials, pip configuration or host paths in its history, environment or files)."""
import json
import subprocess
import sys

import pytest

from trainyard.sdk import image, image_base, store

from .conftest import BUILD_SECONDS, run_in

pytestmark = pytest.mark.slow


def test_the_image_holds_python_torch_and_this_trainyard_and_nothing_of_the_builder(engine, cpu_image):
    import torch

    import trainyard

    _, path = engine
    facts = run_in(engine, cpu_image, "python", "-c", "import json, sys, torch, trainyard, trainyard.container.node; "
                   "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, "
                   "'trainyard': trainyard.__version__}))")
    assert facts.returncode == 0, facts.stderr
    got = json.loads(facts.stdout.strip().splitlines()[-1])
    assert got["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert got["torch"].split("+")[0] == torch.__version__.split("+")[0] == image.TORCH_VERSION
    assert got["trainyard"] == trainyard.__version__
    entry = run_in(engine, cpu_image, "sh", "-c", "command -v train && python -m trainyard.container.node --help | head -1")
    assert entry.returncode == 0 and "/usr/local/bin/train" in entry.stdout, entry.stderr
    # what the build machine had must not be in the image
    creds = store.credentials(store.store_root())
    secrets = [creds.access_key_id, creds.secret_access_key, store.trainyard_home()]
    settings = image_base.pip_settings()
    local_paths = [v for k, v in settings.items() if k in ("find-links", "cert", "constraint")]
    history = subprocess.run([path, "history", "--no-trunc", "--format", "{{.CreatedBy}}", cpu_image],
                             capture_output=True, text=True, check=True).stdout
    env = json.loads(subprocess.run([path, "image", "inspect", "--format", "{{json .Config.Env}}", cpu_image],
                                    capture_output=True, text=True, check=True).stdout)
    for text, what in ((history, "history"), ("\n".join(env), "environment")):
        for s in [*secrets, *local_paths, "find-links", "AWS_"]:
            assert s not in text, (what, s)
    files = run_in(engine, cpu_image, "sh", "-c",
                   "find / -xdev \\( -name pip.conf -o -name credentials.json -o -name 'torch-*.whl' \\) -print; "
                   "find /run/trainyard-pip -type f 2>/dev/null; ls -d /opt/wheels /root/.trainyard 2>/dev/null; "
                   "pip config list; echo done")
    lines = files.stdout.split()
    assert lines[-1] == "done" and all(line.startswith(":env:") for line in lines[:-1]), files.stdout
    assert not any(k in files.stdout for k in ("find-links", "index-url", "cert", "constraint")), files.stdout
    size = json.loads(subprocess.run([path, "image", "inspect", "--format", "{{json .Size}}", cpu_image],
                                     capture_output=True, text=True, check=True).stdout)
    print(f"{cpu_image}: {size / 2**30:.2f} GiB, built (or found) in {BUILD_SECONDS.get(cpu_image, 0):.0f} s")
    assert 0.3 * 2**30 < size < 3 * 2**30

