"""sdk/containers.py without a container engine: which engine is picked, what an image must hold, the command
that runs a host's driver, and the runtime chosen for this machine's cgroups (fakes for the engine's answers;
tests/image runs the real thing)."""
import json
from types import SimpleNamespace

import pytest

from trainyard.job.errors import ConfigError
from trainyard.sdk import containers

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
    labels = json.dumps({containers.VERSION_LABEL: "0.0.9"})
    with pytest.raises(ConfigError, match="holds Trainyard 0.0.9, and this SDK is 0.1.0"):
        containers.check_image(engine, "img:1", "0.1.0", _runner({"inspect": (0, labels)}))
    containers.check_image(engine, "img:1", "0.0.9", _runner({"inspect": (0, labels)}))


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
