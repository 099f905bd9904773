"""requirements.txt into an overlay (trainyard/container/requirements.py): real pip, offline, local wheels."""
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile

import pytest

import trainyard
from trainyard.container import requirements
from trainyard.container.requirements import RequirementsError, overlay_key, prepare

from .wheels import make_wheel


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """pip sees no index and no configuration of this machine: only the paths the tests give it."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)


def _code(tmp_path, lines, name="code", **wheel):
    code = tmp_path / name
    make_wheel(str(code / "wheels"), **wheel)
    (code / "requirements.txt").write_text("\n".join(lines) + "\n")
    return str(code)


def _env_listing():
    """What the running environment has installed: its site-packages and bin folders, entry by entry."""
    dirs = [*site.getsitepackages(), os.path.join(sys.prefix, "bin")]
    return {d: sorted(e for e in os.listdir(d) if e != "__pycache__") for d in dirs if os.path.isdir(d)}


def _run(code, environ, python=sys.executable):
    return subprocess.run([python, "-c", code], env=environ, capture_output=True, text=True, timeout=60)


def _env_with(tmp_path, *wheels):
    """A virtual environment that sees this one (pip, trainyard) and has `wheels` installed: its python."""
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(str(env))
    python = str(env / "bin" / "python")
    env_site = _run("import sysconfig; print(sysconfig.get_path('purelib'))", {}, python).stdout.strip()
    with open(os.path.join(env_site, "outer.pth"), "w") as fh:
        for d in site.getsitepackages():
            fh.write(f"import site; site.addsitedir({d!r})\n")
        fh.write(os.path.dirname(os.path.dirname(trainyard.__file__)) + "\n")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(env_site)
    return python


def test_no_requirements_txt_gives_none(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    assert prepare(str(tmp_path), str(tmp_path / "cache"), say=lambda m: None) is None
    assert not (tmp_path / "cache").exists()


def test_installs_into_an_overlay_that_a_subprocess_sees_and_leaves_the_environment_alone(tmp_path):
    code = _code(tmp_path, ["numpy", "./wheels/tinypkg-0.1-py3-none-any.whl"])
    before = _env_listing()
    said = []
    ov = prepare(code, str(tmp_path / "cache"), say=said.append)

    assert not ov.reused and ov.installed == ["tinypkg==0.1"]
    assert os.path.dirname(ov.path) == str(tmp_path / "cache") and ov.pythonpath[0] == ov.site_packages
    assert os.path.isfile(os.path.join(ov.site_packages, "tinypkg", "__init__.py"))
    assert "installed 1 package(s)" in ov.summary() and ov.path in ov.summary()
    # pip's output reached the log; numpy, already in the environment, was not installed again
    assert any(m.startswith("pip: Requirement already satisfied: numpy") for m in said), said
    assert not [f for _, ds, fs in os.walk(ov.path) for f in ds + fs if "numpy" in f.lower()]
    # the running environment is unchanged
    assert importlib.util.find_spec("tinypkg") is None
    assert _env_listing() == before

    environ = dict(os.environ, PYTHONPATH="/elsewhere", PATH="/usr/bin:/bin")
    ov.activate(environ)
    assert environ["PYTHONPATH"].split(os.pathsep) == [*ov.pythonpath, "/elsewhere"]
    assert environ["PATH"].split(os.pathsep) == [ov.bin_dir, "/usr/bin", "/bin"]
    r = _run("import numpy, tinypkg; print(tinypkg.VERSION, tinypkg.__file__, numpy.__file__)", environ)
    assert r.returncode == 0, r.stderr
    version, tiny_file, numpy_file = r.stdout.split()
    assert version == "0.1" and tiny_file.startswith(ov.path)
    assert numpy_file.startswith(os.path.realpath(sys.prefix)) or numpy_file.startswith(sys.prefix)
    # the console script is on PATH and runs with this Python (which sees the overlay)
    cli = shutil.which("tinypkg-cli", path=environ["PATH"])
    assert cli == os.path.join(ov.bin_dir, "tinypkg-cli")
    r = subprocess.run([cli], env=environ, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "hello from tinypkg 0.1", r.stderr


def test_same_requirements_reuse_the_overlay_without_pip(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    first = prepare(_code(tmp_path, ["./wheels/tinypkg-0.1-py3-none-any.whl"]), cache, say=lambda m: None)

    def no_pip(*a, **kw):
        raise AssertionError("pip ran again")

    monkeypatch.setattr(requirements, "_run_pip", no_pip)
    # another job: another code folder with the same requirements and the same wheel
    again = prepare(_code(tmp_path, ["./wheels/tinypkg-0.1-py3-none-any.whl"], name="code2"), cache, say=lambda m: None)
    assert again.reused and again.path == first.path and again.pythonpath == first.pythonpath
    assert again.installed == ["tinypkg==0.1"] and again.summary() == f"reused {first.path}"
    # the same file name with other bytes is another overlay: pip must run
    other = _code(tmp_path, ["./wheels/tinypkg-0.1-py3-none-any.whl"], name="code3", extra="CHANGED = True\n")
    assert overlay_key(other) != os.path.basename(first.path)
    with pytest.raises(AssertionError, match="pip ran again"):
        prepare(other, cache, say=lambda m: None)


def test_a_half_finished_install_is_not_reused(tmp_path):
    code = _code(tmp_path, ["./wheels/tinypkg-0.1-py3-none-any.whl"])
    cache = tmp_path / "cache"
    leftover = cache / overlay_key(code)
    (leftover / "lib").mkdir(parents=True)
    (leftover / "lib" / "half-written").write_text("x")
    ov = prepare(code, str(cache), say=lambda m: None)
    assert ov.path == str(leftover) and not ov.reused and ov.installed == ["tinypkg==0.1"]
    assert not (leftover / "lib" / "half-written").exists()
    assert os.path.isfile(os.path.join(ov.site_packages, "tinypkg", "__init__.py"))


def test_concurrent_processes_install_once(tmp_path):
    code = _code(tmp_path, ["./wheels/tinypkg-0.1-py3-none-any.whl"])
    cache = str(tmp_path / "cache")
    script = ("import json, sys; from trainyard.container.requirements import prepare; "
              "o = prepare(sys.argv[1], sys.argv[2], say=lambda m: None); print(json.dumps([o.reused, o.path]))")
    procs = [subprocess.Popen([sys.executable, "-c", script, code, cache], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(reused for reused, _ in results) == [False, True, True]
    assert len({path for _, path in results}) == 1


def test_a_failing_requirement_raises_with_pips_message_and_caches_nothing(tmp_path):
    code = _code(tmp_path, ["./wheels/tinypkg-9.9-py3-none-any.whl"])  # no such file
    cache = tmp_path / "cache"
    said = []
    with pytest.raises(RequirementsError) as e:
        prepare(code, str(cache), say=said.append)
    msg = str(e.value)
    first = msg.splitlines()[0]
    assert first.startswith("pip install -r requirements.txt failed (exit 1): ERROR:")
    assert "tinypkg-9.9-py3-none-any.whl" in msg
    # pip's own lines, as the log showed them
    errors = [m[len("pip: "):] for m in said if m.startswith("pip: ERROR:")]
    assert errors and errors[0] in first
    assert [p.name for p in cache.iterdir()] == [f"{overlay_key(code)}.lock"]  # no overlay left behind
    # fixed, the next attempt installs
    (tmp_path / "code" / "requirements.txt").write_text("./wheels/tinypkg-0.1-py3-none-any.whl\n")
    assert prepare(code, str(cache), say=lambda m: None).installed == ["tinypkg==0.1"]


def test_pips_environment_variables_apply(tmp_path, monkeypatch):
    code = _code(tmp_path, ["tinypkg==0.1"])  # by name: only PIP_FIND_LINKS says where it is
    with pytest.raises(RequirementsError, match="No matching distribution found for tinypkg==0.1"):
        prepare(code, str(tmp_path / "cache"), say=lambda m: None)
    monkeypatch.setenv("PIP_FIND_LINKS", os.path.join(code, "wheels"))
    monkeypatch.setenv("PIP_TARGET", str(tmp_path / "target"))  # would move the install out of the overlay
    ov = prepare(code, str(tmp_path / "cache"), say=lambda m: None)
    assert ov.installed == ["tinypkg==0.1"] and not (tmp_path / "target").exists()


def test_another_version_of_an_installed_package_goes_to_the_overlay_and_the_environment_keeps_its_own(tmp_path):
    """pip's --prefix alone would uninstall the environment's tinypkg 0.1 here: it must stay."""
    python = _env_with(tmp_path, make_wheel(str(tmp_path / "w"), version="0.1"))  # tinypkg 0.1 installed there
    env_site = _run("import sysconfig; print(sysconfig.get_path('purelib'))", {}, python).stdout.strip()
    code = _code(tmp_path, ["./wheels/tinypkg-0.2-py3-none-any.whl"], version="0.2")
    script = ("import json, sys; from trainyard.container.requirements import prepare; "
              "o = prepare(sys.argv[1], sys.argv[2], say=print); print(json.dumps(o.pythonpath))")
    r = subprocess.run([python, "-c", script, code, str(tmp_path / "cache")], env=dict(os.environ),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Not uninstalling tinypkg" in r.stdout
    pythonpath = json.loads(r.stdout.splitlines()[-1])
    assert os.path.isfile(os.path.join(env_site, "tinypkg-0.1.dist-info", "RECORD"))
    assert os.path.isfile(os.path.join(env_site, "tinypkg", "__init__.py"))
    show = "import tinypkg; print(tinypkg.VERSION)"
    assert _run(show, dict(os.environ), python).stdout.strip() == "0.1"
    assert _run(show, dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath)), python).stdout.strip() == "0.2"


def test_an_overlay_that_shadows_a_package_with_a_version_others_refuse_is_refused_naming_them(tmp_path):
    """pip installs an old copy of a package that installed packages need newer (the HF notebook's pinned
    transformers brought an old huggingface_hub under datasets), warns, and exits 0; the job would fail at an
    import. Here pytest (installed) requires `packaging` newer than the requirements file's 0.0.1."""
    code = tmp_path / "code"
    make_wheel(str(code / "wheels"), name="packaging", version="0.0.1")
    (code / "requirements.txt").write_text("./wheels/packaging-0.0.1-py3-none-any.whl\n")
    cache = tmp_path / "cache"
    with pytest.raises(RequirementsError) as e:
        prepare(str(code), str(cache), say=lambda _: None)
    text = str(e.value)
    assert text.startswith("requirements.txt: what requirements.txt installs breaks")
    assert "has requirement packaging" in text and "but you have packaging 0.0.1" in text, text
    assert "pytest" in text
    assert not any(p.is_dir() for p in cache.iterdir())  # nothing cached: the next attempt installs again



