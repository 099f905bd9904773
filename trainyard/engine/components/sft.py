"""Supervised fine-tuning data: chat examples rendered with the model's own chat template, the loss on the
assistant's tokens only, and exact packing of several examples into one sequence.

- Examples: the `.jsonl` files of a folder (in name order), one JSON object a line: `{"messages": [{"role": ...,
  "content": ...}, ...]}`, or `{"prompt": ..., "completion": ...}` (a user turn and the assistant's answer).
- Rendering: the tokenizer's `apply_chat_template`. Each assistant turn's tokens are what the conversation up to
  and including it renders to beyond the conversation before it with the generation prompt (so the template's own
  end-of-turn tokens are learnt, its role headers are not). A template whose renderings are not prefixes of one
  another is refused, naming the example. Without a chat template, prompt/completion examples are the prompt's
  tokens then the completion's and the end-of-sequence token; chat examples are refused.
- Labels: every token but the assistants' is IGNORE (-100), which the loss skips.
- Rows: `[3, seq_len]` of input ids, target ids (the next token's label: IGNORE where it is not an assistant token
  or belongs to the next example) and positions. Packed: examples follow each other in a row, positions restart at
  0 with each, so a Hugging Face model given them (and no attention mask) confines attention to each example (its
  mask is block-diagonal: `masking_utils.find_packed_sequence_indices`); the rest of a row is padding whose
  targets are IGNORE. Padded: one example per row. An example longer than a row is cut to it (counted).
- The order: the examples shuffled once by the seed, then packed in that order; step s takes the next
  global_batch_size rows, round the rows again at the end: a pure function of (seed, step), as every source.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import torch

IGNORE = -100


def read_examples(folder: str) -> list[list[dict]]:
    """Every example of the folder's `.jsonl` files as a list of messages; ValueError naming the file and line."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".jsonl")) if os.path.isdir(folder) else []
    if not files:
        raise ValueError(f"task sft: {folder} holds no .jsonl files; give the data channel .jsonl files of chat "
                         'examples ({"messages": [{"role": "user", "content": ...}, ...]} or {"prompt": ..., '
                         '"completion": ...} per line)')
    examples = []
    for name in files:
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    examples.append(_messages(line, f"{name}:{number}"))
    if not examples:
        raise ValueError(f"task sft: the .jsonl files of {folder} ({', '.join(files)}) hold no example")
    return examples


def _messages(line: str, where: str) -> list[dict]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"task sft: {where} is not one JSON object a line ({e.msg} at character {e.pos})") from None
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        messages = record["messages"]
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"task sft: {where}: every message needs a string role and content, got {m!r}")
        if not any(m["role"] == "assistant" for m in messages):
            roles = sorted({m["role"] for m in messages})
            raise ValueError(f"task sft: {where} has no assistant message (roles {', '.join(roles) or 'none'}): "
                             "nothing to learn from it; the learnt turns have role \"assistant\"")
        return messages
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    raise ValueError(f'task sft: {where} has neither "messages" (a list) nor "prompt" and "completion" (strings)')


def _template(tokenizer, messages: list[dict], *, prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)
    return list(ids)


