"""Supervised fine-tuning data (engine/components/sft.py): the loss counts the assistants' tokens only, rendered
with the model's chat template; packed rows give the losses and gradients of the same examples one a row."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from trainyard.engine.components import sft

ROOT = Path(__file__).resolve().parents[2]


def _standin():
    spec = importlib.util.spec_from_file_location("standin", ROOT / "examples" / "finetune" / "standin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    _standin().write(str(root / "model"), str(root / "chat"), count=24)
    return root


@pytest.fixture(scope="module")
def tokenizer(folders):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folders / "model")


def test_only_the_assistants_tokens_are_learnt(tokenizer):
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "why the cat"},
                {"role": "assistant", "content": "the mat"}, {"role": "user", "content": "what is it"},
                {"role": "assistant", "content": "a red box"}]
    ids, labels = sft.render(tokenizer, messages)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nanswer briefly<|im_end|>\n<|im_start|>user\nwhy the cat"
                                     "<|im_end|>\n<|im_start|>assistant\nthe mat<|im_end|>\n<|im_start|>user\nwhat is "
                                     "it<|im_end|>\n<|im_start|>assistant\na red box<|im_end|>\n")
    learnt = [i for i, label in enumerate(labels) if label != sft.IGNORE]
    assert [labels[i] for i in learnt] == [ids[i] for i in learnt]
    # two runs of learnt tokens, each an answer and its end of turn; the role headers are not learnt
    runs = [[learnt[0]]]
    for i in learnt[1:]:
        (runs[-1].append(i) if i == runs[-1][-1] + 1 else runs.append([i]))
    assert [tokenizer.decode([ids[i] for i in run]) for run in runs] == ["the mat<|im_end|>\n", "a red box<|im_end|>\n"]
    inputs, targets = sft.example_rows(ids, labels)
    assert len(inputs) == len(targets) == len(ids) - 1 and targets == labels[1:]


def test_a_template_that_rewrites_earlier_turns_and_bad_lines_are_refused(tokenizer, tmp_path):
    rewriting = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    rewriting.chat_template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] if loop.last else 'x' }};"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "the mat"}]
    with pytest.raises(ValueError, match="a turn's tokens change with the turns after it"):
        sft.render(rewriting, messages, "example 3")
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="a.jsonl:1 has no assistant message"):
        sft.read_examples(str(tmp_path))
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="a.jsonl:1 has no assistant message \\(roles bot\\)"):
        sft.read_examples(str(tmp_path))
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match='a.jsonl:1 has neither "messages"'):
        sft.read_examples(str(tmp_path))
    (tmp_path / "a.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"\(a.jsonl\) hold no example"):
        sft.read_examples(str(tmp_path))


def test_data_whose_answers_all_fall_beyond_seq_len_is_refused(tokenizer, tmp_path):
    """Otherwise the job would train on nothing and report a loss of 0."""
    long = " ".join(["the cat sat on the mat"] * 20)
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": long, "completion": "yes"}) + "\n")
    with pytest.raises(ValueError, match="no assistant token of the 1 examples .* falls within seq_len 32"):
        sft.SftSource(str(tmp_path), tokenizer, seed=0, global_batch_size=1, seq_len=32)


def test_packed_rows_give_the_losses_and_gradients_of_the_examples_one_a_row(folders, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folders / "model")
    examples = [sft.example_rows(*sft.render(tokenizer, m)) for m in sft.read_examples(str(folders / "chat"))]
    padded = sft.build_rows(examples, 256, pad_id=tokenizer.pad_token_id, packing=False)
    packed = sft.build_rows(examples, 256, pad_id=tokenizer.pad_token_id, packing=True)
    assert packed.target_tokens == padded.target_tokens and len(packed.rows) * 2 <= len(padded.rows)
    assert int(packed.lengths.sum()) == int(padded.lengths.sum()) == sum(len(i) for i, _ in examples)

    def loss_and_grads(rows):
        model.zero_grad()
        out = model(input_ids=rows[:, 0], position_ids=rows[:, 2], use_cache=False)
        loss = sft.sft_loss(out.logits, rows[:, 1], 1.0 / int((rows[:, 1] != sft.IGNORE).sum()))
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads(padded.rows)
    got, grads = loss_and_grads(packed.rows)
    assert got == pytest.approx(want, rel=1e-6)
    worst = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in want_grads.items())
    assert worst <= 1e-6
    # without the positions the examples of a row would attend to each other: the loss differs
    out = model(input_ids=packed.rows[:, 0], use_cache=False)
    leaked = sft.sft_loss(out.logits, packed.rows[:, 1], 1.0 / packed.target_tokens).item()
    assert abs(leaked - want) > 1e-4  # a hundred times the tolerance above
