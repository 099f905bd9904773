"""The user data of an EC2 job's instances: one bash script, identical for every instance of a launch.

It mounts the job's FSx for Lustre file systems at `/fsx/<fs-id>`, logs in to ECR, pulls the training
image and runs the node agent (`python -m trainyard.container.node`, see trainyard/container/node.py) in it; when
the container exits, whatever its status, the instance powers off (the launch template's
InstanceInitiatedShutdownBehavior=terminate makes that a termination). A step that fails before the
agent runs writes the host's status object (phase `Failed`) itself, so the controller learns why, and the
instance powers off all the same: nothing is left running.

It times what it does before the agent runs, for the host's phases (trainyard/container/phases.py): its
own start (the instance runs: the end of `capacity`) and the registry login and image pull (`image`), handed
to the agent's container as `TRAINYARD_USERDATA_START`, `TRAINYARD_IMAGE_PULL_START` and `..._END`.

Every value is quoted with `shlex.quote`. The agent's command line follows the marker line
`AGENT_MARKER`; `agent_command(user_data)` gives it back as argv (tests play the instance with it).
"""
from __future__ import annotations

import re
import shlex

from trainyard.container.phases import IMAGE_END_ENV, IMAGE_START_ENV, USERDATA_START_ENV
from trainyard.job import catalog
from trainyard.job.spec import JobSpec
from trainyard.job.uris import split_fsx

USER_DATA_LIMIT = 16 * 1024  # EC2 refuses user data above 16 KB (counted before base64)
AGENT_MARKER = "# trainyard: node agent"
AGENT_MODULE = "trainyard.container.node"
LOG_FILE = "/var/log/trainyard-user-data.log"
FSX_ROOT = "/fsx"
ML_ROOT = "/opt/ml"
MOUNT_TRIES, MOUNT_WAIT_S = 10, 15  # a file system just created may refuse mounts for a minute or two
PULL_TRIES, PULL_WAIT_S = 5, 15  # ECR and Docker Hub throttle and time out now and then
LUSTRE_OPTIONS = "relatime,flock"  # REFERENCE: mount -t lustre -o relatime,flock <dns>@tcp:/<mount> <dir>
STOP_TIMEOUT_S = 45
STACK_BYTES = 67108864  # 64 MiB stack limit, as in AWS's own deep-learning containers

NOW = "$(date -u +%Y-%m-%dT%H:%M:%S.%3N+00:00)"  # UTC, milliseconds: what Python's fromisoformat reads
_ECR_HOST = re.compile(r"^\d{12}\.dkr\.ecr(?:-fips)?\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?$")
_REGION = re.compile(r"^[a-z]{2}(?:-[a-z]+)+-\d+$")
_FS_ID = re.compile(r"^fs-[0-9a-f]{8,17}$")
_PUNCTUATION = set("();<>|&")

q = shlex.quote


def ecr_registry(image_uri: str) -> tuple[str, str] | None:
    """`123456789012.dkr.ecr.us-west-2.amazonaws.com/repo:tag` -> (registry host, its region); None when
    the image is not in ECR (Docker Hub, a public registry)."""
    host = image_uri.split("/", 1)[0] if "/" in image_uri else ""
    m = _ECR_HOST.match(host)
    return (host, m.group(1)) if m else None


def _check(spec: "JobSpec", state_uri: str, region: str, attempt: int, fsx_mounts: list[dict]) -> None:
    if not spec.image_uri:
        raise ValueError("image_uri: EC2 jobs need a training image (ECR URI)")
    if not spec.job_name:
        raise ValueError("the spec has no job_name yet")
    if not _REGION.match(region):
        raise ValueError(f"region {region!r} is not an AWS region name such as 'us-east-1'")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an integer >= 1, got {attempt!r}")
    if not state_uri.startswith("s3://"):
        raise ValueError(f"state_uri must be an s3:// URI, got {state_uri!r}")
    ids = []
    for m in fsx_mounts:
        missing = {"file_system_id", "dns_name", "mount_name"} - set(m)
        if missing:
            raise ValueError(f"FSx mount {m!r} lacks {sorted(missing)}")
        if not _FS_ID.match(m["file_system_id"]):
            raise ValueError(f"FSx mount {m!r}: {m['file_system_id']!r} is not a file system id")
        ids.append(m["file_system_id"])
    for ch in spec.channels:
        if ch.uri.startswith("fsx://") and split_fsx(ch.uri)[0] not in ids:
            raise ValueError(f"inputs.{ch.name}: {ch.uri} needs {split_fsx(ch.uri)[0]} in fsx_mounts")


