"""`algo-N` host names: the hosts file, the Python shim and the launcher that local hosts start through."""
import json
import os
import subprocess
import sys
import textwrap

from trainyard.container import hostnames

NAMES = {"algo-1": "127.0.0.1", "algo-2": "127.0.0.3"}

# what a program on the host resolves; run with the venv's Python
PROBE = textwrap.dedent('''\
    import json, os, socket
    out = {"uid": os.getuid(), "gid": os.getgid(), "byname": socket.gethostbyname("algo-2"),
           "upper": socket.gethostbyname("ALGO-1"), "ex": socket.gethostbyname_ex("algo-2")[2],
           "addrinfo": sorted({a[4][0] for a in socket.getaddrinfo("algo-2", 80, socket.AF_INET)}),
           "bytes": socket.getaddrinfo(b"algo-1", 80, socket.AF_INET)[0][4][0],
           "localhost": socket.gethostbyname("localhost"), "chained": os.environ.get("CHAINED", "")}
    try:
        socket.gethostbyname("algo-3")
        out["algo-3"] = "resolved"
    except socket.gaierror:
        out["algo-3"] = "unknown"
    print("PROBE " + json.dumps(out), flush=True)
''')


def _probe(out: str) -> dict:
    line = next(l for l in out.splitlines() if l.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def test_hosts_file_keeps_the_base_and_names_each_host_once():
    base = ("# static table\n127.0.0.1\tlocalhost\n::1 localhost ip6-localhost\n"
            "10.9.9.9 algo-2 build-box  # an old entry\n10.8.8.8 ALGO-1\n10.0.0.1 old\t# trainyard\n\n")
    text = hostnames.render_hosts(base, {"algo-1": "10.0.0.5", "algo-2": "10.0.1.7"})
    assert text == ("# static table\n127.0.0.1\tlocalhost\n::1 localhost ip6-localhost\n"
                    "10.9.9.9 build-box # an old entry\n"  # algo-2 goes from the line, the other name stays
                    "10.0.0.5\talgo-1\t# trainyard\n10.0.1.7\talgo-2\t# trainyard\n")
    assert hostnames.marked_names(text) == {"algo-1": "10.0.0.5", "algo-2": "10.0.1.7"}
    # rendering again (a new attempt, other addresses) replaces the lines instead of adding to them
    again = hostnames.render_hosts(text, {"algo-1": "10.0.2.1"})
    assert again.endswith("10.9.9.9 build-box # an old entry\n10.0.2.1\talgo-1\t# trainyard\n")
    assert hostnames.marked_names(again) == {"algo-1": "10.0.2.1"}
    assert hostnames.render_hosts("", {"algo-1": "1.2.3.4"}) == "1.2.3.4\talgo-1\t# trainyard\n"
    # no names: only the lines of an earlier rendering go
    assert hostnames.render_hosts(base, {}) == base.replace("10.0.0.1 old\t# trainyard\n", "").rstrip("\n") + "\n"


def test_prepare_writes_the_job_files(tmp_path):
    base = tmp_path / "etc-hosts"
    base.write_text("127.0.0.1 localhost\n")
    hosts_file, shim_dir = hostnames.prepare(NAMES, str(tmp_path / "job"), base_hosts=str(base))
    assert open(hosts_file).read() == "127.0.0.1 localhost\n127.0.0.1\talgo-1\t# trainyard\n127.0.0.3\talgo-2\t# trainyard\n"
    compile(open(os.path.join(shim_dir, "sitecustomize.py")).read(), "sitecustomize.py", "exec")
    cmd = hostnames.launcher_command("algo-2", hosts_file, shim_dir, python="/py")
    assert cmd == ["/py", "-m", "trainyard.container.hostnames", "--host", "algo-2", "--hosts-file", hosts_file,
                   "--shim-dir", shim_dir, "--"]


def test_shim_answers_python_lookups_and_runs_the_sitecustomize_it_hides(tmp_path):
    _, shim_dir = hostnames.prepare(NAMES, str(tmp_path / "job"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([shim_dir, str(other)])}
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = _probe(r.stdout)
    assert got["byname"] == "127.0.0.3" and got["upper"] == "127.0.0.1" and got["ex"] == ["127.0.0.3"]
    assert got["addrinfo"] == ["127.0.0.3"] and got["bytes"] == "127.0.0.1"
    assert got["localhost"] == "127.0.0.1" and got["algo-3"] == "unknown"  # other names: the system's answer
    assert got["chained"] == "yes"


def _launch(tmp_path, *command, mode: str = "") -> tuple[subprocess.CompletedProcess, str]:
    hosts_file, shim_dir = hostnames.prepare(NAMES, str(tmp_path / "job"))
    env = {**os.environ, hostnames.MODE_ENV: mode}
    r = subprocess.run(hostnames.launcher_command("algo-2", hosts_file, shim_dir) + list(command), env=env,
                       capture_output=True, text=True, timeout=60)
    return r, shim_dir


def test_launcher_gives_the_command_a_private_etc_hosts_or_the_shim(tmp_path):
    with open("/etc/hosts") as fh:
        before = fh.read()
    r, shim_dir = _launch(tmp_path, sys.executable, "-c", PROBE + "import subprocess\n"
                          "print('GETENT ' + subprocess.run(['getent', 'hosts', 'algo-2'], capture_output=True, "
                          "text=True).stdout.strip(), flush=True)\n")
    assert r.returncode == 0, r.stdout + r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("[algo-2] host names: algo-1 127.0.0.1, algo-2 127.0.0.3 through "), first
    got = _probe(r.stdout)
    assert got["byname"] == "127.0.0.3" and got["upper"] == "127.0.0.1" and got["algo-3"] == "unknown"
    assert (got["uid"], got["gid"]) == (os.getuid(), os.getgid())  # a user namespace keeps the ids
    getent = next(l for l in r.stdout.splitlines() if l.startswith("GETENT"))
    if "through a private /etc/hosts" in first:  # every program sees the names
        assert getent.split()[1:] == ["127.0.0.3", "algo-2"], r.stdout
    else:  # no namespace to be had on this machine: Python only
        assert "through a Python shim" in first and getent == "GETENT", r.stdout
    with open("/etc/hosts") as fh:
        assert fh.read() == before  # nothing leaked out of the namespace


def test_namespaces_work_here_as_this_user_and_report_what_fails(tmp_path):
    """The namespace ways this machine offers (as root: both; as another user: the user namespace), and
    an error that says what failed, from a child process that is thrown away."""
    hosts_file, _ = hostnames.prepare(NAMES, str(tmp_path / "job"))
    assert hostnames.private_hosts_work(hosts_file, user=True) is None
    if os.geteuid() == 0:
        assert hostnames.private_hosts_work(hosts_file, user=False) is None
    why = hostnames.private_hosts_work(str(tmp_path / "no-such-file"), user=True)
    assert why is not None and "bind-mounting" in why and "no-such-file" in why


def test_launcher_shim_mode_puts_the_shim_first_on_pythonpath(tmp_path):
    r, shim_dir = _launch(tmp_path, "sh", "-c", 'echo "PYTHONPATH=$PYTHONPATH"; getent hosts algo-2 || echo unknown; '
                          f'exec "{sys.executable}" -c \'{PROBE}\'', mode="shim")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("[algo-2] host names: algo-1 127.0.0.1, algo-2 127.0.0.3 through a Python shim")
    assert lines[0].endswith(f"no private /etc/hosts: {hostnames.MODE_ENV}=shim")
    assert lines[1].split("=", 1)[1].split(os.pathsep)[0] == shim_dir
    assert lines[2] == "unknown"  # getent is not Python: the shim does not reach it
    assert _probe(r.stdout)["byname"] == "127.0.0.3"


def test_launcher_needs_a_command(tmp_path):
    hosts_file, shim_dir = hostnames.prepare(NAMES, str(tmp_path / "job"))
    r = subprocess.run(hostnames.launcher_command("algo-1", hosts_file, shim_dir), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "no command to run" in r.stderr