PREPARE = ("import json, sys; from trainyard.container.requirements import prepare, RequirementsError\n"
           "try:\n    o = prepare(sys.argv[1], sys.argv[2], say=print, pins=sys.argv[3:])\n"
           "except RequirementsError as e:\n    print('REFUSED', json.dumps(str(e)))\n"
           "else:\n    print('INSTALLED', json.dumps(o.installed))\n")


@pytest.mark.parametrize("fitting", [True, False], ids=["a-fitting-version-exists", "none-fits"])
def test_a_dependent_the_overlay_breaks_is_resolved_again_into_it_or_the_install_is_refused(tmp_path, fitting):
    """The environment has tinypkg 0.2 and `dependent` 1.0, which needs tinypkg>=0.2; the requirements pin
    tinypkg 0.1 (as an HF notebook's transformers pin brings an old huggingface_hub under datasets). pip
    installs it and only warns. The overlay then gets a `dependent` that accepts 0.1, resolved by pip against
    the whole environment, or, where none exists, the install is refused naming the broken requirement."""
    built = tmp_path / "built"
    python = _env_with(tmp_path, make_wheel(str(built), version="0.2"),
                       make_wheel(str(built), name="dependent", version="1.0", requires=("tinypkg>=0.2",)))
    code = tmp_path / "code"
    make_wheel(str(code / "wheels"), version="0.1")
    if fitting:
        make_wheel(str(code / "wheels"), name="dependent", version="0.9", requires=("tinypkg<0.2",))
    (code / "requirements.txt").write_text("--find-links ./wheels\ntinypkg==0.1\n")
    r = subprocess.run([python, "-c", PREPARE, str(code), str(tmp_path / "cache")], env=dict(os.environ),
                       capture_output=True, text=True, timeout=180)
    last = r.stdout.splitlines()[-1]
    assert "break(s) what dependent of the environment need(s)" in r.stdout, r.stdout + r.stderr
    if fitting:
        assert last.startswith("INSTALLED") and json.loads(last.split(" ", 1)[1]) == ["dependent==0.9",
                                                                                      "tinypkg==0.1"], r.stdout
    else:
        assert last.startswith("REFUSED"), r.stdout
        text = json.loads(last.split(" ", 1)[1])
        assert text.startswith("requirements.txt: what requirements.txt installs breaks 1 requirement")
        assert "dependent 1.0 has requirement tinypkg>=0.2, but you have tinypkg 0.1" in text
        assert "pip found no versions of dependent that fit it" in text


