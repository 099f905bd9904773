"""Storage of one checkpoint step, verified: what DCP writes is checksummed as it is written; what it
reads is checked before its bytes are used, and nothing is unpickled beyond DCP's own metadata classes.

Write (`VerifiedWriter`, a DCP `FsspecWriter`): each rank writes one safetensors file under a key prefix
of its own (`rank-00003/__3_0.distcp`: its shard of every tensor, keyed by name); every data file goes
through a CRC-32 as it is written, and each rank then writes `rank-00003/__3.checksums.json`
({file: {"size", "crc32"}}) next to its files. DCP's coordinator writes `.metadata` (the commit marker)
only after every rank's `write_data` returned, so a committed step always has its manifests.

Read (`SafeReader`, a DCP `FsspecReader`): `.metadata` is a pickle written by DCP; it is read with an
unpickler that only builds the classes DCP's metadata is made of (a crafted `.metadata` that names
anything else is refused, not run). A step whose metadata holds non-tensor (pickled) entries is refused:
DCP would `torch.load(weights_only=False)` them. Trainyard saves only tensors. Each data file is read
whole, in one request, (by default) checked against its manifest, and parsed once as safetensors (a
JSON header and raw bytes: no unpickling at all, where DCP's default format is one `torch.save` zip
per tensor, each `torch.load`ed).

`verify_step` checks a whole step without loading it: every file `.metadata` references exists with
the recorded size and CRC-32; ranks share the reading (each checks every world-th file).
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import struct
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StoragePrefix
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.futures import Future

MANIFEST_SUFFIX = ".checksums.json"


def manifest_of(data_file: str) -> str:
    """The manifest that records `data_file`: the rank's files are `rank-00003/__3_<k>.distcp`, its
    manifest `rank-00003/__3.checksums.json`, so a reader fetches only the manifests of what it reads."""
    return data_file.rsplit("_", 1)[0] + MANIFEST_SUFFIX
METADATA_FILE = ".metadata"


class CheckpointDamaged(ValueError):
    """A committed step that cannot be trusted: a file missing, short, or with other bytes than saved."""


def _relative(path, root: str) -> str:
    return os.path.relpath(os.fspath(path), root)


def _data_file(path) -> str | None:
    """The file name when `path` is a data file of DCP's (not `.metadata` nor a manifest), else None."""
    name = os.path.basename(os.fspath(path))
    return None if name.startswith(METADATA_FILE) or name.endswith(MANIFEST_SUFFIX) else name


class _HashingStream(io.RawIOBase):
    """Write-through proxy that keeps the CRC-32 and length of what passed through it."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.crc, self.size = inner, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return self.inner.write(data)

    def tell(self) -> int:  # DCP records item offsets; the file is written from its start, in order
        return self.size

    def fileno(self) -> int:
        return self.inner.fileno()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:  # the inner stream is closed by its own context manager
        pass


class _Parts:
    """In-memory sink that keeps what is written as parts (bytes written are kept, not copied)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(data if isinstance(data, bytes) else bytes(data))
        return len(self.parts[-1])

    def value(self) -> bytes:
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    def flush(self) -> None:
        pass


class _HashingFileSystem(FileSystem):
    """Checksums every data file as it is written. On object stores a data file is serialised into
    memory and sent with one put (fsspec's file would send it in many small writes and parts); local
    files are written in place."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        self.written: dict[str, dict[str, int]] = {}  # path relative to the step -> size, crc32

    def _local(self) -> bool:
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))

    @contextmanager
    def create_stream(self, path, mode: str):
        name = _data_file(path)
        if "w" not in mode or name is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if self._local():
            self.fs.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
            with super().create_stream(path, mode) as stream:
                hashed = _HashingStream(stream)
                yield hashed
        else:
            parts = _Parts()
            hashed = _HashingStream(parts)
            yield hashed
            self.fs.pipe_file(os.fspath(path), parts.value())
        self.written[_relative(path, self.root)] = {"size": hashed.size, "crc32": hashed.crc}


class VerifiedWriter(FsspecWriter):
    """FsspecWriter that writes each rank's shards as one safetensors file, records a CRC-32 of every data
    file it writes and writes this rank's manifest."""

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(path, serialization_format=SerializationFormat.SAFETENSORS, **kwargs)
        hashing = _HashingFileSystem(os.fspath(self.path))
        hashing.fs = self.fs.fs
        self.fs = hashing
        self.moved: tuple[int, float] = (0, 0.0)  # this rank's bytes written and seconds, once written

    def prepare_global_plan(self, plans):
        """Each rank's files under a prefix of its own (`rank-00003/__3_0.distcp`): object stores scale
        request rates per key prefix, so thousands of ranks writing at once do not share one."""
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"rank-{i:05d}/__{i}_"))
                for i, plan in enumerate(plans)]

    def write_data(self, plan, planner):
        names = [item.index.fqn for item in plan.items]
        opaque = sorted(item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO)
        if opaque:
            raise ValueError(f"checkpoint state {opaque[:5]} is not a tensor; Trainyard checkpoints hold tensors "
                             "only (store numbers as tensors)")
        if len(set(names)) != len(names):  # a safetensors file holds one tensor per name
            raise ValueError(f"this rank holds several shards of {sorted({n for n in names if names.count(n) > 1})[:5]}")
        start = time.perf_counter()
        future = super().write_data(plan, planner)
        future.wait()  # the base class writes synchronously; the manifest must follow the data
        if self.fs.written:
            name = manifest_of(sorted(self.fs.written)[0])  # one per rank: ranks never collide
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as f:
                f.write(json.dumps(self.fs.written, sort_keys=True).encode())
        # this rank's share: its data files' bytes, and the seconds from serialising them to the manifest written
        self.moved = (sum(f["size"] for f in self.fs.written.values()), time.perf_counter() - start)
        return future


