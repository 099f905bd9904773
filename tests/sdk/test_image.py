"""The training image's tag, builder choice, build and push: tags from content (with Docker's ignore rules),
the commands a fake runner records for docker and buildah, and pushes against moto's ECR over HTTP."""
import json
import os
import shutil
import subprocess
import threading
import urllib.request

import boto3
import pytest

from trainyard.sdk import image
from trainyard.sdk.backends.local import containers
from trainyard.errors import ImageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACCOUNT = "123456789012"  # moto's account
REGISTRY = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/trainyard"


class Runner:
    """Records every command; answers `inspect` with `inspect_code` and everything else with 0."""

    def __init__(self, inspect_code=1, stderr=""):
        self.calls: list[tuple[list[str], dict]] = []
        self.inspect_code, self.stderr = inspect_code, stderr

    def __call__(self, cmd, **kw):
        self.calls.append((list(cmd), kw))
        code = self.inspect_code if "inspect" in cmd else 0
        return subprocess.CompletedProcess(cmd, code, stdout="", stderr=self.stderr if code else "")

    @property
    def argvs(self):
        return [c for c, _ in self.calls]


def _only(*names):
    return lambda name: f"/usr/bin/{name}" if name in names else None


def _context(tmp_path, name="ctx"):
    root = tmp_path / name
    (root / "trainyard" / "container").mkdir(parents=True)
    (root / "trainyard" / "container" / "Dockerfile").write_text("FROM scratch\nCOPY . /src\n")
    (root / "pkg").mkdir()
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0\1")
    (root / "tests").mkdir()
    (root / "tests" / "test_a.py").write_text("def test(): pass\n")
    (root / "docs").mkdir()
    (root / "docs" / "keep.md").write_text("kept\n")
    (root / "docs" / "other.md").write_text("dropped\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "README.md").write_text("readme\n")
    (root / ".dockerignore").write_text("# comment\n**/.git\n**/__pycache__\ntests\n/docs\n!docs/keep.md\n")
    return root


def _tag(root):
    return image.image_tag(str(root), version="0.1.0")


# -- the tag ---------------------------------------------------------------------------------------


def test_same_content_same_tag_anywhere(tmp_path):
    root = _context(tmp_path)
    tag = _tag(root)
    assert tag.startswith("0.1.0-") and len(tag) == len("0.1.0-") + 12
    assert _tag(root) == tag
    copy = tmp_path / "elsewhere"
    shutil.copytree(root, copy)  # another folder, other times
    os.utime(copy / "pkg" / "a.py", (1, 1))
    assert _tag(copy) == tag
    assert image.image_tag(str(root), version="0.2.0").startswith("0.2.0-")
    assert image.image_tag(str(root), version="0.2.0")[6:] != tag[6:]  # the version is hashed too
    assert image.image_tag(str(root), version="0.1.0+dirty").startswith("0.1.0-dirty-")  # a valid tag


@pytest.mark.parametrize("change", ["edit", "add", "remove", "chmod", "dockerfile", "rename", "kept-doc"])
def test_any_change_to_what_is_sent_changes_the_tag(tmp_path, change):
    root = _context(tmp_path)
    before = _tag(root)
    if change == "edit":
        (root / "pkg" / "a.py").write_text("A = 2\n")
    elif change == "add":
        (root / "pkg" / "b.py").write_text("")
    elif change == "remove":
        (root / "README.md").unlink()
    elif change == "chmod":
        os.chmod(root / "pkg" / "a.py", 0o755)
    elif change == "dockerfile":
        (root / "trainyard" / "container" / "Dockerfile").write_text("FROM scratch\nCOPY . /app\n")
    elif change == "rename":
        (root / "pkg" / "a.py").rename(root / "pkg" / "c.py")
    elif change == "kept-doc":  # brought back by `!docs/keep.md`
        (root / "docs" / "keep.md").write_text("changed\n")
    assert _tag(root) != before


def test_what_dockerignore_excludes_never_changes_the_tag(tmp_path):
    root = _context(tmp_path)
    before = _tag(root)
    (root / "tests" / "test_a.py").write_text("def test(): assert 0\n")
    (root / "tests" / "new.py").write_text("")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/other\n")
    (root / "pkg" / "__pycache__" / "b.pyc").write_bytes(b"\2")
    (root / "docs" / "other.md").write_text("changed, and still excluded\n")
    assert _tag(root) == before
    assert image.context_files(str(root)) == [".dockerignore", "README.md", "docs/keep.md",
                                              "pkg/a.py", "trainyard/container/Dockerfile"]


def test_a_dockerfile_the_context_excludes_still_counts(tmp_path):
    root = _context(tmp_path)
    (root / ".dockerignore").write_text("trainyard/container\n")
    before = _tag(root)
    assert "trainyard/container/Dockerfile" not in image.context_files(str(root))
    (root / "trainyard" / "container" / "Dockerfile").write_text("FROM scratch\n")
    assert _tag(root) != before


def test_symlinks_are_hashed_as_links(tmp_path):
    root = _context(tmp_path)
    os.symlink("a.py", root / "pkg" / "link.py")
    before = _tag(root)
    os.remove(root / "pkg" / "link.py")
    os.symlink("../README.md", root / "pkg" / "link.py")
    assert _tag(root) != before


def test_no_dockerfile_is_a_clear_error(tmp_path):
    with pytest.raises(ImageError, match="no Dockerfile"):
        image.image_tag(str(tmp_path))


@pytest.mark.parametrize("pattern,path,excluded", [
    ("foo", "foo", True), ("foo", "foo/bar.py", True), ("foo", "a/foo", False),      # relative to the root
    ("/foo", "foo/x", True), ("./foo/", "foo/x", True),                               # cleaned
    ("**/foo", "a/b/foo", True), ("**/foo", "foo", True), ("**/foo", "a/foo/x", True),
    ("*.md", "README.md", True), ("*.md", "docs/a.md", False), ("**/*.md", "docs/a.md", True),
    ("a/*/c", "a/b/c", True), ("a/*/c", "a/b/x/c", False), ("a/**/c", "a/b/x/c", True),
    ("fo?", "foo", True), ("fo?", "fooo", False), ("[a-c]x", "bx", True), ("[^a-c]x", "bx", False),
    ("foo/**", "foo/a/b", True), ("foo/**", "foo", False),
])
def test_docker_ignore_rules(pattern, path, excluded):
    assert image.IgnoreRules(pattern).excluded(path) is excluded


def test_an_invalid_pattern_is_named():
    with pytest.raises(ImageError, match=r"pattern 'src/\[a' is not valid"):
        image.IgnoreRules("src/[a")


def test_exceptions_and_the_last_match_wins():
    rules = image.IgnoreRules("*.md\n!README*.md\nREADME-secret.md\n# a comment\n\n")
    assert rules.excluded("CHANGES.md") and not rules.excluded("README.md") and rules.excluded("README-secret.md")
    rules = image.IgnoreRules("docs\n!docs/api")
    assert rules.excluded("docs/guide.md") and not rules.excluded("docs/api/x.md")
    assert rules.may_reinclude_under("docs") and not image.IgnoreRules("docs").may_reinclude_under("docs")


def test_the_repositorys_dockerignore_keeps_the_package_and_drops_the_rest():
    rules = image.IgnoreRules.for_context(ROOT)
    for path in (".git", ".git/HEAD", ".venv", ".venv/bin/python", "trainyard/sdk/__pycache__/image.cpython-311.pyc",
                 "trainyard/engine/x.pyc", "tests/sdk/test_image.py", "bench/results/mics.json", "trainyard.egg-info/PKG-INFO",
                 ".env", "trainyard/sdk/.env.local", "docs/aws.md", ".pytest_cache/v"):
        assert rules.excluded(path), path
    for path in ("pyproject.toml", "README.md", "trainyard/__init__.py", "trainyard/sdk/image.py", "trainyard/job/catalog/prices.json",
                 "trainyard/container/driver.py", "trainyard/container/Dockerfile", "trainyard/engine/train.py",
                 "trainyard/kernels/__init__.py"):
        assert not rules.excluded(path), path


# -- builders and build ----------------------------------------------------------------------------


def test_no_builder_on_path_names_what_to_install(monkeypatch):
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ImageError) as e:
        image.find_builder(shutil.which)
    text = str(e.value)
    for word in ("docker", "buildah", "podman", "apt-get install buildah", "https://docs.docker.com/engine/install/"):
        assert word in text


