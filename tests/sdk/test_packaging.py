"""Code packaging: ignore rules, reproducible bytes, content addressing."""
import io
import os
import tarfile

from trainyard.sdk import packaging


def _tree(root, files):
    for rel, text in files.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as fh:
            fh.write(text)


def test_ignore_rules_and_defaults(tmp_path):
    _tree(tmp_path, {
        "train.py": "x", "lib/util.py": "y", ".env": "SECRET=1", ".env.prod": "S=2", ".git/config": "g",
        "__pycache__/a.pyc": "c", "lib/__pycache__/b.pyc": "c", ".venv/bin/python": "v",
        "data/big.bin": "d", "logs/run.log": "l", "keep.log": "k",
        ".gitignore": "data/\n*.log\n!keep.log\n", ".trainyardignore": "notes.txt\n", "notes.txt": "n",
        "sub/.gitignore": "local.txt\n", "sub/local.txt": "s", "sub/kept.txt": "s", "other/local.txt": "o",
    })
    files = packaging.collect_files(str(tmp_path))
    assert files == sorted([".gitignore", ".trainyardignore", "keep.log", "lib/util.py", "other/local.txt",
                            "sub/.gitignore", "sub/kept.txt", "train.py"])


def test_reproducible_and_content_addressed(tmp_path):
    _tree(tmp_path, {"train.py": "print(1)\n", "pkg/mod.py": "X = 1\n"})
    os.chmod(tmp_path / "train.py", 0o755)
    a = packaging.package(str(tmp_path))
    os.utime(tmp_path / "pkg" / "mod.py", (1, 1))  # times do not matter
    b = packaging.package(str(tmp_path))
    assert a.data == b.data and a.key == b.key and a.key.startswith("trainyard-code/")
    (tmp_path / "pkg" / "mod.py").write_text("X = 2\n")
    assert packaging.package(str(tmp_path)).key != a.key
    with tarfile.open(fileobj=io.BytesIO(a.data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"train.py", "pkg/mod.py"}
        assert members["train.py"].mode == 0o755 and members["train.py"].mtime == 0


def test_single_entry_file_without_source_dir(tmp_path):
    _tree(tmp_path, {"train.py": "x", "secret.txt": "s"})
    pkg = packaging.package(None, str(tmp_path / "train.py"))
    assert pkg.files == ("train.py",)


def test_upload_is_skipped_when_unchanged(tmp_path, s3_bucket):
    import boto3

    _tree(tmp_path, {"train.py": "x"})
    pkg = packaging.package(str(tmp_path))
    uri = packaging.upload(pkg, f"s3://{s3_bucket}/code")
    assert uri == f"s3://{s3_bucket}/code/{pkg.key}"
    s3 = boto3.client("s3")
    first = s3.head_object(Bucket=s3_bucket, Key=f"code/{pkg.key}")["LastModified"]
    calls = []
    from trainyard.job import storage

    storage.s3_client().meta.events.register("before-call.s3.PutObject", lambda **kw: calls.append(1))
    assert packaging.upload(pkg, f"s3://{s3_bucket}/code") == uri
    assert calls == [] and s3.head_object(Bucket=s3_bucket, Key=f"code/{pkg.key}")["LastModified"] == first
