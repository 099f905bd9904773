"""EFA/NCCL settings by detection, on fake sysfs trees: what counts as EFA, the plugin's version, which
variables are set, and that the job's own values win. Also the driver's use of it, and the Dockerfile."""
import io
import os
import re
from contextlib import redirect_stdout

import pytest

from trainyard.container import driver, efa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAFE = {"FI_EFA_USE_HUGE_PAGE": "0", "NCCL_SOCKET_IFNAME": "^docker,lo,veth"}


def _pci(sysfs, address, *, driver_name=None, vendor=None, device=None, klass=None):
    """A PCI function under <sysfs>/devices, bound to `driver_name` (a link into bus/pci/drivers, as in sysfs),
    and listed in bus/pci/devices."""
    dev = sysfs / "devices" / "pci0000:00" / address
    dev.mkdir(parents=True)
    for name, value in (("vendor", vendor), ("device", device), ("class", klass)):
        if value is not None:
            (dev / name).write_text(value + "\n")
    if driver_name is not None:
        drv = sysfs / "bus" / "pci" / "drivers" / driver_name
        drv.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(drv, dev), dev / "driver")
    listing = sysfs / "bus" / "pci" / "devices"
    listing.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(dev, listing), listing / address)
    return dev


def _rdma(sysfs, name, pci_dev):
    """An RDMA device <sysfs>/class/infiniband/<name> whose `device` is `pci_dev`."""
    node = pci_dev / "infiniband" / name
    node.mkdir(parents=True)
    os.symlink(os.path.relpath(pci_dev, node), node / "device")
    cls = sysfs / "class" / "infiniband"
    cls.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(node, cls), cls / name)


def _efa_host(tmp_path, n=4, *, uverbs=True):
    sysfs = tmp_path / "sys"
    for i in range(n):
        dev = _pci(sysfs, f"0000:{0x10 + i:02x}:1b.0", driver_name="efa", vendor="0x1d0f", device="0xefa1",
                   klass="0x020000")
        _rdma(sysfs, f"rdmap{16 + i}s27", dev)
    devdir = tmp_path / "dev"
    (devdir / "infiniband").mkdir(parents=True)
    if uverbs:
        for i in range(n):
            (devdir / "infiniband" / f"uverbs{i}").write_text("")
    return sysfs, devdir


def _plugin(tmp_path, version_text: bytes, name="libnccl-net.so"):
    d = tmp_path / "ofi-nccl" / "lib"
    d.mkdir(parents=True, exist_ok=True)
    # a library's bytes around the compiled-in package string, as `strings` shows it
    (d / name).write_bytes(b"\x7fELF\x02\x01" + b"\0" * 64 + b"NET/OFI Initializing " + version_text + b"\0" * 32)
    return str(d)


def _detect(tmp_path, sysfs, devdir, plugin_dirs=(), packages=None, which=lambda name: None):
    return efa.detect(str(sysfs), which=which, plugin_dirs=plugin_dirs, dev=str(devdir),
                      installed_packages=str(packages or tmp_path / "no-such-file"))


def test_no_infiniband_folder_means_no_efa_and_only_the_socket_rule(tmp_path):
    d = efa.detect(str(tmp_path / "empty-sys"), which=lambda name: None, plugin_dirs=(),
                   installed_packages=str(tmp_path / "nothing"), dev=str(tmp_path / "nodev"))
    assert not d.efa and d.efa_devices == () and d.gpus == 0 and d.ofi_nccl_plugin is None and d.fi_info is None
    assert efa.nccl_env(d, {}) == {"NCCL_SOCKET_IFNAME": "^docker,lo,veth"}
    assert d.describe() == "EFA: none"


def test_this_machine_is_harmless():
    """The local backend runs the same driver: detection on the real /sys works and never raises."""
    d = efa.detect()
    assert isinstance(d.efa_devices, tuple) and d.gpus >= 0
    assert "RDMAV_FORK_SAFE" not in efa.nccl_env(d, {})


