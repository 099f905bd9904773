"""Stand-ins for what you would bring: a Hugging Face model folder (as `huggingface-cli download` leaves it:
config.json, model.safetensors, tokenizer.json) and a folder of your own text (.jsonl lines with a "text" field).
This machine reaches no model hub, so `write()` makes a tiny Llama with random weights and a byte-level BPE
tokenizer trained on the text. Replace both folders with yours; the rest of the example stays the same."""
import json
import os


def write(model_dir: str = "model", text_dir: str = "text") -> list[str]:
    """Write both folders; returns the text's documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    docs = [f"the {a} {b} sat on the {c} mat number {i}" for i, (a, b, c) in
            enumerate(zip(["red", "big", "old", "shy"] * 60, ["cat", "dog", "fox"] * 80, ["blue", "green"] * 120))]
    os.makedirs(text_dir, exist_ok=True)
    with open(os.path.join(text_dir, "part-0.jsonl"), "w") as fh:
        fh.write("\n".join(json.dumps({"text": d}) for d in docs) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    os.makedirs(model_dir, exist_ok=True)
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(model_dir)  # config.json + model.safetensors
    return docs
