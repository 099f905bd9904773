"""The family matrix (issue 29): every Hugging Face family the engine is verified on
(`engine/models/hf/families.py`) trains exactly as one unsharded process on every layout, with and without
kernels, built with real weights and on the meta device, tied and untied, or is refused by name; its export
loads with `from_pretrained`. Losses within 1e-5 and final weights within 1e-4 (relative) of the oracle
(tests/engine/family_worker.py says how the oracle starts). docs/engine.md's table is this run's."""
import os
import re
import sys
from pathlib import Path

import pytest
import transformers

from trainyard.engine.models.hf.families import TRANSFORMERS_BELOW, TRANSFORMERS_MIN, VERIFIED, transformers_verified

from . import families as F
from .family_worker import run_case
from .launch import HF, run_on_two_hosts

LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4
WORKER = os.path.join(os.path.dirname(__file__), "family_worker.py")
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "engine.md"
TABLE = re.compile(r"<!-- family-matrix -->\n(.*?)<!-- /family-matrix -->", re.S)


def _classes() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {f: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[F.config(f).model_type] for f in F.FAMILIES}


def _exact(name: str, result: dict) -> None:
    assert "refused" not in result, (name, result["refused"])
    assert result["loss_err"] <= LOSS_TOL, (name, result)
    assert result["weight_err"] <= WEIGHT_TOL, (name, result)
    assert result.get("export_err", 0.0) <= 1e-5, (name, result)


def test_the_matrix_covers_exactly_the_verified_classes():
    assert {v: k for k, v in _classes().items()} == {k: VERIFIED[k] for k in VERIFIED}


def test_the_installed_transformers_is_one_the_matrix_passed():
    """pyproject's `hf` extra pins the releases of families.py; the installed one must be among them: a newer
    transformers may change a family's code (it renamed past_key_values in 5), so it is refused here loudly."""
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', text)
    assert pin, "pyproject.toml's hf extra must pin transformers>=MIN,<BELOW"
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert (as_tuple(pin[1]) + (0,))[:2] == TRANSFORMERS_MIN and as_tuple(pin[2])[:2] == TRANSFORMERS_BELOW
    assert transformers_verified(transformers.__version__), (
        f"transformers {transformers.__version__} is outside the releases the family matrix passed; run "
        "tests/engine/test_families.py against it, then move TRANSFORMERS_BELOW and the pin together")


@pytest.mark.parametrize("family", list(F.FAMILIES))
def test_one_process_is_exact(engine, family, tmp_path):
    """Tied models built on meta used to get two tensors for one weight here (to_empty), then fail to export."""
    for case in F.one_process_cases(family, tmp_path):
        result = run_case(case)
        _exact(case["name"], result)
    assert "export_err" in run_case(F.one_process_cases(family, tmp_path / "again")[0])
    # its "1 process" cell in docs/engine.md's table says exact (the matrix test checks the other columns)
    documented = TABLE.search(DOCS.read_text())
    assert documented, "docs/engine.md lost its family-matrix table"
    row = next(r for r in _statuses(documented[1]) if r[0].startswith(f"{family} ("))
    assert row[ONE_PROCESS] == "exact", row


