"""SageMaker's host names, `algo-1`..`algo-N`, resolvable on every host of a job.

Scripts written for SageMaker do `MASTER_ADDR = SM_HOSTS[0]`, `socket.gethostbyname("algo-2")` or write
hostfiles with these names, so every host must resolve them. Two ways, both built from `render_hosts`:

* an /etc/hosts with one `ADDR algo-i  # trainyard` line per host. On EC2 the node agent adds the lines to
  the container's own /etc/hosts (`update_hosts_file`; it is root there). Locally every host runs on this
  one machine, so each host's driver is started by this module's launcher,

      python -m trainyard.container.hostnames --host algo-1 --hosts-file F --shim-dir D -- <driver command>

  which bind-mounts the job's hosts file F over /etc/hosts in a mount namespace of its own (as root), or
  in a user and mount namespace that keeps the caller's uid and gid (without root, where the kernel lets
  unprivileged users have one), then runs the command in it: every program of the host sees the names;
* where neither namespace can be had, a Python shim: `D/sitecustomize.py` (`render_shim`) put first on
  PYTHONPATH, which answers socket.getaddrinfo/gethostbyname/gethostbyname_ex for the job's names and then
  runs the sitecustomize it hides. Only Python's own lookups see the names there; C++ code that resolves
  by itself (torch.distributed's TCPStore for `tcp://algo-1:port`) does not. glibc's HOSTALIASES is no
  way out: it only rewrites names sent to DNS and maps names to names, never to addresses.

The launcher says on its output (the host's log) which way it took. `TRAINYARD_HOST_NAMES=shim` in the
environment skips the namespaces. Nothing here imports anything outside the standard library.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Mapping

HOSTS_FILE = "/etc/hosts"
MARK = "# trainyard"  # ends every line this module adds: the next rendering replaces them
MODE_ENV = "TRAINYARD_HOST_NAMES"  # "shim": no namespaces, the Python shim only
# "1" when every program of the host resolves the names (a private /etc/hosts, or EC2's): the driver then
# gives torchrun `algo-1` as its master address, so scripts see MASTER_ADDR=algo-1 as on SageMaker
RESOLVES_ENV = "TRAINYARD_HOST_NAMES_RESOLVE"
SHIM_FILE = "sitecustomize.py"

# <sched.h>, <sys/mount.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000


# -- hosts files ----------------------------------------------------------------------------------


def render_hosts(base: str, names: Mapping[str, str]) -> str:
    """`base` (the text of an /etc/hosts) with one `ADDR NAME  # trainyard` line per entry of `names`
    (name -> address) at the end. Lines of an earlier rendering go, and so do the given names on other
    lines (an address left with no name goes with them): each name resolves to its address only."""
    wanted = {n.lower() for n in names}
    kept = []
    for line in base.splitlines():
        if line.rstrip().endswith(MARK):
            continue
        body, hash_, comment = line.partition("#")
        fields = body.split()
        if len(fields) >= 2 and any(f.lower() in wanted for f in fields[1:]):
            others = [f for f in fields[1:] if f.lower() not in wanted]
            if not others:
                continue
            line = " ".join([fields[0], *others]) + (f" #{comment}" if hash_ else "")
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    added = [f"{addr}\t{name}\t{MARK}" for name, addr in names.items()]
    return "".join(f"{line}\n" for line in [*kept, *added])


def marked_names(text: str) -> dict[str, str]:
    """The name -> address entries that `render_hosts` added to a hosts file's text."""
    out = {}
    for line in text.splitlines():
        if line.rstrip().endswith(MARK):
            fields = line.split("#", 1)[0].split()
            out.update({name: fields[0] for name in fields[1:]})
    return out


def update_hosts_file(names: Mapping[str, str], path: str = HOSTS_FILE) -> str:
    """Add the names to the hosts file at `path` (see `render_hosts`), rewriting it in place: a container's
    /etc/hosts is a bind mount that cannot be replaced by a rename. Returns the new text."""
    try:
        with open(path) as fh:
            base = fh.read()
    except FileNotFoundError:
        base = ""
    text = render_hosts(base, names)
    with open(path, "w") as fh:
        fh.write(text)
    return text


# -- the Python shim ------------------------------------------------------------------------------

_SHIM = '''\
"""Written by trainyard (trainyard/container/hostnames.py): the job's host names for Python programs on a
host that has no private /etc/hosts. Answers socket's name lookups for them, then runs the sitecustomize
that this one hides on sys.path."""
import socket as _socket

_NAMES = @NAMES@


def _install():
    names = {k.lower(): v for k, v in _NAMES.items()}

    def address(host):
        if isinstance(host, (bytes, bytearray)):
            host = bytes(host).decode("ascii", "replace")
        return names.get(host.rstrip(".").lower()) if isinstance(host, str) else None

    getaddrinfo, gethostbyname, gethostbyname_ex = \\
        _socket.getaddrinfo, _socket.gethostbyname, _socket.gethostbyname_ex

    def shim_getaddrinfo(host, *args, **kwargs):
        return getaddrinfo(address(host) or host, *args, **kwargs)

    def shim_gethostbyname(host):
        return address(host) or gethostbyname(host)

    def shim_gethostbyname_ex(host):
        found = address(host)
        return (host, [], [found]) if found else gethostbyname_ex(host)

    for name, fn, original in (("getaddrinfo", shim_getaddrinfo, getaddrinfo),
                               ("gethostbyname", shim_gethostbyname, gethostbyname),
                               ("gethostbyname_ex", shim_gethostbyname_ex, gethostbyname_ex)):
        fn.__name__, fn.__doc__, fn.__wrapped__ = name, original.__doc__, original
        setattr(_socket, name, fn)


def _chain():
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_install()
_chain()
'''


