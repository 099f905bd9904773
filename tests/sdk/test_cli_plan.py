"""`trainyard plan`: the table on a terminal (through a pseudo-terminal), plain text piped, --json, bad input."""
from __future__ import annotations

import json
import os
import sys

from trainyard.sdk.cli import main

ARGS = ["plan", "--model", "llama3-8b", "--seq-len", "8192", "--global-batch-size", "16", "--instance-type",
        "ml.p5.48xlarge", "--instance-count", "1"]


def _tty_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE",
                                                            "TTY_INTERACTIVE")}
    env.update(COLUMNS="200", LINES="50", TERM="xterm-256color")
    return env


def test_the_table_on_a_terminal(on_a_tty):
    out = on_a_tty([*ARGS, "--top", "5", "--train-tokens", "1e10"], _tty_env())
    assert "llama3-8b: 8.03B parameters" in out and "8 x NVIDIA H100" in out
    assert "╭" in out and "tokens/s/GPU" in out and "$ to train" in out  # rich's box on a terminal
    rows = [line for line in out.splitlines() if line.startswith("│") and "yes" in line]
    assert len(rows) == 5 and rows[0].split("│")[1].strip() == "1"


def test_json_lists_every_layout_best_first(capsys):
    assert main([*ARGS, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["layouts"] and len(doc["layouts"]) > 100
    first = doc["layouts"][0]
    assert first["fits"] is True and 0 < first["mfu"] < 1 and first["tokens_per_s_per_gpu"] > 0
    assert isinstance(first["memory_per_gpu_bytes"], int)
    assert {"dp", "partition_group_size", "tp", "pp", "pipeline_schedule", "micro_batch_size", "microbatches",
            "activation_checkpointing", "distribution"} <= set(first)
    fits = [row["fits"] for row in doc["layouts"]]
    assert fits == sorted(fits, reverse=True)  # every fitting layout before the first that does not


def test_piped_table_is_plain_text(capsys):
    assert main([*ARGS, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "╭" not in out and "\x1b" not in out
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["#", "fits", "dp"] and [ln.split()[0] for ln in lines[2:5]] == ["1", "2", "3"]
    # then what the columns are, wrapped; no note about nominal speeds off local hosts
    legend = " ".join(lines[5:])
    assert legend.startswith("dp: data-parallel ranks; p: MiCS partition group") and "are predicted" in legend
    assert "nominal" not in legend and all(len(ln) <= 120 for ln in lines[5:])


def test_local_speeds_are_said_to_be_nominal_and_a_typo_gets_a_suggestion(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--instance-type",
                 "local", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny: 0.50M parameters") and "do not predict what a run here measures" in \
        " ".join(out.split())
    assert main([*ARGS[:2], "llama3-8bb", *ARGS[3:]]) == 2
    assert "a folder holding one (did you mean 'llama3-8b'?)" in capsys.readouterr().err


def test_bad_input_exits_2_naming_the_field(capsys):
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "8192", "--global-batch-size", "16",
                 "--instance-type", "g5.xlarge"]) == 2
    assert "instance_type: 'g5.xlarge'" in capsys.readouterr().err


def test_several_instance_counts_in_one_plan(capsys):
    args = ["plan", "--model", "llama3-8b", "--seq-len", "4096", "--global-batch-size", "32", "--instance-type",
            "p5.48xlarge", "--instance-count", "1-2"]
    assert main([*args, "--json"]) == 0
    counts = {row["instance_count"] for row in json.loads(capsys.readouterr().out)["layouts"]}
    assert counts == {1, 2}
    assert main([*args, "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "1/2 x p5.48xlarge" in out and out.splitlines()[1].split()[:3] == ["#", "hosts", "fits"]


def test_compile_plans_the_job_under_torch_compile(capsys):
    speeds = {}
    for extra in ([], ["--compile"]):
        assert main([*ARGS, "--top", "1", *extra]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert ("; compiled;" if extra else "; eager;") in header
        assert main([*ARGS, "--json", *extra]) == 0
        speeds[bool(extra)] = json.loads(capsys.readouterr().out)["layouts"][0]["tokens_per_s_per_gpu"]
    assert speeds[True] > speeds[False]


def test_a_reader_that_leaves_early_gets_no_error():
    import shutil
    import subprocess

    exe = shutil.which("trainyard") or os.path.join(os.path.dirname(sys.executable), "trainyard")
    out = subprocess.run(f"'{exe}' {' '.join(ARGS)} --json | head -c 10", shell=True, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout == '{"layouts"' and out.stderr == ""
