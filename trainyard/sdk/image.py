"""The training image: a content-derived tag, a local build with docker (or buildah, or podman), a push to
ECR that never pushes the same content twice.

    ref = build(".")                  # "trainyard:0.1.0-3f2a9c1b7d4e", built unless the builder has it already
    ref = build(".", variant="cpu")   # "trainyard:0.1.0-cpu-...": the CPU variant on a Debian base (image_base.py)
    uri = push(ref)       # "<account>.dkr.ecr.<region>.amazonaws.com/trainyard:0.1.0-3f2a9c1b7d4e"
    uri = publish(".")    # both, and neither when ECR has that tag already (`trainyard image push`)

The CPU variant is built with podman or buildah (preferred for it: they mount this machine's pip configuration
into the build, read-only and for the install steps only), or docker; its base is made once per machine. With
podman and buildah the build runs with the host network, the image format that keeps SHELL, and open-file
limits no higher than this process may set (root here cannot always raise them to what podman asks).

The tag is `<SDK version>-<12 hex>`: a SHA-256 over the SDK version, the Dockerfile and every file the
build context sends to the builder once `.dockerignore` has removed what it names (paths in a stable
order, each with its content, its executable bit, or a symlink's target). Same content, same tag; any
change to what goes into the image, another tag. Files that `.dockerignore` keeps out (tests, docs, caches,
.git, .venv) never change the tag, so editing them costs no rebuild and no push.

`.dockerignore` is read with Docker's rules (which are not .gitignore's): one pattern per line relative to
the context's root, `#` comments, `!` exceptions, `*` and `?` within one path element, `**` across any
number of them, the last matching pattern wins, and a pattern that matches a folder excludes what it holds.

Every command goes through `runner` (subprocess.run's signature), so tests record them. Builds of one context
folder take turns (an exclusive lock on the folder itself): a second `build` of the same checkout waits for the
first and then, of the same variant, finds its image instead of building it again beside it.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Mapping

import trainyard
from trainyard.errors import ConfigError, ImageError
from trainyard.sdk import image_base
from trainyard.sdk.backends.local import containers

DOCKERFILE = "trainyard/container/Dockerfile"  # relative to the build context (the repository root)
DOCKERIGNORE = ".dockerignore"
DEFAULT_REPOSITORY = "trainyard"
BUILDERS = ("docker", "buildah", "podman")  # in order of preference (the CPU variant: podman, buildah, docker)
VARIANTS = ("gpu", "cpu")
BUILDER_ENV = "TRAINYARD_IMAGE_BUILDER"  # names one of BUILDERS to use it even when another comes first
TORCH_VERSION = "2.13.0"  # the Dockerfile's ARG TORCH_VERSION and pyproject's pin (tests check all three)
TAG_HEX = 12  # 48 bits of the digest: a collision among one project's images is not a practical concern
_ECR_HOST = re.compile(r"^(?P<acct>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?$")
_DAEMON_DOWN = ("Cannot connect to the Docker daemon", "permission denied while trying to connect",
                "Is the docker daemon running")

Runner = Callable[..., "subprocess.CompletedProcess"]


def _say(msg: str) -> None:
    print(f"trainyard image: {msg}", flush=True)


def sdk_version() -> str:
    return trainyard.__version__


# -- .dockerignore ---------------------------------------------------------------------------------


class _Pattern:
    __slots__ = ("text", "exception", "regex", "prefix")

    def __init__(self, text: str, exception: bool):
        self.text, self.exception = text, exception
        try:
            self.regex = re.compile(_translate(text))
        except re.error as e:  # Docker refuses such a file too
            raise ImageError(f"{DOCKERIGNORE}: pattern {text!r} is not valid ({e})") from None
        # the literal start of the pattern (up to its first wildcard): which folders it may reach into
        self.prefix = re.split(r"[*?\[\\]", text, maxsplit=1)[0]

    def matches(self, rel: str) -> bool:
        return self.regex.match(rel) is not None


def _translate(pattern: str) -> str:
    """A Docker ignore pattern as a regular expression over `/`-separated relative paths, built the way
    Docker's pattern matcher builds its own: `*` and `?` stay within one path element, `**` spans any
    number of them (none included), `\\` escapes the next character, the regular-expression characters
    that have no meaning in a path pattern are escaped, and the rest (character classes `[...]`
    included) passes through as it is."""
    out, i, n = ["^"], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if i + 1 < n and pattern[i + 1] == "*":
                i += 2
                if i < n and pattern[i] == "/":  # `**/` is `**`
                    i += 1
                out.append(".*" if i >= n else "(?:.*/)?")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c in ".+()|{}$":
            out.append("\\" + c)
        elif c == "\\":
            i += 1
            out.append(re.escape(pattern[i]) if i < n else "\\\\")
        else:
            out.append(c)
        i += 1
    out.append("$")
    return "".join(out)


def _clean(pattern: str) -> str:
    """Docker's clean-up of a pattern: path.Clean, no leading `/` (the context's root is the root)."""
    absolute = pattern.startswith("/")
    parts: list[str] = []
    for part in pattern.split("/"):
        if part in ("", "."):
            continue
        if part == ".." and parts and parts[-1] != "..":
            parts.pop()
            continue
        if part == ".." and absolute:
            continue
        parts.append(part)
    return "/".join(parts) or "."


def read_ignore_patterns(text: str) -> list[_Pattern]:
    patterns = []
    for raw in text.splitlines():
        line = raw.lstrip("\ufeff")
        if line.startswith("#"):
            continue
        line = line.strip()
        if not line:
            continue
        exception = line.startswith("!")
        if exception:
            line = line[1:].strip()
        if not line:
            continue
        patterns.append(_Pattern(_clean(line), exception))
    return patterns


class IgnoreRules:
    """The rules of one `.dockerignore`: `excluded(rel)` as Docker's matcher answers it."""

    def __init__(self, text: str = ""):
        self.patterns = read_ignore_patterns(text)

    @classmethod
    def for_context(cls, context_dir: str) -> "IgnoreRules":
        path = os.path.join(context_dir, DOCKERIGNORE)
        if not os.path.isfile(path):
            return cls("")
        with open(path, encoding="utf-8", errors="replace") as fh:
            return cls(fh.read())

    def excluded(self, rel: str) -> bool:
        """Whether the context's file or folder `rel` (`/`-separated) stays out of the build context."""
        parents = rel.split("/")[:-1]
        candidates = ["/".join(parents[: i + 1]) for i in range(len(parents))] + [rel]
        matched = False
        for p in self.patterns:
            if p.exception != matched:  # an exclusion only matters while included, an exception while excluded
                continue
            if any(p.matches(c) for c in candidates):
                matched = not p.exception
        return matched

    def may_reinclude_under(self, rel_dir: str) -> bool:
        """Whether some `!` pattern could bring back a path under the excluded folder `rel_dir`."""
        prefix = rel_dir + "/"
        return any(p.exception and (p.prefix.startswith(prefix) or prefix.startswith(p.prefix))
                   for p in self.patterns)


