"""The `trainyard` command line: help, the jobs table, rm and prune, metrics, the store's subcommands, and
the one-line errors of cloud commands without a region or credentials.

Jobs are faked as folders shaped as the local backend writes them (spec.json, status.json, supervisor.json,
the first host's metrics.jsonl, logs/); each jobs test has a Trainyard home of its own. The store tests use
the session's embedded store, each with buckets of its own.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from trainyard import Estimator
from trainyard.errors import ConfigError
from trainyard.job.spec import build_spec
from trainyard.sdk.jobs import format as cli_output
from trainyard.sdk.cli import build_parser, main
from trainyard.sdk.cli.jobs import last_step_loss
from trainyard.sdk.jobs.joblog import stamped
from trainyard.sdk.jobs.jobstate import job_dir, jobs_root, write_json
from trainyard.sdk.store import ensure_store

BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters
REGION_LINE = "no AWS region: set AWS_REGION (or AWS_DEFAULT_REGION) or pass --region"
CREDENTIALS_LINE = ("no AWS credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run "
                    "aws configure")
COMMANDS = {"jobs", "describe", "logs", "metrics", "report", "stop", "rm", "prune", "store", "checkpoint", "gc",
            "image", "render", "plan", "catalog"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A Trainyard home of this test's own, for its jobs (the embedded store is not started in it)."""
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_job(name, status="Completed", *, age=timedelta(hours=1), ran=timedelta(minutes=3, seconds=7),
             metrics=(), log="", metric_definitions=(), supervisor_pid=None, instance_count=2):
    """A job folder as the local backend leaves it: created `age` ago, ended `ran` later unless InProgress."""
    d = job_dir(name)
    os.makedirs(f"{d}/logs")
    os.makedirs(f"{d}/hosts/algo-1/output/data")
    spec = build_spec(job_name=name, entry_point="train.py", entry_kind="script", instance_type="local",
                      instance_count=instance_count, processes_per_host=1, output_path="s3://bkt/out",
                      metric_definitions=[dict(m) for m in metric_definitions])
    with open(f"{d}/spec.json", "w") as fh:
        fh.write(spec.to_json())
    created = datetime.now(timezone.utc) - age
    doc = {"TrainingJobStatus": status, "SecondaryStatus": "Training" if status == "InProgress" else status,
           "SecondaryStatusTransitions": [], "CreationTime": created.isoformat(),
           "TrainingStartTime": (created + timedelta(seconds=1)).isoformat(),
           "LastModifiedTime": created.isoformat()}
    if status != "InProgress":
        doc["TrainingEndTime"] = doc["LastModifiedTime"] = (created + ran).isoformat()
    write_json(f"{d}/status.json", doc)
    if supervisor_pid is not None:
        write_json(f"{d}/supervisor.json", {"pid": supervisor_pid})
    with open(f"{d}/hosts/algo-1/output/data/metrics.jsonl", "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in metrics)
    with open(f"{d}/logs/algo-1.log", "w") as fh:  # each line stamped, as the supervisor writes it
        fh.writelines(stamped(line, created.timestamp() + 2 + i) + "\n" for i, line in enumerate(log.splitlines()))
    return d


def _sleeper():
    """A live process to stand in for a running job's supervisor (stop() sends it SIGTERM)."""
    return subprocess.Popen(["sleep", "120"])


# ---- help


def _subparsers(parser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def test_every_command_and_subcommand_has_help_with_an_example():
    root = build_parser()
    top = _subparsers(root)
    assert set(top.choices) == COMMANDS
    summaries = {a.dest: a.help for a in top._choices_actions}
    text = root.format_help()
    for name in COMMANDS:  # one line each in `trainyard --help`: the name, then its summary
        assert summaries[name] and "\n" not in summaries[name]
        assert re.search(rf"^\s+{name}\s+(\n\s+)?{re.escape(summaries[name])}$", text, re.M), name
    todo, seen = [("trainyard", root)], []
    while todo:
        prog, parser = todo.pop()
        seen.append(prog)
        epilog = parser.epilog or ""
        assert "examples:" in epilog and f"\n  {prog}" in "\n" + epilog.split("examples:", 1)[1], prog
        sub = _subparsers(parser)
        todo += [(f"{prog} {n}", p) for n, p in sub.choices.items()] if sub else []
    assert {"trainyard store ls", "trainyard store put", "trainyard store get", "trainyard store rm",
            "trainyard store creds", "trainyard checkpoint export", "trainyard image build", "trainyard image push",
            "trainyard render terraform", "trainyard render kubernetes"} <= set(seen)


def test_main_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        main(["store", "put", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:\n  trainyard store put data.csv s3://my-data/train/" in out


# ---- jobs


def test_jobs_table_newest_first_plain_when_piped(home, capsys):
    fake_job("old-job", age=timedelta(days=9), metrics=[{"step": 1, "loss": 3.25}, {"step": 2, "loss": 2.5,
                                                                                     "comm": {"x": 1}}])
    fake_job("scraped-job", "Failed", age=timedelta(hours=2), instance_count=3,
             log="epoch 1 acc=0.25\nepoch 2 acc=0.75\n", metric_definitions=[{"Name": "acc", "Regex": "acc=([0-9.]+)"}])
    sleeper = _sleeper()
    try:
        fake_job("running-job", "InProgress", age=timedelta(seconds=30), supervisor_pid=sleeper.pid)
        os.makedirs(os.path.join(jobs_root(), "broken-job"))  # no spec, no status
        assert main(["jobs"]) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    out = capsys.readouterr().out
    assert not BOX.search(out) and "\x1b" not in out  # piped: plain text
    lines = out.splitlines()
    assert lines[0].split() == ["name", "status", "hosts", "started", "duration", "last", "step/loss"]
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["broken-job", "running-job", "scraped-job", "old-job"]  # newest first
    row = {line.split()[0]: line for line in lines[1:]}
    assert re.search(r"old-job\s+Completed\s+2 x local\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\s+3m07s\s+step 2, loss 2.5$",
                     row["old-job"])
    assert re.search(r"scraped-job\s+Failed\s+3 x local\s.*3m07s\s+acc 0.75$", row["scraped-job"])
    assert re.search(r"running-job\s+InProgress\s+2 x local\s.*\s(3\d|4\d)s$", row["running-job"])
    assert "unreadable" in row["broken-job"] and "spec.json" in row["broken-job"]
    assert all(line == line.rstrip() for line in lines)


def test_no_jobs_names_the_folder(home, capsys):
    assert main(["jobs"]) == 0
    assert capsys.readouterr().out.strip() == f"no jobs under {home / 'jobs'}"


def test_last_step_loss():
    assert last_step_loss([]) == ""
    assert last_step_loss([{"step": 1, "loss": 2.0}, {"step": 2, "tokens_per_s": 9.0}]) == "step 2, loss 2"
    assert last_step_loss([{"timestamp": 5.0, "train:acc": 0.5}, {"timestamp": 6.0, "val:loss": 1.25}]) == \
        "val:loss 1.25"


# ---- rm and prune


def test_rm_deletes_ended_jobs_and_refuses_running_ones(home, capsys):
    done = fake_job("done-job")
    keep = home / "keep.txt"
    keep.write_text("mine")
    sleeper = _sleeper()
    try:
        running = fake_job("busy-job", "InProgress", supervisor_pid=sleeper.pid)
        assert main(["rm", "done-job", "busy-job"]) == 1
        out, err = capsys.readouterr()
        assert f"deleted done-job ({done})" in out and not os.path.exists(done)
        assert "busy-job is running" in err and "`trainyard stop busy-job`" in err and "--force" in err
        assert os.path.isdir(running)
        assert main(["rm", "--force", "busy-job"]) == 0  # stops it (its supervisor gets SIGTERM), then deletes
        out = capsys.readouterr().out
        assert "stopped busy-job" in out and "deleted busy-job" in out and not os.path.exists(running)
        assert sleeper.wait(timeout=10) == -15
    finally:
        sleeper.kill()
        sleeper.wait()
    assert main(["rm", "no-such-job"]) == 2
    assert "no job named 'no-such-job'" in capsys.readouterr().err
    os.makedirs(home / "store" / "objects")
    assert main(["rm", "--force", "../store"]) == 2  # never outside the jobs folder
    assert "not a job name" in capsys.readouterr().err
    assert os.path.isdir(home / "store" / "objects") and keep.read_text() == "mine"


def test_rm_of_an_unreadable_folder_needs_force(home, capsys):
    broken = os.path.join(jobs_root(), "broken")
    os.makedirs(broken)
    assert main(["rm", "broken"]) == 1 and "--force" in capsys.readouterr().err and os.path.isdir(broken)
    assert main(["rm", "--force", "broken"]) == 0 and not os.path.exists(broken)


def test_prune_deletes_only_ended_jobs_older_than_the_duration(home, capsys):
    old = fake_job("old-job", age=timedelta(days=8))
    failed = fake_job("old-failed", "Failed", age=timedelta(days=3))
    recent = fake_job("recent-job", age=timedelta(hours=3))
    sleeper = _sleeper()
    try:
        running = fake_job("old-running", "InProgress", age=timedelta(days=30), supervisor_pid=sleeper.pid)
        assert main(["prune", "--older-than", "2d", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert [line.split()[:3] for line in out.splitlines()] == [["would", "delete", "old-job"],
                                                                   ["would", "delete", "old-failed"]]
        assert all(os.path.isdir(d) for d in (old, failed, recent, running))
        assert main(["prune", "--older-than", "2d"]) == 0
        out = capsys.readouterr().out
        assert "deleted old-job (Completed, ended " in out and "deleted old-failed (Failed, ended " in out
        assert not os.path.exists(old) and not os.path.exists(failed)
        assert os.path.isdir(recent) and os.path.isdir(running)
        assert main(["prune", "--older-than", "1d12h"]) == 0
        assert capsys.readouterr().out.strip() == f"no ended jobs older than 1d12h under {jobs_root()}"
        assert main(["prune", "--older-than", "2h"]) == 0 and not os.path.exists(recent)
        assert os.path.isdir(running)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("bad", ["7", "seven", "7x", "-1d", "7d garbage", ""])
def test_prune_refuses_a_bad_duration(home, capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["prune", f"--older-than={bad}"])  # the = form: "-1d" would read as an option
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--older-than" in err and "e.g. 7d, 12h or 30m" in err


def test_parse_duration():
    assert cli_output.parse_duration("30m") == 1800
    assert cli_output.parse_duration("12h") == 12 * 3600
    assert cli_output.parse_duration("7d") == 7 * 86400
    assert cli_output.parse_duration("1d12h") == 36 * 3600
    assert cli_output.parse_duration("2W") == 14 * 86400
    assert cli_output.human_duration(3720) == "1h02m" and cli_output.human_duration(59) == "59s"


# ---- metrics


def test_metrics_table_json_and_none(home, capsys):
    rows = [{"step": s, "loss": 4.0 - s, "lr": 0.001, "comm": {"x": s}} for s in range(1, 4)]
    fake_job("m-job", metrics=rows)
    assert main(["metrics", "m-job"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "loss", "lr"]  # nested values only in --json
    assert [line.split() for line in lines[1:]] == [["1", "3", "0.001"], ["2", "2", "0.001"], ["3", "1", "0.001"]]
    assert main(["metrics", "m-job", "--json", "--tail", "2"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows[1:]
    fake_job("quiet-job")
    assert main(["metrics", "quiet-job"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no metrics for quiet-job yet") and "metric_definitions" in out
    assert "$SM_OUTPUT_DATA_DIR/metrics.jsonl" in out
    assert main(["metrics", "quiet-job", "--json"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "no metrics for quiet-job yet" in err
    assert main(["metrics", "nope"]) == 2 and "no job named 'nope'" in capsys.readouterr().err


def test_metrics_of_scraped_lines_show_their_time(home, capsys):
    fake_job("s-job", log="loss=2.5\nloss=1.5\n", metric_definitions=[{"Name": "loss", "Regex": "loss=([0-9.]+)"}])
    assert main(["metrics", "s-job"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["loss", "time"]
    assert [line.split()[0] for line in lines[1:]] == ["2.5", "1.5"]
    assert re.fullmatch(r" ?\S+\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", lines[1])


# ---- store


@pytest.fixture
def bucket():
    """A bucket name no other test uses (the embedded store is shared by the session)."""
    return f"cli-{uuid.uuid4().hex[:12]}"


def _store_client():
    return ensure_store().client()


def _bucket_names():
    return {b["Name"] for b in _store_client().list_buckets()["Buckets"]}


def test_store_put_ls_get_rm(tmp_path, capsys, bucket):
    (tmp_path / "one.txt").write_text("hello")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "b.txt").write_text("bb")
    assert main(["store", "put", str(tmp_path / "one.txt"), f"s3://{bucket}/docs/"]) == 0  # creates the bucket
    assert main(["store", "put", str(tree), f"s3://{bucket}/tree"]) == 0
    out = capsys.readouterr().out
    assert f"-> s3://{bucket}/docs/one.txt" in out and f"2 files (3 B) -> s3://{bucket}/tree/" in out
    s3 = _store_client()
    assert sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]) == \
        ["docs/one.txt", "tree/a.txt", "tree/sub/b.txt"]

    assert main(["store", "ls"]) == 0
    assert bucket in [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert main(["store", "ls", f"s3://{bucket}/tree"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["key", "size"]
    assert [line.split() for line in lines[1:]] == [["tree/a.txt", "1", "B"], ["tree/sub/b.txt", "2", "B"]]

    assert main(["store", "get", f"s3://{bucket}/docs/one.txt", str(tmp_path / "got") + "/"]) == 0
    assert (tmp_path / "got" / "one.txt").read_text() == "hello"
    assert main(["store", "get", f"s3://{bucket}/tree", str(tmp_path / "tree-copy")]) == 0
    assert (tmp_path / "tree-copy" / "sub" / "b.txt").read_text() == "bb"
    capsys.readouterr()

    assert main(["store", "rm", f"s3://{bucket}/tree"]) == 2  # a prefix needs --recursive
    assert "pass --recursive" in capsys.readouterr().err
    assert main(["store", "rm", "--recursive", f"s3://{bucket}/tree"]) == 0
    assert main(["store", "rm", f"s3://{bucket}/docs/one.txt"]) == 0
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)
    assert main(["store", "rm", f"s3://{bucket}"]) == 0  # an empty bucket goes without --recursive
    assert bucket not in _bucket_names()


@pytest.mark.parametrize("argv, says", [
    (["store", "ls", "s3://{bucket}"], "S3_URI: s3://{bucket}: no such bucket"),
    (["store", "ls", "s3://trainyard-default/{bucket}/nothing"], "no such key or prefix"),
    (["store", "get", "s3://{bucket}/k", "out"], "S3_URI: s3://{bucket}/k: no such bucket"),
    (["store", "rm", "s3://trainyard-default/{bucket}.txt"], "no such key"),
    (["store", "ls", "my-data/x"], "S3_URI: expected an s3:// URI"),
    (["store", "put", "/no/such/file", "s3://{bucket}/x"], "LOCAL: /no/such/file: no such file or folder"),
])
def test_store_errors_are_one_line_exit_2(capsys, bucket, argv, says):
    assert main([a.format(bucket=bucket) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainyard: ") and says.format(bucket=bucket) in err
    assert bucket not in _bucket_names()  # looking never creates a bucket


def test_store_creds_reach_the_embedded_store(tmp_path, capsys, bucket, monkeypatch):
    _store_client().create_bucket(Bucket=bucket)
    assert main(["store", "creds"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("=")[0] for line in lines] == ["export AWS_ENDPOINT_URL", "export AWS_ACCESS_KEY_ID",
                                                      "export AWS_SECRET_ACCESS_KEY", "export AWS_DEFAULT_REGION"]
    env = dict(shlex.split(line)[1].split("=", 1) for line in lines)
    assert env["AWS_ENDPOINT_URL"] == ensure_store().url
    # what a user's shell does with them: a plain boto3 client, nothing passed by hand
    for k in list(os.environ):
        if k.startswith("AWS_") and k != "AWS_CA_BUNDLE":
            monkeypatch.delenv(k)
    (tmp_path / "none").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code = "import boto3; print(' '.join(b['Name'] for b in boto3.client('s3').list_buckets()['Buckets']))"
    r = subprocess.run(["bash", "-c", f'eval "$({sys.executable} -m trainyard.sdk.cli store creds)" && '
                                      f'{sys.executable} -c "{code}"'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert bucket in r.stdout.split()
    for k, v in env.items():  # the shell after the eval: `store put` still creates buckets on the store
        monkeypatch.setenv(k, v)
    assert main(["store", "put", str(tmp_path / "none"), f"s3://{bucket}-2/x"]) == 0
    assert f"{bucket}-2" in _bucket_names()
    assert main(["store", "rm", "--recursive", f"s3://{bucket}-2"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # another endpoint: creds still name the store's
    assert main(["store", "creds", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == env and "AWS_ENDPOINT_URL is set to http://127.0.0.1:9" in err


def test_store_address_and_stop(home, capsys):
    assert main(["store", "--stop"]) == 0  # this home's store never started
    assert capsys.readouterr().out.strip() == "not running"


# ---- what a person sees on a terminal


def _piped(argv, env) -> str:
    return subprocess.run([sys.executable, "-m", "trainyard.sdk.cli", *argv], capture_output=True, text=True,
                          env=env, check=True, timeout=120).stdout


def _tty_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE",
                                                            "TTY_INTERACTIVE")}
    env.update(COLUMNS="160", LINES="50", TERM="xterm-256color")
    return env


def test_jobs_on_a_terminal_and_piped(home, on_a_tty):
    fake_job("tty-job", metrics=[{"step": 7, "loss": 1.5}])
    tty = on_a_tty(["jobs"], _tty_env())
    assert BOX.search(tty)
    header = next(line for line in tty.splitlines() if "name" in line)
    assert all(h in header for h in ("status", "hosts", "started", "duration", "last step/loss"))
    assert re.search(r"tty-job.*Completed.*2 x local.*3m07s.*step 7, loss 1.5", tty)
    piped = _piped(["jobs"], _tty_env())
    assert not BOX.search(piped) and "\x1b" not in piped
    assert re.search(r"^tty-job +Completed +2 x local +.*step 7, loss 1.5$", piped, re.M)


def test_metrics_on_a_narrow_terminal_show_whole_columns_and_name_the_rest(home, on_a_tty):
    """(issue 34) 20 columns on a 120-column terminal were squeezed to 3 characters each."""
    row = {"step": 1, "loss": 2.5, **{f"metric_number_{i:02d}": 1000.0 + i for i in range(18)}}
    fake_job("wide-job", metrics=[row])
    tty = on_a_tty(["metrics", "wide-job"], {**_tty_env(), "COLUMNS": "120"})
    header = next(line for line in tty.splitlines() if "step" in line)
    assert "metric_number_00" in header and "metric_number_17" not in tty.split("more column")[0]
    assert re.search(r"\d+ more column\(s\) do not fit this terminal: .*metric_number_17; trainyard metrics "
                     r"wide-job --json shows every one", tty.replace("\r\n", " ").replace("\n", " "))
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty)
    assert max(len(line) for line in plain.splitlines() if "│" in line) <= 120
    piped = _piped(["metrics", "wide-job"], _tty_env())  # piped: every column, whole
    assert "metric_number_17" in piped.splitlines()[0]


@pytest.mark.parametrize("columns", [80, 120])
def test_jobs_and_metrics_are_readable_at_80_and_120_columns(home, on_a_tty, columns):
    """(issue 34) On a common terminal no line is wider than it, a job's name (as long as SageMaker's 63
    characters) is whole on one line, where it can be copied, and the metrics' first columns are whole."""
    name = "fine-tune-llama-on-support-tickets-2026-11-27-14-33-56-123"
    fake_job(name, metrics=[{"step": 7, "loss": 1.5, **{f"metric_number_{i:02d}": 1000.0 + i for i in range(18)}}])
    for argv in (["jobs"], ["metrics", name]):
        tty = on_a_tty(argv, {**_tty_env(), "COLUMNS": str(columns)})
        lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty).splitlines()
        table = [line for line in lines if line[:1] in "╭│├╰┃┏┡└"]  # prose after the table wraps as text does
        assert table and max(len(line) for line in table) <= columns, (argv, tty)
        if argv == ["jobs"]:
            assert any(name in line for line in lines), tty
        else:
            header = next(line for line in lines if "step" in line)
            assert "loss" in header and "metric_number_00" in header, tty


def test_store_ls_on_a_terminal_and_piped(tmp_path, bucket, on_a_tty):
    (tmp_path / "f.bin").write_bytes(b"x" * 2048)
    assert main(["store", "put", str(tmp_path / "f.bin"), f"s3://{bucket}/data/f.bin"]) == 0
    tty = on_a_tty(["store", "ls", f"s3://{bucket}/data"], _tty_env())
    assert BOX.search(tty) and re.search(r"key.*size", tty) and re.search(r"data/f\.bin.*2\.0 KiB", tty)
    piped = _piped(["store", "ls", f"s3://{bucket}/data"], _tty_env())
    lines = piped.splitlines()
    assert [line.split() for line in lines] == [["key", "size"], ["data/f.bin", "2.0", "KiB"]]
    assert len(lines[0]) == len(lines[1])  # sizes right-aligned under their header
    tty = on_a_tty(["store", "ls"], _tty_env())
    assert BOX.search(tty) and re.search(r"bucket.*created", tty) and bucket in tty


# ---- AWS: no region, no credentials


@pytest.fixture
def no_aws(tmp_path, monkeypatch):
    """A machine with no AWS configuration at all: no AWS_* variables, empty config and credentials files,
    no instance metadata."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    (tmp_path / "empty").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # an EC2 test machine's role must not answer


@pytest.mark.parametrize("argv", [["gc"], ["image", "push"], ["gc", "--include-running"]])
def test_cloud_commands_without_a_region(no_aws, capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and REGION_LINE in err


@pytest.mark.parametrize("argv", [["gc", "--region", "us-east-1"], ["image", "push", "--region", "eu-west-1"],
                                  ["image", "push", "--registry",
                                   "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard"]])
def test_cloud_commands_without_credentials(no_aws, capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and CREDENTIALS_LINE in err


def test_aws_region_is_read_and_partial_credentials_are_named(no_aws, capsys, monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-west-2")  # botocore alone reads only AWS_DEFAULT_REGION
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    assert main(["gc"]) == 2
    err = capsys.readouterr().err
    assert CREDENTIALS_LINE in err and "AWS_SECRET_ACCESS_KEY" in err.split(CREDENTIALS_LINE)[1]
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    assert main(["gc"]) == 2
    assert "no-such-profile" in capsys.readouterr().err


def test_credentials_lost_mid_command_are_one_line(no_aws, capsys, monkeypatch):
    from botocore.exceptions import NoCredentialsError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")

    def gc(session, **kw):
        raise NoCredentialsError()

    monkeypatch.setattr("trainyard.sdk.cli.gc", gc)
    assert main(["gc", "--region", "us-east-1"]) == 2
    assert capsys.readouterr().err == f"trainyard: credentials: {CREDENTIALS_LINE}\n"


def test_fit_dry_run_on_ec2_without_region_or_credentials(no_aws, src, home, monkeypatch):
    est = Estimator(entry_point="train.py", source_dir=src, instance_type="ml.p4d.24xlarge", instance_count=2,
                    output_path="s3://my-bucket/out")
    with pytest.raises(ConfigError) as e:
        est.fit(dry_run=True)
    assert e.value.field == "region" and "no AWS region: set AWS_REGION (or AWS_DEFAULT_REGION)" in str(e.value)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(ConfigError) as e:
        est.fit(dry_run=True)
    assert e.value.field == "credentials" and CREDENTIALS_LINE in str(e.value)
    assert not os.path.exists(jobs_root())  # nothing was created


def test_wait_names_the_report_and_a_metric_regex_that_matched_nothing(home, capsys):
    """(issue 34) The README promises a report at the end: wait() names the command; a metric_definitions Regex
    that matched no line of a completed job is said (metrics()[-1] used to raise IndexError with no word why)."""
    from trainyard.errors import JobFailedError
    from trainyard.sdk.backends import open_job

    fake_job("w-job", log="loss=2.5\nLoss: 1.5\n", metric_definitions=[
        {"Name": "loss", "Regex": "loss=([0-9.]+)"}, {"Name": "acc", "Regex": "accuracy=([0-9.]+)"}])
    open_job("w-job").wait(logs="None")
    err = capsys.readouterr().err
    assert "warning: metric_definitions matched no log line of w-job for 'acc'" in err and "'loss'" not in err
    assert "trainyard report w-job" not in err  # logs="None": quiet but for the warning
    open_job("w-job").wait()
    assert "[trainyard] w-job Completed: its HTML report" in capsys.readouterr().err
    fake_job("w-failed", "Failed", metric_definitions=[{"Name": "acc", "Regex": "accuracy=([0-9.]+)"}])
    with pytest.raises(JobFailedError):
        open_job("w-failed").wait(logs="None")
    assert "metric_definitions" not in capsys.readouterr().err  # a failed job's missing lines are not the regex's fault
