"""User data of EC2 jobs: the script's text, its syntax, and a run of it against stand-in commands."""
import json
import shlex
import stat
import subprocess

import pytest

from trainyard.sdk.backends.aws.userdata import (AGENT_MARKER, USER_DATA_LIMIT, agent_command, ecr_registry,
                                        render_user_data)
from trainyard.job.spec import build_spec

ECR_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainyard:1.0"
FS = "fs-0123456789abcdef0"
MOUNT = {"file_system_id": FS, "dns_name": f"{FS}.fsx.us-east-1.amazonaws.com", "mount_name": "abcdefgh"}


def _spec(**kw):
    fields = dict(job_name="ud-job", entry_point="trainyard.engine.train", entry_kind="module",
                  instance_type="p4d.24xlarge", instance_count=2, processes_per_host=8, output_path="s3://jobs/out",
                  image_uri=ECR_IMAGE)
    fields.update(kw)
    return build_spec(**fields)


def _render(spec=None, *, state_uri="s3://jobs/out/ud-job/trainyard", region="us-east-1", attempt=1, mounts=()):
    return render_user_data(spec or _spec(), state_uri=state_uri, region=region, attempt=attempt,
                            fsx_mounts=list(mounts))


def _bash_n(text: str, tmp_path) -> None:
    path = tmp_path / "user-data.sh"
    path.write_text(text)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def _agent_line(text: str) -> str:
    lines = text.splitlines()
    return lines[lines.index(AGENT_MARKER) + 1]


def test_scripts_pass_bash_n(tmp_path):
    fsx_spec = _spec(channels=[{"name": "train", "uri": f"fsx://{FS}/data"}])
    for text in (_render(), _render(fsx_spec, mounts=[MOUNT]), _render(_spec(image_uri="nvcr.io/nvidia/pytorch:24.01-py3")),
                 _render(_spec(instance_type="trn1.32xlarge"), mounts=[MOUNT])):
        assert text.startswith("#!/bin/bash\n") and "\nset -euo pipefail\n" in text
        assert "/var/log/trainyard-user-data.log" in text and "/dev/console" in text
        _bash_n(text, tmp_path)


def test_fsx_mount_install_and_volume(tmp_path):
    spec = _spec(channels=[{"name": "train", "uri": f"fsx://{FS}/data"}])
    other = {"file_system_id": "fs-0fedcba9876543210", "dns_name": "fs-0fedcba9876543210.fsx.us-east-1.amazonaws.com",
             "mount_name": "xyz12345"}
    text = _render(spec, mounts=[MOUNT, other])
    # REFERENCE: mount -t lustre -o relatime,flock <DNSName>@tcp:/<MountName> <dir>, one folder per file system
    assert f"mount -t lustre -o relatime,flock {FS}.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh /fsx/{FS}" in text
    assert "mount -t lustre -o relatime,flock fs-0fedcba9876543210.fsx.us-east-1.amazonaws.com@tcp:/xyz12345 " \
           "/fsx/fs-0fedcba9876543210" in text
    assert "retry 10 15 mount -t lustre" in text and f"mkdir -p /fsx/{FS}" in text
    assert "command -v mount.lustre" in text
    assert "dnf install -y lustre-client" in text and 'apt-get install -y "lustre-client-modules-$(uname -r)"' in text
    assert text.index("mount -t lustre") < text.index("docker pull") < text.index(AGENT_MARKER)
    assert " -v /fsx:/fsx " in _agent_line(text)
    plain = _render()
    assert "lustre" not in plain and "-v /fsx" not in plain