def test_builder_preference_and_override(monkeypatch):
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    assert image.find_builder(_only("docker", "buildah", "podman")) == ("docker", ["/usr/bin/docker"])
    assert image.find_builder(_only("buildah", "podman")) == ("buildah", ["/usr/bin/buildah"])
    assert image.find_builder(_only("podman")) == ("podman", ["/usr/bin/podman"])
    env = {image.BUILDER_ENV: "buildah"}
    assert image.find_builder(_only("docker", "buildah"), env) == ("buildah", ["/usr/bin/buildah"])
    with pytest.raises(ImageError, match="not on PATH"):
        image.find_builder(_only("docker"), env)
    with pytest.raises(ImageError, match="must be one of"):
        image.find_builder(_only("docker"), {image.BUILDER_ENV: "kaniko"})


def test_docker_build_commands(tmp_path, monkeypatch):
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    root = _context(tmp_path)
    tag = image.image_tag(str(root))
    run = Runner(inspect_code=1)  # not built yet
    ref = image.build(str(root), "trainyard", runner=run, which=_only("docker", "buildah"))
    assert ref == f"trainyard:{tag}"
    (inspect, kw), (build, _) = run.calls
    assert inspect == ["/usr/bin/docker", "image", "inspect", ref] and kw["capture_output"]
    version = image.sdk_version()
    assert build == ["/usr/bin/docker", "build", "--file", f"{root}/trainyard/container/Dockerfile", "--tag", ref,
                     "--build-arg", f"TRAINYARD_VERSION={version}", "--label",
                     f"org.opencontainers.image.version={version}",
                     "--label", f"trainyard.source-digest={containers.source_digest(str(root / 'trainyard'))}", str(root)]
    # built already: only the inspect runs
    run = Runner(inspect_code=0)
    assert image.build(str(root), "trainyard", runner=run, which=_only("docker")) == ref
    assert run.argvs == [["/usr/bin/docker", "image", "inspect", ref]]