def test_framework_pins_ask_the_overlay_for_another_major_version_unless_requirements_name_it(tmp_path):
    from trainyard.container.requirements import framework_pins

    have = {"transformers": "5.24.0"}.get
    assert framework_pins({"transformers_version": "4.26"}, str(tmp_path), have) == ["transformers==4.26.*"]
    assert framework_pins({"transformers_version": "4.26.1"}, str(tmp_path), have) == ["transformers==4.26.1"]
    assert framework_pins({"transformers_version": "5.20"}, str(tmp_path), have) == []  # same major: kept
    assert framework_pins({"framework_version": "1.11"}, str(tmp_path), have) == []  # torch: never an overlay
    assert framework_pins({"transformers_version": "4.26"}, str(tmp_path), {}.get) == ["transformers==4.26.*"]
    (tmp_path / "requirements.txt").write_text("# pinned by the notebook\nTransformers[torch]==4.26.1\n")
    assert framework_pins({"transformers_version": "4.26"}, str(tmp_path), have) == []


def test_the_platform_is_never_installed_again_to_fit_an_overlay(tmp_path):
    """A file that shadows what trainyard itself needs (pydantic) is refused at once: pip never runs again with
    `trainyard` named, which an index could answer with another project of that name."""
    code = tmp_path / "code"
    make_wheel(str(code / "wheels"), name="pydantic", version="0.0.1")
    (code / "requirements.txt").write_text("./wheels/pydantic-0.0.1-py3-none-any.whl\n")
    said: list[str] = []
    with pytest.raises(RequirementsError) as e:
        prepare(str(code), str(tmp_path / "cache"), say=said.append)
    assert "trainyard 0.1.0 has requirement pydantic" in str(e.value), str(e.value)
    assert sum(m.startswith("requirements.txt: pip install") for m in said) == 1, said