def test_ecr_login_only_for_ecr_images():
    text = _render(region="us-east-1")
    login = ("aws ecr get-login-password --region us-west-2 | docker login --username AWS --password-stdin "
             "123456789012.dkr.ecr.us-west-2.amazonaws.com")
    assert login in text  # the registry's region, not the job's
    assert text.index(login) < text.index("docker pull")
    for image in ("nvcr.io/nvidia/pytorch:24.01-py3", "public.ecr.aws/trainyard/trainyard:1", "pytorch/pytorch:2.3"):
        other = _render(_spec(image_uri=image))
        assert "get-login-password" not in other and "docker login" not in other
        assert f"docker pull {image}" in other
    assert ecr_registry(ECR_IMAGE) == ("123456789012.dkr.ecr.us-west-2.amazonaws.com", "us-west-2")
    assert ecr_registry("123456789012.dkr.ecr.cn-north-1.amazonaws.com.cn/x:1")[1] == "cn-north-1"
    assert ecr_registry("ubuntu") is None


def test_docker_run_has_devices_limits_gpus_and_shutdown_follows():
    text = _render()
    line = _agent_line(text)
    for part in ("docker run --rm", "--network host", "--init", "--stop-timeout 45", "--gpus all", "--ulimit memlock=-1:-1",
                 "--ulimit stack=67108864", '--shm-size "${shm_kib}k"', "-v /opt/ml:/opt/ml", "-e AWS_REGION=us-east-1",
                 f" {ECR_IMAGE} python -m trainyard.container.node "):
        assert part in line, part
    assert line.endswith(" || code=$?")
    assert '${devices[@]+"${devices[@]}"}' in line
    # the times of the script's own steps reach the agent, for the host's capacity and image phases
    assert "-e TRAINYARD_USERDATA_START -e TRAINYARD_IMAGE_PULL_START -e TRAINYARD_IMAGE_PULL_END " in line
    assert text.index("export TRAINYARD_USERDATA_START=") < text.index("export TRAINYARD_IMAGE_PULL_START=") \
        < text.index("get-login-password") < text.index("docker pull") < text.index("export TRAINYARD_IMAGE_PULL_END=")
    assert "for dev in /dev/infiniband/uverbs* " in text and 'devices+=(--device "$dev")' in text
    tail = text[text.index(AGENT_MARKER):]
    assert "\nshutdown -h now\n" in tail
    assert "--gpus" not in _agent_line(_render(_spec(instance_type="trn1.32xlarge")))  # no NVIDIA runtime there


def test_agent_command_round_trips():
    state_uri = "s3://jobs/out/ud-job/trainyard"
    assert agent_command(_render(state_uri=state_uri, region="eu-west-1", attempt=3)) == [
        "python", "-m", "trainyard.container.node", "--state-uri", state_uri, "--region", "eu-west-1", "--attempt", "3"]
    with pytest.raises(ValueError, match="no '# trainyard: node agent' line"):
        agent_command("#!/bin/bash\necho hi\n")
    continued = f"x\n{AGENT_MARKER}\ndocker run \\\n  img python -m trainyard.container.node --attempt 2; echo done\n"
    assert agent_command(continued) == ["python", "-m", "trainyard.container.node", "--attempt", "2"]


ODD_URI = "s3://jobs/we ird/$(touch PWNED)/`touch PWNED2`/it's \"q\";&|<>*/ud-job/trainyard"


def test_odd_values_are_quoted(tmp_path):
    image = "registry.example.com:5000/team/it's $(touch PWNED3):tag"
    text = _render(_spec(image_uri=image), state_uri=ODD_URI)
    _bash_n(text, tmp_path)
    cmd = agent_command(text)
    assert cmd[cmd.index("--state-uri") + 1] == ODD_URI
    assert shlex.quote(image) in _agent_line(text)