# What DCP's metadata is made of: its dataclasses and enums, torch.Size, dtypes and the layout lookup.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE_NAMES = {("torch", "Size"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               ("torch.serialization", "_get_layout")}


def _enum_member(owner, name):
    """`getattr` as an enum's pickle uses it: Python 3.11.0 to 3.11.4 (Debian 12's 3.11.2, the CPU image's) pickle an
    Enum member as `getattr(EnumClass, "NAME")`, where later versions pickle `EnumClass(value)`. Only a member of an
    Enum class the unpickler admitted is returned."""
    import enum

    if isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str) and name in owner.__members__:
        return owner[name]
    raise CheckpointDamaged(f"checkpoint metadata asks for attribute {name!r} of {owner!r}, which is not an enum "
                            "member; refusing to load it")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes; anything else a pickle names (os.system, ...) is refused."""

    def find_class(self, module: str, name: str):
        import torch

        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if "." not in name:
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if (module, name) in _SAFE_NAMES:
                return super().find_class(module, name)
            if module == _METADATA_MODULE and isinstance(found := super().find_class(module, name), type):
                return found
        raise CheckpointDamaged(f"checkpoint metadata names {module}.{name}, which is not part of a DCP checkpoint; "
                                "refusing to load it")


def read_metadata(fs, path: str) -> Metadata:
    """The step's `.metadata`, unpickled with the restricted unpickler."""
    with fs.create_stream(fs.concat_path(path, METADATA_FILE), "rb") as f:
        metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointDamaged(f"{path}/{METADATA_FILE} does not hold DCP metadata")
    pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    if pickled:
        raise CheckpointDamaged(f"{path} holds non-tensor (pickled) entries {pickled[:5]}; Trainyard checkpoints "
                                "hold tensors only and never unpickle, refusing to load it")
    return metadata


class _WholeFileReads(FileSystem):
    """Reads each data file with one request into memory (DCP would otherwise issue one ranged read per
    tensor) and, with `verify`, checks its size and CRC-32 against the manifest before serving it."""

    def __init__(self, inner: FileSystem, root: str, verify: bool) -> None:
        super().__init__()
        self.fs, self.root, self.verify = inner.fs, root, verify
        self._manifests: dict[str, dict[str, dict]] = {}

    def recorded(self, name: str) -> dict | None:
        """{"size", "crc32"} recorded for the data file `name` (relative to the step), or None."""
        manifest = manifest_of(name)
        if manifest not in self._manifests:
            try:
                self._manifests[manifest] = json.loads(self.fs.cat(os.path.join(os.fspath(self.root), manifest)))
            except FileNotFoundError:
                self._manifests[manifest] = {}
        return self._manifests[manifest].get(name)

    @contextmanager
    def create_stream(self, path, mode: str):
        if "r" not in mode or _data_file(path) is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        data = self.read_file(path)
        self.check(path, data)
        yield io.BytesIO(data)

    def read_file(self, path) -> bytes:
        """A data file's bytes, read in one request. (In parts fetched 4 at a time it was slower from the embedded
        store here: 0.80 s against 0.66 s for the 120 MB of bench/checkpoint.py's 10m model.)"""
        try:
            return self.fs.cat(os.fspath(path))
        except FileNotFoundError:
            raise CheckpointDamaged(f"{self.root}: {_relative(path, self.root)} is missing") from None

    def check(self, path, data: bytes) -> None:
        """With `verify`: raise CheckpointDamaged unless `data` has the size and CRC-32 its manifest
        recorded for the file at `path`."""
        if not self.verify:
            return
        name = _relative(path, self.root)
        want = self.recorded(name)
        if want is None:
            raise CheckpointDamaged(f"{self.root}: no checksum recorded for {name}")
        crc = zlib.crc32(data)
        if len(data) != want["size"] or crc != want["crc32"]:
            raise CheckpointDamaged(f"{self.root}: {name} has {len(data)} bytes with crc32 {crc:08x}; "
                                    f"{want['size']} bytes with crc32 {want['crc32']:08x} were written")


