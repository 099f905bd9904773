"""sdk/backends/local/containers.py without a container engine: which engine is picked, what an image must hold, the command
that runs a host's driver, and the runtime chosen for this machine's cgroups (fakes for the engine's answers;
tests/image runs the real thing)."""
import json
from types import SimpleNamespace

import pytest

from trainyard.errors import ConfigError
from trainyard.sdk.backends.local import containers

HYBRID = ("tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
          "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
UNIFIED = "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"


def _runner(answers: dict[str, tuple[int, str]]):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        code, out = next((v for k, v in answers.items() if k in " ".join(cmd)), (0, ""))
        return SimpleNamespace(returncode=code, stdout=out, stderr="")
    run.calls = calls
    return run


def test_podman_first_and_docker_only_with_its_daemon():
    paths = {"podman": "/usr/bin/podman", "docker": "/usr/bin/docker"}
    assert containers.find_engine(paths.get, _runner({})) == ("podman", "/usr/bin/podman")
    assert containers.find_engine({"docker": "/d"}.get, _runner({})) == ("docker", "/d")
    with pytest.raises(ConfigError, match="apt-get install podman") as e:
        containers.find_engine({"docker": "/d"}.get, _runner({"version": (1, "")}))  # a client without a daemon
    assert e.value.field == "image_uri"


def test_an_image_must_be_there_and_hold_the_sdks_version():
    engine = ("podman", "/p")
    with pytest.raises(ConfigError, match="trainyard image build --variant cpu"):
        containers.check_image(engine, "img:1", "0.1.0", _runner({"inspect": (125, "")}))
    with pytest.raises(ConfigError, match="is not a Trainyard image"):  # e.g. python:3.11 or the bare base
        containers.check_image(engine, "python:3.11", "0.1.0", _runner({"inspect": (0, "null")}))
    labels = json.dumps({containers.VERSION_LABEL: "0.0.9", "trainyard.source-digest": "abc"})
    with pytest.raises(ConfigError, match="holds Trainyard 0.0.9, and this SDK is 0.1.0"):
        containers.check_image(engine, "img:1", "0.1.0", _runner({"inspect": (0, labels)}))
    assert containers.check_image(engine, "img:1", "0.0.9", _runner({"inspect": (0, labels)}), sdk_sources="abc") is None
    stale = containers.check_image(engine, "img:1", "0.0.9", _runner({"inspect": (0, labels)}), sdk_sources="def")
    assert "built from other sources than this SDK's (image abc, SDK def)" in stale


def test_the_source_digest_follows_the_python_files(tmp_path):
    from trainyard.sdk.backends.local.containers import source_digest

    for copy in ("a", "b"):
        (tmp_path / copy / "sub" / "__pycache__").mkdir(parents=True)
        (tmp_path / copy / "sub" / "m.py").write_text("x = 1\n")
    (tmp_path / "b" / "sub" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"compiled")
    (tmp_path / "b" / "notes.txt").write_text("not code")
    assert source_digest(str(tmp_path / "a")) == source_digest(str(tmp_path / "b"))
    (tmp_path / "b" / "sub" / "m.py").write_text("x = 2\n")
    assert source_digest(str(tmp_path / "a")) != source_digest(str(tmp_path / "b"))


def test_a_hosts_command(monkeypatch):
    monkeypatch.setattr(containers, "runtime_options", lambda name, path: ())
    cmd = containers.run_command(("podman", "/p"), "img:1", job="j", host="algo-2", jobdir="/jobs/j",
                                 hostdir="/jobs/j/hosts/algo-2", addresses={"algo-1": "127.0.0.1"},
                                 env={"A": "1"}, driver_args=["--root", "/opt/ml"], netns="ty-j-1")
    text = " ".join(cmd)
    assert cmd[:3] == ["/p", "run", "--rm"] and "--label trainyard.job=j" in text and "--pid host" in text
    assert "--network ns:/run/netns/ty-j-1" in text and "--add-host algo-1:127.0.0.1" in text
    assert "--volume /jobs/j/hosts/algo-2:/opt/ml --volume /jobs/j:/jobs/j" in text and "--preserve-fds 1" in text
    assert cmd[cmd.index("img:1"):] == ["img:1", "python", "-m", "trainyard.container.driver", "--root", "/opt/ml"]
    docker = containers.run_command(("docker", "/d"), "img:1", job="j", host="algo-1", jobdir="/j", hostdir="/h",
                                    addresses={}, env={}, driver_args=[])
    assert "--preserve-fds" not in docker and "--network" in docker and docker[docker.index("--network") + 1] == "host"


def test_runc_where_crun_would_meet_a_hybrid_cgroup_hierarchy(tmp_path):
    hybrid, unified = tmp_path / "hybrid", tmp_path / "unified"
    hybrid.write_text(HYBRID)
    unified.write_text(UNIFIED)
    assert containers.hybrid_cgroups(str(hybrid)) and not containers.hybrid_cgroups(str(unified))
    crun = _runner({"info": (0, json.dumps({"host": {"ociRuntime": {"name": "crun"}}}))})
    runc = _runner({"info": (0, json.dumps({"host": {"ociRuntime": {"name": "runc"}}}))})
    which = {"runc": "/usr/sbin/runc"}.get
    opts = containers.runtime_options.__wrapped__
    assert opts("podman", "/p", crun, which, str(hybrid)) == ("--runtime", "/usr/sbin/runc")
    assert opts("podman", "/p", crun, which, str(unified)) == ()
    assert opts("podman", "/p", runc, which, str(hybrid)) == ()
    assert opts("docker", "/d", crun, which, str(hybrid)) == ()
    buildah = _runner({"info": (0, json.dumps({"host": {"OCIRuntime": "crun"}}))})
    assert opts("buildah", "/b", buildah, which, str(hybrid)) == ("--runtime", "/usr/sbin/runc")
    with pytest.raises(ConfigError, match="apt-get install runc"):
        opts("podman", "/p", crun, {}.get, str(hybrid))


def test_a_container_gets_the_aws_settings_and_the_credentials_resolved_here():
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_PROFILE": "dev", "AWS_CA_BUNDLE": "/etc/ca.pem",
           "HOME": "/root", "AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s"}
    assert containers.aws_env(env) == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_ACCESS_KEY_ID": "AKIA1",
                                       "AWS_SECRET_ACCESS_KEY": "s"}  # files of this machine are not passed
    frozen = SimpleNamespace(access_key="ASIA2", secret_key="t", token="tok")
    session = SimpleNamespace(get_credentials=lambda: SimpleNamespace(get_frozen_credentials=lambda: frozen),
                              region_name="eu-west-1")
    got = containers.aws_env({"AWS_PROFILE": "sso"}, session_factory=lambda: session)
    assert got == {"AWS_ACCESS_KEY_ID": "ASIA2", "AWS_SECRET_ACCESS_KEY": "t", "AWS_SESSION_TOKEN": "tok",
                   "AWS_DEFAULT_REGION": "eu-west-1"}
    none = SimpleNamespace(get_credentials=lambda: None, region_name=None)
    assert containers.aws_env({}, session_factory=lambda: none) == {}
