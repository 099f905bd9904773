"""Checkpoint layout, commit marker, retention, and a save/load round trip (local and S3)."""
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from trainyard.engine.components import checkpoint as ckpt
from trainyard.engine.models.llama.model import Transformer, ModelConfig, init_weights
from trainyard.engine.components.optim import build_optimizer, build_scheduler
from tests.waiting import within


def _fake_step(uri: str, step: int, committed: bool) -> None:
    """A step prefix with a shard file, and the commit marker when committed."""
    import fsspec

    base = ckpt.step_uri(uri, step)
    with fsspec.open(f"{base}/__0_0.distcp", "wb") as f:
        f.write(b"shard")
    if committed:
        with fsspec.open(f"{base}/.metadata", "wb") as f:
            f.write(b"meta")


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run/ckpt"


def test_step_uri_and_types():
    assert ckpt.step_uri("s3://b/p/", 100) == "s3://b/p/step-00000100"
    from pathlib import Path

    with pytest.raises(ValueError, match="str"):
        ckpt.step_uri(Path("/tmp/x"), 1)


def test_latest_ignores_uncommitted_and_unrelated(uri):
    assert ckpt.latest_committed_step(uri) is None  # nothing there yet
    _fake_step(uri, 2, committed=True)
    _fake_step(uri, 4, committed=True)
    _fake_step(uri, 6, committed=False)  # an interrupted save
    import fsspec

    with fsspec.open(f"{uri}/step-latest/x", "wb") as f:  # not a step prefix
        f.write(b"x")
    assert ckpt.list_steps(uri) == {2: True, 4: True, 6: False}
    assert ckpt.latest_committed_step(uri) == 4


def test_purge_keeps_last_two_and_the_protected_step(uri):
    for step in (1, 2, 3, 4):
        _fake_step(uri, step, committed=True)
    _fake_step(uri, 0, committed=False)  # older interrupted save: garbage
    _fake_step(uri, 5, committed=False)  # newer interrupted save: left alone
    assert ckpt.purge(uri, keep_last=2) == [0, 1, 2]
    assert ckpt.list_steps(uri) == {3: True, 4: True, 5: False}
    # the step just written is never deleted, even when it is not among the newest
    assert ckpt.purge(uri, keep_last=1, protect=3) == []
    assert ckpt.purge(uri, keep_last=1) == [3]


def test_validate_uri_requires_existing_bucket(s3_endpoint):
    with pytest.raises(ValueError, match="bucket 'no-such-bucket' does not exist"):
        ckpt.validate_uri("s3://no-such-bucket/ck")
    with pytest.raises(ValueError, match="names no bucket"):
        ckpt.validate_uri("s3:///ck")