def test_size_limit_and_bad_arguments():
    many = [{"file_system_id": f"fs-{i:017x}", "dns_name": f"fs-{i:017x}.fsx.us-east-1.amazonaws.com" + "x" * 200,
             "mount_name": "m" * 50} for i in range(40)]
    with pytest.raises(ValueError, match=f"over EC2's limit of {USER_DATA_LIMIT} bytes"):
        _render(mounts=many)
    assert len(_render(mounts=many[:10]).encode()) <= USER_DATA_LIMIT
    with pytest.raises(ValueError, match="image_uri"):
        _render(_spec(image_uri=None))
    with pytest.raises(ValueError, match=f"needs {FS} in fsx_mounts"):
        _render(_spec(channels=[{"name": "train", "uri": f"fsx://{FS}/data"}]))
    with pytest.raises(ValueError, match="region"):
        _render(region="us-east-1; rm -rf /")
    with pytest.raises(ValueError, match="lacks"):
        _render(mounts=[{"file_system_id": FS}])
    with pytest.raises(ValueError, match="attempt"):
        _render(attempt=0)


# -- running the script against stand-ins for mount, docker, aws, curl, shutdown ----------------------

SHIM = r'''#!/bin/bash
name=$(/usr/bin/basename "$0")
line=$(printf '%s' "$name"; printf '\x1f%s' "$@")
printf '%s\n' "$line" >> "$SHIM_DIR/calls"  # one write: the two sides of a pipeline log at once
case "$name" in
  tee) exec /bin/cat ;;
  awk) echo 1048576 ;;
  date) echo 2030-01-01T00:00:00+00:00 ;;
  uname) echo 6.1.0-test ;;
  mountpoint) exit 1 ;;
  mount)  # fails until the third try
    n=$(( $(/bin/cat "$SHIM_DIR/mount-tries" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$SHIM_DIR/mount-tries"
    exit $(( n >= 3 ? 0 : 1 )) ;;
  curl)
    case "$*" in
      *api/token*) echo tok ;;
      *ami-launch-index*) echo 1 ;;
      *instance-id*) echo i-0shim ;;
      *) exit 22 ;;
    esac ;;
  aws)
    case "$1 $2" in
      "ecr get-login-password") echo secret ;;
      "ec2 describe-instances") echo "${HOST_INDEX_TAG:-None}" ;;
      "s3 cp") /bin/cat > "$SHIM_DIR/status.json"; echo "${@: -1}" > "$SHIM_DIR/status-uri" ;;
    esac ;;
  docker)
    case "$1" in
      login) /bin/cat > "$SHIM_DIR/login-password" ;;
      pull) exit "${PULL_EXIT:-0}" ;;
      run) exit "${RUN_EXIT:-0}" ;;
    esac ;;
esac
exit 0
'''
SHIMS = ("tee", "awk", "date", "uname", "mountpoint", "mount", "mount.lustre", "mkdir", "curl", "aws", "docker",
         "sleep", "shutdown", "dnf")