def render_user_data(spec: "JobSpec", *, state_uri: str, region: str, attempt: int, fsx_mounts: list[dict]) -> str:
    """The bash script every instance of `spec`'s launch runs at boot. Raises ValueError when it would
    exceed EC2's 16 KB limit or when an argument is malformed."""
    _check(spec, state_uri, region, attempt, fsx_mounts)
    itype = catalog.lookup(spec.instance_type)
    image = spec.image_uri
    out = [
        "#!/bin/bash",
        f"# Trainyard job {_comment(spec.job_name)}, attempt {attempt}: mount FSx, pull the image, run the node agent,",
        "# power off (the launch template's shutdown behaviour terminates the instance).",
        "set -euo pipefail",
        f"LOG_FILE={q(LOG_FILE)}",
        "CONSOLE=/dev/console",
        f"STATE_URI={q(state_uri.rstrip('/'))}",
        f"REGION={q(region)}",
        f"ATTEMPT={attempt}",
        f"export {USERDATA_START_ENV}={NOW}  # the instance runs: the end of its capacity phase",
        'exec > >(tee -a "$LOG_FILE" >"$CONSOLE") 2>&1',
        f'echo "trainyard: user data started ${USERDATA_START_ENV}"',
        'step="starting"',
        _FUNCTIONS,
        "trap finish EXIT",
    ]
    if fsx_mounts:
        out += [
            'step="installing the Lustre client"',
            "if ! command -v mount.lustre >/dev/null 2>&1; then",
            "  if command -v dnf >/dev/null 2>&1; then",
            "    dnf install -y lustre-client  # Amazon Linux 2023",
            "  elif command -v apt-get >/dev/null 2>&1; then",
            "    apt-get update -y",
            '    apt-get install -y "lustre-client-modules-$(uname -r)"  # Ubuntu, with the FSx apt repository',
            "  else",
            '    echo "trainyard: neither dnf nor apt-get: cannot install the Lustre client" >&2',
            "    exit 1",
            "  fi",
            "fi",
        ]
        for m in fsx_mounts:
            fs_id = m["file_system_id"]
            mount_point = f"{FSX_ROOT}/{fs_id}"
            source = f"{m['dns_name']}@tcp:/{m['mount_name']}"
            out += [
                f"step={q('mounting ' + fs_id)}",
                f"mkdir -p {q(mount_point)}",
                f"mountpoint -q {q(mount_point)} || retry {MOUNT_TRIES} {MOUNT_WAIT_S} "
                f"mount -t lustre -o {LUSTRE_OPTIONS} {q(source)} {q(mount_point)}",
            ]
    out.append(f"export {IMAGE_START_ENV}={NOW}")
    ecr = ecr_registry(image)
    if ecr is not None:
        registry, ecr_region = ecr
        out += [
            'step="logging in to ECR"',
            "ecr_login() {",
            f"  aws ecr get-login-password --region {q(ecr_region)} | "
            f"docker login --username AWS --password-stdin {q(registry)}",
            "}",
            f"retry {PULL_TRIES} {PULL_WAIT_S} ecr_login",
        ]
    out += [
        f"step={q('pulling ' + image)}",
        f"retry {PULL_TRIES} {PULL_WAIT_S} docker pull {q(image)}",
        f"export {IMAGE_END_ENV}={NOW}",
        'step="starting the node agent"',
        f"mkdir -p {ML_ROOT}",
        "devices=()",
        "for dev in /dev/infiniband/uverbs* /dev/neuron*; do  # EFA and Neuron devices, as the instance has them",
        '  if [ -e "$dev" ]; then devices+=(--device "$dev"); fi',
        "done",
        "# --shm-size rather than --ipc host: the container keeps its own IPC namespace (nothing of one job",
        "# leaks into the host's /dev/shm) and NCCL and data-loader workers still get half of the RAM",
        "shm_kib=$(awk '/^MemTotal:/ {print int($2 / 2)}' /proc/meminfo)",
        "code=0",
        AGENT_MARKER,
        _docker_run(spec, itype.num_gpus > 0, bool(fsx_mounts), state_uri, region, attempt) + " || code=$?",
        "# 125-127: docker could not start the container or the agent in it; any other status is the",
        "# agent's, which has reported it itself",
        'if [ "$code" -ge 125 ] && [ "$code" -le 127 ]; then',
        '  step="docker run (exit $code)"',
        '  report_failure "$code" || echo "trainyard: could not write the failure status"',
        "fi",
        "trap - EXIT",
        'echo "trainyard: the node agent exited with status $code; shutting down"',
        "shutdown -h now",
        "",
    ]
    text = "\n".join(out)
    size = len(text.encode())
    if size > USER_DATA_LIMIT:
        raise ValueError(f"the user data of job {spec.job_name} is {size} bytes, over EC2's limit of "
                         f"{USER_DATA_LIMIT} bytes: fewer FSx mounts or shorter URIs")
    return text


