"""Storage of one checkpoint step, verified: what DCP writes is checksummed as it is written; what it
reads is checked before its bytes are used, and nothing is unpickled beyond DCP's own metadata classes.

Write (`VerifiedWriter`, a DCP `FsspecWriter`): each rank writes one safetensors file under a key prefix
of its own (`rank-00003/__3_0.distcp`: its shard of every tensor, keyed by name; to S3 in 8 MiB parts, several
in flight: `put_in_parts`); every data file goes through a CRC-32 as it is written, and each rank then writes
`rank-00003/__3.checksums.json` ({file: {"size", "crc32"}}) next to its files. DCP's coordinator writes
`.metadata` (the commit marker) only after every rank's `write_data` returned, so a committed step always has
its manifests.

Read (`SafeReader`, a DCP `FsspecReader`): `.metadata` is a pickle written by DCP; it is read with an
unpickler that only builds the classes DCP's metadata is made of (a crafted `.metadata` that names
anything else is refused, not run). A step whose metadata holds non-tensor (pickled) entries is refused:
DCP would `torch.load(weights_only=False)` them. Trainyard saves only tensors. Each data file is read
whole, in one request (from S3 streamed, its CRC-32 summed as it arrives), (by default) checked against its
manifest, and parsed once as safetensors (a JSON header and raw bytes: no unpickling at all, where DCP's
default format is one `torch.save` zip per tensor, each `torch.load`ed).

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
from concurrent.futures import Future as Fetching, ThreadPoolExecutor
from contextlib import contextmanager

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY, FORMAT_VALUE,
                                                    HF_DCP_VERSION)
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
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
    """Write-through proxy that keeps the length and (with `summing`) the CRC-32 of what passed through it."""

    def __init__(self, inner, summing: bool = True) -> None:
        super().__init__()
        self.inner, self.crc, self.size, self.summing = inner, 0, 0, summing

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.summing:
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
    """In-memory sink that keeps what is written as pieces, not copied: bytes as they are, other buffers (a tensor's
    memory, written by `VerifiedWriter.write_data`) as views, which their writer keeps alive until they are sent."""

    def __init__(self) -> None:
        self.parts: list = []

    def write(self, data) -> int:
        self.parts.append(data if isinstance(data, bytes) else memoryview(data).cast("B"))
        return len(self.parts[-1])

    def flush(self) -> None:
        pass


PART_BYTES = 8 * 2**20  # a data file's upload part: AWS's guidance for throughput is 8-16 MB parts


def put_in_parts(fs, path: str, data, meanwhile=None):
    """`data` (bytes, or a list of buffers sent one after the other) to the object at `path`: on S3, a multipart
    upload of PART_BYTES parts, up to the filesystem's `max_concurrency` (10) in flight; elsewhere, or when it fits
    one part, one put. s3fs's own `pipe_file` sends 50 MiB parts: for bench/checkpoint.py's 120 MB rank file to the
    embedded store, 1.94 s against 1.38 s in 8 MiB parts (16 MiB: 1.48 s). Each part is copied out of `data` only
    when it is sent (botocore takes no memoryview), so at most `max_concurrency` parts are copies at once. A failed
    upload is aborted: no part stays stored, and the object is not there. `meanwhile()`, if given, runs in the
    calling thread while the parts go up (in the filesystem's event-loop thread); its result is returned. No thread
    is started here: a save finished by the interpreter's exit handlers can start none."""
    import asyncio

    pieces = [memoryview(p).cast("B") for p in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data)]
    size = sum(len(p) for p in pieces)
    if not hasattr(fs, "_call_s3") or size <= PART_BYTES:
        fs.pipe_file(path, b"".join(pieces))
        return meanwhile() if meanwhile else None
    upload = asyncio.run_coroutine_threadsafe(_put_in_parts(fs, path, pieces, size), fs.loop)
    try:
        result = meanwhile() if meanwhile else None
    finally:
        upload.result()  # the upload's own error first, whatever `meanwhile` did
    fs.invalidate_cache(path)
    return result


def _part(pieces: list[memoryview], start: int, stop: int) -> bytes:
    """Bytes start..stop of the pieces laid end to end, in one copy."""
    out, at = [], 0
    for piece in pieces:
        if at >= stop:
            break
        if at + len(piece) > start:
            out.append(piece[max(0, start - at):stop - at])
        at += len(piece)
    return b"".join(out)


async def _put_in_parts(fs, path: str, pieces: list[memoryview], size: int) -> None:
    import asyncio

    bucket, key, _ = fs.split_path(path)
    upload = (await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
    slots = asyncio.Semaphore(max(1, getattr(fs, "max_concurrency", 1)))

    async def part(number: int, start: int) -> dict:
        async with slots:
            out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                    Body=_part(pieces, start, start + PART_BYTES))
        return {"PartNumber": number, "ETag": out["ETag"]}

    tasks = [asyncio.ensure_future(part(i + 1, start)) for i, start in enumerate(range(0, size, PART_BYTES))]
    try:
        parts = await asyncio.gather(*tasks)
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                          MultipartUpload={"Parts": list(parts)})
    except BaseException:
        for task in tasks:  # the parts still in flight stop first
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        except Exception:  # the store may be what failed: the first error is the one to report
            pass
        raise


