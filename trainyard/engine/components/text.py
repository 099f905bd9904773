"""Text channels: documents -> token ids (once, cached on disk) -> the same windows as token files.

Files. Under the channel directory, recursively, in sorted relative-path order (hidden files and folders,
names starting with ".", are skipped):
- `.jsonl`: one JSON object per line, the document in the string field `text_field`; blank lines are
  skipped; a bad line is an error naming the file and the line number.
- `.txt`: the whole file is one document; it is NOT split on blank lines (a book's paragraphs stay one
  document, with no EOS between them). A file is tokenized in pieces of about TXT_PIECE_CHARS characters
  ending at a line end, for bounded memory and parallel tokenization; the only difference from
  tokenizing it whole is at those few piece boundaries.
- `.parquet`: the string column `text_field`, read in record batches with pyarrow; one row is one document.
Empty documents are skipped; a null or non-string value is an error.

Tokens. `tokenizers.Tokenizer.from_file(tokenizer.json)` with its truncation and padding switched off and
no special tokens added (no BOS); the EOS id follows every document. EOS is `eos_token` of a
tokenizer_config.json beside tokenizer.json when it names a token in the vocabulary, else the first of
EOS_NAMES in the vocabulary; with none, documents are concatenated as they are. Documents go through
`encode_batch` DOC_BATCH at a time (the library tokenizes a batch on all cores).

Cache. The stream is written once to `cache_dir` (default: `default_cache_dir()`, never the channel, which
may be read-only) as raw little-endian uint16 when every id of the tokenizer fits, else uint32, named
`text-<key>.<dtype>` where key hashes the files' relative paths and contents, tokenizer.json's content, the
EOS id, text_field and CACHE_FORMAT (content, not times: hosts that staged the same files share one key): a
restarted job memory-maps it instead of tokenizing again, after reading the files once to hash them.
A builder writes a private temporary file, fsyncs it and renames it into place, so a reader sees a whole
file or none. Processes of one host take an flock on `text-<key>.lock`: one tokenizes, the others wait
and then map its file; on a file system without locks each may build, and renames of identical content
are harmless.

Sampling is `windows.TokenWindows`, as for token files: the global batch of a step is a pure function of
(seed, step), so resuming on another data-parallel degree continues the same stream.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from trainyard.engine.components.windows import TokenWindows, check_shape, max_token

TEXT_SUFFIXES = (".jsonl", ".txt", ".parquet")
# Tried in this order when no tokenizer_config.json names the EOS token: Llama-2/Mistral, GPT-2/Qwen,
# Llama-3, Gemma.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
# Part of the cache key: bump it when the way files become tokens changes, so old caches are not reused.
CACHE_FORMAT = "trainyard-text-1"
# Documents (or .txt pieces) per encode_batch call, and at most this many characters per call: large
# enough to keep every core busy, small enough to bound the memory of one batch's encodings.
DOC_BATCH = 1024
BATCH_CHARS = 1 << 25
# A .txt file is tokenized in pieces of about this many characters (1 Mi), cut at line ends.
TXT_PIECE_CHARS = 1 << 20
# Ids below this fit the uint16 cache format.
_UINT16_IDS = 1 << 16
_INSTALL_HINT = "reading text channels needs the tokenizers and pyarrow packages: pip install 'trainyard[hf]'"


def default_cache_dir(env: dict | None = None) -> str:
    """`$SM_OUTPUT_INTERMEDIATE_DIR/trainyard-text` inside a job, else `<temp dir>/trainyard-text`."""
    env = os.environ if env is None else env
    return os.path.join(env.get("SM_OUTPUT_INTERMEDIATE_DIR") or tempfile.gettempdir(), "trainyard-text")


def text_files(path: str) -> list[str]:
    """The .jsonl/.txt/.parquet files under `path`, recursively, in sorted relative-path order."""
    found = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.relpath(os.path.join(root, n), path) for n in names
                  if n.endswith(TEXT_SUFFIXES) and not n.startswith(".")]
    return [os.path.join(path, rel) for rel in sorted(found, key=lambda rel: rel.split(os.sep))]


class TextSource(TokenWindows):
    """Windows of seq_len + 1 tokens from a channel of text files, tokenized once and cached."""

    built = False
    """Whether this construction tokenized the files (False: it mapped the cache)."""

    def __init__(self, *, path: str, tokenizer_path: str, seed: int, global_batch_size: int, seq_len: int,
                 vocab_size: int, text_field: str = "text", cache_dir: str | None = None) -> None:
        check_shape(global_batch_size, seq_len)
        if not os.path.isdir(path):
            raise ValueError(f"text directory {path} does not exist or is not a directory")
        self.text_files = text_files(path)
        if not self.text_files:
            raise ValueError(f"no {', '.join(TEXT_SUFFIXES)} files under {path}")
        self.tokenizer_file = _tokenizer_file(tokenizer_path)
        tokenizer = load_tokenizer(self.tokenizer_file)
        self.eos_id = eos_token_id(tokenizer, self.tokenizer_file)
        ids = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        dtype = np.dtype("<u2") if ids <= _UINT16_IDS else np.dtype("<u4")
        key = _cache_key(path, self.text_files, self.tokenizer_file, self.eos_id, text_field)
        cache_dir = cache_dir or default_cache_dir()
        self.cache_file = os.path.join(cache_dir, f"text-{key}.{'uint16' if dtype.itemsize == 2 else 'uint32'}")
        if not os.path.exists(self.cache_file):
            os.makedirs(cache_dir, exist_ok=True)
            with _host_lock(os.path.join(cache_dir, f"text-{key}.lock")):
                if not os.path.exists(self.cache_file):  # another process may have built it while we waited
                    self._build(tokenizer, text_field, dtype)
        tokens = _load(self.cache_file, dtype)
        if not self.built:
            print(f"text source: {len(tokens)} tokens from cache {self.cache_file}", flush=True)
        top = max_token(tokens)
        if top >= vocab_size:
            raise ValueError(
                f"token id {top} >= vocab_size {vocab_size}: tokenizer {self.tokenizer_file} does not match the "
                f"model's vocabulary (its ids need vocab_size >= {top + 1})"
            )
        super().__init__([tokens], seed=seed, global_batch_size=global_batch_size, seq_len=seq_len,
                         where=f"{path} ({len(self.text_files)} text file(s), tokenized)")

    def _build(self, tokenizer, text_field: str, dtype: np.dtype) -> None:
        tmp = f"{self.cache_file}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        began = time.perf_counter()
        try:
            with open(tmp, "wb") as out:
                docs, tokens = tokenize_to(out, _pieces(self.text_files, text_field), tokenizer, self.eos_id, dtype)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.cache_file)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.built = True
        print(f"text source: tokenized {docs} documents, {tokens} tokens from {len(self.text_files)} file(s) in "
              f"{time.perf_counter() - began:.1f} s -> {self.cache_file}", flush=True)


def load_tokenizer(tokenizer_file: str):
    """A `tokenizers.Tokenizer` with truncation and padding off (a model's tokenizer.json may set them)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    try:
        tokenizer = Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # the library raises a bare Exception for an unreadable file
        raise ValueError(f"{tokenizer_file}: not a tokenizer.json the tokenizers library can read ({e})") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def eos_token_id(tokenizer, tokenizer_file: str) -> int | None:
    """The EOS id: tokenizer_config.json's `eos_token` beside tokenizer_file, else the first of EOS_NAMES."""
    config = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
    names = list(EOS_NAMES)
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):  # older configs store an AddedToken: {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    return None