def _docker_run(spec: "JobSpec", gpus: bool, fsx: bool, state_uri: str, region: str, attempt: int) -> str:
    parts = ["docker run --rm",
             "--init",  # tini as PID 1: reaps what torchrun leaves behind and passes SIGTERM to the agent
             "--name trainyard-agent --network host",  # host network: peers and IMDS at their real addresses
             # on shutdown or `docker stop`, time for the agent to stop the driver (its STOP_GRACE_S, 30 s)
             # and flush the logs and the status, where docker's default is 10 s
             f"--stop-timeout {STOP_TIMEOUT_S}"]
    if gpus:
        parts.append("--gpus all")
    parts += ['${devices[@]+"${devices[@]}"}',  # the devices found, none without tripping `set -u`
              "--ulimit memlock=-1:-1",  # EFA registers (pins) the training buffers
              f"--ulimit stack={STACK_BYTES}",
              '--shm-size "${shm_kib}k"']
    if fsx:
        parts.append(f"-v {FSX_ROOT}:{FSX_ROOT}")
    parts += [f"-v {ML_ROOT}:{ML_ROOT}", f"-e AWS_REGION={q(region)}",
              # the times the script took above, for the host's phases (exported: -e NAME passes the value)
              f"-e {USERDATA_START_ENV} -e {IMAGE_START_ENV} -e {IMAGE_END_ENV}", q(spec.image_uri),
              "python -m", AGENT_MODULE, "--state-uri", q(state_uri.rstrip("/")), "--region", q(region),
              "--attempt", str(attempt)]
    return " ".join(parts)


def _comment(text: str) -> str:
    return re.sub(r"[^\w.-]", "?", text)


def agent_command(user_data: str) -> list[str]:
    """The node agent's argv in `user_data`: from `python -m trainyard.container.node` to the end of the
    command on the line after `AGENT_MARKER` (before `||`, `;` and the like)."""
    lines = user_data.splitlines()
    try:
        start = lines.index(AGENT_MARKER) + 1
    except ValueError:
        raise ValueError(f"no {AGENT_MARKER!r} line in the user data") from None
    logical = ""
    for line in lines[start:]:  # join backslash continuations
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        break
    lex = shlex.shlex(logical, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = list(lex)
    for i in range(len(tokens) - 2):
        if tokens[i] == "python" and tokens[i + 1] == "-m" and tokens[i + 2] == AGENT_MODULE:
            cmd = []
            for t in tokens[i:]:
                if t and set(t) <= _PUNCTUATION:
                    break
                cmd.append(t)
            return cmd
    raise ValueError(f"the line after {AGENT_MARKER!r} does not run `python -m {AGENT_MODULE}`")


_FUNCTIONS = r'''retry() {  # retry <tries> <seconds between> <command...>
  local tries=$1 wait=$2 i
  shift 2
  for ((i = 1; i <= tries; i++)); do
    if "$@"; then return 0; fi
    echo "trainyard: try $i of $tries failed: $*"
    if ((i < tries)); then sleep "$wait"; fi
  done
  return 1
}
imds() {  # IMDSv2 GET of latest/<path>
  local token
  token=$(curl -sf -m 5 -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" http://169.254.169.254/latest/api/token)
  curl -sf -m 5 -H "X-aws-ec2-metadata-token: $token" "http://169.254.169.254/latest/$1"
}
report_failure() {  # the agent did not run: write this host's status object for it
  local code=$1 index instance host reason now
  instance=$(imds meta-data/instance-id) || return 1
  # the host-index tag (instances Terraform launches one by one), else the launch index
  index=$(aws ec2 describe-instances --region "$REGION" --instance-ids "$instance" --output text --query \
    "Reservations[0].Instances[0].Tags[?Key=='trainyard:host-index'].Value | [0]" 2>/dev/null) || index=""
  case "$index" in '' | None | *[!0-9]*) index=$(imds meta-data/ami-launch-index) || return 1 ;; esac
  host="algo-$((index + 1))"
  reason="$host user data: $step failed (exit $code); see $LOG_FILE on the instance"
  reason=${reason//[\"\\]/?}  # stays a JSON string
  now=$(date -u +%Y-%m-%dT%H:%M:%S+00:00)
  printf '{"host": "%s", "instance_id": "%s", "attempt": %s, "phase": "Failed", "message": "%s", "time": "%s", "exit_code": %s, "failure_reason": "%s"}\n' \
    "$host" "$instance" "$ATTEMPT" "$reason" "$now" "$code" "$reason" |
    aws s3 cp --region "$REGION" --content-type application/json - "$STATE_URI/hosts/$host/status.json"
}
finish() {  # on an early exit: report, then power off all the same
  local code=$?
  echo "trainyard: $step failed (exit $code)"
  report_failure "$code" || echo "trainyard: could not write the failure status"
  echo "trainyard: shutting down"
  shutdown -h now
}'''