def test_efa_devices_with_a_current_plugin(tmp_path):
    sysfs, devdir = _efa_host(tmp_path, 4)
    plugin_dir = _plugin(tmp_path, b"aws-ofi-nccl 1.9.1-aws")
    d = _detect(tmp_path, sysfs, devdir, plugin_dirs=[plugin_dir], which=lambda n: f"/opt/amazon/efa/bin/{n}")
    assert d.efa_devices == ("rdmap16s27", "rdmap17s27", "rdmap18s27", "rdmap19s27")
    assert d.uverbs_devices == ("uverbs0", "uverbs1", "uverbs2", "uverbs3")
    assert d.ofi_nccl_version == "1.9.1" and d.ofi_nccl_plugin.endswith("libnccl-net.so") and not d.old_plugin
    assert d.fi_info == "/opt/amazon/efa/bin/fi_info"
    env = efa.nccl_env(d, {})
    assert env == SAFE  # no FI_PROVIDER, no NCCL_PROTO for a plugin newer than 1.5
    assert "RDMAV_FORK_SAFE" not in env
    assert d.describe() == "EFA: 4 device(s), aws-ofi-nccl 1.9.1"


def test_an_old_plugin_also_gets_provider_and_protocol(tmp_path):
    sysfs, devdir = _efa_host(tmp_path, 1)
    for text, old in ((b"aws-ofi-nccl 1.5.0-aws", True), (b"aws-ofi-nccl 1.4.0", True), (b"aws-ofi-nccl 1.6.0", False),
                      (b"aws-ofi-nccl 1.16.2", False)):
        plugin_dir = _plugin(tmp_path / text.decode().replace(" ", "_"), text)
        d = _detect(tmp_path, sysfs, devdir, plugin_dirs=[plugin_dir])
        assert d.old_plugin is old, text
        env = efa.nccl_env(d, {})
        if old:
            assert env == {**SAFE, "FI_PROVIDER": "efa", "NCCL_PROTO": "simple"}
        else:
            assert env == SAFE


def test_version_from_the_installer_record_when_the_library_does_not_say(tmp_path):
    sysfs, devdir = _efa_host(tmp_path, 2)
    plugin_dir = _plugin(tmp_path, b"aws-ofi-nccl GitHub-dev", name="libnccl-net-ofi.so")  # a git build
    record = tmp_path / "efa_installed_packages"
    record.write_text("# EFA installer version: 1.50.0\n# Debug packages installed: yes\n# Packages installed:\n"
                      "ibverbs-providers_60.0-1_amd64 libfabric1-aws_2.4.0amzn3.0_amd64 "
                      "libnccl-ofi-dbgsym_1.4.0-1_amd64 libnccl-ofi_1.4.0-1_amd64 efa-profile_1.7_all\n")
    d = _detect(tmp_path, sysfs, devdir, plugin_dirs=[plugin_dir], packages=record)
    assert d.ofi_nccl_version == "1.4.0" and d.old_plugin
    # without the record the version is unknown, and an unknown plugin is treated as a current one
    d = _detect(tmp_path, sysfs, devdir, plugin_dirs=[plugin_dir])
    assert d.ofi_nccl_version is None and d.ofi_nccl_plugin and not d.old_plugin
    assert efa.nccl_env(d, {}) == SAFE
    assert d.describe() == "EFA: 2 device(s), aws-ofi-nccl (version unknown)"


def test_a_non_efa_rdma_device_does_not_count(tmp_path):
    sysfs = tmp_path / "sys"
    mlx = _pci(sysfs, "0000:3b:00.0", driver_name="mlx5_core", vendor="0x15b3", device="0x101b", klass="0x020700")
    _rdma(sysfs, "mlx5_0", mlx)
    d = _detect(tmp_path, sysfs, tmp_path / "dev")
    assert d.efa_devices == () and d.other_rdma_devices == ("mlx5_0",)
    assert efa.nccl_env(d, {}) == {"NCCL_SOCKET_IFNAME": "^docker,lo,veth"}
    assert "mlx5_0" in d.describe() and d.describe().startswith("EFA: none")
    # next to EFA devices, still only the EFA ones count
    sysfs2, devdir = _efa_host(tmp_path / "mixed", 2)
    mlx2 = _pci(sysfs2, "0000:3b:00.0", driver_name="mlx5_core", vendor="0x15b3", device="0x101b")
    _rdma(sysfs2, "mlx5_0", mlx2)
    d = _detect(tmp_path, sysfs2, devdir)
    assert d.efa_devices == ("rdmap16s27", "rdmap17s27") and d.other_rdma_devices == ("mlx5_0",)