def _play(text: str, tmp_path, without=(), **env) -> tuple[int, list[list[str]]]:
    """Run the user data with every system command replaced by a recording stand-in (PATH holds nothing
    else; `without` names stand-ins to leave out)."""
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    for name in set(SHIMS) - set(without):
        (shims / name).write_text(SHIM)
        (shims / name).chmod(stat.S_IRWXU)
    text = text.replace("LOG_FILE=/var/log/trainyard-user-data.log", f"LOG_FILE={tmp_path}/ud.log")
    text = text.replace("CONSOLE=/dev/console", f"CONSOLE={tmp_path}/console")
    script = tmp_path / "user-data.sh"
    script.write_text(text)
    r = subprocess.run(["/bin/bash", str(script)], env={"PATH": str(shims), "SHIM_DIR": str(shims), **env},
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    calls = [line.split("\x1f") for line in (shims / "calls").read_text().splitlines()]
    return r.returncode, calls


def test_script_runs_mount_login_pull_agent_then_shutdown(tmp_path):
    spec = _spec(channels=[{"name": "train", "uri": f"fsx://{FS}/data"}])
    text = _render(spec, state_uri=ODD_URI, mounts=[MOUNT])
    code, calls = _play(text, tmp_path, RUN_EXIT="143")
    assert code == 0, (tmp_path / "console").read_text()
    names = [c[0] for c in calls if c[0] not in ("tee", "date", "awk", "mkdir", "sleep", "mountpoint")]
    # aws | docker login is a pipeline: the two start in either order
    assert names[:3] == ["mount"] * 3 and sorted(names[3:5]) == ["aws", "docker"], calls
    assert names[5:] == ["docker", "docker", "shutdown"], calls
    assert calls[[c[0] for c in calls].index("mount")][1:] == [
        "-t", "lustre", "-o", "relatime,flock", f"{FS}.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh", f"/fsx/{FS}"]
    assert ["sleep", "15"] in calls  # between mount tries
    assert (tmp_path / "shims/login-password").read_text() == "secret\n"
    run = next(c for c in calls if c[:2] == ["docker", "run"])
    assert run[run.index("python"):] == agent_command(text)  # what bash runs is what the tests extract
    assert "--shm-size" in run and run[run.index("--shm-size") + 1] == "1048576k"
    assert calls[-1] == ["shutdown", "-h", "now"]
    assert not (tmp_path / "shims/status.json").exists()  # the agent reports for itself
    assert not list(tmp_path.glob("PWNED*"))
    assert "the node agent exited with status 143" in (tmp_path / "console").read_text()


def test_a_failed_bootstrap_reports_failed_and_still_shuts_down(tmp_path):
    code, calls = _play(_render(), tmp_path, PULL_EXIT="1")
    assert code != 0
    assert [c[:2] for c in calls if c[0] == "docker"] == [["docker", "login"]] + [["docker", "pull"]] * 5
    assert not any(c[:2] == ["docker", "run"] for c in calls)
    assert calls[-1] == ["shutdown", "-h", "now"]
    status = json.loads((tmp_path / "shims/status.json").read_text())
    assert (tmp_path / "shims/status-uri").read_text().strip() == "s3://jobs/out/ud-job/trainyard/hosts/algo-2/status.json"
    assert status["host"] == "algo-2" and status["instance_id"] == "i-0shim" and status["attempt"] == 1
    assert status["phase"] == "Failed" and status["exit_code"] == 1
    assert status["failure_reason"].startswith(f"algo-2 user data: pulling {ECR_IMAGE} failed (exit 1)")
    assert set(status) == {"host", "instance_id", "attempt", "phase", "message", "time", "exit_code", "failure_reason"}


def test_a_failure_report_names_the_host_by_its_host_index_tag(tmp_path):
    # Terraform launches instances one by one (all launch index 0) and tags each with its host index
    code, calls = _play(_render(), tmp_path, PULL_EXIT="1", HOST_INDEX_TAG="3")
    status = json.loads((tmp_path / "shims/status.json").read_text())
    assert status["host"] == "algo-4" and status["failure_reason"].startswith("algo-4 user data:")
    assert (tmp_path / "shims/status-uri").read_text().strip().endswith("/hosts/algo-4/status.json")


def test_an_image_without_the_agent_is_reported(tmp_path):
    code, calls = _play(_render(), tmp_path, RUN_EXIT="127")
    assert code == 0 and calls[-1] == ["shutdown", "-h", "now"]
    status = json.loads((tmp_path / "shims/status.json").read_text())
    assert status["phase"] == "Failed" and status["exit_code"] == 127 and "docker run (exit 127)" in status["failure_reason"]


def test_lustre_client_is_installed_when_missing(tmp_path):
    spec = _spec(channels=[{"name": "train", "uri": f"fsx://{FS}/data"}])
    code, calls = _play(_render(spec, mounts=[MOUNT]), tmp_path, without=("mount.lustre",))
    assert code == 0
    names = [c[0] for c in calls]
    assert ["dnf", "install", "-y", "lustre-client"] in calls and names.index("dnf") < names.index("mount")
    (tmp_path / "again").mkdir()
    code, calls = _play(_render(spec, mounts=[MOUNT]), tmp_path / "again", without=("mount.lustre", "dnf"))
    assert code != 0 and calls[-1] == ["shutdown", "-h", "now"]  # neither dnf nor apt-get: fails, reports, stops