def context_files(context_dir: str) -> list[str]:
    """The files (and symlinks) the build context sends, as sorted `/`-separated relative paths."""
    root = os.path.abspath(context_dir)
    rules = IgnoreRules.for_context(root)
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if os.path.islink(os.path.join(dirpath, d)):  # sent as a link, not followed
                if not rules.excluded(rel):
                    out.append(rel)
            elif not rules.excluded(rel) or rules.may_reinclude_under(rel):
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            full = os.path.join(dirpath, f)
            # regular files and links only: a socket or a FIFO left in a work tree is no content (and a FIFO
            # would block the read that hashes it)
            if (os.path.islink(full) or os.path.isfile(full)) and not rules.excluded(rel):
                out.append(rel)
    return sorted(out)


# -- the tag ---------------------------------------------------------------------------------------


def _file_digest(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _entry(path: str) -> bytes:
    if os.path.islink(path):
        return b"link " + os.readlink(path).encode()
    executable = os.stat(path).st_mode & 0o111
    return f"file {'x' if executable else '-'} {_file_digest(path)}".encode()


def image_tag(context_dir: str, dockerfile: str = DOCKERFILE, *, version: str | None = None, variant: str = "gpu",
              extra: bytes = b"") -> str:
    """`<version>-<12 hex>` (`<version>-cpu-<12 hex>` for the CPU variant) from the SDK version, the Dockerfile,
    the context's files after `.dockerignore` and `extra` (the CPU variant: its base and pinned versions).
    `dockerfile` is relative to the context (or absolute)."""
    root = os.path.abspath(context_dir)
    version = version or sdk_version()
    df = dockerfile if os.path.isabs(dockerfile) else os.path.join(root, dockerfile)
    if not os.path.isfile(df):
        raise ImageError(f"no Dockerfile at {df}: build from the Trainyard repository's root (the context), "
                         f"whose {DOCKERFILE} defines the image")
    h = hashlib.sha256()
    h.update(f"trainyard {version}\n".encode())
    # the Dockerfile counts whether or not the context also sends it (.dockerignore may name it)
    h.update(b"dockerfile\0" + _entry(df) + b"\n")
    for rel in context_files(root):
        h.update(rel.encode() + b"\0" + _entry(os.path.join(root, rel)) + b"\n")
    if variant != "gpu":
        h.update(f"variant {variant}\n".encode() + extra)
    # a tag allows [A-Za-z0-9_.-]: a local version label such as 0.1.0+dirty becomes 0.1.0-dirty
    middle = "" if variant == "gpu" else f"{variant}-"
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', version)}-{middle}{h.hexdigest()[:TAG_HEX]}"


# -- builders --------------------------------------------------------------------------------------


def find_builder(which: Callable[[str], str | None] = shutil.which,
                 environ: Mapping[str, str] | None = None, *, order: tuple[str, ...] = BUILDERS,
                 runner: Runner | None = None) -> tuple[str, list[str]]:
    """(name, argv prefix) of the image builder to use: the first of `order` on PATH (docker, else buildah, else
    podman), skipping a docker whose daemon cannot be reached when `runner` is given and another builder is
    there; `TRAINYARD_IMAGE_BUILDER=buildah` picks one. Raises ImageError naming what to install."""
    env = os.environ if environ is None else environ
    wanted = env.get(BUILDER_ENV, "").strip()
    if wanted:
        if wanted not in BUILDERS:
            raise ImageError(f"{BUILDER_ENV}={wanted!r}: must be one of {', '.join(BUILDERS)}")
        path = which(wanted)
        if not path:
            raise ImageError(f"{BUILDER_ENV}={wanted} but {wanted} is not on PATH: install it or unset {BUILDER_ENV}")
        return wanted, [path]
    found = [(name, path) for name in order if (path := which(name))]
    for i, (name, path) in enumerate(found):
        if name == "docker" and runner is not None and i + 1 < len(found):
            probe = runner([path, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                           check=False)
            if probe.returncode != 0:
                _say(f"docker's daemon cannot be reached: building with {found[i + 1][0]}")
                continue
        return name, [path]
    raise ImageError(
        "no image builder found: building the training image needs docker, buildah or podman on PATH, "
        "and none of them is. Install one of them: Docker Engine (https://docs.docker.com/engine/install/), "
        "or buildah, which needs no daemon (`sudo apt-get install buildah` on Debian/Ubuntu, "
        "`sudo dnf install buildah` on Fedora/Amazon Linux), or podman (`sudo apt-get install podman`); "
        f"then run `trainyard image build` again ({BUILDER_ENV} picks one when several are installed)")


def _inspect_command(name: str, base: list[str], ref: str) -> list[str]:
    if name == "buildah":
        return [*base, "inspect", "--type", "image", ref]
    return [*base, "image", "inspect", ref]


def _check_daemon(name: str, result) -> None:
    err = (getattr(result, "stderr", "") or "")
    if isinstance(err, bytes):
        err = err.decode(errors="replace")
    if name == "docker" and any(s in err for s in _DAEMON_DOWN):
        first = err.strip().splitlines()[0] if err.strip() else ""
        raise ImageError(f"docker is installed but its daemon cannot be reached ({first}). Start it "
                         "(`sudo systemctl start docker`), or add yourself to the `docker` group, or install "
                         f"buildah, which needs no daemon (`sudo apt-get install buildah`; {BUILDER_ENV}=buildah "
                         "picks it while docker is installed)")


def image_exists(name: str, base: list[str], ref: str, runner: Runner = subprocess.run) -> bool:
    """Whether the builder's local store has `ref`."""
    r = runner(_inspect_command(name, base, ref), capture_output=True, text=True, check=False)
    if r.returncode == 0:
        return True
    _check_daemon(name, r)
    return False


def build_command(name: str, base: list[str], context_dir: str, ref: str, dockerfile: str,
                  version: str, *, build_args: Mapping[str, str] | None = None, extra: list[str] = ()) -> list[str]:
    df = dockerfile if os.path.isabs(dockerfile) else os.path.join(context_dir, dockerfile)
    cmd = [*base, "build"]
    if name == "buildah":
        cmd.append("--layers")  # reuse unchanged layers as docker does (buildah squashes them by default)
    args = [a for k, v in (build_args or {}).items() for a in ("--build-arg", f"{k}={v}")]
    return [*cmd, *extra, "--file", df, "--tag", ref,
            "--build-arg", f"TRAINYARD_VERSION={version}", *args,
            "--label", f"org.opencontainers.image.version={version}",
            "--label", f"{containers.SOURCE_LABEL}={containers.source_digest(os.path.join(context_dir, 'trainyard'))}",
            context_dir]


def _daemonless_options(name: str, path: str, runner: Runner) -> list[str]:
    """podman and buildah: the host network (no bridge needed to reach the package index), the docker image
    format (OCI drops SHELL, and with it pipefail), open-file limits this process may set, and runc where crun
    would fail (sdk/backends/local/containers.py)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = hard if hard != resource.RLIM_INFINITY else 1048576
    soft = soft if soft != resource.RLIM_INFINITY else hard
    try:
        runtime = containers.runtime_options(name, path, runner)
    except ConfigError as e:
        raise ImageError(str(e)) from None
    return ["--network", "host", "--format", "docker", "--ulimit", f"nofile={soft}:{hard}", *runtime]


def _context_version(context_dir: str) -> str | None:
    path = os.path.join(context_dir, "pyproject.toml")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        return tomllib.load(fh).get("project", {}).get("version")


def _check_context_version(root: str) -> str:
    """The SDK's version, after checking that the context's pyproject.toml (when it has one) says the same."""
    version = sdk_version()
    theirs = _context_version(root)
    if theirs is not None and theirs != version:
        raise ImageError(f"the context at {root} is Trainyard {theirs} and this SDK is {version}: the image must "
                         "hold the SDK's own version (the contract between them). Build with the SDK installed "
                         "from that checkout (`pip install -e .` there)")
    return version


def build(context_dir: str = ".", repository: str = DEFAULT_REPOSITORY, *, dockerfile: str = DOCKERFILE,
          variant: str = "gpu", runner: Runner = subprocess.run, which: Callable[[str], str | None] = shutil.which,
          pip_settings: dict[str, str] | None = None) -> str:
    """Build the image (`variant` "gpu" or "cpu") of `context_dir` as `<repository>:<image_tag>`, unless the
    builder has it already. Returns the reference."""
    if variant not in VARIANTS:
        raise ImageError(f"variant {variant!r}: one of {', '.join(VARIANTS)}")
    root = os.path.abspath(context_dir)
    version = _check_context_version(root)
    with _turn(root):
        return _build_variant(root, repository, dockerfile, variant, version, runner, which, pip_settings)


@contextlib.contextmanager
def _turn(root: str):
    """Hold the build turn of the context folder `root` (flock on the folder itself: nothing is written there, and
    the lock goes with the process however it ends); where the folder cannot be locked, go on without a turn."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _say(f"another build of {root} is under way: waiting for it")
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without flock
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _build_variant(root: str, repository: str, dockerfile: str, variant: str, version: str, runner: Runner,
                   which: Callable[[str], str | None], pip_settings: dict[str, str] | None) -> str:
    if variant == "gpu":
        tag = image_tag(root, dockerfile, version=version)
        name, base = find_builder(which)
        return _build(name, base, root, f"{repository}:{tag}", dockerfile, version, runner)
    name, base = find_builder(which, order=("podman", "buildah", "docker"), runner=runner)
    base_ref = image_base.ensure_base(name, base, runner, which, exists=lambda r: image_exists(name, base, r, runner))
    mounts = image_base.pip_mounts(TORCH_VERSION, pip_settings) if name != "docker" else None
    try:
        pinned = open(os.path.join(mounts.folder, "constraints.txt"), "rb").read() if mounts else b""
        tag = image_tag(root, dockerfile, version=version, variant="cpu", extra=base_ref.encode() + b"\0" + pinned)
        build_args = {"VARIANT": "cpu", "CPU_BASE": base_ref}
        extra: list[str] = []
        if mounts is not None:
            extra = [*_daemonless_options(name, base[0], runner), *mounts.args()]
            if mounts.torch_wheel_here:
                build_args["TORCH_INDEX"] = "pip"  # this machine's pip has the CPU wheel: no PyTorch index
        return _build(name, base, root, f"{repository}:{tag}", dockerfile, version, runner, build_args, extra)
    finally:
        if mounts is not None:
            mounts.close()


def _build(name: str, base: list[str], root: str, ref: str, dockerfile: str, version: str, runner: Runner,
           build_args: Mapping[str, str] | None = None, extra: list[str] = ()) -> str:
    if image_exists(name, base, ref, runner):
        _say(f"{ref} exists already ({name}): same content, not rebuilt")
        return ref
    _say(f"building {ref} with {name} from {root}")
    r = runner(build_command(name, base, root, ref, dockerfile, version, build_args=build_args, extra=list(extra)),
               check=False)
    if r.returncode != 0:
        raise ImageError(f"{name} build of {ref} failed with exit status {r.returncode}; its output is above")
    _say(f"built {ref}")
    return ref


# -- push ------------------------------------------------------------------------------------------


def split_ref(ref: str) -> tuple[str, str]:
    """`trainyard:0.1.0-abc` -> ("trainyard", "0.1.0-abc"); a registry's port is not a tag."""
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag or not name or not tag:
        raise ImageError(f"{ref!r} has no tag: give the image as <repository>:<tag>, as `trainyard image build` "
                         "printed it")
    return name, tag


def ecr_host(registry_uri: str) -> tuple[str, str] | None:
    """(account, region) when `registry_uri`'s host is an ECR registry, else None."""
    m = _ECR_HOST.match(registry_uri.split("/", 1)[0])
    return (m["acct"], m["region"]) if m else None


def default_registry(session, repository: str) -> str:
    """`<account>.dkr.ecr.<region>.amazonaws.com/<repository>` of the session's account and region."""
    region = session.region_name
    if not region:
        raise ImageError("no AWS region to push to: set AWS_DEFAULT_REGION (or a profile's region) or pass the "
                         "registry URI (<account>.dkr.ecr.<region>.amazonaws.com/<repository>)")
    account = session.client("sts", region_name=region).get_caller_identity()["Account"]
    return f"{account}.dkr.ecr.{region}.amazonaws.com/{repository}"


def _run(runner: Runner, cmd: list[str], what: str, **kw) -> None:
    r = runner(cmd, check=False, **kw)
    if r.returncode != 0:
        err = getattr(r, "stderr", None)
        detail = f": {err.strip()}" if isinstance(err, str) and err.strip() else ""
        raise ImageError(f"{what} failed with exit status {r.returncode}{detail}")


def push(image_ref: str, *, registry_uri: str | None = None, session=None, runner: Runner = subprocess.run,
         which: Callable[[str], str | None] = shutil.which) -> str:
    """Push the local `image_ref` (`trainyard:<tag>`) to `registry_uri` (`<host>/<repository>`, default: ECR of
    the session's account and region, same repository name) under the same tag. In ECR an image whose tag
    is there already is not pushed again. Returns the remote reference."""
    local_repo, tag = split_ref(image_ref)
    registry_uri, session = _registry(registry_uri, session, local_repo.rsplit("/", 1)[-1])
    host, repository = registry_uri.split("/", 1)
    remote = f"{registry_uri}:{tag}"
    name, base = find_builder(which)
    ecr = ecr_host(registry_uri)
    if ecr is None:
        _say(f"{host} is not ECR: pushing with the {name} login you have; whether {tag} is there already is "
             "not checked")
    else:
        account, region = ecr
        client = session.client("ecr", region_name=region)
        if _ecr_has_tag(client, account, region, repository, tag):
            _say(f"{remote} is in ECR already: same content, not pushed again")
            return remote
        _ecr_login(client, account, host, name, base, runner)
    _run(runner, [*base, "tag", image_ref, remote], f"{name} tag {image_ref} {remote}")
    _say(f"pushing {remote}")
    _run(runner, [*base, "push", remote], f"{name} push {remote}")
    _say(f"pushed {remote}")
    return remote


def _registry(registry_uri: str | None, session, repository: str):
    """(registry URI checked and without a trailing `/`, a boto3 session) for a push."""
    if session is None:
        import boto3

        session = boto3.Session()
    if registry_uri is None:
        registry_uri = default_registry(session, repository)
    registry_uri = registry_uri.rstrip("/")
    if "/" not in registry_uri:
        raise ImageError(f"registry URI {registry_uri!r} names no repository: <host>/<repository>, such as "
                         "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard")
    if re.search(r"[:@]", registry_uri.split("/", 1)[1]):
        raise ImageError(f"registry URI {registry_uri!r} names an image, not a repository: leave out the tag "
                         "(the image keeps its own, derived from its content)")
    return registry_uri, session


def publish(context_dir: str = ".", repository: str = DEFAULT_REPOSITORY, *, registry_uri: str | None = None,
            session=None, dockerfile: str = DOCKERFILE, runner: Runner = subprocess.run,
            which: Callable[[str], str | None] = shutil.which) -> str:
    """`trainyard image push`: the image of `context_dir` in the registry, built and pushed only when
    needed. When ECR has this content's tag already, nothing is built and nothing is pushed. Returns the
    remote reference."""
    root = os.path.abspath(context_dir)
    tag = image_tag(root, dockerfile, version=_check_context_version(root))
    registry_uri, session = _registry(registry_uri, session, repository.rsplit("/", 1)[-1])
    ecr = ecr_host(registry_uri)
    if ecr is not None:
        account, region = ecr
        client = session.client("ecr", region_name=region)
        if _ecr_has_tag(client, account, region, registry_uri.split("/", 1)[1], tag):
            _say(f"{registry_uri}:{tag} is in ECR already: same content, neither built nor pushed again")
            return f"{registry_uri}:{tag}"
    ref = build(root, repository, dockerfile=dockerfile, runner=runner, which=which)
    return push(ref, registry_uri=registry_uri, session=session, runner=runner, which=which)


def _ecr_has_tag(client, account: str, region: str, repository: str, tag: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        out = client.describe_images(registryId=account, repositoryName=repository, imageIds=[{"imageTag": tag}])
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code == "ImageNotFoundException":
            return False
        if code == "RepositoryNotFoundException":
            raise ImageError(
                f"ECR repository {repository!r} does not exist in account {account} ({region}). Create it with "
                f"`aws ecr create-repository --repository-name {repository} --region {region}`, or apply the "
                "Terraform cluster module (infra/modules/cluster), which creates it; then push again") from None
        raise ImageError(f"ECR DescribeImages on {repository} ({account}, {region}) failed: {code or e}") from None
    return bool(out.get("imageDetails"))


def _ecr_login(client, account: str, host: str, name: str, base: list[str], runner: Runner) -> None:
    data = client.get_authorization_token(registryIds=[account])["authorizationData"][0]
    user, _, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
    # the password goes on standard input: never on a command line, which other users can read in ps
    _run(runner, [*base, "login", "--username", user, "--password-stdin", host], f"{name} login to {host}",
         input=password, text=True, capture_output=True)