def _crc(pieces: list) -> int:
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


class _HashingFileSystem(FileSystem):
    """Checksums every data file as it is written. On object stores a data file is kept as the pieces written to it
    (a tensor's memory is not copied) and sent in parts of PART_BYTES, several at once (`put_in_parts`; fsspec's
    file would send it in many small writes); local files are written in place."""

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
            hashed = _HashingStream(parts, summing=False)
            yield hashed
            # summed here while the parts go up from the event loop's thread (zlib lets go of the GIL): 60 ms of
            # 120 MB that the upload no longer waits for
            hashed.crc = put_in_parts(self.fs, os.fspath(path), parts.parts, meanwhile=lambda: _crc(parts.parts))
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
        future: Future = Future()
        future.set_result(self._write_safetensors(plan.storage_data, plan.items, planner))
        if self.fs.written:
            name = manifest_of(sorted(self.fs.written)[0])  # one per rank: ranks never collide
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as f:
                f.write(json.dumps(self.fs.written, sort_keys=True).encode())
        # this rank's share: its data files' bytes, and the seconds from serialising them to the manifest written
        self.moved = (sum(f["size"] for f in self.fs.written.values()), time.perf_counter() - start)
        return future

    def _write_safetensors(self, prefix: _StoragePrefix, items: list, planner) -> list[WriteResult]:
        """The rank's one data file, as DCP's safetensors writer makes it (the same name, header, metadata and
        results; tests/engine/test_checkpoint.py compares them), written from the tensors' own memory: the header,
        then each tensor's bytes, no copy before the parts that carry them. DCP's writer serialises the whole file
        into one bytes object first (safetensors' `save`: two copies, ~0.2 s of 120 MB) and only then sends its
        first part (and refused a non-contiguous tensor). A tensor in device memory is copied to host memory first (an
        asynchronous save's copy is there already)."""
        import torch

        name = f"{prefix.prefix}0{DEFAULT_SUFFIX}"
        codes = {dtype: code for code, dtype in _dtypes().items()}
        header, offsets, pieces, results, at = {}, {}, [], [], 0
        for item in items:
            fqn = item.index.fqn
            tensor = planner.resolve_data(item).detach().cpu().contiguous()
            if tensor.dtype not in codes:
                raise ValueError(f"checkpoint state {fqn!r} is a {tensor.dtype} tensor, which safetensors cannot hold; "
                                 f"save it as one of {sorted(str(d) for d in codes)}")
            nbytes = tensor.numel() * tensor.element_size()
            header[fqn] = {"dtype": codes[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [at, at + nbytes]}
            offsets[fqn] = {"saved_offsets": list(item.tensor_data.chunk.offsets)}
            if nbytes:
                pieces.append(tensor.reshape(-1).view(torch.uint8).numpy())
            at += nbytes
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=_StorageInfo(name, 0, nbytes)))
        header["__metadata__"] = {CUSTOM_METADATA_KEY: json.dumps(offsets), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                                  FORMAT_KEY: FORMAT_VALUE}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors lays it out
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            stream.write(struct.pack("<Q", len(text)) + text)
            for piece in pieces:
                stream.write(piece)
        return results


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


READ_CHUNK = 8 * 2**20  # the most one read of a streamed GET asks for (it returns what has arrived)
READ_ATTEMPTS = 3  # a GET whose body breaks off is sent again (s3fs's cat retried the same way)