def _setup(seed: int):
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=24, max_seq_len=16)
    model = Transformer(cfg)
    init_weights(model, seed)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    sched = build_scheduler(opt, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    return model, opt, sched


def _train(model, opt, sched, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (2, 9), generator=gen)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_and_load_round_trip(uri):
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 3)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(uri, step, model, opt, sched, keep_last=2)
    assert ckpt.list_steps(uri) == {2: True, 3: True}
    import fsspec

    fs, root = fsspec.core.url_to_fs(ckpt.step_uri(uri, 3), **ckpt.storage_options(uri))
    assert sorted(p[len(root.rstrip("/")) + 1:] for p in fs.find(root)) == [
        ".metadata", "model.json", "rank-00000/__0.checksums.json", "rank-00000/__0_0.distcp"]

    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    assert ckpt.load_checkpoint(uri, 3, fresh, fresh_opt, fresh_sched) == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_sched.last_epoch == 3
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    state_a, state_b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(state_a[i]["exp_avg_sq"], state_b[i]["exp_avg_sq"]) for i in state_a)
    # the same next step from both
    _train(model, opt, sched, 1, seed=5)
    _train(fresh, fresh_opt, fresh_sched, 1, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def _damage(uri: str, step: int, how: str) -> None:
    import fsspec

    path = f"{ckpt.step_uri(uri, step)}/rank-00000/__0_0.distcp"
    fs, p = fsspec.core.url_to_fs(path, **ckpt.storage_options(uri))
    if how == "missing":
        fs.rm(p)
        return
    data = bytearray(fs.cat(p))
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "extended":  # bytes beyond those written
        data += b"\0" * 100
    else:  # one flipped bit, size unchanged
        data[len(data) // 2] ^= 0x01
    fs.pipe(p, bytes(data))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("how", ["missing", "truncated", "extended", "flipped"])
def test_damaged_newest_step_is_skipped_with_a_warning(uri, how):
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 2)
    ckpt.save_checkpoint(uri, 2, model, opt, sched, keep_last=2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, sched, 1)
    ckpt.save_checkpoint(uri, 3, model, opt, sched, keep_last=2)
    assert ckpt.newest_verified_step(uri) == 3
    _damage(uri, 3, how)
    warnings: list[str] = []
    assert ckpt.newest_verified_step(uri, warn=warnings.append) == 2
    assert len(warnings) == 1 and "step 3" in warnings[0] and "damaged" in warnings[0], warnings
    # resuming checks each file as it reads it: the damaged step is skipped, the one before loads
    warnings.clear()
    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    assert ckpt.resume(uri, fresh, fresh_opt, fresh_sched, warn=warnings.append) == 2
    assert len(warnings) == 1 and "step 3" in warnings[0] and "damaged" in warnings[0], warnings
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    _damage(uri, 2, how)  # nothing loadable left: an error, not a silent start from scratch
    with pytest.raises(ckpt.CheckpointDamaged, match="no committed checkpoint .* could be loaded"):
        ckpt.resume(uri, fresh, fresh_opt, fresh_sched, warn=warnings.append)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_direct_load_of_a_damaged_step_raises_checkpoint_damaged_and_copies_nothing(uri):
    """A rank's file is checked before any of it is copied: a load that fails leaves the model as it was, and the
    error is CheckpointDamaged (DCP's own CheckpointException, a BaseException, is what wraps it)."""
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 1)
    ckpt.save_checkpoint(uri, 1, model, opt, sched)
    _damage(uri, 1, "flipped")  # the header still parses: the bytes would be copied
    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ckpt.CheckpointDamaged, match="crc32"):
        ckpt.load_checkpoint(uri, 1, fresh, fresh_opt, fresh_sched)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_store_that_fails_is_not_taken_for_damage_and_a_bad_manifest_is_named(uri, monkeypatch):
    """A read that fails in the store (retries spent) raises: the step is not skipped as damaged, so a flaky link
    never sends a job back to an older step. A manifest that is not JSON is damage, named."""
    import fsspec

    from trainyard.engine.components.checkpoint import io

    model, opt, sched = _setup(seed=0)
    for step in (1, 2):
        _train(model, opt, sched, 1)
        ckpt.save_checkpoint(uri, step, model, opt, sched)

    def unreachable(self, path):
        raise ConnectionResetError("the store went away")

    with monkeypatch.context() as m:
        m.setattr(io._WholeFileReads, "read_file", unreachable)
        warnings: list[str] = []
        fresh, fresh_opt, fresh_sched = _setup(seed=1)
        with pytest.raises(ConnectionResetError, match="the store went away"):
            ckpt.resume(uri, fresh, fresh_opt, fresh_sched, warn=warnings.append)
        with pytest.raises(OSError, match="step 2 .* could not be read .*not known to be damaged"):
            ckpt.newest_verified_step(uri, warn=warnings.append)
        assert not warnings
    with monkeypatch.context() as m:  # a blocking save that fails raises the store's error, an Exception
        m.setattr(io, "put_in_parts", lambda fs, path, data, meanwhile=None: unreachable(None, path))
        m.setattr(io._HashingFileSystem, "_local", lambda self: False)  # the local files go the same way
        caught = None
        try:
            ckpt.save_checkpoint(uri, 3, model, opt, sched)
        except Exception as e:  # DCP's CheckpointException would pass through this
            caught = e
        assert isinstance(caught, ConnectionResetError) and "the store went away" in str(caught)
    assert ckpt.newest_verified_step(uri) == 2  # never committed
    manifest = f"{ckpt.step_uri(uri, 2)}/rank-00000/__0.checksums.json"
    fs, path = fsspec.core.url_to_fs(manifest, **ckpt.storage_options(uri))
    fs.pipe(path, b"{not json")
    warnings = []
    assert ckpt.resume(uri, fresh, fresh_opt, fresh_sched, warn=warnings.append) == 1
    assert len(warnings) == 1 and "the manifest rank-00000/__0.checksums.json is not valid JSON" in warnings[0]