def test_two_builds_of_one_checkout_take_turns_and_the_second_finds_the_image(tmp_path, monkeypatch, capsys):
    """`make test` builds the image in the background while the image tests' fixture may ask for it too."""
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    root = _context(tmp_path)
    built, building, release = threading.Event(), threading.Event(), threading.Event()
    calls: list[list[str]] = []

    def runner(cmd, **kw):
        calls.append(list(cmd))
        if "inspect" in cmd:
            return subprocess.CompletedProcess(cmd, 0 if built.is_set() else 1, stdout="", stderr="")
        building.set()
        assert release.wait(10)
        built.set()
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    refs: list[str] = []
    first = threading.Thread(target=lambda: refs.append(image.build(str(root), runner=runner, which=_only("docker"))))
    first.start()
    assert building.wait(10)
    second = threading.Thread(target=lambda: refs.append(image.build(str(root), runner=runner, which=_only("docker"))))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second build did not wait for the first"
    release.set()
    first.join(10)
    second.join(10)
    assert len(refs) == 2 and refs[0] == refs[1]
    assert [c[1] for c in calls] == ["image", "build", "image"]  # inspect, build; then the second's inspect only
    assert "another build of" in capsys.readouterr().out


def test_buildah_build_commands(tmp_path, monkeypatch):
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    root = _context(tmp_path)
    run = Runner(inspect_code=1)
    ref = image.build(str(root), "my/repo", runner=run, which=_only("buildah", "podman"))
    assert ref.startswith("my/repo:") and ref.endswith(image.image_tag(str(root)))
    (inspect, _), (build, _) = run.calls
    assert inspect == ["/usr/bin/buildah", "inspect", "--type", "image", ref]
    assert build[:3] == ["/usr/bin/buildah", "build", "--layers"] and build[-1] == str(root)
    assert build[build.index("--tag") + 1] == ref


