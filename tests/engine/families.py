"""Small configs of every Hugging Face family the engine is verified on (`engine/models/hf/families.py`), and
the layouts of the family matrix (tests/engine/test_families.py). Each config keeps what makes its family
itself: Gemma's (1 + w) norms and GELU MLP, Gemma 2's soft-capping (at 2.0, where it changes the loss) and
alternating sliding/full attention, Gemma 3's layer types and per-head q/k norms, Qwen2's q/k/v biases,
Qwen3's q/k norms, Mistral's sliding window, Phi3's packed projections, OLMo2's norms over all heads,
Phi's partial rotary and biased head, Starcoder2's LayerNorms and biases, Cohere's interleaved rotary and
logit scale, Granite's embedding, residual and logit multipliers, GPT-2's Conv1D and learned positions,
GPT-NeoX's packed q/k/v and partial rotary. The sliding windows (3 tokens) are shorter than the sequences (16)."""
from __future__ import annotations

VOCAB, SEQ = 128, 16

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": 3},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 3, "final_logit_softcapping": 2.0, "attn_logit_softcapping": 5.0},
    "gemma3_text": {"head_dim": 16, "sliding_window": 3,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    "phi3": {},
    "phi": {"partial_rotary_factor": 0.5},
    "olmo2": {},
    "starcoder2": {"sliding_window": 3},
    "cohere": {"logit_scale": 0.5},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 2.0},
    # GPT-2's dropouts default to 0.1: off, or two runs could not agree
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": {"rotary_pct": 0.5},
}

# distributions of the 2 hosts x 2 processes run ("tp2" alone: of 1 host x 2); "1 process" runs in the test
# process itself
LAYOUTS = {
    "mics p2": {"mics": {"partition_group_size": 2}},
    "tp2 x mics": {"tensor_parallel_degree": 2},
    "pp2 x mics": {"pipeline_parallel_degree": 2},
    # 2 stages a rank (4 in all), interleaved
    "pp2 v2 x mics": {"pipeline_parallel_degree": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved_1f1b"},
    "tp2": {"tensor_parallel_degree": 2},
    # the partition group: 2 data-parallel x 2 context-parallel ranks, spanning the hosts
    "cp2 x mics": {"context_parallel_degree": 2, "mics": {"partition_group_size": 2}},
}
# the table's columns (docs/engine.md): layout, kernels
COLUMNS = [("1 process", None), ("mics p2", None), ("tp2 x mics", None), ("tp2", None), ("pp2 x mics", None),
           ("cp2 x mics", None), ("mics p2", "eager")]


def config(family: str, *, tie: bool | None = None):
    from transformers import AutoConfig

    kw = dict(FAMILIES[family]) if family == "gpt2" else {**COMMON, **FAMILIES[family]}
    if tie is not None:
        kw["tie_word_embeddings"] = tie
    return AutoConfig.for_model(family, **kw)


def default_tie(family: str) -> bool:
    return bool(config(family).tie_word_embeddings)


def one_process_cases(family: str, export_dir=None) -> list[dict]:
    """Built on meta with the family's own tying (exported to `export_dir` when given), with and without kernels;
    with real weights, tied the other way."""
    t = default_tie(family)
    export = {"export": f"{export_dir}/{family}"} if export_dir else {}
    return [{"name": f"{family}|1 process|meta", "family": family, "layout": "1 process", "build": "meta", "tie": t,
             **export},
            {"name": f"{family}|1 process|real, tie {not t}", "family": family, "layout": "1 process",
             "build": "real", "tie": not t},
            {"name": f"{family}|1 process|kernels", "family": family, "layout": "1 process", "build": "meta",
             "tie": t, "kernels": "eager"}]


def matrix_cases(export_dir) -> list[dict]:
    """The 2 hosts x 2 processes cases of every family: MiCS (meta, exported; real, tied the other way), TP x MiCS
    (real), PP x MiCS (untied: a tied pair would span the first and last stage), CP x MiCS (real), MiCS with
    kernels (meta)."""
    cases = []
    for f in FAMILIES:
        t = default_tie(f)
        cases += [
            {"name": f"{f}|mics p2|meta", "family": f, "layout": "mics p2", "build": "meta", "tie": t,
             "export": f"{export_dir}/{f}"},
            {"name": f"{f}|mics p2|real, tie {not t}", "family": f, "layout": "mics p2", "build": "real",
             "tie": not t},
            {"name": f"{f}|tp2 x mics|real", "family": f, "layout": "tp2 x mics", "build": "real", "tie": t},
            {"name": f"{f}|pp2 x mics|real, untied", "family": f, "layout": "pp2 x mics", "build": "real",
             "tie": False},
            {"name": f"{f}|cp2 x mics|real", "family": f, "layout": "cp2 x mics", "build": "real", "tie": t},
            {"name": f"{f}|mics p2|kernels", "family": f, "layout": "mics p2", "build": "meta", "tie": t,
             "kernels": "eager"},
        ]
    return cases


def tied_tp_cases() -> list[dict]:
    """TP alone (1 host x 2 processes: one data-parallel rank, nothing wrapped by MiCS) on tied models built on
    meta: where `to_empty` used to untie the embedding and the head."""
    return [{"name": f"{f}|tp2|meta, tied", "family": f, "layout": "tp2", "build": "meta", "tie": True}
            for f in FAMILIES]


def cell(results: list[dict]) -> str:
    """One table cell: the worst error of its cases (losses and weights, relative), or the refusal's reason."""
    if not results:
        return "not run"
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:  # the reason: the refusal's first clause after the option it names
        return "refused: " + refused[0].split(": ", 1)[-1].split("; ", 1)[0]
    worst = max(max(r["loss_err"], r["weight_err"]) for r in results)
    return f"{worst:.0e}" if worst else "0"


def render_table(results: dict[str, dict], classes: dict[str, str]) -> str:
    """The markdown table of docs/engine.md from the results by case name."""
    head = ["family (class)", "1 process", "MiCS p=2", "TP2 x MiCS", "TP2 alone (tied, meta)", "PP2 x MiCS",
            "CP2 x MiCS", "kernels=eager-chunked"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family in FAMILIES:
        cells = []
        for layout, kernels in COLUMNS:
            mine = [r for name, r in results.items()
                    if name.split("|")[:2] == [family, layout] and ("kernels" in name) == bool(kernels)]
            cells.append(cell(mine))
        lines.append(f"| {family} ({classes[family]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)