def test_amazon_pci_ids_count_when_the_driver_link_is_unreadable(tmp_path):
    sysfs = tmp_path / "sys"
    dev = _pci(sysfs, "0000:10:1b.0", vendor="0x1d0f", device="0xefa2")  # no driver link
    _rdma(sysfs, "rdmap16s27", dev)
    ena = _pci(sysfs, "0000:20:05.0", vendor="0x1d0f", device="0xec20")  # an ENA function is not EFA
    _rdma(sysfs, "odd0", ena)
    d = _detect(tmp_path, sysfs, tmp_path / "dev")
    assert d.efa_devices == ("rdmap16s27",) and d.other_rdma_devices == ("odd0",)


def test_gpus_are_nvidia_display_functions_only(tmp_path):
    sysfs = tmp_path / "sys"
    for i in range(8):
        _pci(sysfs, f"0000:{0x50 + i:02x}:00.0", driver_name="nvidia", vendor="0x10de", klass="0x030200")
    _pci(sysfs, "0000:90:00.0", driver_name="nvidia", vendor="0x10de", klass="0x068000")  # an NVSwitch bridge
    _pci(sysfs, "0000:00:02.0", vendor="0x1234", klass="0x030000")  # another vendor's display
    d = _detect(tmp_path, sysfs, tmp_path / "dev")
    assert d.gpus == 8


def test_the_jobs_own_variables_win(tmp_path):
    sysfs, devdir = _efa_host(tmp_path, 4)
    d = _detect(tmp_path, sysfs, devdir, plugin_dirs=[_plugin(tmp_path, b"aws-ofi-nccl 1.5.0")])
    existing = {"NCCL_SOCKET_IFNAME": "ens32", "NCCL_PROTO": "LL128", "FI_EFA_USE_HUGE_PAGE": ""}
    assert efa.nccl_env(d, existing) == {"FI_PROVIDER": "efa"}  # an empty value is a value the user chose
    environ = dict(existing, PATH="/bin")
    line = efa.configure(environ, d)
    assert environ == {**existing, "PATH": "/bin", "FI_PROVIDER": "efa"}
    assert line == ("EFA: 4 device(s), aws-ofi-nccl 1.5.0; set FI_PROVIDER=efa; kept the job's "
                    "FI_EFA_USE_HUGE_PAGE= NCCL_PROTO=LL128 NCCL_SOCKET_IFNAME=ens32")


def test_configure_says_what_it_found_and_set(tmp_path):
    sysfs, devdir = _efa_host(tmp_path, 4)
    d = _detect(tmp_path, sysfs, devdir, plugin_dirs=[_plugin(tmp_path, b"aws-ofi-nccl 1.9.1-aws")])
    environ: dict = {}
    assert efa.configure(environ, d) == \
        "EFA: 4 device(s), aws-ofi-nccl 1.9.1; set FI_EFA_USE_HUGE_PAGE=0 NCCL_SOCKET_IFNAME=^docker,lo,veth"
    assert environ == SAFE
    # a second call finds everything set and says so
    assert efa.configure(environ, d).endswith("; set nothing; kept the job's FI_EFA_USE_HUGE_PAGE=0 "
                                              "NCCL_SOCKET_IFNAME=^docker,lo,veth")


def test_devices_not_passed_into_the_container_are_named(tmp_path):
    sysfs, devdir = _efa_host(tmp_path, 4, uverbs=False)
    d = _detect(tmp_path, sysfs, devdir)
    assert d.efa and d.uverbs_devices == ()
    text = d.describe()
    assert "no aws-ofi-nccl plugin found" in text and "no /dev/infiniband/uverbs*" in text


def test_plugin_dirs_follow_ld_library_path_first():
    dirs = efa.default_plugin_dirs({"LD_LIBRARY_PATH": "/custom/lib::/opt/amazon/ofi-nccl/lib"})
    assert dirs[0] == "/custom/lib" and dirs.count("/opt/amazon/ofi-nccl/lib") == 1
    assert "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu" in dirs


@pytest.mark.parametrize("text,expected", [("1.9.1-aws", (1, 9, 1)), ("v1.5", (1, 5)), ("GitHub-dev", None),
                                           (None, None), ("1.16.2", (1, 16, 2))])
