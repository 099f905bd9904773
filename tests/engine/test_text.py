"""Text channels: .jsonl/.txt/.parquet tokenized once with a local BPE tokenizer, cached, sampled like token files."""
import json
import os
import random
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from trainyard.engine.components.data import TokenFileSource, build_source, rank_rows
from trainyard.engine.components.text import TextSource, eos_token_id, text_files, train_bpe_tokenizer

VOCAB = 320  # the tokenizer's size: 256 bytes, <|endoftext|> and 63 merges
_WORDS = "the a train yard loads cargo at dawn and every engine pulls its wagons past quiet stations".split()


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return train_bpe_tokenizer(_sentences(300), VOCAB, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _channel(root, kind: str, docs: list[str]) -> str:
    """A channel directory holding `docs` as two files of `kind`."""
    path = root / f"channel-{kind}"
    path.mkdir()
    for part, chunk in enumerate((docs[:len(docs) // 2], docs[len(docs) // 2:])):
        if kind == "jsonl":
            lines = [json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(chunk)]
            (path / f"part-{part}.jsonl").write_text("".join(lines))
        elif kind == "parquet":
            pq.write_table(pa.table({"id": list(range(len(chunk))), "text": chunk}), path / f"part-{part}.parquet")
        else:  # one document per .txt file
            for i, d in enumerate(chunk):
                (path / f"part-{part}-{i:03}.txt").write_text(d)
    return str(path)


def _source(path, tokenizer, cache, **kw):
    args = dict(seed=0, global_batch_size=8, seq_len=16, vocab_size=VOCAB, cache_dir=str(cache))
    return TextSource(path=path, tokenizer_path=tokenizer, **(args | kw))


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_channel_gives_deterministic_batches(tmp_path, tokenizer, kind, capsys):
    docs = _sentences(40, seed=1)
    path = _channel(tmp_path, kind, docs)
    src = _source(path, tokenizer, tmp_path / "cache")
    assert src.built and f"tokenized {len(docs)} documents" in capsys.readouterr().out
    batch = src.global_batch(3)
    assert batch.shape == (8, 17) and batch.dtype == torch.long
    assert 0 <= batch.min() and batch.max() < VOCAB
    assert torch.equal(batch, src.global_batch(3))
    assert not torch.equal(batch, src.global_batch(4))
    # the stream is the documents' ids, each followed by <|endoftext|>, in file order
    tok = Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    expected = [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eos]]
    stream = np.fromfile(src.cache_file, dtype="<u2")
    assert stream.tolist() == expected
    # every row is a window of the stream
    text = "," + ",".join(map(str, expected)) + ","
    assert all("," + ",".join(map(str, row.tolist())) + "," in text for row in batch)
    # a fresh source (another process, a restart) reads the cache and gives the same batches
    again = _source(path, tokenizer, tmp_path / "cache")
    assert not again.built and torch.equal(again.global_batch(3), batch)
    out = capsys.readouterr().out
    assert "tokenized" not in out and "from cache" in out
    # another seed, another stream of windows
    assert not torch.equal(_source(path, tokenizer, tmp_path / "cache", seed=1).global_batch(3), batch)


def test_rank_slices_on_any_data_parallel_degree(tmp_path, tokenizer):
    src = _source(_channel(tmp_path, "jsonl", _sentences(40)), tokenizer, tmp_path / "cache")
    batch = src.global_batch(7)
    for world in (1, 2, 4, 8):
        assert torch.equal(torch.cat([rank_rows(batch, r, world) for r in range(world)]), batch)


def test_cache_key_follows_files_and_tokenizer(tmp_path, tokenizer):
    path = _channel(tmp_path, "jsonl", _sentences(20))
    first = _source(path, tokenizer, tmp_path / "cache")
    with open(os.path.join(path, "part-1.jsonl"), "a") as f:
        f.write(json.dumps({"text": "One more line."}) + "\n")
    changed = _source(path, tokenizer, tmp_path / "cache")
    assert changed.built and changed.cache_file != first.cache_file and changed.total > first.total
    other = train_bpe_tokenizer(_sentences(300, seed=5), VOCAB + 20, str(tmp_path / "other" / "tokenizer.json"))
    assert _source(path, other, tmp_path / "cache", vocab_size=VOCAB + 20).built


def test_two_hosts_with_the_same_files_share_one_cache_key(tmp_path, tokenizer):
    """Hosts stage a channel at different times: same content, other mtimes, one key (and so one cache where
    they share a folder). A same-size edit with the old mtime gets a new key."""
    for host in ("algo-1", "algo-2"):
        (tmp_path / host).mkdir()
    first = _channel(tmp_path / "algo-1", "jsonl", _sentences(20))
    second = _channel(tmp_path / "algo-2", "jsonl", _sentences(20))
    for rel in os.listdir(second):
        os.utime(os.path.join(second, rel), ns=(10**18, 10**18))
    one = _source(first, tokenizer, tmp_path / "cache")
    two = _source(second, tokenizer, tmp_path / "cache")
    assert one.built and not two.built and two.cache_file == one.cache_file
    part = os.path.join(second, sorted(os.listdir(second))[0])
    text, st = open(part).read(), os.stat(part)
    with open(part, "w") as f:
        f.write(text.replace("a", "b", 1))  # the same size
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same time
    edited = _source(second, tokenizer, tmp_path / "cache")
    assert edited.built and edited.cache_file != one.cache_file


def test_txt_file_is_one_document(tmp_path, tokenizer):
    (tmp_path / "ch").mkdir()
    (tmp_path / "ch" / "book.txt").write_text("First paragraph of the book.\n\nSecond paragraph.\n")
    src = _source(str(tmp_path / "ch"), tokenizer, tmp_path / "cache", seq_len=4)
    stream = np.fromfile(src.cache_file, dtype="<u2").tolist()
    assert stream.count(0) == 1 and stream[-1] == 0  # <|endoftext|> is id 0, once, at the end


def test_files_recursive_in_sorted_order(tmp_path):
    for rel in ["b/2.jsonl", "a.txt", "b/10.parquet", "b/1/x.txt", ".hidden/y.txt", "c/.z.txt", "d.bin", "e.json"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    names = [os.path.relpath(f, tmp_path) for f in text_files(str(tmp_path))]
    assert names == ["a.txt", "b/1/x.txt", "b/10.parquet", "b/2.jsonl"]


def test_bad_jsonl_line_names_file_and_line(tmp_path, tokenizer):
    (tmp_path / "ch").mkdir()
    (tmp_path / "ch" / "data.jsonl").write_text('{"text": "fine"}\n\n{"text": "broken\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:3: not a JSON line"):
        _source(str(tmp_path / "ch"), tokenizer, tmp_path / "cache")
    (tmp_path / "ch" / "data.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:2: field 'text' is a number, not a string"):
        _source(str(tmp_path / "ch"), tokenizer, tmp_path / "cache")
    assert not os.listdir(tmp_path / "cache") or all(n.endswith(".lock") for n in os.listdir(tmp_path / "cache"))


def test_missing_field_is_named(tmp_path, tokenizer):
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "d.jsonl").write_text('{"text": "fine"}\n{"content": "no text here"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: no field 'text' \(fields: 'content'\)"):
        _source(str(tmp_path / "j"), tokenizer, tmp_path / "cache")
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"content": ["a b c"]}), tmp_path / "p" / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet: no column 'text' \(columns: 'content'\)"):
        _source(str(tmp_path / "p"), tokenizer, tmp_path / "cache")
    # the field can be named
    src = _source(str(tmp_path / "p"), tokenizer, tmp_path / "cache", text_field="content", seq_len=2)
    assert src.total >= 3


def test_token_id_beyond_vocab_size_refused(tmp_path, tokenizer):
    path = _channel(tmp_path, "jsonl", _sentences(20))
    with pytest.raises(ValueError, match=r"token id \d+ >= vocab_size 100: tokenizer .*tokenizer\.json"):
        _source(path, tokenizer, tmp_path / "cache", vocab_size=100)


def test_no_text_files(tmp_path, tokenizer):
    (tmp_path / "notes.md").write_text("not data")
    with pytest.raises(ValueError, match=r"no \.jsonl, \.txt, \.parquet files under"):
        _source(str(tmp_path), tokenizer, tmp_path / "cache")
    with pytest.raises(ValueError, match="does not exist"):
        _source(str(tmp_path / "missing"), tokenizer, tmp_path / "cache")
    (tmp_path / "a.txt").write_text("Too short.")
    with pytest.raises(ValueError, match="at least seq_len"):
        _source(str(tmp_path), tokenizer, tmp_path / "cache", seq_len=64)


def test_eos_from_tokenizer_config(tmp_path, tokenizer):
    tok = Tokenizer.from_file(tokenizer)
    assert eos_token_id(tok, tokenizer) == tok.token_to_id("<|endoftext|>")
    model = tmp_path / "model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "a"}}))
    assert eos_token_id(tok, str(model / "tokenizer.json")) == tok.token_to_id("a")


def test_concurrent_builders_tokenize_once(tmp_path, tokenizer):
    path = _channel(tmp_path, "jsonl", _sentences(200))
    sources = [None, None]

    def build(i):
        sources[i] = _source(path, tokenizer, tmp_path / "cache")

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.built for s in sources) == [False, True]
    assert torch.equal(sources[0].global_batch(0), sources[1].global_batch(0))
    assert [n for n in os.listdir(tmp_path / "cache") if ".tmp-" in n] == []


def test_build_source_text_channel(tmp_path, tokenizer):
    path = _channel(tmp_path, "jsonl", _sentences(20))
    env = {"SM_CHANNEL_TRAIN": path, "SM_OUTPUT_INTERMEDIATE_DIR": str(tmp_path / "intermediate")}
    args = dict(seed=0, global_batch_size=2, seq_len=4, vocab_size=VOCAB, env=env)
    with pytest.raises(ValueError, match="pass a model directory with tokenizer.json"):
        build_source("train", **args)
    src = build_source("train", tokenizer_path=os.path.dirname(tokenizer), **args)  # a model directory
    assert isinstance(src, TextSource)
    assert src.cache_file.startswith(str(tmp_path / "intermediate" / "trainyard-text") + os.sep)
    # token files win when both are there
    np.arange(50, dtype="<u2").tofile(os.path.join(path, "tokens.bin"))
    assert isinstance(build_source("train", tokenizer_path=tokenizer, **args), TokenFileSource)