class SafeReader(FsspecReader):
    """FsspecReader whose metadata is read by `read_metadata` (restricted, tensors only), that reads each
    data file once, whole, and with `verify` (the default) checks it against its manifest first."""

    def __init__(self, path: str, *, verify: bool = True, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _WholeFileReads(self.fs, self.path, verify)
        self._metadata: Metadata | None = None
        self.moved: tuple[int, float] = (0, 0.0)  # this rank's bytes read and seconds, once read

    def read_metadata(self, *args, **kwargs) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata is None:  # the caller's check and DCP's load read it once
            self._metadata = read_metadata(self.fs, self.path)
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """Each file is read once, in one request, and parsed once: its tensors are views of the bytes
        read, each item is narrowed to the part this rank needs and copied into place. While one file is
        copied the next one is fetched (at most two files in memory), and its CRC-32 runs on another
        thread (zlib and torch's copy both release the GIL); a mismatch fails the load as any damage
        does, and the caller then loads an older step over whatever was copied."""
        start = time.perf_counter()
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        names = list(per_file)
        paths = [self.fs.concat_path(self.path, name) for name in names]
        moved = 0
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-fetch") as fetcher, \
                ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc") as checker:
            fetched = fetcher.submit(self.fs.read_file, paths[0]) if paths else None
            for i, (name, path) in enumerate(zip(names, paths)):
                data = fetched.result()
                if i + 1 < len(paths):
                    fetched = fetcher.submit(self.fs.read_file, paths[i + 1])
                checked = checker.submit(self.fs.check, path, data)
                try:
                    self._copy_items(name, data, per_file[name], planner)
                except CheckpointDamaged:
                    checked.result()  # a checksum mismatch explains it better
                    raise
                checked.result()
                moved += len(data)
                del data
        # this rank's share: the bytes it read, and the seconds from the first request to the last copy
        self.moved = (moved, time.perf_counter() - start)
        future: Future = Future()
        future.set_result(None)
        return future

    def _copy_items(self, name: str, data: bytes, items, planner) -> None:
        tensors = safetensors_views(data, f"{self.path}/{name}")
        for item in items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO or fqn not in tensors:
                raise CheckpointDamaged(f"{self.path}: {name} holds no tensor {fqn}")
            saved = narrow_tensor_by_index(tensors[fqn], item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != saved.size():
                raise CheckpointDamaged(f"{self.path}: {fqn} in {name} has shape {tuple(saved.shape)}, "
                                        f"{tuple(target.shape)} expected")
            target.copy_(saved)
            planner.commit_tensor(item, target)


def _dtypes() -> dict:
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def safetensors_views(data: bytes, where: str) -> dict:
    """The tensors of the safetensors file `data` (an 8-byte little-endian header length, a JSON header
    {name: {dtype, shape, data_offsets}}, then the bytes), as read-only views of `data`: no copy, and
    nothing but JSON is parsed. Raises CheckpointDamaged when the layout does not hold together."""
    import torch

    dtypes, views = _dtypes(), {}
    try:
        (size,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(memoryview(data)[8:8 + size].tobytes())
        header.pop("__metadata__", None)
        base, buffer = 8 + size, memoryview(data)
        with warnings.catch_warnings():  # views of immutable bytes: they are only read, never written
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for name, info in header.items():
                dtype, shape, (begin, end) = dtypes[info["dtype"]], info["shape"], info["data_offsets"]
                if not (0 <= begin <= end <= len(data) - base
                        and end - begin == math.prod(shape) * dtype.itemsize):
                    raise ValueError(f"{name}: bytes {begin}..{end} do not hold {info['dtype']}{shape}")
                flat = (torch.frombuffer(buffer[base + begin:base + end], dtype=dtype) if end > begin
                        else torch.empty(0, dtype=dtype))
                views[name] = flat.view(shape)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise CheckpointDamaged(f"{where} is not a whole safetensors file ({type(e).__name__}: {e})") from None
    return views


def verify_step(path: str, storage_options: dict, *, rank: int = 0, world: int = 1) -> None:
    """Raise CheckpointDamaged unless every data file of the step at `path` is whole: present, of the
    size its manifest recorded and long enough for every item `.metadata` places in it (checked by all
    ranks), with the CRC-32 recorded (rank `rank` of `world` reads every world-th file)."""
    fs = SafeReader(path, **storage_options).fs
    metadata = read_metadata(fs, fs.root)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for i, (name, end) in enumerate(sorted(needed.items())):
        where = fs.concat_path(fs.root, name)
        want = fs.recorded(name)
        if want is None:
            raise CheckpointDamaged(f"{path}: no checksum recorded for {name}")
        if not fs.fs.exists(os.fspath(where)):
            raise CheckpointDamaged(f"{path}: {name} is missing")
        size = fs.fs.size(os.fspath(where))
        if size != want["size"] or size < end:
            raise CheckpointDamaged(f"{path}: {name} has {size} bytes, {want['size']} were written")
        if i % world == rank:
            with fs.create_stream(where, "rb"):  # reads the file whole and checks its CRC-32
                pass
