"""Stand-ins for what you would bring to a fine-tuning job: a Hugging Face model folder (config.json,
model.safetensors, tokenizer.json and tokenizer_config.json with its chat template) and a folder of chat examples
(.jsonl, one conversation a line). This machine reaches no model hub, so `write()` makes a tiny Llama with random
weights, a byte-level BPE tokenizer with a ChatML template, and conversations of skewed lengths (most short, a few
long, as real chat data is). Replace both folders with yours; the rest of the example stays the same."""
import json
import os
import random

# ChatML, as Qwen's and many other models' templates render a conversation
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "the a red big old shy cat dog fox sat ran on under blue green mat box why how what is it yes no".split()


def conversations(count: int = 64, seed: int = 0) -> list[dict]:
    """Chat examples of skewed lengths: 3 in 4 one short exchange, the rest several long turns."""
    rng = random.Random(seed)
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    out = []
    for i in range(count):
        turns = 1 if i % 4 else 3
        messages = [{"role": "system", "content": "answer briefly"}] if i % 3 == 0 else []
        for _ in range(turns):
            messages += [{"role": "user", "content": say(rng.randint(2, 6 if turns == 1 else 12))},
                         {"role": "assistant", "content": say(rng.randint(2, 5 if turns == 1 else 14))}]
        out.append({"messages": messages} if i % 5 else {"prompt": messages[-2]["content"],
                                                          "completion": messages[-1]["content"]})
    return out


def write_tokenizer(model_dir: str, texts: list[str]) -> None:
    """tokenizer.json (byte-level BPE trained on `texts`) and tokenizer_config.json (the ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    os.makedirs(model_dir, exist_ok=True)
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "chat_template": CHATML}, fh)


def write(model_dir: str = "model", data_dir: str = "chat", count: int = 64) -> list[dict]:
    """Write both folders; returns the examples."""
    from transformers import LlamaConfig, LlamaForCausalLM

    examples = conversations(count)
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as fh:
        fh.write("\n".join(json.dumps(e) for e in examples) + "\n")
    texts = [m["content"] for e in examples for m in e.get("messages", [])] + WORDS
    write_tokenizer(model_dir, texts)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(model_dir)  # config.json + model.safetensors
    return examples