def test_build_failures_are_clear(tmp_path, monkeypatch):
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    root = _context(tmp_path)
    down = Runner(inspect_code=1, stderr="Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
                                         "Is the docker daemon running?\n")
    with pytest.raises(ImageError, match="daemon cannot be reached.*systemctl start docker.*buildah"):
        image.build(str(root), runner=down, which=_only("docker"))
    assert len(down.calls) == 1  # no build was attempted

    def failing(cmd, **kw):
        code = 1 if ("inspect" in cmd or "build" in cmd) else 0
        return subprocess.CompletedProcess(cmd, code, "", "")

    with pytest.raises(ImageError, match="build of trainyard:.* failed with exit status 1"):
        image.build(str(root), runner=failing, which=_only("docker"))
    (root / "pyproject.toml").write_text('[project]\nname = "trainyard"\nversion = "9.9.9"\n')
    with pytest.raises(ImageError, match="Trainyard 9.9.9 and this SDK is"):
        image.build(str(root), runner=Runner(), which=_only("docker"))


def test_the_repository_builds_as_its_own_context(monkeypatch):
    """The real context: its pyproject's version is the SDK's, and the recorded build names container/Dockerfile."""
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    run = Runner(inspect_code=1)
    ref = image.build(ROOT, runner=run, which=_only("docker"))
    assert ref == f"trainyard:{image.image_tag(ROOT)}"
    assert run.argvs[1][run.argvs[1].index("--file") + 1] == os.path.join(ROOT, "trainyard", "container", "Dockerfile")


# -- push ------------------------------------------------------------------------------------------


@pytest.fixture
def ecr(s3_endpoint, monkeypatch):
    """moto over HTTP, reset: an ECR client and a session that reach it."""
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST"), timeout=30).read()
    session = boto3.Session(region_name="us-east-1")
    return session, session.client("ecr")


def _manifest():
    return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                       "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 2,
                                  "digest": "sha256:" + "a" * 64}, "layers": []})


def test_an_image_already_in_ecr_is_not_pushed_again(ecr, capsys):
    session, client = ecr
    client.create_repository(repositoryName="trainyard")
    client.put_image(repositoryName="trainyard", imageManifest=_manifest(), imageTag="0.1.0-abcdef012345")
    run = Runner()
    remote = image.push("trainyard:0.1.0-abcdef012345", registry_uri=REGISTRY, session=session, runner=run,
                        which=_only("docker"))
    assert remote == f"{REGISTRY}:0.1.0-abcdef012345"
    assert run.calls == []  # no login, no tag, no push
    assert "in ECR already" in capsys.readouterr().out


def test_a_new_tag_is_logged_in_tagged_and_pushed(ecr):
    session, client = ecr
    client.create_repository(repositoryName="trainyard")
    client.put_image(repositoryName="trainyard", imageManifest=_manifest(), imageTag="0.1.0-000000000000")
    run = Runner()
    remote = image.push("trainyard:0.1.0-abcdef012345", registry_uri=REGISTRY, session=session, runner=run,
                        which=_only("docker"))
    host = REGISTRY.split("/")[0]
    (login, login_kw), (tag, _), (push, _) = run.calls
    assert login == ["/usr/bin/docker", "login", "--username", "AWS", "--password-stdin", host]
    password = login_kw["input"]
    assert password == f"{ACCOUNT}-auth-token"  # moto's token is base64("AWS:<account>-auth-token")
    assert all(password not in arg for argv in run.argvs for arg in argv)  # never on a command line
    assert tag == ["/usr/bin/docker", "tag", "trainyard:0.1.0-abcdef012345", remote]
    assert push == ["/usr/bin/docker", "push", remote]


