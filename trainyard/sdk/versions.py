"""`framework_version` / `py_version` (and the HF estimator's `transformers_version` / `pytorch_version`)
checked against what runs the job: this Python environment for local jobs, the Trainyard image for EC2.

SageMaker picks a prebuilt image by these versions; Trainyard has one image (trainyard/container/Dockerfile)
and local jobs run in the user's own environment. Another major version of transformers (the HF notebooks'
`transformers_version='4.26'` beside transformers 5, whose API differs) is installed into the job's
requirements overlay (trainyard/container/requirements.py `framework_pins`); any other version that differs
cannot be honoured: the job runs all the same and the mismatch is said once, with both versions.
"""
from __future__ import annotations

import sys
from importlib import metadata

from trainyard.container.requirements import framework_pins

# What trainyard/container/Dockerfile installs: torch pinned as in pyproject.toml, Ubuntu 24.04's python3
IMAGE_VERSIONS = {"torch": "2.13.0", "python": "3.12"}


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _matches(asked: str, have: str | None) -> bool:
    """'2.13' and '2.13.0' match 2.13.0; '1.11.0' does not."""
    if have is None:
        return False
    a = [p for p in asked.split(".") if p]
    h = have.split("+")[0].split(".")
    return a == h[: len(a)]


def check_framework(asked: dict[str, tuple[str, str | None]], py_version: str | None, *, local: bool,
                    source_dir: str | None = None) -> list[str]:
    """Notes for each version asked for that the job will not have (empty when all match), or that its overlay
    installs (`framework_pins`: another major version of transformers). `asked` maps the argument's name to
    (package, version): `{"framework_version": ("torch", "2.1")}`."""
    where = "this Python environment (local jobs run in it)" if local else "the Trainyard image"
    notes = []
    for argument, (package, version) in asked.items():
        if not version:
            continue
        have = installed(package) if local else IMAGE_VERSIONS.get(package)
        pins = framework_pins({argument: version}, source_dir, have=lambda _: have)
        if pins:
            found = f"has {package} {have}" if have else f"has no {package}"
            notes.append(f"{argument} {version!r}: {where} {found}; the job installs {pins[0]} into its "
                         "requirements overlay when it starts (with versions of the environment's packages that "
                         "fit it, or refused naming what it would break)")
        elif not _matches(version, have):
            found = f"{package} {have}" if have else f"no {package} (add it to requirements.txt)"
            notes.append(f"{argument} {version!r}: {where} has {found}; the job runs with that")
    if py_version:
        have_py = f"{sys.version_info.major}.{sys.version_info.minor}" if local else IMAGE_VERSIONS["python"]
        digits = py_version.removeprefix("py")
        want = f"{digits[0]}.{digits[1:]}" if digits.isdigit() and len(digits) >= 2 else digits
        if want != have_py and not (want == "3" and have_py.startswith("3.")):
            notes.append(f"py_version {py_version!r}: {where} has Python {have_py}; the job runs with that")
    return notes
