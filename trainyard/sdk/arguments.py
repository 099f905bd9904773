"""The Estimator's arguments sorted before a spec is built: what each means on the backend that runs the job.

- `refuse_unsupported`: arguments asking for what Trainyard does not do (HyperPod recipes, heterogeneous
  clusters, Pipe input), refused naming the argument;
- `triage`: SageMaker arguments for services Trainyard does not run, EC2's on a local job, and
  `keep_alive_period_in_seconds` (SageMaker's warm pools, used by that backend only): which are used, which
  are accepted and named as without effect (`inert`), and the EC2 fields the spec gets;
- `source`: a git_config's clone (or an s3:// sourcedir.tar.gz, extracted) standing in for source_dir, and the
  dependencies inside it;
- `resolve_entry_point`, `check_entry_syntax` (at `fit()`), `check_dependencies`, `processes_per_host`,
  `launches_plain`, `auto_options`, `check_emulated_network`:
  the entry point as the job sees it, the dependencies, SageMaker's processes-per-host rule (and its plain
  `python` without a distribution), the planned form of `distribution` and where an emulated network can be;
- `notes`: what the Estimator says on stderr once built (the arguments without effect, named once).

Everything here but `source` (which clones) reads only its arguments and the files they name.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Any

from trainyard.container import codefetch
from trainyard.job import catalog, storage
from trainyard.errors import ConfigError
from trainyard.job.spec import MODULE_NAME, launches_plain  # noqa: F401 - one of this module's rules
from trainyard.sdk import gitsource
from trainyard.sdk.backends.local.netem import unavailable_reason

# SageMaker arguments that ask for a service Trainyard does not run, with the values that ask for nothing
# (those are not reported). Any other value is accepted and named once as having no effect.
INERT_UNLESS = {
    "keep_alive_period_in_seconds": (None, 0),
    "volume_kms_key": (None,),
    "output_kms_key": (None,),
    "rules": (None, [], ()),
    "debugger_hook_config": (None, False),
    "enable_network_isolation": (None, False),
    "encrypt_inter_container_traffic": (None, False),
    "training_repository_access_mode": (None,),
    "training_repository_credentials_provider_arn": (None,),
    "enable_infra_check": (None, False),
    "container_entry_point": (None,),
    "container_arguments": (None,),
    "disable_output_compression": (None, False),
    "enable_remote_debug": (None, False),
    "enable_session_tag_chaining": (None, False),
    "training_plan": (None,),
    "instance_placement_config": (None,),
    "compiler_config": (None,),
    "enable_sagemaker_metrics": (None, True, False),
}
# EC2 arguments that SageMaker's local mode ignores: accepted and reported for local jobs (image_uri but for
# instance_type "local": its hosts then run in containers of the image)
EC2_ONLY = ("image_uri", "subnets", "security_group_ids", "use_spot_instances", "max_wait", "volume_size",
            "capacity_reservation_id", "network")
EC2_DEFAULTS = {"image_uri": None, "subnets": None, "security_group_ids": None, "use_spot_instances": False,
                "max_wait": None, "volume_size": 30, "capacity_reservation_id": None, "network": None}
INPUT_MODES = ("File", "FastFile")


def asks_nothing(value: Any, defaults: tuple) -> bool:
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


def processes_per_host(itype: catalog.InstanceType, distribution: dict | None, given: int | None, *,
                       plain: bool = False) -> int:
    """SageMaker's rule: one process per GPU (or NeuronCore), one on a CPU host, unless `mpi` says how many
    (`processes_per_host`) or the `processes_per_host` argument does. A `plain` job (a script of the user's with
    no distribution that asks for a launcher: `launches_plain`) runs once per host unless the argument says more."""
    mpi = (distribution or {}).get("mpi") if isinstance(distribution, dict) else None
    from_mpi = mpi.get("processes_per_host") if isinstance(mpi, dict) and mpi.get("enabled") else None
    if from_mpi is not None and given is not None and from_mpi != given:
        raise ConfigError("processes_per_host", f"{given} contradicts distribution mpi.processes_per_host "
                                                f"({from_mpi}); give one of them")
    if given is not None:
        return given
    if from_mpi is not None:
        return from_mpi
    return 1 if plain else itype.processes_per_host



def check_dependencies(dependencies: object) -> tuple[str, ...]:
    if not dependencies:
        return ()
    if isinstance(dependencies, str) or not isinstance(dependencies, (list, tuple)):
        raise ConfigError("dependencies", f"expected a list of paths (folders or files), got {dependencies!r}")
    for d in dependencies:
        if not isinstance(d, str) or not os.path.exists(d):
            raise ConfigError("dependencies", f"{d!r} does not exist; give folders or files on this machine")
    names = [os.path.basename(os.path.normpath(d)) for d in dependencies]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError("dependencies", f"two dependencies would land at the same name {dup} in the code folder")
    return tuple(dependencies)


def resolve_entry_point(entry_point: object, source_dir: str | None) -> tuple[str | None, str, str]:
    """-> (file to package when there is no source_dir, entry point as the job sees it, 'script'|'module')."""
    if not isinstance(entry_point, str) or not entry_point.strip():
        raise ConfigError("entry_point", "missing: give a script ('train.py', inside source_dir) or an installed "
                                         "module ('trainyard.engine.train')")
    if source_dir is not None:
        if not isinstance(source_dir, str) or not os.path.isdir(source_dir):
            raise ConfigError("source_dir", f"{source_dir!r} is not a directory; give the folder holding {entry_point!r}")
        if os.path.isabs(entry_point) or ".." in entry_point.replace("\\", "/").split("/"):
            inside = os.path.relpath(os.path.realpath(os.path.join(source_dir, entry_point)),
                                     os.path.realpath(source_dir))
            if inside.startswith(".."):
                raise ConfigError("entry_point", f"{entry_point!r} is outside source_dir {source_dir!r}: the job runs "
                                                 "the code packaged from source_dir; give the script's path inside it "
                                                 "(e.g. 'train.py'), or drop source_dir to ship this file alone")
            entry_point = inside
        if os.path.isfile(os.path.join(source_dir, entry_point)):
            return None, entry_point, "script"
        if MODULE_NAME.match(entry_point) and not entry_point.endswith(".py"):
            return None, entry_point, "module"
        raise ConfigError("entry_point", f"{entry_point!r} is not a file in source_dir {source_dir!r}")
    if os.path.isfile(entry_point):
        return entry_point, os.path.basename(entry_point), "script"
    if MODULE_NAME.match(entry_point) and not entry_point.endswith(".py"):
        try:
            found = importlib.util.find_spec(entry_point) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return None, entry_point, "module"
    raise ConfigError("entry_point", f"{entry_point!r} is neither a file nor an installed module; pass source_dir "
                                     "with the script in it, or a module name such as 'trainyard.engine.train'")


def check_entry_syntax(path: str | None) -> None:
    """A Python entry point that does not compile is refused by `fit()` before anything is uploaded or launched (it
    used to fail once the job's hosts had started: 15 s locally, after the instances launched on EC2), naming the
    file, the line and Python's message."""
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return
    with open(path, "rb") as fh:
        source = fh.read()
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as e:  # IndentationError and TabError are SyntaxErrors
        where = f"{path}:{e.lineno}" if e.lineno else path
        raise ConfigError("entry_point", f"{where}: {type(e).__name__}: {e.msg}; fix the script, nothing was "
                                         "started") from None
    except ValueError as e:  # null bytes
        raise ConfigError("entry_point", f"{path}: {e}") from None


AUTO_KEYS = ("model", "seq_len", "global_batch_size", "micro_batch_size", "precision", "compile")


def auto_options(distribution: object) -> dict | None:
    """None unless `distribution` is "auto" ({}) or {"auto": {model, seq_len, global_batch_size, micro_batch_size,
    precision, compile}} (what the planner needs of a script of your own, or a Hugging Face model's config)."""
    if distribution == "auto":
        return {}
    if not (isinstance(distribution, dict) and "auto" in distribution):
        return None
    opts = distribution["auto"]
    if len(distribution) > 1 or not isinstance(opts, dict):
        raise ConfigError("distribution", 'the planned form is "auto" or {"auto": {"model": PRESET|CONFIG.json|DIR, '
                                          '"seq_len": N, "global_batch_size": N}} alone; got ' + repr(distribution))
    bad = [k for k in opts if k not in AUTO_KEYS]
    if bad:
        raise ConfigError("distribution", f"auto: unknown key(s) {bad}; known: {list(AUTO_KEYS)}")
    if not isinstance(opts.get("compile", False), bool):
        raise ConfigError("distribution", f"auto: compile must be true or false (a bool), got {opts['compile']!r}")
    return dict(opts)


def refuse_unsupported(*, training_recipe: object, recipe_overrides: object, instance_groups: object,
                       input_mode: object) -> None:
    """Arguments asking for what Trainyard does not do: a ConfigError naming the argument and what to give."""
    if training_recipe is not None or recipe_overrides:
        raise ConfigError("training_recipe", "SageMaker HyperPod recipes are not run by Trainyard; give an "
                                             "entry_point (e.g. 'trainyard.engine.train') and hyperparameters")
    if instance_groups:
        raise ConfigError("instance_groups", "heterogeneous clusters are not supported; give instance_type and "
                                             "instance_count")
    if input_mode not in INPUT_MODES:
        raise ConfigError("input_mode", f"{input_mode!r} is not supported: Trainyard stages channels as files; "
                                        "use 'File' or 'FastFile' (both give the script the same files)")


@dataclass(frozen=True)
class Triage:
    inert: tuple[str, ...]
    """Arguments accepted with no effect on this job, in the order given (named once on stderr)."""
    ec2: dict[str, Any]
    """The EC2 fields of the spec (their defaults on a local job, but image_uri)."""
    keep_alive: int | None
    """SageMaker's warm-pool period, for the SageMaker backend only."""


def triage(*, instance_type: str, backend: str | None, sagemaker_only: dict[str, Any], ec2: dict[str, Any],
           profiler_inert: bool = False) -> Triage:
    """Sort the SageMaker-only arguments (`sagemaker_only`, names of INERT_UNLESS) and the EC2 ones (`ec2`, the
    names of EC2_ONLY) for a job on `instance_type` and `backend`; `profiler_inert`: profiler_config asks for
    SageMaker's system monitor only."""
    rest = dict(sagemaker_only)
    keep_alive = rest.pop("keep_alive_period_in_seconds", None) if backend == "sagemaker" else None
    inert = [k for k, v in rest.items() if not asks_nothing(v, INERT_UNLESS[k])]
    if profiler_inert:
        inert.append("profiler_config")
    ec2 = {**EC2_DEFAULTS, **ec2}
    if catalog.lookup(instance_type).is_local:  # image_uri runs local hosts in containers of that image
        if ec2["image_uri"] is not None and instance_type != "local":
            raise ConfigError("image_uri", f"local hosts run in an image on instance_type 'local' (the CPU image); "
                                           f"{instance_type!r} runs them as processes of this machine: drop "
                                           "image_uri, or use instance_type='local'")
        inert += [k for k in EC2_ONLY if k != "image_uri" and ec2[k] != EC2_DEFAULTS[k] and ec2[k] != []]
        ec2 = {**EC2_DEFAULTS, "image_uri": ec2["image_uri"]}
    return Triage(inert=tuple(inert), ec2=ec2, keep_alive=keep_alive)


def source(git_config: dict[str, str] | None, source_dir: str | None, dependencies: list[str] | None, *,
           s3=None) -> tuple[str | None, list[str] | None, str | None]:
    """(source_dir, dependencies, the clone) with `git_config`'s repository cloned: source_dir and the
    dependencies are then paths inside the clone; an `s3://...tar.gz` source_dir (how JumpStart and SageMaker's
    examples pass their scripts) is read with the client `s3` and extracted into a folder of its own, which is
    then the source_dir; otherwise as given and no clone."""
    if isinstance(source_dir, str) and source_dir.startswith("s3://"):
        if git_config:
            raise ConfigError("source_dir", "an s3:// archive and git_config both name the code: give one")
        folder = source_archive(source_dir, s3)
        return folder, dependencies, folder
    if not git_config:
        return source_dir, dependencies, None
    repo = gitsource.clone(git_config)
    return (os.path.join(repo, source_dir) if source_dir else repo,
            [os.path.join(repo, d) for d in dependencies or []], repo)


def source_archive(uri: str, s3=None) -> str:
    """The `sourcedir.tar.gz` at `uri`, extracted (regular files and folders only, as a host extracts code:
    container/codefetch.py) into a new temporary folder; its path."""
    if not uri.endswith((".tar.gz", ".tgz")):
        raise ConfigError("source_dir", f"{uri!r}: an s3:// source_dir is the code as a .tar.gz (SageMaker's "
                                        "sourcedir.tar.gz); give the archive's URI, or a local folder")
    try:
        data = storage.get_bytes(uri, s3=s3)
    except Exception as e:  # noqa: BLE001 - botocore's ClientError (NoSuchKey, AccessDenied) and the like
        raise ConfigError("source_dir", f"{uri} could not be read: {type(e).__name__}: {e}") from None
    folder = tempfile.mkdtemp(prefix="trainyard-source-")
    try:
        codefetch.extract(data, folder)
    except (codefetch.UnsafeArchive, tarfile.TarError, OSError, EOFError) as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError("source_dir", f"{uri} is not a code archive Trainyard extracts: {e}") from None
    return folder


def check_emulated_network(local: bool) -> None:
    """`emulated_network` is for local jobs on a machine that can shape links (netem's `unavailable_reason`)."""
    if not local:
        raise ConfigError("emulated_network", "only for instance_type='local'")
    why = unavailable_reason()
    if why:
        raise ConfigError("emulated_network", why)


def notes(spec, said: list[str]) -> list[str]:
    """What the Estimator says on stderr once built: the version and profiler notes, then the arguments
    accepted with no effect on the backend that runs the job (named once)."""
    lines = [f"[trainyard] {note}" for note in said]
    if spec.inert:
        where = "local jobs" if catalog.lookup(spec.instance_type).is_local else {
            "sagemaker": "SageMaker jobs", "kubernetes": "Kubernetes jobs"}.get(spec.backend, "EC2 jobs")
        lines.append(f"[trainyard] accepted with no effect on {where}: {', '.join(spec.inert)} (docs/sdk.md says why)")
    return lines