def render_shim(names: Mapping[str, str]) -> str:
    """The source of the `sitecustomize.py` that resolves `names` (name -> address) in Python programs."""
    return _SHIM.replace("@NAMES@", repr(dict(names)))


# -- the local jobs' launcher ---------------------------------------------------------------------


def prepare(names: Mapping[str, str], folder: str, base_hosts: str = HOSTS_FILE) -> tuple[str, str]:
    """Write a job's hosts file (`base_hosts` plus the names) and its shim into `folder`; returns
    (hosts file, shim folder) for `launcher_command`."""
    shim_dir = os.path.join(folder, "python")
    os.makedirs(shim_dir, exist_ok=True)
    try:
        with open(base_hosts) as fh:
            base = fh.read()
    except FileNotFoundError:
        base = "127.0.0.1\tlocalhost\n::1\tlocalhost\n"
    hosts_file = os.path.join(folder, "hosts")
    with open(hosts_file, "w") as fh:
        fh.write(render_hosts(base, names))
    with open(os.path.join(shim_dir, SHIM_FILE), "w") as fh:
        fh.write(render_shim(names))
    return hosts_file, shim_dir


def launcher_command(host: str, hosts_file: str, shim_dir: str, python: str = sys.executable) -> list[str]:
    """The prefix that runs a command with the job's names resolvable (the command follows it)."""
    return [python, "-m", "trainyard.container.hostnames", "--host", host, "--hosts-file", hosts_file,
            "--shim-dir", shim_dir, "--"]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def enter_private_hosts(hosts_file: str, user: bool) -> None:
    """Move this (single-threaded) process into a new mount namespace, and with `user` a new user
    namespace too, in which `hosts_file` is bind-mounted over /etc/hosts. The user namespace maps the
    caller's uid and gid to themselves: programs run in it see the same ids as outside. Raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWNS | (CLONE_NEWUSER if user else 0)), "unshare")
    if user:
        _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    # nothing mounted here may reach the namespace we came from
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    _check(libc.mount(os.fsencode(hosts_file), os.fsencode(HOSTS_FILE), None, MS_BIND, None),
           f"bind-mounting {hosts_file} over {HOSTS_FILE}")


def private_hosts_work(hosts_file: str, user: bool) -> str | None:
    """Whether `enter_private_hosts` works here, tried in a child process (a half-made user namespace
    cannot be left again). Returns None when it does, else why not."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: try, report, leave without running any cleanup of the parent's
        os.close(read_end)
        code = 0
        try:
            enter_private_hosts(hosts_file, user)
        except BaseException as e:  # noqa: BLE001 - whatever it is, the parent hears of it
            os.write(write_end, f"{type(e).__name__}: {e}".encode()[:4000])
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        why = fh.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return why or f"the trial process ended with status {os.waitstatus_to_exitcode(status)}"


def isolate(hosts_file: str, shim_dir: str, environ: dict[str, str]) -> str:
    """Make the names in `hosts_file` resolvable for this process and what it runs next: a private
    /etc/hosts when a namespace can be had, else the shim in `shim_dir` first on `environ`'s PYTHONPATH.
    Returns how, for the log."""
    failures = []
    if environ.get(MODE_ENV, "").strip().lower() == "shim":
        failures.append(f"{MODE_ENV}=shim")
    else:
        ways = [("a mount namespace", False)] if os.geteuid() == 0 else []
        ways.append(("a user and mount namespace", True))
        for what, user in ways:
            why = private_hosts_work(hosts_file, user)
            if why is None:
                enter_private_hosts(hosts_file, user)
                environ[RESOLVES_ENV] = "1"
                return f"through a private {HOSTS_FILE} ({what})"
            failures.append(f"{what}: {why}")
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (shim_dir, environ.get("PYTHONPATH")) if p)
    environ.pop(RESOLVES_ENV, None)
    return (f"through a Python shim ({shim_dir}/{SHIM_FILE} first on PYTHONPATH; programs that are not "
            f"Python do not see them), no private {HOSTS_FILE}: {'; '.join(failures)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainyard.container.hostnames",
                                description="Run a command with the job's host names resolvable.")
    p.add_argument("--host", required=True, help="this host's name, for the log line")
    p.add_argument("--hosts-file", required=True, help="the job's hosts file (render_hosts)")
    p.add_argument("--shim-dir", required=True, help="the folder of the job's sitecustomize.py (render_shim)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command to run")
    with open(a.hosts_file) as fh:
        names = marked_names(fh.read())
    environ = dict(os.environ)
    how = isolate(a.hosts_file, a.shim_dir, environ)
    listed = ", ".join(f"{name} {addr}" for name, addr in names.items())
    print(f"[{a.host}] host names: {listed} {how}", flush=True)
    os.execvpe(command[0], command, environ)
    return 127  # not reached: exec replaced this process or raised


if __name__ == "__main__":
    sys.exit(main())
