"""Model weights as Hugging Face safetensors: written whole by one rank, read back piecewise by every rank.

Layout under OUT (a local directory or `s3://bucket/prefix`; the one `from_pretrained` reads):

    model.safetensors                          when all tensors together are <= max_shard_size (5 GiB)
    model-00001-of-0000N.safetensors ...       otherwise, tensors in state-dict order, a new file
    model.safetensors.index.json               whenever the next tensor would overflow the current one
                                               {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    config.json                                with an HF config (as `save_pretrained` writes it)
    trainyard_model.json                       without one: {"format", "version", "tensors",
                                               "parameters", "dtype", "total_size", "files"}

Every file is written whole (locally to `NAME.tmp`, then renamed; on S3 one upload, which becomes visible
only when complete), weights first, then the index, then config.json / trainyard_model.json, so a reader
never sees an index naming a missing file. Weight files of an earlier save that the new one does not
name are removed before the config is written (`from_pretrained` prefers a stale `model.safetensors`
over a new index).

A safetensors file is: 8 bytes little-endian u64 N, N bytes of JSON header {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {"format": "pt"}}, then the data, offsets counted from
byte 8 + N, each tensor row-major. The rows of dim 0 of a tensor are therefore contiguous bytes: a
rank that holds rows [a, b) of a parameter (FSDP2 `Shard(0)`, TP colwise, `_StridedShard(0)`) fetches
just those byte ranges, and slices the other dims (TP rowwise `Shard(1)`) in memory. Under FSDP2 over
N ranks each rank reads about 1/N of the bytes.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from trainyard.engine.components.checkpoint import filesystem

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "trainyard_model.json"
SUMMARY_VERSION = 1
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30  # HF's default for save_pretrained ("5GB")
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_METADATA = {"format": "pt"}  # from_pretrained refuses a file whose metadata names no known format
_HEADER_LIMIT = 100 * 2**20  # the safetensors library refuses headers over 100 MB
# Bytes one rank fetches at once from one file: bounds its buffer, and lets s3fs fetch the ranges of
# a batch concurrently.
_READ_BATCH = 256 * 2**20
_LISTED = 10  # names quoted in an error before "..."

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightNamesError(KeyError):
    """The tensor names in the files and in the model differ (printed as a message, not a repr)."""

    def __str__(self) -> str:
        return str(self.args[0])


# ---------------------------------------------------------------------------------------------- write


def write_pretrained(state: dict[str, torch.Tensor], out: str, *, config: Any = None,
                     max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                     tied: dict[str, str] | None = None) -> list[str]:
    """Write the full (gathered, CPU) state dict `state` under `out` in the layout above; rank 0 only.

    `config`: a `transformers.PretrainedConfig` (then config.json, loadable by `from_pretrained`), or
    None (then trainyard_model.json). `tied`: {tied name: source name} (HF `_tied_weights_keys`, when
    the config ties them); the tied names are not written. Tensors are written contiguous, in their
    dtype. Returns the URIs written, in the order written. Peak extra memory: one file's bytes.
    """
    _check_uri(out)
    if not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    tensors = _tensors_to_write(state, tied or {})
    shards = _plan_shards(tensors, max_shard_size)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    fs, root = filesystem(out)
    if _is_local(fs):
        os.makedirs(root, exist_ok=True)  # never for S3: the engine does not create buckets
    written = [_put(fs, root, name, safetensors_bytes(shard, metadata=_METADATA))
               for name, shard in zip(names, shards)]
    if len(shards) > 1:
        written.append(_put(fs, root, INDEX_FILE, _json_bytes(_index(tensors, names, shards))))
    _remove_stale(fs, root, keep=set(names) | ({INDEX_FILE} if len(shards) > 1 else set()))
    if config is not None:
        written.append(_put(fs, root, CONFIG_FILE, _config_bytes(config, tensors)))
    else:
        written.append(_put(fs, root, SUMMARY_FILE, _json_bytes(_summary(tensors, names))))
    return [f"{out.rstrip('/')}/{path.rsplit('/', 1)[-1]}" for path in written]


def _tensors_to_write(state: dict[str, torch.Tensor], tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors to write: tied names dropped, each contiguous on CPU, none sharing storage."""
    if not state:
        raise ValueError("write_pretrained: the state dict is empty; pass model.state_dict() (gathered)")
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        _check_full(name, tensor)
        if name in tied:
            _check_tied(state, name, tied[name])
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in storages:
            # safetensors refuses tensors sharing storage; one not declared in `tied` is written as a copy
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


