"""Tiny wheels written offline (a wheel is a zip: the package, METADATA, WHEEL, RECORD)."""
import base64
import hashlib
import os
import zipfile


def make_wheel(folder: str, name: str = "tinypkg", version: str = "0.1", extra: str = "",
               requires: tuple[str, ...] = ()) -> str:
    """`<folder>/<name>-<version>-py3-none-any.whl`: `import <name>` gives VERSION, `<name>-cli` prints
    'hello from <name> <version>'. `extra` is appended to the module (to change the bytes, not the name);
    `requires` are its Requires-Dist lines (`tinypkg>=0.2`)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py":
            f"VERSION = {version!r}\n\ndef main():\n    print('hello from', __name__, VERSION)\n{extra}",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: trainyard-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": f"[console_scripts]\n{name}-cli = {name}:main\n",
    }
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    os.makedirs(folder, exist_ok=True)
    whl = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():  # a fixed date: the same arguments give the same bytes
            z.writestr(zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0)), text)
    return whl
