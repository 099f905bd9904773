"""SageMaker's `git_config`: the code cloned from a repository into a temporary folder, which source_dir,
entry_point and dependencies then name paths in.

Credentials never reach a command line (every local user sees those in `ps`) or a file another user can read:
`token`, or `username` and `password`, go to git through its askpass protocol: `GIT_ASKPASS` names a small
script, in a folder of this user's alone, that prints them from this process's environment (readable by this
user only) when git asks. The repository comes after `--` (a value starting with `-` is not an option to git),
only the http(s), ssh, git and file transports are allowed (`ext::` would run a command), the user's credential
helpers are not asked, and a failed clone removes its folder.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile

from trainyard.errors import ConfigError

# the askpass helper: git calls it with its prompt ("Username for ...", "Password for ...")
_ASKPASS = """#!{python}
import os, sys
prompt = sys.argv[1] if len(sys.argv) > 1 else ""
print(os.environ.get("TRAINYARD_GIT_USERNAME" if prompt.startswith("Username") else "TRAINYARD_GIT_PASSWORD", ""))
"""
PROTOCOLS = "http:https:ssh:git:file"


def clone(git_config: object) -> str:
    """Clone `repo` (at `branch` and `commit`) into a new temporary folder; returns it (ConfigError, and no
    folder left, on any failure)."""
    if not isinstance(git_config, dict) or not isinstance(git_config.get("repo"), str):
        raise ConfigError("git_config", f"expected {{'repo': URL, 'branch': ..., 'commit': ...}}, got {git_config!r}")
    for key in ("branch", "commit"):
        value = git_config.get(key)
        if value is not None and (not isinstance(value, str) or value.startswith("-") or not value.strip()):
            raise ConfigError("git_config", f"{key} {value!r}: a branch name or a commit hash")
    repo = git_config["repo"]
    dest = tempfile.mkdtemp(prefix="trainyard-git-")
    helper = tempfile.mkdtemp(prefix="trainyard-askpass-")  # 0700: mkdtemp's mode
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ALLOW_PROTOCOL": PROTOCOLS}
    secret = _credentials(git_config)
    try:
        if secret is not None:
            askpass = os.path.join(helper, "askpass")
            with open(askpass, "w") as fh:
                fh.write(_ASKPASS.format(python=sys.executable))
            os.chmod(askpass, stat.S_IRWXU)
            env.update(GIT_ASKPASS=askpass, TRAINYARD_GIT_USERNAME=secret[0], TRAINYARD_GIT_PASSWORD=secret[1])
        # no credential helper of the user's: these credentials, or none
        steps = [["git", "-c", "credential.helper=", "clone", "--quiet", "--", repo, dest]]
        if git_config.get("branch"):
            steps.append(["git", "-C", dest, "checkout", "--quiet", git_config["branch"], "--"])
        if git_config.get("commit"):
            steps.append(["git", "-C", dest, "checkout", "--quiet", git_config["commit"], "--"])
        for cmd in steps:
            _run(cmd, env, repo)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(helper, ignore_errors=True)
    return dest


def _credentials(git_config: dict) -> tuple[str, str] | None:
    """(username, password) for the askpass helper: a token is the user name (GitHub's personal access tokens)."""
    if git_config.get("token"):
        return str(git_config["token"]), ""
    if git_config.get("username"):
        return str(git_config["username"]), str(git_config.get("password") or "")
    return None


def _run(cmd: list[str], env: dict, repo: str) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError("git_config", f"git {cmd[3] if 'clone' in cmd else 'checkout'} failed: {e}") from None
    if r.returncode != 0:
        what = f"clone {repo}" if "clone" in cmd else f"checkout {cmd[-2]}"
        raise ConfigError("git_config", f"git could not {what}: {(r.stderr or r.stdout).strip()[-500:]}")
