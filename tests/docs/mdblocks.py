"""The fenced code blocks of the project's Markdown, and how the docs test runs each.

Every block names its language after the opening fence; an HTML comment on the line just above it may
add directives for the test, `<!-- doctest: key=value ... -->` (values quoted as in a shell):

    python      run with the project's interpreter, in the page's work folder
    sh          run with bash -euo pipefail, in the page's work folder (the venv's bin first on PATH)
    console     `$ command` lines run one by one; the lines after each are its expected stdout, exactly
    json        parsed (with `file=` also written there)
    hcl         parsed with python-hcl2
    text        not code: output, a folder layout, a command's synopsis

    copy=PATH       copy the repository folder PATH's contents into the work folder first (the example's files)
    file=PATH       write the block to PATH in the work folder instead of running it (a later block runs it)
    same-as=PATH    the block is the repository's file PATH, byte for byte, or all of it after its module
                    docstring when the page leaves that out (it is not run)
    instead=CMD     run CMD (sh) instead, with why="..." saying why the block itself cannot run here
    cloud=1         run with AWS pointed at the test cloud (a moto server) holding the page's resources
    timeout=S       seconds (default 300)

All blocks of one page run in order in one work folder, which links the repository's top-level folders
(`examples/`, `infra/`, ...), so a page's commands work as written from the repository root while what
they write stays out of the checkout. A failure names the page and the line of the block.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = {"python", "sh", "console"}
KNOWN = RUN | {"json", "hcl", "text"}
_FENCE = re.compile(r"^(\s*)```(.*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doctest:(.*?)-->\s*$")


@dataclass
class Block:
    path: str
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


class DocError(AssertionError):
    """A block that failed, with its page and line first."""


def pages() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def blocks(path: str) -> list[Block]:
    lines = open(path, encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).strip()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise DocError(f"{os.path.relpath(path, ROOT)}:{start + 1}: code block never closed")
        i += 1
        directives = {}
        d = _DIRECTIVE.match(lines[start - 1]) if start else None
        if d:
            for word in shlex.split(d.group(1)):
                key, _, value = word.partition("=")
                directives[key] = value
        out.append(Block(path, start + 1, info.split()[0] if info else "", "\n".join(body) + "\n", directives))
    return out


def check_tagged(block: Block) -> None:
    if block.lang not in KNOWN:
        raise DocError(f"{block.where}: the block's language is {block.lang or 'missing'!r}; tag it one of "
                       f"{sorted(KNOWN)} (text for output and layouts) so the docs test knows how to check it")
    unknown = set(block.directives) - {"file", "same-as", "instead", "why", "cloud", "timeout", "copy"}
    if unknown:
        raise DocError(f"{block.where}: unknown doctest directive(s) {sorted(unknown)}")
    if "instead" in block.directives and not block.directives.get("why"):
        raise DocError(f"{block.where}: instead= needs why=\"...\" (why the block itself cannot run here)")


def work_folder(base: str) -> str:
    """A folder that looks like the repository root: its top-level entries linked, nothing written back."""
    os.makedirs(base, exist_ok=True)
    for name in os.listdir(ROOT):
        if name.startswith(".") or name in ("model",):
            continue
        link = os.path.join(base, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join(ROOT, name), link)
    return base


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _fail(block: Block, what: str, r: subprocess.CompletedProcess) -> DocError:
    tail = "\n".join(((r.stdout or "") + (r.stderr or "")).splitlines()[-40:])
    return DocError(f"{block.where}: {block.lang} block {what}:\n{tail}")


def run_block(block: Block, cwd: str, env: dict[str, str]) -> str:
    """Check or run one block; returns what it printed. Raises DocError naming the page and line."""
    check_tagged(block)
    d = block.directives
    timeout = float(d.get("timeout", 300))
    if "copy" in d:
        shutil.copytree(os.path.join(ROOT, d["copy"]), cwd, dirs_exist_ok=True)
    if "same-as" in d:
        with open(os.path.join(ROOT, d["same-as"]), encoding="utf-8") as fh:
            source = fh.read()
        body = re.sub(r'^"""(?:.|\n)*?"""\n', "", source, count=1)
        if block.text not in (source, body):
            raise DocError(f"{block.where}: the block is no longer the same as {d['same-as']}; copy the file "
                           "into the page again")
        return ""
    if "file" in d:
        target = os.path.join(cwd, d["file"])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(block.text)
    if block.lang == "json":
        try:
            json.loads(block.text)
        except ValueError as e:
            raise DocError(f"{block.where}: json block does not parse: {e}") from None
        return ""
    if block.lang == "hcl":
        import hcl2

        try:
            hcl2.loads(block.text)
        except Exception as e:  # noqa: BLE001 - any parse error of the block
            raise DocError(f"{block.where}: hcl block does not parse: {e}") from None
        return ""
    if block.lang == "text" or "file" in d:
        return ""
    env = _env(env)
    if "instead" in d:
        return _run_sh(block, d["instead"], cwd, env, timeout, f"(instead: {d['instead']!r})")
    if block.lang == "python":
        script = os.path.join(cwd, f".doc-block-{block.line}.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(block.text)
        r = subprocess.run([sys.executable, script], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise _fail(block, f"exited with status {r.returncode}", r)
        return r.stdout
    if block.lang == "sh":
        return _run_sh(block, block.text, cwd, env, timeout, "")
    return _run_console(block, cwd, env, timeout)


def _run_sh(block: Block, script: str, cwd: str, env: dict, timeout: float, note: str) -> str:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise _fail(block, f"{note} exited with status {r.returncode}".strip(), r)
    return r.stdout


def _run_console(block: Block, cwd: str, env: dict, timeout: float) -> str:
    """`$ cmd` then its expected stdout lines, for each command of the block."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        else:
            raise DocError(f"{block.where}: a console block starts with `$ command`")
    printed = []
    for cmd, want in steps:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=timeout)
        if r.returncode != 0:
            raise _fail(block, f"command `{cmd}` exited with status {r.returncode}", r)
        got = r.stdout.rstrip("\n").split("\n") if r.stdout.strip() else []
        if got != want:
            raise DocError(f"{block.where}: `{cmd}` printed\n" + "\n".join(got) + "\nwhere the page shows\n"
                           + "\n".join(want))
        printed.append(r.stdout)
    return "".join(printed)