def test_parse_version(text, expected):
    assert efa.parse_version(text) == expected


def test_the_driver_adds_the_variables_and_logs_one_line(tmp_path):
    sysfs, devdir = _efa_host(tmp_path, 4)
    d = _detect(tmp_path, sysfs, devdir, plugin_dirs=[_plugin(tmp_path, b"aws-ofi-nccl 1.9.1-aws")])
    environ = {"NCCL_SOCKET_IFNAME": "eth0"}
    out = io.StringIO()
    with redirect_stdout(out):
        driver.configure_network("algo-1", environ, detect=lambda: d)
    # the EFA count also goes to the engine, for the run's hardware fingerprint
    assert environ == {"NCCL_SOCKET_IFNAME": "eth0", "FI_EFA_USE_HUGE_PAGE": "0", "TRAINYARD_EFA_DEVICES": "4"}
    assert out.getvalue() == ("[algo-1] driver: EFA: 4 device(s), aws-ofi-nccl 1.9.1; set FI_EFA_USE_HUGE_PAGE=0; "
                              "kept the job's NCCL_SOCKET_IFNAME=eth0\n")

    # a CPU host (no GPU, no EFA device: gloo, no NCCL): the variables all the same, and not a word
    cpu = _detect(tmp_path, *_efa_host(tmp_path / "cpu", 0))
    environ, out = {}, io.StringIO()
    with redirect_stdout(out):
        driver.configure_network("algo-1", environ, detect=lambda: cpu)
    assert out.getvalue() == "" and environ["TRAINYARD_EFA_DEVICES"] == "0" and "NCCL_SOCKET_IFNAME" in environ

    def broken():
        raise PermissionError("sysfs says no")

    out = io.StringIO()
    with redirect_stdout(out):
        driver.configure_network("algo-2", {}, detect=broken)  # detection never fails a job
    assert out.getvalue().startswith("[algo-2] driver: EFA/NCCL detection failed (PermissionError: sysfs says no)")


def test_probe_switch_and_port():
    assert driver.probe_requested({"TRAINYARD_BANDWIDTH_PROBE": "1"})
    assert driver.probe_requested({"TRAINYARD_BANDWIDTH_PROBE": "true"})
    assert not driver.probe_requested({}) and not driver.probe_requested({"TRAINYARD_BANDWIDTH_PROBE": "0"})
    assert driver.probe_port(29400, {}) == 29401
    assert driver.probe_port(29400, {"TRAINYARD_PROBE_PORT": "31000"}) == 31000


# -- the image's definition ------------------------------------------------------------------------


def _dockerfile() -> str:
    with open(os.path.join(ROOT, "trainyard", "container", "Dockerfile")) as fh:
        return fh.read()


def test_dockerfile_runs_the_efa_installer_with_the_reference_flags():
    text = _dockerfile()
    # REFERENCE.md: EFA installer with `-y -g -d --skip-kmod --skip-limit-conf --no-verify`
    assert re.search(r"^\s*\./efa_installer\.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify;", text, re.M)
    assert "https://efa-installer.amazonaws.com" in text and "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" in text
    assert "gpg --batch --status-fd 1 --verify" in text  # verified before it runs
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "RDMAV_FORK_SAFE" not in text and "ENV FI_" not in text and "ENV NCCL_" not in text  # by detection


def test_dockerfile_installs_trainyard_from_the_context_and_runs_commands_as_given():
    text = _dockerfile()
    assert re.search(r"^COPY \. /src$", text, re.M) and re.search(r"^\s+pip install /src\b", text, re.M)
    assert "pip install -e" not in text
    # user data runs `docker run ... <image> python -m trainyard.container.node ...`: nothing may wrap it
    assert re.search(r"^ENTRYPOINT \[\]$", text, re.M)
    assert re.search(r"^CMD \[\"python\", \"-m\", \"trainyard.container.node\"", text, re.M)
    assert "/opt/venv/bin" in text  # `python` is the environment's


def test_torch_pin_matches_pyproject():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.startswith("torch"))
    version = re.search(r"ARG TORCH_VERSION=(\S+)", _dockerfile()).group(1)
    assert torch_pin == f"torch=={version}"