async def _get_whole(fs, path: str) -> tuple[bytearray, int]:
    """The object at `path` in one GET, its body read as it arrives into one buffer, with the CRC-32 of what
    has arrived kept up to date (zlib releases the GIL: the sum costs no time the download did not wait anyway).
    A body that breaks off, or ends short of its length, is fetched again, up to READ_ATTEMPTS times."""
    import asyncio

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    error: Exception = OSError(f"{path}: not read")
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            await asyncio.sleep(0.1 * 2 ** attempt)
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
        size, body = response["ContentLength"], response["Body"]
        out = bytearray(size)
        view, got, crc = memoryview(out), 0, 0
        try:
            while got < size:
                chunk = await body.read(min(size - got, READ_CHUNK))
                if not chunk:
                    break
                view[got:got + len(chunk)] = chunk
                crc = zlib.crc32(chunk, crc)
                got += len(chunk)
        except Exception as e:  # the HTTP client's payload and timeout errors: the transfer, not the object
            error = e
        else:
            if got == size:
                return out, crc
            error = OSError(f"{path}: the body ended after {got} of {size} bytes")
        finally:
            body.close()
    raise error


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
                recorded = json.loads(self.fs.cat(os.path.join(os.fspath(self.root), manifest)))
            except FileNotFoundError:
                recorded = {}
            except ValueError as e:  # not JSON (nor UTF-8)
                raise CheckpointDamaged(f"{self.root}: the manifest {manifest} is not valid JSON ({e})") from None
            if not isinstance(recorded, dict):
                raise CheckpointDamaged(f"{self.root}: the manifest {manifest} holds no {{file: checksum}} map")
            self._manifests[manifest] = recorded
        return self._manifests[manifest].get(name)

    @contextmanager
    def create_stream(self, path, mode: str):
        if "r" not in mode or _data_file(path) is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        data, crc = self.read_file(path)
        self.check(path, data, crc)
        yield io.BytesIO(data)

    def read_file(self, path) -> tuple[bytes | bytearray, int | None]:
        """A data file's bytes, read in one request, and their CRC-32 when it was computed on the way (from S3,
        chunk by chunk as they arrive: `_get_whole`), else None. Not s3fs's `cat`: for a large object it sends
        ranged GETs in parallel, from the embedded store 0.80 s for bench/checkpoint.py's 120 MB rank file
        against 0.28 s in one streamed GET (with its CRC-32), and 0.66-0.80 s in 16 MiB parts 4 at a time."""
        try:
            if hasattr(self.fs, "_call_s3"):
                from fsspec.asyn import sync

                return sync(self.fs.loop, _get_whole, self.fs, os.fspath(path))
            return self.fs.cat(os.fspath(path)), None
        except FileNotFoundError:
            raise CheckpointDamaged(f"{self.root}: {_relative(path, self.root)} is missing") from None

    def check(self, path, data: bytes | bytearray, crc: int | None = None) -> None:
        """With `verify`: raise CheckpointDamaged unless `data` has the size and CRC-32 (`crc`, when computed
        already) its manifest recorded for the file at `path`."""
        if not self.verify:
            return
        name = _relative(path, self.root)
        want = self.recorded(name)
        if want is None:
            raise CheckpointDamaged(f"{self.root}: no checksum recorded for {name}")
        crc = zlib.crc32(data) if crc is None else crc
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
        self._ahead: tuple[str, Fetching, float] | None = None  # this rank's own file, fetched ahead (`_fetch_ahead`)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata is None:  # the caller's check and DCP's load read it once
            self._metadata = read_metadata(self.fs, self.path)
            self._fetch_ahead(self._metadata)
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _fetch_ahead(self, metadata: Metadata) -> None:
        """Start fetching this rank's own data file (and its manifest) now, while the caller and DCP plan the load:
        where the step was saved by as many ranks as load it, each rank reads its own file (on the 120 MB of
        bench/checkpoint.py, planning took 26 ms before the first byte was asked for). Another world size
        reshards: what a rank reads is known only from the plan, and nothing is fetched ahead."""
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        files = {info.relative_path for info in metadata.storage_data.values()}
        mine = f"rank-{rank:05d}/__{rank}_0.distcp"
        if mine not in files or len({f.split("/", 1)[0] for f in files}) != world:
            return
        pool = ThreadPoolExecutor(2, thread_name_prefix="ckpt-ahead")
        path = self.fs.concat_path(self.path, mine)
        self._ahead = (os.fspath(path), pool.submit(self.fs.read_file, path), time.perf_counter())
        pool.submit(self.fs.recorded, mine)
        pool.shutdown(wait=False)  # its threads end with their fetches

    def read_data(self, plan, planner):
        """Each file is read once, in one request, and parsed once: its tensors are views of the bytes
        read, each item is narrowed to the part this rank needs and copied into place. While one file is
        copied the next one is fetched (at most two files in memory, three with one fetched ahead). Each file's
        size and CRC-32 (summed on the way from S3, else here) are checked before any of it is copied, on a thread
        that fetched the manifests while the data came; a mismatch fails the load as any damage does. A load
        that fails after an earlier file was copied (or on another rank) leaves the model partly loaded: resume
        then loads an older step over it."""
        start = time.perf_counter()
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        names = list(per_file)
        paths = [self.fs.concat_path(self.path, name) for name in names]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] in map(os.fspath, paths):
            start = ahead[2]  # its first byte was asked for then
        moved = 0
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-fetch") as fetcher, \
                ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc") as checker:
            def fetch(path):
                return ahead[1] if ahead is not None and os.fspath(path) == ahead[0] else \
                    fetcher.submit(self.fs.read_file, path)

            for name in names:  # the manifests come while the data does (the checks queue behind them)
                checker.submit(self.fs.recorded, name)
            fetched = fetch(paths[0]) if paths else None
            for i, (name, path) in enumerate(zip(names, paths)):
                data, crc = fetched.result()
                if i + 1 < len(paths):
                    fetched = fetch(paths[i + 1])
                # checked before anything of it is copied into place (from S3 its CRC-32 came with it: the
                # check waits only for the manifest, fetched meanwhile)
                checker.submit(self.fs.check, path, data, crc).result()
                self._copy_items(name, data, per_file[name], planner)
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
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
            "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
            "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
            "F8_E5M2FNUZ": torch.float8_e5m2fnuz}


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