class _Payload:
    """Unpickling this creates a marker file: proof that a pickle ran."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pickled_state_is_never_unpickled(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from trainyard.engine.components.checkpoint.io import CheckpointDamaged, SafeReader, read_metadata

    marker = tmp_path / "pwned"
    _Payload.marker = str(marker)
    uri = str(tmp_path / "ckpt")
    # a step whose non-tensor state holds a malicious object (what DCP's default planner would torch.load
    # with weights_only=False), committed with .metadata and checksums
    target = ckpt.step_uri(uri, 1)
    dcp.save({"w": torch.ones(2), "evil": _Payload()}, storage_writer=FsspecWriter(target))
    assert not marker.exists()
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # DCP wraps the reader's CheckpointDamaged in its own
        dcp.load({"w": torch.zeros(2), "evil": None}, storage_reader=SafeReader(target))
    model, opt, sched = _setup(seed=0)
    with pytest.raises(CheckpointDamaged, match=r"non-tensor \(pickled\) entries \['evil'\]"):
        ckpt.load_checkpoint(uri, 1, model, opt, sched)
    assert not marker.exists()
    # a crafted .metadata that names a callable is refused by the restricted unpickler
    with open(f"{target}/.metadata", "wb") as f:
        pickle.dump(_Payload(), f)
    with pytest.raises(CheckpointDamaged, match="not part of a DCP checkpoint"):
        read_metadata(SafeReader(target).fs, target)
    assert ckpt.newest_verified_step(uri, warn=lambda m: None) is None
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_pickled_by_python_3_11_2_loads(tmp_path):
    """Python 3.11.0-3.11.4 (the CPU image's Debian 3.11.2) pickle Enum members as getattr(EnumClass, name): a
    checkpoint written there loads here, and getattr is still refused for anything but an enum member."""
    import enum
    import io
    import pickle

    from trainyard.engine.components.checkpoint.io import CheckpointDamaged, SafeReader, read_metadata

    class As3112(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    def rewrite(path, obj):
        buf = io.BytesIO()
        As3112(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
        with open(path, "wb") as f:
            f.write(buf.getvalue())
        return buf.getvalue()

    uri = str(tmp_path / "ckpt")
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 2)
    ckpt.save_checkpoint(uri, 2, model, opt, sched)
    target = ckpt.step_uri(uri, 2)
    metadata = read_metadata(SafeReader(target).fs, target)
    assert b"getattr" in rewrite(f"{target}/.metadata", metadata)
    assert read_metadata(SafeReader(target).fs, target).state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    ckpt.load_checkpoint(uri, 2, fresh, fresh_opt, fresh_sched)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    # getattr of anything but an enum member (here torch.Size's class, a way to reach `type`) is still refused
    with open(f"{target}/.metadata", "wb") as f:
        f.write(b"cbuiltins\ngetattr\n(ctorch\nSize\nS'__class__'\ntR.")
    with pytest.raises(CheckpointDamaged, match="not an enum member"):
        read_metadata(SafeReader(target).fs, target)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_save_stages_then_uploads_and_reports_failures(uri, tmp_path):
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 2)
    staged = {k: v.clone() for k, v in model.state_dict().items()}
    said: list[str] = []
    saver = ckpt.AsyncSaver(uri, keep_last=2, say=said.append)
    blocked = saver.save(2, model, opt, sched)
    assert blocked >= 0
    _train(model, opt, sched, 1)  # the loop goes on while the upload runs: the staged copy is saved
    assert saver.wait() and ckpt.newest_verified_step(uri) == 2 and said[-1].startswith("checkpoint step 2 saved")
    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    ckpt.load_checkpoint(uri, 2, fresh, fresh_opt, fresh_sched)
    assert all(torch.equal(staged[k], v) for k, v in fresh.state_dict().items())
    # a save that fails is reported and leaves nothing committed; the next one works
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be")
    broken = ckpt.AsyncSaver(str(blocker / "ckpt"), say=said.append)
    broken.save(3, model, opt, sched)
    assert broken.wait() is False and broken.failed == [3] and "step 3" in said[-1] and "failed" in said[-1]
    assert saver.save(3, model, opt, sched) >= 0 and saver.wait()
    assert ckpt.list_steps(uri) == {2: True, 3: True}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_next_optimizer_step_waits_for_the_background_copy(tmp_path, monkeypatch):
    """save() returns before the state is copied (the copy here starts when the next optimizer step does, and takes
    0.3 s); that step waits for the copy, so the checkpoint holds the weights of the save, not of the step, and the
    wait is counted in `held`. A model with persistent buffers (a forward may change them) is copied before save()
    returns."""
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 2)
    staged = {k: v.clone() for k, v in model.state_dict().items()}
    saver = ckpt.AsyncSaver(str(tmp_path / "ckpt"), keep_last=2, say=lambda m: None)
    copy, stepping = saver._stager._stage, threading.Event()

    def late_copy(*args, **kwargs):
        stepping.wait(30)
        time.sleep(0.3)
        return copy(*args, **kwargs)

    monkeypatch.setattr(saver._stager, "_stage", late_copy)
    opt.register_step_pre_hook(lambda *_: stepping.set())  # before the saver's own: the copy starts now
    saver.save(2, model, opt, sched)
    assert not saver.staging.done()
    _train(model, opt, sched, 1)  # its optimizer step waits for the copy
    assert saver.take_held() >= 0.25 and saver.take_held() == 0.0
    assert saver.wait()
    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    ckpt.load_checkpoint(str(tmp_path / "ckpt"), 2, fresh, fresh_opt, fresh_sched)
    assert all(torch.equal(staged[k], v) for k, v in fresh.state_dict().items())
    model.register_buffer("running", torch.zeros(3))  # persistent
    stepping.clear()
    threading.Timer(0.2, stepping.set).start()
    assert saver.save(3, model, opt, sched) >= 0.15  # copied before save() returned: in its own time, not `held`
    assert saver.staging is None and saver.take_held() == 0.0
    assert saver.wait()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_data_file_written_from_the_tensors_is_dcps_own(uri, monkeypatch):
    """VerifiedWriter writes a rank's safetensors file itself, from the tensors' memory, in pieces: the same file as
    DCP's writer makes (the same tensors under the same names, the same header metadata, the same `.metadata`
    results), with bf16, 0-dim and empty tensors among them, read back by the checkpoint's loader and by
    safetensors' own."""
    from safetensors.torch import load as st_load

    from trainyard.engine.components.checkpoint import io as cio

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.planner import SavePlan

    def dcps_writer(self, prefix, items, planner):
        return FsspecWriter.write_data(self, SavePlan(items, storage_data=prefix), planner).wait()

    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 2)
    extra = {"half": torch.randn(5, 3).bfloat16(), "scalar": torch.tensor(2.5), "none": torch.zeros(0, 4)}
    files, metadata = {}, {}
    for way in ("ours", "dcp"):
        if way == "dcp":
            monkeypatch.setattr(cio.VerifiedWriter, "_write_safetensors", dcps_writer)
        target = f"{uri}/{way}"
        ckpt.save_checkpoint(target, 1, model, opt, sched, extra=extra)
        fs, root = ckpt.filesystem(ckpt.step_uri(target, 1))
        data = fs.cat_file(f"{root}/rank-00000/__0_0.distcp")
        files[way] = st_load(data)
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        metadata[way] = (cio.SafeReader(ckpt.step_uri(target, 1), **ckpt.storage_options(target)).read_metadata()
                         .storage_data, header.get("__metadata__"))
    assert files["ours"].keys() == files["dcp"].keys() and len(files["ours"]) > 20
    assert all(torch.equal(files["ours"][k], files["dcp"][k]) and files["ours"][k].dtype == files["dcp"][k].dtype
               for k in files["ours"])
    assert metadata["ours"] == metadata["dcp"]
    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    loaded = {k: torch.zeros_like(v) for k, v in extra.items()}
    ckpt.load_checkpoint(f"{uri}/ours", 1, fresh, fresh_opt, fresh_sched, extra=loaded)
    assert all(torch.equal(loaded[k], v) for k, v in extra.items())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_dtype_safetensors_holds_round_trips_and_others_are_refused_by_name(uri):
    """complex64 (a RoPE table kept as a buffer), unsigned and float8 tensors, and a non-contiguous one: saved and
    loaded back exactly (the reader used to call a complex64 file damaged); a dtype safetensors has no name for is
    refused when saved, naming the entry."""
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 1)
    extra = {"rope": torch.polar(torch.ones(4, 3), torch.randn(4, 3)), "u16": torch.arange(6).to(torch.uint16),
             "u32": torch.arange(6).to(torch.uint32), "u64": torch.arange(6).to(torch.uint64),
             "f8": torch.randn(4).to(torch.float8_e4m3fn), "transposed": torch.randn(3, 5).t()}
    ckpt.save_checkpoint(uri, 1, model, opt, sched, extra=extra)
    loaded = {k: torch.zeros_like(v) for k, v in extra.items()}
    ckpt.load_checkpoint(uri, 1, model, opt, sched, extra=loaded)
    assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))
               for k, v in extra.items())
    with pytest.raises(ValueError, match=r"checkpoint state 'extra.odd' is a torch.complex32 tensor, which safetensors"):
        ckpt.save_checkpoint(uri, 2, model, opt, sched, extra={"odd": torch.zeros(2, dtype=torch.complex32)})
    assert ckpt.list_steps(uri) == {1: True, 2: False} or ckpt.list_steps(uri) == {1: True}