def test_buildah_push_and_the_default_registry(ecr):
    session, client = ecr
    client.create_repository(repositoryName="trainyard")
    run = Runner()
    remote = image.push("trainyard:0.1.0-abcdef012345", session=session, runner=run, which=_only("buildah"))
    assert remote == f"{REGISTRY}:0.1.0-abcdef012345"  # the session's account (STS) and region
    assert [argv[:2] for argv in run.argvs] == [["/usr/bin/buildah", "login"], ["/usr/bin/buildah", "tag"],
                                                ["/usr/bin/buildah", "push"]]


def test_a_missing_ecr_repository_says_how_to_create_it(ecr):
    session, _ = ecr
    run = Runner()
    with pytest.raises(ImageError) as e:
        image.push("trainyard:0.1.0-abcdef012345", registry_uri=REGISTRY, session=session, runner=run,
                   which=_only("docker"))
    text = str(e.value)
    assert "aws ecr create-repository --repository-name trainyard --region us-east-1" in text
    assert "Terraform cluster module" in text and run.calls == []


def test_other_registries_and_bad_references(monkeypatch):
    monkeypatch.delenv(image.BUILDER_ENV, raising=False)
    run = Runner()
    remote = image.push("trainyard:1-abc", registry_uri="registry.example.com:5000/team/trainyard", runner=run,
                        which=_only("docker"))
    assert remote == "registry.example.com:5000/team/trainyard:1-abc"
    assert run.argvs == [["/usr/bin/docker", "tag", "trainyard:1-abc", remote], ["/usr/bin/docker", "push", remote]]
    with pytest.raises(ImageError, match="has no tag"):
        image.push("localhost:5000/trainyard", registry_uri=REGISTRY, runner=run, which=_only("docker"))
    with pytest.raises(ImageError, match="names an image"):
        image.push("trainyard:1-abc", registry_uri=REGISTRY + ":latest", runner=run, which=_only("docker"))
    with pytest.raises(ImageError, match="names no repository"):
        image.push("trainyard:1-abc", registry_uri="registry.example.com", runner=run, which=_only("docker"))


def test_publish_builds_and_pushes_only_what_ecr_lacks(ecr, tmp_path, capsys):
    """`trainyard image push`: nothing at all when ECR has this content's tag; else build, log in, tag, push."""
    session, client = ecr
    client.create_repository(repositoryName="trainyard")
    root = _context(tmp_path)
    tag = image.image_tag(str(root))
    client.put_image(repositoryName="trainyard", imageManifest=_manifest(), imageTag=tag)
    run = Runner(inspect_code=1)
    assert image.publish(str(root), registry_uri=REGISTRY, session=session, runner=run,
                         which=_only("docker")) == f"{REGISTRY}:{tag}"
    assert run.calls == []  # neither built nor pushed
    assert "neither built nor pushed" in capsys.readouterr().out
    (root / "pkg" / "a.py").write_text("A = 3\n")  # new content, new tag
    new_tag = image.image_tag(str(root))
    run = Runner(inspect_code=1)
    assert image.publish(str(root), registry_uri=REGISTRY, session=session, runner=run,
                         which=_only("docker")) == f"{REGISTRY}:{new_tag}"
    assert [argv[1] for argv in run.argvs] == ["image", "build", "login", "tag", "push"]
    assert run.argvs[-1] == ["/usr/bin/docker", "push", f"{REGISTRY}:{new_tag}"]
