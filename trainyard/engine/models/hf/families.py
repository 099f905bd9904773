"""Which Hugging Face causal-LM classes, and which transformers releases, the engine is verified on.

`tests/engine/test_families.py` trains a small model of every class below against one unsharded process on
each layout (1 process, MiCS, TP x MiCS, PP x MiCS, kernels) and checks losses, weights and the exported
model; docs/engine.md keeps its table. A class outside the list still goes through the engine (its spec is
generic over Hugging Face models), with one line at `transform` that names `te.check_equivalence`: the way to
verify it on its own layout before a long job. A transformers release outside TRANSFORMERS gets the same line:
the families' code changes between releases (transformers 5 renamed `past_key_values`, for one).
"""
from __future__ import annotations

# class -> the model_type of its config (tests build each from a small config of that type)
VERIFIED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "PhiForCausalLM": "phi",
    "Olmo2ForCausalLM": "olmo2",
    "Starcoder2ForCausalLM": "starcoder2",
    "CohereForCausalLM": "cohere",
    "GraniteForCausalLM": "granite",
    "GPT2LMHeadModel": "gpt2",
    "GPTNeoXForCausalLM": "gpt_neox",
}

# The transformers releases the matrix passed: pyproject.toml's `hf` extra pins the same range.
TRANSFORMERS_MIN, TRANSFORMERS_BELOW = (5, 0), (5, 25)


def _release(version: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def transformers_verified(version: str) -> bool:
    return TRANSFORMERS_MIN <= _release(version) < TRANSFORMERS_BELOW


def unverified_note(model, version: str) -> str | None:
    """The line transform() prints for a class or a transformers release the matrix did not pass; None
    otherwise."""
    name = type(model).__name__
    if name not in VERIFIED:
        why = f"{name} is not among the Hugging Face families verified here"
    elif not transformers_verified(version):
        why = (f"transformers {version} is outside the releases verified here "
               f"({'.'.join(map(str, TRANSFORMERS_MIN))} to below {'.'.join(map(str, TRANSFORMERS_BELOW))})")
    else:
        return None
    return (f"note: {why} (docs/engine.md, 'Hugging Face families'); run te.check_equivalence on your layout "
            "before a long job")