def test_the_model_s_own_tp_plan_is_refused_by_name_where_a_style_is_not_mapped():
    """transformers 5's plans: every style they name is mapped or refused, naming the model's plan, the module and
    the style (not a `tp_plan` the user never passed)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from trainyard.engine.distributed.tp import STYLE_NAMES, check_plan, resolve_plan
    from trainyard.engine.models.registry import resolve_spec

    emitted = {style for cls in CONFIG_MAPPING.values() for style in (getattr(cls, "base_model_tp_plan", None) or {}).values()}
    unmapped = emitted - set(STYLE_NAMES)
    assert {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
            "replicated_with_grad_allreduce"} <= emitted - unmapped  # what the matrix's families use is mapped
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_moe", **{**F.COMMON, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    spec = resolve_spec(moe)
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM._tp_plan \(transformers [\d.]+\)\['model.layers.0.mlp"
                                         r".experts[.\w]*'\]: style '(moe_tp_experts|packed_colwise)' is not one the "
                                         "engine maps") as e:
        check_plan(moe, resolve_plan(moe, spec.tp_plan(moe)), 2, spec.tp_plan_source)
    assert "tp_plan[" not in str(e.value) and "use MiCS sharding" in str(e.value)
    assert unmapped >= {"packed_colwise", "moe_tp_experts"}


def test_a_user_plan_on_gpt2_conv1d_is_refused_before_sharding():
    from transformers import AutoModelForCausalLM

    from trainyard.engine.distributed.tp import check_plan, resolve_plan

    gpt2 = AutoModelForCausalLM.from_config(F.config("gpt2"))
    plan = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"tp_plan\['transformer.h.0.attn.c_attn'\]: style 'colwise' splits an "
                                         r"nn.Linear or nn.Embedding weight, but transformer.h.0.attn.c_attn is a Conv1D"):
        check_plan(gpt2, resolve_plan(gpt2, plan), 2)


def test_hf_save_pretrained_of_a_tied_model_loads_on_one_process(engine, tmp_path):
    """transformers writes a tied model without lm_head.weight; the tie kept on 1 process makes it whole."""
    import torch
    from transformers import AutoModelForCausalLM

    import trainyard.engine as te

    torch.manual_seed(3)
    source = AutoModelForCausalLM.from_config(F.config("qwen2", tie=True))
    source.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(F.config("qwen2", tie=True))
    model = te.transform(model)
    te.load_pretrained(model, str(tmp_path))
    ids = torch.randint(0, F.VOCAB, (2, 8))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model(ids).logits, source(ids).logits)


@pytest.mark.slow
def test_every_layout_is_exact_or_refused_by_name(tmp_path):
    """2 hosts x 2 processes: MiCS, TP x MiCS, PP x MiCS, CP x MiCS and kernels for every family, and TP alone on
    1 host x 2 for the tied ones built on meta. Refused: GPT-2's tensor parallelism (no plan: Conv1D) and pipeline
    (its position embedding is used beside the layers), and context parallelism for the families attending in a
    sliding window."""
    export = tmp_path / "export"
    export.mkdir()
    (tmp_path / "tp").mkdir()
    results = run_on_two_hosts(WORKER, F.matrix_cases(export), tmp_path, preload=HF)
    results.update(run_on_two_hosts(WORKER, F.tied_tp_cases(), tmp_path / "tp", hosts=1, preload=HF))
    refusals = {name: r["refused"] for name, r in results.items() if "refused" in r}
    windowed = {"mistral", "gemma2", "gemma3_text", "starcoder2"}  # context parallelism: the ring has no window
    assert refusals.keys() == {"gpt2|tp2 x mics|real", "gpt2|tp2|meta, tied", "gpt2|pp2 x mics|real, untied",
                               *(f"{f}|cp2 x mics|real" for f in windowed)}, refusals
    assert "GPT2LMHeadModel has no tensor-parallel plan" in refusals["gpt2|tp2 x mics|real"]
    assert "uses wpe beside its layers" in refusals["gpt2|pp2 x mics|real, untied"]
    for f in windowed:
        assert "attends within a sliding window (sliding_window=3)" in refusals[f"{f}|cp2 x mics|real"], refusals
    for name, result in results.items():
        if name not in refusals:
            _exact(name, result)
    assert all("export_err" in results[f"{f}|mics p2|meta"] for f in F.FAMILIES)
    # the table in docs/engine.md is this matrix's: the same cells, refused or measured (its "1 process" column is
    # test_one_process_is_exact's, which runs those cases anyway; they are run here only to write the table)
    writing = bool(os.environ.get("TRAINYARD_WRITE_DOCS"))
    measured = F.render_table({**results, **(_one_process_results() if writing else {})}, _classes())
    if writing:
        DOCS.write_text(TABLE.sub(lambda m: f"<!-- family-matrix -->\n{measured}\n<!-- /family-matrix -->",
                                  DOCS.read_text()))
    documented = TABLE.search(DOCS.read_text())
    assert documented, "docs/engine.md lost its family-matrix table"
    without_one = lambda rows: [row[:ONE_PROCESS] + row[ONE_PROCESS + 1:] for row in rows]  # noqa: E731
    assert without_one(_statuses(documented[1])) == without_one(_statuses(measured)), \
        "rerun with TRAINYARD_WRITE_DOCS=1 to update the table"


def _one_process_results() -> dict[str, dict]:
    import trainyard.engine as te

    te.init({})
    try:
        return {c["name"]: run_case(c) for f in F.FAMILIES for c in F.one_process_cases(f)}
    finally:
        te.finish()


ONE_PROCESS = 1  # the table's "1 process" column


def _statuses(table: str) -> list[list[str]]:
    """Per row, each cell's text when refused, else 'exact' (the figures differ in the last digit by machine)."""
    rows = [line.strip("|").split(" | ") for line in table.splitlines()[2:]]
    return [[c.strip() if c.strip().startswith("refused") or i == 0 else "exact" for i, c in enumerate(row)]
            for row in rows]


def test_a_family_or_release_outside_the_matrix_gets_one_line_naming_check_equivalence(engine, capsys, monkeypatch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import trainyard.engine as te

    mixtral = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mixtral", **{**F.COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}))
    te.transform(mixtral)
    out = capsys.readouterr().out
    assert out.count("note: MixtralForCausalLM is not among the Hugging Face families verified here") == 1
    assert "run te.check_equivalence on your layout before a long job" in out
    te.transform(AutoModelForCausalLM.from_config(F.config("llama")))
    assert "note:" not in capsys.readouterr().out
    with torch.device("meta"):
        llama = AutoModelForCausalLM.from_config(F.config("llama"))
    # transformers swaps its lazy module in sys.modules as it loads: patch the one the engine will read
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.31.0")
    te.transform(llama)
    assert "note: transformers 5.31.0 is outside the releases verified here (5.0 to below 5.25)" in \
        capsys.readouterr().out
