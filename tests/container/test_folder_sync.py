"""Job folders mirrored to object storage while the job runs (container/folder_sync.py), and the folders the
driver mirrors for a job: the TensorBoard folder (event files growing every step) and the profiler's traces."""
import os

from tests.container.test_ckpt_sync import _keys
from trainyard.container.driver import OUTPUT_SYNC_ENV, start_syncs, stop_syncs
from trainyard.container.folder_sync import FolderSync
from trainyard.job.spec import build_spec
from tests.waiting import eventually


def test_an_appended_file_is_uploaded_at_every_scan_without_settling(s3_bucket, tmp_path):
    """TensorBoard event files grow every step: the store follows them scan by scan, not only at the end."""
    local = tmp_path / "tb"
    local.mkdir()
    sync = FolderSync(str(local), f"s3://{s3_bucket}/tb", interval=3600, settle=False, what="tensorboard")
    events = local / "events.out.tfevents.1"
    events.write_bytes(b"record-1")
    assert sync.sync(final=False) == 1  # uploaded at once, although it changed since the previous scan
    assert _keys(s3_bucket, "tb/") == {"tb/events.out.tfevents.1": b"record-1"}
    assert sync.sync(final=False) == 0  # unchanged: not again
    with open(events, "ab") as fh:
        fh.write(b"record-2")
    assert sync.sync(final=False) == 1
    assert _keys(s3_bucket, "tb/") == {"tb/events.out.tfevents.1": b"record-1record-2"}


def test_a_file_being_written_beside_its_name_is_never_uploaded(s3_bucket, tmp_path):
    local = tmp_path / "prof"
    local.mkdir()
    (local / ".rank0-steps2-3.pt.trace.json.partial").write_text('{"traceEv')
    sync = FolderSync(str(local), f"s3://{s3_bucket}/prof", interval=3600, what="profiler")
    assert sync.sync(final=False) == 0 and sync.sync(final=False) == 0 and sync.stop() == {}
    assert _keys(s3_bucket, "prof/") == {}


def test_the_thread_uploads_while_running_and_creates_the_folder(s3_bucket, tmp_path):
    local = tmp_path / "not-yet"
    sync = FolderSync(str(local), f"s3://{s3_bucket}/live", interval=0.05, settle=False).start()
    assert local.is_dir()  # the job writes into it: it exists before the job starts
    (local / "a.txt").write_text("a")
    eventually(lambda: "live/a.txt" in _keys(s3_bucket, "live/"), timeout=10)  # before stop(): by the thread
    assert sync.stop() == {} and sync.files_uploaded == 1


def test_the_driver_mirrors_tensorboard_and_profiler_folders_to_the_jobs_prefixes(s3_bucket, tmp_path):
    spec = build_spec(job_name="job-tb", entry_point="trainyard.engine.train", entry_kind="module",
                      instance_type="local", processes_per_host=1, output_path=f"s3://{s3_bucket}/out",
                      tensorboard_output_config={"s3_output_path": f"s3://{s3_bucket}/tb"}, profiler={"steps": [2]})
    root = str(tmp_path / "algo-1")
    said: list[str] = []
    syncs: list = []
    start_syncs(spec, root, {OUTPUT_SYNC_ENV: "3600"}, said.append, syncs)
    assert [s.what for s in syncs] == ["tensorboard", "profiler"]
    assert [s.settle for s in syncs] == [False, True]  # event files grow; traces are written once
    with open(f"{root}/output/tensorboard/events.out.tfevents.7", "w") as fh:
        fh.write("events")
    with open(f"{root}/output/profiler/rank0-steps2-2.pt.trace.json", "w") as fh:
        fh.write('{"traceEvents": []}')
    status: dict = {}
    assert stop_syncs(syncs, status) == ""  # the last sync uploads both, whatever their age
    assert status == {"tensorboard_files_uploaded": 1, "profiler_files_uploaded": 1}
    assert _keys(s3_bucket, "tb/") == {"tb/job-tb/tensorboard-output/events.out.tfevents.7": b"events"}
    assert _keys(s3_bucket, "out/job-tb/profiler-output/") == {
        "out/job-tb/profiler-output/rank0-steps2-2.pt.trace.json": b'{"traceEvents": []}'}


def test_what_could_not_be_uploaded_is_named_by_folder(s3_bucket, tmp_path):
    spec = build_spec(job_name="job-lost", entry_point="trainyard.engine.train", entry_kind="module",
                      instance_type="local", processes_per_host=1, output_path=f"s3://{s3_bucket}/out",
                      tensorboard_output_config={"s3_output_path": "s3://no-such-bucket-here/tb"})
    root = str(tmp_path / "algo-1")
    said: list[str] = []
    syncs: list = []
    start_syncs(spec, root, {OUTPUT_SYNC_ENV: "3600"}, said.append, syncs)
    os.makedirs(f"{root}/output/tensorboard/run")
    with open(f"{root}/output/tensorboard/run/events.out.tfevents.1", "w") as fh:
        fh.write("x")
    lost = stop_syncs(syncs, {})
    assert lost.startswith("1 tensorboard file(s) could not be uploaded to s3://no-such-bucket-here/tb/job-lost/"
                           "tensorboard-output: run/events.out.tfevents.1: ")
    assert any(m.startswith("tensorboard sync: uploading run/events.out.tfevents.1") for m in said)