def test_an_async_save_left_in_flight_at_exit_is_committed(s3_bucket, tmp_path):
    """A script that saves asynchronously to S3 and returns without te.finish(): the exit handlers finish the
    upload (the data file's checksum is summed without starting a thread, which the exit handlers could not)."""
    import subprocess
    import sys

    uri = f"s3://{s3_bucket}/exit"
    script = tmp_path / "script.py"
    script.write_text(f"""
import torch
import trainyard.engine as te
te.init({{}})
model = te.transform(torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.Linear(4096, 512)))  # 16 MiB
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 512)).sum().backward()
opt.step()
te.save_checkpoint(model, opt, step=1, uri="{uri}", blocking=True)
te.save_checkpoint(model, opt, step=2, uri="{uri}")
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert ckpt.list_steps(uri) == {1: True, 2: True}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_before_the_optimizers_first_step_changes_nothing_and_resumes_exactly(tmp_path):
    """Before the first step the optimizer has no state, and none is saved: DCP's state-dict API would make some
    with a step at learning rate 0 (AdamW's step count one ahead: other weights from then on) or, with gradients
    set, save none that its load then asks for. Saved there (with and without gradients, blocking and async), the
    run trains on exactly as one that did not save, and a load of that step resumes exactly."""
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for grads in (False, True):
        for blocking in (True, False):
            uri = str(tmp_path / f"ckpt-{grads}-{blocking}")
            model, opt, sched = _setup(seed=0)
            if grads:
                model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
            if blocking:
                ckpt.save_checkpoint(uri, 0, model, opt, sched)
            else:
                saver = ckpt.AsyncSaver(uri, say=lambda m: None)
                saver.save(0, model, opt, sched)
                assert saver.wait()
            assert not opt.state
            opt.zero_grad()
            _train(model, opt, sched, 3)
            assert all(torch.equal(want[k], v) for k, v in model.state_dict().items()), (grads, blocking)
            fresh, fresh_opt, fresh_sched = _setup(seed=1)  # other weights: the load brings the saved ones
            ckpt.load_checkpoint(uri, 0, fresh, fresh_opt, fresh_sched)
            assert not fresh_opt.state
            _train(fresh, fresh_opt, fresh_sched, 3)
            assert all(torch.equal(want[k], v) for k, v in fresh.state_dict().items()), (grads, blocking)


def test_the_host_stager_copies_into_buffers_kept_between_saves(tmp_path):
    """HostCopies (the async save's copy on a host without an accelerator): the copy holds the values of the call,
    not what the loop writes afterwards; the second copy of the same state reuses the first one's buffers; a
    DTensor keeps its mesh, placements and global shape; a tensor met twice (tied weights) is copied once; numbers
    pass as they are; a changed shape gets a new buffer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainyard.engine.components.checkpoint.staging import HostCopies

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight, moment = torch.randn(4, 3), torch.randn(2, 5).t()  # a transposed one: its strides are kept
        sharded = distribute_tensor(torch.randn(6, 2), mesh, [Shard(0)])
        state = {"app": {"w": weight, "tied": weight, "m": moment, "d": sharded}, "n": 7, "l": [weight]}
        stager = HostCopies()
        before, before_local = weight.clone(), sharded.to_local().clone()
        first = stager.stage(state).result()
        weight.add_(1.0)
        sharded.to_local().add_(1.0)
        assert torch.equal(first["app"]["w"], before) and first["app"]["tied"] is first["app"]["w"]
        assert first["app"]["m"].stride() == moment.stride() and torch.equal(first["app"]["m"], moment)
        d = first["app"]["d"]
        assert d.placements == sharded.placements and d.shape == sharded.shape and d.device_mesh == mesh
        assert torch.equal(d.to_local(), before_local)
        assert first["n"] == 7 and isinstance(first["l"], list) and torch.equal(first["l"][0], before)
        second = stager.stage(state).result()
        assert second["app"]["w"].data_ptr() == first["app"]["w"].data_ptr()
        assert second["app"]["d"].to_local().data_ptr() == d.to_local().data_ptr()
        assert torch.equal(second["app"]["w"], weight) and torch.equal(second["app"]["d"].to_local(), sharded.to_local())
        state["app"]["m"] = torch.randn(3, 3)
        third = stager.stage(state).result()
        assert torch.equal(third["app"]["m"], state["app"]["m"]) and third["app"]["m"].shape == (3, 3)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_saver_purges_in_the_background(uri, monkeypatch):
    model, opt, sched = _setup(seed=0)
    said: list[str] = []
    saver = ckpt.AsyncSaver(uri, keep_last=2, say=said.append)
    for step in (1, 2, 3):
        saver.save(step, model, opt, sched)
    # no wait(): once step 3 is committed the background thread purges step 1 by itself
    within(lambda: ckpt.list_steps(uri) == {2: True, 3: True}, 30, interval=0.05)
    assert ckpt.list_steps(uri) == {2: True, 3: True}
    assert saver.wait()
    # a purge that fails is reported; the step it followed stays committed and the save counts as done
    def broken_purge(*args, **kwargs):
        raise OSError("SlowDown")

    monkeypatch.setattr(ckpt.manager, "purge", broken_purge)  # where the saver finds it
    saver.save(4, model, opt, sched)
    assert saver.wait() and ckpt.list_steps(uri) == {2: True, 3: True, 4: True}
    assert "purging old checkpoints" in said[-1] and "SlowDown" in said[-1]


def test_purge_uncommits_a_step_before_deleting_its_files(tmp_path, monkeypatch):
    import fsspec.implementations.local as local

    uri = str(tmp_path / "ckpt")
    for step in (1, 2, 3):
        _fake_step(uri, step, committed=True)
    removed: list[str] = []
    real_rm = local.LocalFileSystem.rm

    def rm_then_die(self, path, recursive=False, **kwargs):
        removed.append(str(path))
        if recursive:
            raise OSError("the process died here")
        return real_rm(self, path, recursive=recursive, **kwargs)

    monkeypatch.setattr(local.LocalFileSystem, "rm", rm_then_die)
    with pytest.raises(OSError, match="died"):
        ckpt.purge(uri, keep_last=2)
    assert removed[0].endswith("step-00000001/.metadata")
    # cut short after the marker went: step 1 is an interrupted save, never a committed damaged step
    assert ckpt.list_steps(uri) == {1: False, 2: True, 3: True}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_consolidates_into_safetensors(tmp_path, capsys):
    from safetensors.torch import load_file

    from trainyard.engine.models.llama.model import ModelConfig as Config
    from trainyard.sdk.cli import main

    uri = str(tmp_path / "ckpt")
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 1)
    ckpt.save_checkpoint(uri, 1, model, opt, sched)
    _train(model, opt, sched, 1)
    ckpt.save_checkpoint(uri, 2, model, opt, sched)
    assert main(["checkpoint", "export", uri, str(tmp_path / "out")]) == 0  # the newest step
    assert "step 2" in capsys.readouterr().out
    config = __import__("json").loads((tmp_path / "out" / "config.json").read_text())
    fresh = Transformer(Config(**config["model_config"]))
    fresh.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert main(["checkpoint", "export", ckpt.step_uri(uri, 1), str(tmp_path / "one")]) == 0
    assert __import__("json").loads((tmp_path / "one" / "config.json").read_text())["step"] == 1
    (tmp_path / "nothing").mkdir()
    assert main(["checkpoint", "export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err


def test_export_says_what_is_wrong_with_the_uri(tmp_path, capsys, s3_bucket):
    from trainyard.engine.components.export import resolve_step
    from trainyard.sdk.cli import main

    (tmp_path / "empty").mkdir()
    _fake_step(str(tmp_path / "half"), 3, committed=False)
    for uri, says in [
        ("s3:/bucket/ckpt", "'s3:/bucket/ckpt' is not a valid URI: write s3://, two slashes after the scheme "
                            "(e.g. 's3://bucket/ckpt')"),
        ("s3://", "'s3://' names no bucket"),
        ("gs://bucket/ckpt", "scheme gs:// is not supported"),
        (str(tmp_path / "missing"), "does not exist on this machine"),
        (f"file://{tmp_path}/missing", "does not exist on this machine"),
        ("s3://no-such-bucket/ckpt", "bucket 'no-such-bucket' does not exist"),
        (str(tmp_path / "empty"), "no committed checkpoint under"),
        (str(tmp_path / "half"), "its 1 step(s) are not committed or do not verify"),
        (str(tmp_path / "half" / "step-00000003"), "holds no committed step (no .metadata"),
        (f"s3://{s3_bucket}/none", "nothing named step-* is under it"),
    ]:
        with pytest.raises(ValueError) as e:
            resolve_step(uri)
        assert says in str(e.value), (uri, str(e.value))
        if "no committed step" not in says and "no-such-bucket" not in uri:  # and what a valid one looks like
            assert "'s3://bucket/prefix'" in str(e.value) and "step-00000100" in str(e.value), str(e.value)
    # the CLI says it (exit 2) instead of only "no committed checkpoint"
    assert main(["checkpoint", "export", "s3:/bucket/ckpt", str(tmp_path / "out")]) == 2
    assert "two slashes after the scheme" in capsys.readouterr().err


def test_damage_is_read_from_the_exceptions_types():
    """resume names what is damaged from DCP's gathered failures, by type: the damage on any rank first."""
    from torch.distributed.checkpoint.api import CheckpointException

    from trainyard.engine.components.checkpoint.io import CheckpointDamaged

    damaged = CheckpointDamaged("s3://b/ckpt/step-00000003: rank-00001/__1_0.distcp is missing")
    gathered = CheckpointException("load failed", {0: (OSError("peer gone"), None), 1: (damaged, None)})
    assert ckpt.damage(gathered) == str(damaged)
    assert ckpt.damage(damaged) == str(damaged)
    assert ckpt.damage(CheckpointException("x", {2: (OSError("SlowDown"), None)})) == "OSError: SlowDown"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_manager_saves_waits_resumes_and_keeps_what_the_last_save_asked(uri):
    model, opt, sched = _setup(seed=0)
    manager = ckpt.CheckpointManager(uri, keep_last=1, say=lambda m: None)
    for step in (1, 2):
        manager.save(step, model, opt, sched)
    assert manager.wait() and ckpt.list_steps(uri) == {2: True}
    manager.keep_last = 3
    manager.save(3, model, opt, sched)
    manager.save(4, model, opt, sched, blocking=True)
    assert ckpt.list_steps(uri) == {2: True, 3: True, 4: True}
    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    assert manager.resume(fresh, fresh_opt, fresh_sched) == 4 and manager.newest_verified() == 4
    # the figures of the blocking save and of the load; the asynchronous saves' come through busy() (below)
    io = manager.take_io()
    assert [(e["op"], e["step"]) for e in io] == [("save", 4), ("load", 4)] and manager.take_io() == []
    files = sum(f.stat().st_size for f in Path(uri).glob("step-00000004/rank-*/*.distcp")) if "://" not in uri else None
    assert io[0]["bytes_per_rank"] == io[1]["bytes_per_rank"] == ([files] if files else io[0]["bytes_per_rank"])
    assert io[0]["bytes_per_rank"][0] > 10_000 and all(e["gbps_per_rank"][0] > 0 for e in io)
    manager.keep_last = 0  # refused when saved, before anything is written, on each way to save
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        manager.save(5, model, opt, sched)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        manager.save(5, model, opt, sched, blocking=True)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ckpt.save_checkpoint(uri, 5, model, opt, sched, keep_last=0)
    assert ckpt.list_steps(uri) == {2: True, 3: True, 4: True}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_due_while_the_last_upload_is_in_flight_is_known_as_busy(tmp_path, monkeypatch):
    """busy(): the last asynchronous save still uploading (held here in its purge, after the commit); once it is
    done, busy() is False and records its figures. The agreement of every rank: tests/engine/test_api.py."""
    import threading

    model, opt, sched = _setup(seed=0)
    manager = ckpt.CheckpointManager(str(tmp_path / "ckpt"), say=lambda m: None)
    assert not manager.busy()  # nothing saved yet
    release = threading.Event()
    monkeypatch.setattr(ckpt.manager, "purge", lambda *a, **k: release.wait(30))
    manager.save(1, model, opt, sched)
    assert manager.busy() and manager.take_io() == []
    release.set()
    assert manager.wait() and not manager.busy()
    (save,) = manager.take_io()
    assert save["op"] == "save" and save["step"] == 1 and save["bytes_per_rank"][0] > 10_000


def test_a_stalled_store_request_times_out_within_the_read_timeout(monkeypatch):
    """A store that accepts connections and answers nothing (an outage behind a load balancer): the checkpoint
    I/O's client gives up on the request after READ_TIMEOUT_S, then retries, instead of botocore's 60 s. Shown
    with the timeout cut to 1 s and one attempt, on the options the checkpoint I/O gets (`storage_options`)."""
    import socket
    import threading
    import time

    import boto3
    from botocore.config import Config
    from botocore.exceptions import ReadTimeoutError

    from trainyard.engine.components.checkpoint import locations

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(4)], daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setattr(locations, "READ_TIMEOUT_S", 1)
    options = locations.storage_options("s3://stalled/ckpt")
    assert options["config_kwargs"]["connect_timeout"] == locations.CONNECT_TIMEOUT_S <= 10
    config = Config(**{**options["config_kwargs"], "retries": {"max_attempts": 1, "mode": "standard"}})
    s3 = boto3.client("s3", endpoint_url=options["client_kwargs"]["endpoint_url"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing", config=config)
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        s3.head_object(Bucket="stalled", Key="ckpt/step-00000001/.metadata")
    assert time.monotonic() - started < 5
    server.close()


def _s3fs(monkeypatch, fail=None):
    """The checkpoint's s3fs filesystem with `_call_s3` counted by method (and `fail(method, count)` raising where it
    returns an exception): a fake of our own in front of the real requests to the moto server."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **ckpt.storage_options("s3://x"))
    calls: dict[str, int] = {}
    real = fs._call_s3

    async def counted(method, *args, **kwargs):
        calls[method] = calls.get(method, 0) + 1
        error = fail(method, calls[method], kwargs) if fail else None
        if error is not None:
            raise error
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", counted)
    return fs, calls


def test_a_large_rank_file_goes_up_in_parts_and_a_failed_part_leaves_nothing(s3_bucket, monkeypatch):
    import os

    from trainyard.engine.components.checkpoint import io

    monkeypatch.setattr(io, "PART_BYTES", 5 * 2**20)  # S3's least part size: 3 parts of this file
    data = os.urandom(11 * 2**20)
    fs, calls = _s3fs(monkeypatch)
    io.put_in_parts(fs, f"{s3_bucket}/whole", data)
    assert calls["upload_part"] == 3 and calls["complete_multipart_upload"] == 1 and "put_object" not in calls
    assert fs.cat(f"{s3_bucket}/whole") == data
    io.put_in_parts(fs, f"{s3_bucket}/small", data[:100])  # one part's worth: one put
    assert calls.get("put_object") == 1 and fs.cat(f"{s3_bucket}/small") == data[:100]

    def second_part_fails(method, count, kwargs):
        return OSError("injected") if method == "upload_part" and kwargs["PartNumber"] == 2 else None

    fs, calls = _s3fs(monkeypatch, second_part_fails)
    with pytest.raises(OSError, match="injected"):
        io.put_in_parts(fs, f"{s3_bucket}/broken", data)
    assert calls["abort_multipart_upload"] == 1 and "complete_multipart_upload" not in calls
    assert not fs.exists(f"{s3_bucket}/broken")
    import boto3

    assert not boto3.client("s3").list_multipart_uploads(Bucket=s3_bucket).get("Uploads")  # no part stays stored


class _CutBody:
    """A GET's body that ends after `keep` bytes of `data` (a connection that broke off): a fake of our own."""

    def __init__(self, data: bytes, keep: int, error: Exception | None = None) -> None:
        self.data, self.keep, self.error, self.at = data, keep, error, 0

    async def read(self, n: int) -> bytes:
        if self.at >= self.keep:
            if self.error is not None:
                raise self.error
            return b""
        chunk = self.data[self.at:min(self.keep, self.at + n, self.at + 1000)]
        self.at += len(chunk)
        return chunk

    def close(self) -> None:
        pass


def test_a_data_file_is_read_in_one_get_with_its_crc_and_a_body_cut_short_is_fetched_again(s3_bucket, monkeypatch):
    import zlib

    from trainyard.engine.components.checkpoint import io

    data = bytes(range(256)) * 40
    fs, _ = _s3fs(monkeypatch)
    fs.pipe_file(f"{s3_bucket}/step/rank-00000/__0_0.distcp", data)
    cuts = iter([_CutBody(data, 3000), _CutBody(data, 5000, ConnectionResetError("reset"))])
    gets = []

    async def get(method, *args, **kwargs):
        assert method == "get_object", method
        gets.append(kwargs["Key"])
        cut = next(cuts, None)
        return {"ContentLength": len(data), "Body": cut or _CutBody(data, len(data))}

    monkeypatch.setattr(fs, "_call_s3", get)
    reads = io._WholeFileReads.__new__(io._WholeFileReads)
    reads.fs, reads.root, reads.verify = fs, f"{s3_bucket}/step", True
    got, crc = reads.read_file(f"{s3_bucket}/step/rank-00000/__0_0.distcp")
    assert bytes(got) == data and crc == zlib.crc32(data) and len(gets) == 3  # short, then reset, then whole
    cuts = iter([_CutBody(data, 10) for _ in range(io.READ_ATTEMPTS)])
    with pytest.raises(OSError, match=f"the body ended after 10 of {len(data)} bytes"):
        reads.read_file(f"{s3_bucket}/step/rank-00000/__0_0.distcp")