def tokenize_to(out, pieces: Iterator[tuple[str, bool]], tokenizer, eos_id: int | None,
                dtype: np.dtype) -> tuple[int, int]:
    """Write the ids of `pieces` ((text, ends a document) pairs) to the binary file `out`, the EOS id after
    every document; return (documents, tokens)."""
    docs = tokens = 0
    for batch in _batches(pieces):
        encodings = tokenizer.encode_batch([text for text, _ in batch], add_special_tokens=False)
        ids: list[int] = []
        for (_, ends), encoding in zip(batch, encodings):
            ids += encoding.ids
            if ends:
                docs += 1
                if eos_id is not None:
                    ids.append(eos_id)
        out.write(np.asarray(ids, dtype=dtype).tobytes())
        tokens += len(ids)
    return docs, tokens


def train_bpe_tokenizer(texts: list[str], vocab_size: int, out_path: str) -> str:
    """Train a byte-level BPE tokenizer on `texts` (special token `<|endoftext|>`, id 0) and save it as a
    tokenizer.json at `out_path`; return out_path. Any text encodes (every byte is in the vocabulary)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must be >= {len(alphabet) + 1} (256 bytes and <|endoftext|>), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tokenizer.save(out_path)
    return out_path


def _tokenizer_file(tokenizer_path: str) -> str:
    file = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
    if not os.path.isfile(file):
        raise ValueError(f"tokenizer {file} does not exist (pass a tokenizer.json, or a model directory holding one)")
    return file


def _cache_key(path: str, files: list[str], tokenizer_file: str, eos_id: int | None, text_field: str) -> str:
    """What the cache holds, from content alone: two hosts that staged the same files (at other times: other
    mtimes) share one key, and an edited file with the same size and time gets a new one."""
    h = hashlib.sha256(json.dumps([CACHE_FORMAT, text_field, eos_id]).encode())
    for file in [*files, tokenizer_file]:
        h.update(json.dumps([os.path.relpath(file, path) if file != tokenizer_file else "tokenizer",
                             os.path.getsize(file)]).encode())
        with open(file, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:24]


@contextmanager
def _host_lock(lock_file: str) -> Iterator[None]:
    """Exclusive flock on lock_file while inside; a no-op where the file system has no locks."""
    with open(lock_file, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield  # closing the file releases the lock


def _load(cache_file: str, dtype: np.dtype) -> np.ndarray:
    size = os.path.getsize(cache_file)
    if size % dtype.itemsize:
        raise ValueError(f"{cache_file}: size {size} is not a multiple of {dtype.itemsize}; a corrupt cache, delete it")
    return np.memmap(cache_file, dtype=dtype, mode="r") if size else np.empty(0, dtype=dtype)


def _batches(pieces: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    batch: list[tuple[str, bool]] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) >= DOC_BATCH or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _pieces(files: list[str], text_field: str) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) for every file in order."""
    for file in files:
        if file.endswith(".txt"):
            yield from _txt_pieces(file)
        else:
            texts = _jsonl_texts(file, text_field) if file.endswith(".jsonl") else _parquet_texts(file, text_field)
            for text in texts:
                yield text, True