def _check_full(name: str, tensor: Any) -> None:
    if isinstance(tensor, DTensor):
        raise ValueError(f"write_pretrained: state[{name!r}] is a DTensor; gather first, e.g. get_model_state_dict"
                         f"(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"write_pretrained: state[{name!r}] is a {type(tensor).__name__}, not a tensor")
    if tensor.is_meta:
        raise ValueError(f"write_pretrained: state[{name!r}] is on the meta device and holds no data")


def _check_tied(state: dict[str, torch.Tensor], name: str, source: str) -> None:
    if source not in state:
        raise ValueError(f"write_pretrained: tied[{name!r}] = {source!r}, but the state has no {source!r}; "
                         f"pass the model's `_tied_weights_keys` only when config.tie_word_embeddings is true")
    a, b = state[name], state[source]
    same_view = (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                 and a.storage_offset() == b.storage_offset() and a.stride() == b.stride())
    if a.shape != b.shape or not (same_view or torch.equal(a.to("cpu"), b.to("cpu"))):
        raise ValueError(f"write_pretrained: tied[{name!r}] = {source!r}, but the two tensors differ "
                         f"(shapes {tuple(a.shape)} and {tuple(b.shape)}); they are not tied, pass tied=None")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, a new shard whenever the next one would overflow the current (HF's rule); a
    tensor larger than max_shard_size gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + _nbytes(tensor) > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += _nbytes(tensor)
    return shards


def _index(tensors: dict[str, torch.Tensor], names: list[str], shards: list[dict]) -> dict:
    total = sum(_nbytes(t) for t in tensors.values())
    return {"metadata": {"total_size": total},
            "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}


def _summary(tensors: dict[str, torch.Tensor], names: list[str]) -> dict:
    """trainyard_model.json: what a non-HF model's weights hold; `dtype` is the one holding most bytes."""
    by_dtype: Counter[str] = Counter()
    for t in tensors.values():
        by_dtype[str(t.dtype).removeprefix("torch.")] += _nbytes(t)
    return {"format": "trainyard", "version": SUMMARY_VERSION, "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values()), "dtype": by_dtype.most_common(1)[0][0],
            "total_size": sum(by_dtype.values()), "files": names}


def _config_bytes(config: Any, tensors: dict[str, torch.Tensor]) -> bytes:
    """config.json as `save_pretrained` writes it (a diff against the defaults), with `dtype` set to
    the first floating tensor's dtype as `save_pretrained` does; the caller's config is not changed."""
    if not hasattr(config, "to_json_string"):
        raise ValueError(f"write_pretrained: config must be a transformers.PretrainedConfig, got "
                         f"{type(config).__name__}; pass config=None for other models")
    config = copy.deepcopy(config)
    floating = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    if floating is not None:
        config.dtype = str(floating).removeprefix("torch.")
    return config.to_json_string(use_diff=True).encode()


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def _put(fs, root: str, name: str, data: bytes) -> str:
    """Writes `data` as root/name whole: locally to a temporary name, then renamed; remotely in one
    upload (s3fs uses a multipart upload above 100 MB, visible only once completed)."""
    path = f"{root}/{name}"
    if _is_local(fs):
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    else:
        fs.pipe_file(path, data)
    return path


def _remove_stale(fs, root: str, keep: set[str]) -> None:
    """Removes weight files (model.safetensors, model-*-of-*.safetensors, the index) of an earlier save."""
    fs.invalidate_cache(root)
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name not in keep and (name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(name)):
            fs.rm_file(f"{root}/{name}")


# ----------------------------------------------------------------------------------------------- read


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor in a safetensors file: absolute byte range [start, end) of its data. Or, with `parts`, a tensor
    the files hold in pieces (a mixture of experts' experts one by one, `_convert`): row i of dim 0 is the
    concatenation of parts[i]'s tensors, each whole bytes of a file (then path is the first part's, start/end 0)."""
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int
    parts: tuple[tuple["_Entry", ...], ...] | None = None

    def row_ranges(self, a: int, b: int) -> list[tuple[str, int, int]]:
        """The (file, start, end) byte ranges holding rows [a, b) of dim 0, in order."""
        if self.parts is not None:
            return [(p.path, p.start, p.end) for row in self.parts[a:b] for p in row]
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        return [(self.path, self.start + a * row_bytes, self.start + b * row_bytes)]


@dataclass(slots=True)
class _Read:
    """What one rank fetches for one tensor: byte ranges holding its rows, then in-memory index_selects."""
    name: str
    target: torch.Tensor  # the local tensor to copy into
    entry: _Entry
    rows: int  # rows of dim 0 fetched (1 for a 0-d tensor)
    ranges: list[tuple[str, int, int]]  # (file, start, end)
    selects: list[tuple[int, torch.Tensor]]  # (dim, indices) for the sharded dims other than 0

    @property
    def nbytes(self) -> int:
        return sum(end - start for _, start, end in self.ranges)


def load_pretrained_into(model: nn.Module, source: str, *, strict: bool = True,
                         elsewhere: frozenset[str] = frozenset(), targets: dict | None = None,
                         model_type: str | None = None) -> dict:
    """Copy safetensors weights at `source` (a directory or `s3://` prefix holding model.safetensors or
    model.safetensors.index.json and its files, or one `.safetensors` file) into `model`'s parameters and
    persistent buffers, plain tensors or DTensors (FSDP2 / TP: Shard, _StridedShard, Replicate), in place.

    Every rank reads only the rows of dim 0 its local pieces hold. Names and shapes are checked before
    anything is copied: missing or unexpected names raise `WeightNamesError` (a KeyError) unless
    `strict=False` (then a warning; the names both have are loaded); a name the file lacks is fine when
    the model ties it to one the file has; a name in `elsewhere` (held by another pipeline stage) is not
    unexpected. `targets`: the tensors to fill by the files' names (default: the model's, by its state-dict
    names). `model_type`: a Hugging Face config's; files that name its tensors as published checkpoints do
    (a mixture of experts' experts one by one) are read into the model's packed tensors (`_convert`). Returns
    {"tensors": copied, "bytes_read": bytes this rank fetched (headers included), "files": file names,
    "missing": [...], "unexpected": [...]}.
    """
    _check_uri(source)
    fs, root = filesystem(source)
    files = _weight_files(fs, root, source)
    entries, bytes_read = _read_headers(fs, files)
    targets = model_tensors(model) if targets is None else targets
    entries, notes = _convert(entries, targets, model_type, elsewhere)
    plan, missing, unexpected = _match_names(targets, entries, source, strict, elsewhere, notes)
    _check_targets(plan, entries, source)
    with torch.no_grad():
        reads = [_plan_read(name, tensor, entries[name]) for name, tensor in plan]
        for batch in _batches(reads):
            bytes_read += _fetch_and_copy(fs, batch)
    return {"tensors": len(plan), "bytes_read": bytes_read, "files": [f.rsplit("/", 1)[-1] for f in files],
            "missing": missing, "unexpected": unexpected}


def _weight_files(fs, root: str, source: str) -> list[str]:
    """The weight files at `source`, preferring model.safetensors over the index as from_pretrained does."""
    fs.invalidate_cache()  # s3fs caches listings; another process may have written since
    if root.endswith(".safetensors") and fs.isfile(root):
        return [root]
    if fs.exists(f"{root}/{SINGLE_FILE}"):
        return [f"{root}/{SINGLE_FILE}"]
    if fs.exists(f"{root}/{INDEX_FILE}"):
        index = json.loads(fs.cat_file(f"{root}/{INDEX_FILE}"))
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{source}/{INDEX_FILE}: no 'weight_map' {{name: file}}; rewrite it with write_pretrained")
        return [f"{root}/{name}" for name in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{source}: neither {SINGLE_FILE} nor {INDEX_FILE} there; write the weights with "
                            f"write_pretrained (or save_pretrained) first")


def _read_headers(fs, files: list[str]) -> tuple[dict[str, _Entry], int]:
    entries: dict[str, _Entry] = {}
    fetched = 0
    for path in files:
        found, size = _read_header(fs, path)
        fetched += size
        twice = sorted(found.keys() & entries.keys())
        if twice:
            raise ValueError(f"tensors {_listed(twice)} are in {path} and in another file; rewrite the weights")
        entries.update(found)
    return entries, fetched


def _read_header(fs, path: str) -> tuple[dict[str, _Entry], int]:
    """The tensors in one safetensors file and the bytes fetched to learn them (two ranged reads)."""
    # start/end by keyword: s3fs's cat_file takes version_id as its second positional argument
    prefix = fs.cat_file(path, start=0, end=8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= _HEADER_LIMIT:
        raise ValueError(f"{path}: not a safetensors file (header length {length}, expected 1..{_HEADER_LIMIT})")
    header = json.loads(fs.cat_file(path, start=8, end=8 + length))
    base, entries = 8 + length, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']!r}, which torch cannot hold here")
        dtype, shape, (begin, end) = _DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} of shape {shape} {info['dtype']} spans {end - begin} bytes")
        entries[name] = _Entry(path, dtype, shape, base + begin, base + end)
    return entries, 8 + length


def _convert(entries: dict[str, _Entry], targets: dict[str, torch.Tensor], model_type: str | None,
             elsewhere: frozenset[str] = frozenset()) -> tuple[dict[str, _Entry], list[str]]:
    """`entries` as the model names them, where the files follow the names of published checkpoints that
    transformers itself converts when it loads (`transformers.conversion_mapping`, by `model_type`): a module
    renamed (Mixtral's `block_sparse_moe` is `mlp`), and a mixture of experts' experts one by one
    (`experts.3.w1.weight`, `experts.3.w3.weight`) where the model holds them packed (`experts.gate_up_proj`, row e
    the concatenation of expert e's gate and up matrices). Only those two kinds of rule are read (a rename of a
    plain string; stacking experts, `MergeModulelist(dim=0)`, then concatenating the sources, `Concatenate(dim=1)`);
    any other leaves the names as they are, and a mismatch is then refused by name. Names the model already has
    are kept; names of `elsewhere` (other pipeline stages') are converted as the model's own. Returns the entries
    and what kept a packed tensor from being assembled (for the refusal's message)."""
    rules = _conversion_rules(model_type) if model_type and any(n not in targets for n in entries) else None
    if not rules:
        return entries, []
    renames, stacks = rules
    known = targets.keys() | elsewhere
    notes: list[str] = []
    out: dict[str, _Entry] = {}
    pieces: dict[str, dict[int, dict[int, _Entry]]] = {}  # target name -> source index -> expert -> entry
    named: dict[str, dict[str, _Entry]] = {}  # target name -> the files' names of its pieces
    for name, entry in entries.items():
        if name in targets:
            out[name] = entry
            continue
        renamed = name
        for old, new in renames:
            renamed = renamed.replace(old, new)
        for pattern, target, k in stacks:
            m = pattern.search(renamed)
            if m and renamed[:m.start()] + target in known:
                pieces.setdefault(renamed[:m.start()] + target, {}).setdefault(k, {})[int(m.group(1))] = entry
                named.setdefault(renamed[:m.start()] + target, {})[name] = entry
                break
        else:
            out[renamed if renamed in known else name] = entry  # a mismatch is named as the files name it
    for target, by_source in pieces.items():
        sources = [by_source.get(k, {}) for k in range(max(by_source) + 1)]
        # the experts the model holds (a DTensor's shape is the global one); another stage's: as the files number them
        experts = targets[target].shape[0] if target in targets else max(max(s, default=-1) for s in sources) + 1
        rows = tuple(tuple(src.get(e) for src in sources) for e in range(experts))
        problem = "the files hold it packed as well" if target in out else _stack_problem(rows, sources, experts)
        if problem:  # left as the files name them, to be refused by name with the reason
            notes.append(f"{target}: {problem}")
            out.update(named[target])
            continue
        first = rows[0][0]
        shape = (experts, sum(p.shape[0] for p in rows[0]), *first.shape[1:])
        out[target] = _Entry(first.path, first.dtype, shape, 0, 0, parts=rows)
    return out, notes


def _stack_problem(rows: tuple, sources: list[dict[int, _Entry]], experts: int) -> str | None:
    """Why these per-expert matrices do not make the packed tensor of `experts` rows, or None when they do."""
    for k, src in enumerate(sources):
        lacking = [e for e in range(experts) if e not in src]
        extra = sorted(e for e in src if e >= experts)
        if lacking or extra:
            return (f"the files hold experts {sorted(src)} for its part {k + 1} of {len(sources)}; the model has "
                    f"{experts} (0-{experts - 1})")
    for e, row in enumerate(rows):
        for k, (p, q) in enumerate(zip(row, rows[0])):
            if p.dtype != q.dtype or p.shape != q.shape:
                return (f"expert {e}'s part {k + 1} is {tuple(p.shape)} {p.dtype}, expert 0's "
                        f"{tuple(q.shape)} {q.dtype}")
        if any(p.shape[1:] != row[0].shape[1:] for p in row):
            return f"expert {e}'s parts do not concatenate: {[tuple(p.shape) for p in row]}"
    return None


def _conversion_rules(model_type: str) -> tuple[list[tuple[str, str]], list[tuple[re.Pattern, str, int]]] | None:
    """(plain renames, [(pattern of a source with the expert index as group 1, the target's suffix, the source's
    index)]) from transformers' conversion mapping for `model_type`; None when it has none, or a rule of another
    kind (then nothing is converted)."""
    try:
        from transformers.conversion_mapping import (Concatenate, MergeModulelist, WeightConverter, WeightRenaming,
                                                     get_checkpoint_conversion_mapping)
    except ImportError:
        return None
    mapping = get_checkpoint_conversion_mapping(model_type)
    if not mapping:
        return None
    renames, stacks = [], []
    plain = re.compile(r"^[\w.]+$")
    for rule in mapping:
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule) is WeightRenaming and len(sources) == len(targets) == 1 and \
                plain.match(sources[0]) and plain.match(targets[0]):
            renames.append((sources[0], targets[0]))
            continue
        ops = [(type(op), getattr(op, "dim", None)) for op in getattr(rule, "operations", ())]
        stacked = ops == [(MergeModulelist, 0)] and len(sources) == 1 or \
            ops == [(MergeModulelist, 0), (Concatenate, 1)] and len(sources) > 1
        if not (type(rule) is WeightConverter and len(targets) == 1 and plain.match(targets[0]) and stacked and
                all(src.count("*") == 1 and plain.match(src.replace("*", "0")) for src in sources)):
            return None
        for k, src in enumerate(sources):
            before, after = src.split("*")
            stacks.append((re.compile(re.escape(before) + r"(\d+)" + re.escape(after) + "$"), targets[0], k))
    return renames, stacks


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by its state-dict name, shared ones under each name."""
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                found[prefix + name] = param
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                found[prefix + name] = buf
    return found


def _match_names(targets: dict[str, torch.Tensor], entries: dict[str, _Entry], source: str, strict: bool,
                 elsewhere: frozenset[str] = frozenset(),
                 notes: list[str] | None = None) -> tuple[list[tuple[str, torch.Tensor]], list[str], list[str]]:
    """(name, tensor) to load, one per tensor object (tied names are aliases of one), missing, unexpected."""
    aliases: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        aliases.setdefault(id(tensor), []).append(name)
    plan, missing = [], []
    for names in aliases.values():
        present = [n for n in names if n in entries]
        if present:
            plan.append((present[0], targets[present[0]]))
        else:
            missing.append(names[0])
    unexpected = [name for name in entries if name not in targets and name not in elsewhere]
    if missing or unexpected:
        message = (f"the weights at {source} do not match the model: {len(missing)} missing (the model has them, "
                   f"the files do not): {_listed(missing)}; {len(unexpected)} unexpected (the files have them, the "
                   f"model does not): {_listed(unexpected)}. Load weights written for this model's config, or pass "
                   f"strict=False to load the names both have")
        if notes:
            message += f". Experts stored one by one that do not stack: {'; '.join(notes[:_LISTED])}"
        if strict:
            raise WeightNamesError(message)
        warnings.warn(message, stacklevel=3)
    return plan, missing, unexpected


def _listed(names: list[str]) -> str:
    return repr(names[:_LISTED])[:-1] + (", ...]" if len(names) > _LISTED else "]")


def _check_targets(plan: list[tuple[str, torch.Tensor]], entries: dict[str, _Entry], source: str) -> None:
    """Every tensor to load has the file's global shape and holds storage (not meta)."""
    wrong = [f"{name!r}: file {entries[name].shape}, model {tuple(t.shape)}"
             for name, t in plan if entries[name].shape != tuple(t.shape)]
    if wrong:
        raise ValueError(f"the weights at {source} have other shapes than the model for {len(wrong)} tensors: "
                         f"{'; '.join(wrong[:_LISTED])}. Build the model from the config the weights were saved with")
    meta = [name for name, t in plan if _local(t).is_meta]
    if meta:
        raise ValueError(f"load_pretrained_into: {_listed(meta)} are on the meta device; materialise the model "
                         f"first (model.to_empty(device=...))")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_indices(tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The global indices along `dim` of the local piece of `tensor`, in local order; None when the
    whole dim is local. Found by distributing an arange of the dim's length with the placements that
    shard `dim` (the others replicated): no communication (src_data_rank=None), and exact for every
    placement DTensor can build, `_StridedShard` (FSDP2 over TP on the same dim) and uneven sizes included.
    """
    if not isinstance(tensor, DTensor):
        return None
    restricted, sharded = [], False
    for placement in tensor.placements:
        if isinstance(placement, Partial):
            raise ValueError(f"a parameter with placement {placement} holds partial sums, not weights")
        if isinstance(placement, _StridedShard) and placement.dim % tensor.ndim == dim:
            restricted.append(_StridedShard(0, split_factor=placement.split_factor))
        elif isinstance(placement, Shard) and placement.dim % tensor.ndim == dim:
            restricted.append(Shard(0))
        else:
            restricted.append(Replicate())
        sharded = sharded or not isinstance(restricted[-1], Replicate)
    if not sharded:
        return None
    index = torch.arange(tensor.shape[dim])
    return distribute_tensor(index, tensor.device_mesh, restricted, src_data_rank=None).to_local().cpu()


def _runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive indices, in the order given: [0,1,4,5] -> [(0,2), (4,6)]."""
    values = indices.tolist()
    runs: list[tuple[int, int]] = []
    for i in values:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _plan_read(name: str, tensor: torch.Tensor, entry: _Entry) -> _Read:
    if not entry.shape:  # 0-d: one element
        return _Read(name, _local(tensor), entry, 1, [(entry.path, entry.start, entry.end)], [])
    rows = local_indices(tensor, 0)
    runs = [(0, entry.shape[0])] if rows is None else _runs(rows)
    ranges = [r for a, b in runs if b > a for r in entry.row_ranges(a, b)]
    selects = [(d, idx) for d in range(1, len(entry.shape)) if (idx := local_indices(tensor, d)) is not None]
    return _Read(name, _local(tensor), entry, sum(b - a for a, b in runs), ranges, selects)


def _batches(reads: list[_Read]) -> list[list[_Read]]:
    """Reads grouped by file, a group closed once it holds _READ_BATCH bytes."""
    batches: list[list[_Read]] = []
    for path in dict.fromkeys(r.entry.path for r in reads):
        batches.append([])
        size = 0
        for read in (r for r in reads if r.entry.path == path):
            if batches[-1] and size + read.nbytes > _READ_BATCH:
                batches.append([])
                size = 0
            batches[-1].append(read)
            size += read.nbytes
    return batches


def _fetch_and_copy(fs, batch: list[_Read]) -> int:
    """Fetches every range of the batch (concurrently on S3) and copies each tensor in; the bytes fetched."""
    spans = [span for read in batch for span in read.ranges]
    chunks = fs.cat_ranges([p for p, _, _ in spans], [a for _, a, _ in spans], [b for _, _, b in spans],
                           on_error="raise") if spans else []
    for (path, a, b), chunk in zip(spans, chunks):
        if len(chunk) != b - a:
            raise ValueError(f"{path}: bytes [{a}, {b}) came back as {len(chunk)} bytes; the file is truncated")
    position = 0
    for read in batch:
        piece = _assemble(read, chunks[position:position + len(read.ranges)])
        position += len(read.ranges)
        if piece.shape != read.target.shape:
            raise ValueError(f"tensor {read.name!r}: the rows and columns computed for this rank form "
                             f"{tuple(piece.shape)}, but its local piece is {tuple(read.target.shape)}")
        read.target.copy_(piece)
    return sum(b - a for _, a, b in spans)


def _assemble(read: _Read, chunks: list[bytes]) -> torch.Tensor:
    entry = read.entry
    shape = (read.rows, *entry.shape[1:]) if entry.shape else ()
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=entry.dtype)
    buffer = bytearray().join(chunks)  # writable, so frombuffer does not warn
    piece = torch.frombuffer(buffer, dtype=entry.dtype).reshape(shape)
    for dim, indices in read.selects:
        piece = piece.index_select(dim, indices)
    return piece


# --------------------------------------------------------------------------------------------- storage


def _check_uri(uri: Any) -> None:
    # pathlib.Path folds "s3://b" into "s3:/b": storage locations are always str
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"weights location must be a non-empty str (a path or s3:// URI), got {uri!r}")


def _is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)