def render(tokenizer, messages: list[dict], where: str = "an example") -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation: labels IGNORE but on the assistants' tokens."""
    if not getattr(tokenizer, "chat_template", None):
        if [m["role"] for m in messages] != ["user", "assistant"]:
            raise ValueError(f"task sft: the tokenizer has no chat template, so {where} must be a prompt and a "
                             "completion; add a chat_template to tokenizer_config.json for conversations")
        prompt = tokenizer.encode(messages[0]["content"], add_special_tokens=False)
        answer = tokenizer.encode(messages[1]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
        return prompt + answer, [IGNORE] * len(prompt) + answer
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _template(tokenizer, messages[:i], prompt=True)
        upto = _template(tokenizer, messages[:i + 1], prompt=False)
        if upto[:len(before)] != before or before[:len(ids)] != ids:
            raise ValueError(f"task sft: the chat template renders {where} so that a turn's tokens change with the "
                             "turns after it (e.g. it drops earlier reasoning); the assistant's tokens cannot be told "
                             "apart: use a template that renders each turn the same whatever follows")
        labels += [IGNORE] * (len(before) - len(ids)) + upto[len(before):]
        ids = upto
    return ids, labels


def example_rows(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """Inputs and targets of one example: each input token with the next token's label."""
    return ids[:-1], labels[1:]


@dataclass(kw_only=True, slots=True)
class Packed:
    rows: torch.Tensor
    """LongTensor[n, 3, seq_len]: input ids, targets (IGNORE where not learnt) and positions."""
    lengths: torch.Tensor
    """LongTensor[n]: each row's tokens of examples (the rest is padding)."""
    examples: int
    cut: int
    """Examples longer than a row, cut to it."""
    target_tokens: int
    """Tokens the loss counts over all rows."""


def build_rows(examples: list[tuple[list[int], list[int]]], seq_len: int, *, pad_id: int, packing: bool) -> Packed:
    """The rows of `examples` ((input ids, targets) each), packed or one per row (module docstring)."""
    rows: list[torch.Tensor] = []
    lengths: list[int] = []
    current: list[tuple[list[int], list[int]]] = []
    used, cut = 0, 0

    def close() -> None:
        row = torch.full((3, seq_len), IGNORE, dtype=torch.long)
        row[0] = pad_id
        at = 0
        for inputs, targets in current:
            n = len(inputs)
            row[0, at:at + n] = torch.tensor(inputs)
            row[1, at:at + n] = torch.tensor(targets)
            row[2, at:at + n] = torch.arange(n)
            at += n
        row[2, at:] = torch.arange(seq_len - at)  # the padding: a run of positions of its own, never learnt
        rows.append(row)
        lengths.append(at)

    for inputs, targets in examples:
        if len(inputs) > seq_len:
            inputs, targets, cut = inputs[:seq_len], targets[:seq_len], cut + 1
        if current and (not packing or used + len(inputs) > seq_len):
            close()
            current, used = [], 0
        current.append((inputs, targets))
        used += len(inputs)
    if current:
        close()
    stacked = torch.stack(rows)
    return Packed(rows=stacked, lengths=torch.tensor(lengths), examples=len(examples), cut=cut, target_tokens=int((stacked[:, 1] != IGNORE).sum()))


class SftSource:
    """The global batch of a step: `global_batch_size` rows (`[B, 3, seq_len]`) of the packed or padded examples."""

    def __init__(self, folder: str, tokenizer, *, seed: int, global_batch_size: int, seq_len: int,
                 packing: bool = True) -> None:
        messages = read_examples(folder)
        rendered = [example_rows(*render(tokenizer, m, f"example {i + 1}")) for i, m in enumerate(messages)]
        order = list(range(len(rendered)))
        random.Random(seed).shuffle(order)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.packed = build_rows([rendered[i] for i in order], seq_len, pad_id=pad, packing=packing)
        if not self.packed.target_tokens:
            raise ValueError(f"task sft: no assistant token of the {len(rendered)} examples of {folder} falls within "
                             f"seq_len {seq_len} (every answer comes after the first {seq_len} tokens of its example): "
                             "nothing would be learnt; raise seq_len")
        self.global_batch_size = global_batch_size

    def _picked(self, step: int) -> list[int]:
        first = (step - 1) * self.global_batch_size
        return [(first + i) % len(self.packed.rows) for i in range(self.global_batch_size)]

    def global_batch(self, step: int) -> torch.Tensor:
        return self.packed.rows[self._picked(step)]

    def tokens(self, step: int) -> int:
        """The global batch's tokens of examples (its padding not counted)."""
        return int(self.packed.lengths[self._picked(step)].sum())

    def describe(self) -> str:
        p = self.packed
        cut = f", {p.cut} cut to seq_len" if p.cut else ""
        return (f"{p.examples} chat examples in {len(p.rows)} rows ({p.examples / len(p.rows):.2f} a row{cut}), "
                f"{p.target_tokens} assistant tokens learnt per pass")


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """The summed cross-entropy of the targets that count (IGNORE skipped), times `scale`: 1 / the global batch's
    count of them, times the data-parallel ranks whose gradients are averaged, gives every token the same weight
    whatever the rows and ranks it falls on."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                                             reduction="sum") * scale