def _txt_pieces(file: str) -> Iterator[tuple[str, bool]]:
    lines: list[str] = []
    chars = total = 0
    try:
        with open(file, encoding="utf-8") as f:
            for line in f:
                lines.append(line)
                chars += len(line)
                if chars >= TXT_PIECE_CHARS:
                    yield "".join(lines), False
                    total += chars
                    lines, chars = [], 0
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e})") from None
    if total + chars:  # an empty file is no document
        yield "".join(lines), True


def _jsonl_texts(file: str, field: str) -> Iterator[str]:
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"{file}:{lineno}: not a JSON line ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{file}:{lineno}: expected a JSON object with field {field!r}, got {_json_type(obj)}")
            if field not in obj:
                fields = ", ".join(map(repr, obj)) or "none"
                raise ValueError(f"{file}:{lineno}: no field {field!r} (fields: {fields}); set text_field")
            text = obj[field]
            if not isinstance(text, str):
                raise ValueError(f"{file}:{lineno}: field {field!r} is {_json_type(text)}, not a string")
            if text:
                yield text


def _parquet_texts(file: str, field: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{file}: not a readable parquet file ({e})") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise ValueError(f"{file}: no column {field!r} (columns: {', '.join(map(repr, schema.names))}); set text_field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise ValueError(f"{file}: column {field!r} is {kind}, not a string column")
    row = 0
    for batch in parquet.iter_batches(batch_size=DOC_BATCH, columns=[field]):
        texts = batch.column(0).to_pylist()
        if None in texts:
            raise ValueError(f"{file}: row {row + texts.index(None)}: column {field!r} is null")
        yield from (text for text in texts if text)
        row += len(texts)


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
