"""Hang diagnosis from heartbeats (container/hang.py) and the heartbeat itself (engine/components/heartbeat.py),
on files and processes made here; a real hung job is in tests/e2e/test_hang.py."""
import json
import os
import signal
import subprocess
import sys
import time

from trainyard.container import hang
from trainyard.container.hang import Beat, HangWatch, diagnose, ranks_text, stack_top
from tests.waiting import eventually, within


def _beat(rank, *, host=None, t=100.0, step=41, phase="backward", collective="all_gather_into_tensor", seq=5123,
          waiting=True, pid=None):
    return Beat(rank=rank, host=host or f"algo-{rank // 2 + 1}", pid=pid or 1000 + rank, time=t, step=step,
                phase=phase, collective=collective, seq=seq, waiting=waiting)


def test_a_stopped_rank_is_the_culprit_and_the_others_wait_for_it():
    beats = [_beat(0), _beat(1), _beat(2), _beat(3, seq=5100, waiting=False, t=80.0)]
    states = {1000: "S", 1001: "S", 1002: "S", 1003: "T"}
    reason, culprits = diagnose(beats, now=101.0, states=states)
    assert culprits == [3]
    assert reason == ("Hang: rank 3 (algo-2) stopped in backward at step 41 (SIGSTOP); "
                      "ranks 0-2 wait in all_gather_into_tensor #5123")


def test_a_rank_outside_the_collective_is_the_culprit_with_its_stack_top():
    beats = [_beat(0), _beat(1, phase="forward", waiting=False, seq=5122), _beat(2)]
    stack = ('Thread 0x01 (most recent call first):\n  File "/x/threading.py", line 320 in wait\n\n'
             'Current thread 0x02 (most recent call first):\n  File "/code/train.py", line 52 in forward\n'
             '  File "/code/train.py", line 90 in main\n')
    reason, culprits = diagnose(beats, now=100.5, states={}, stacks={1: stack})
    assert culprits == [1]
    assert reason == ("Hang: rank 1 (algo-1) is outside any collective in forward at step 41 (train.py:52 in forward); "
                      "ranks 0,2 wait in all_gather_into_tensor #5123")


def test_the_lowest_collective_number_is_behind():
    beats = [_beat(0, seq=10), _beat(1, seq=9, collective="all_reduce"), _beat(2, seq=10)]
    reason, culprits = diagnose(beats, now=100.0, states={})
    assert culprits == [1] and reason.startswith("Hang: rank 1 (algo-1) is behind in backward at step 41 (last in all_reduce #9)")


def test_a_rank_stopped_before_its_first_step_reads_as_start_up():
    beats = [_beat(0, phase="starting", step=None, seq=0, waiting=False, t=80.0), _beat(1, seq=0)]
    reason, culprits = diagnose(beats, now=101.0, states={1000: "T", 1001: "S"})
    assert culprits == [0]
    assert reason == ("Hang: rank 0 (algo-1) stopped in start-up (before its first step) (SIGSTOP); "
                      "rank 1 waits in all_gather_into_tensor #0")


def test_ranks_text_and_stack_top():
    assert ranks_text([3]) == "rank 3" and ranks_text([2, 0, 1, 5, 7, 6]) == "ranks 0-2,5-7"
    assert stack_top("") == ""


def _write(folder, beat: Beat):
    with open(os.path.join(folder, f"rank-{beat.rank}.json"), "w") as fh:
        json.dump(beat.to_dict(), fh)


def test_watch_fires_after_no_change_for_the_timeout(tmp_path):
    me = os.getpid()
    watch = HangWatch(str(tmp_path / "rank-*.json"), timeout_s=10)
    assert watch.check(0.0) is None  # no heartbeat yet: nothing to judge
    _write(tmp_path, _beat(0, pid=me, seq=1))
    _write(tmp_path, _beat(1, pid=me, seq=1))
    assert watch.check(1.0) is None and watch.check(10.5) is None  # 9.5 s without a change
    _write(tmp_path, _beat(1, pid=me, seq=2))  # progress: the clock starts again
    assert watch.check(11.0) is None and watch.check(20.0) is None
    assert [b.rank for b in watch.check(21.0)] == [0, 1]
    _write(tmp_path, _beat(1, pid=me, seq=2, phase="exited"))  # an exited rank (or a gone process) is not hung
    gone = subprocess.Popen(["true"])
    gone.wait()
    _write(tmp_path, _beat(0, pid=gone.pid))
    assert watch.check(40.0) is None and watch.live() == []


def test_heartbeat_of_a_process_tracks_collectives_and_dumps_stacks_on_sigusr2(tmp_path):
    """A real process with the worker site: its heartbeat shows the collective it blocks in, and SIGUSR2
    writes its stacks."""
    code = """
import os, time, torch, torch.distributed as dist
from trainyard.engine.components import heartbeat
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
assert heartbeat.start()
heartbeat.set_step(7); heartbeat.set_phase("backward")
t = torch.ones(4)
dist.all_reduce(t)
w = dist.all_reduce(t, async_op=True); w.wait()
print("ready", flush=True)
time.sleep(60)
"""
    env = {**os.environ, "TRAINYARD_HEARTBEAT_DIR": str(tmp_path), "RANK": "0",
           "SM_CURRENT_HOST": "algo-1",
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(hang.__file__), "worker_site"),
                                          os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        def second():  # the thread writes every second
            b = hang.read_beats(str(tmp_path / "rank-*.json")).get(0)
            return b if b is not None and b.seq >= 2 else None
        b = eventually(second, 10)
        assert (b.pid, b.host, b.step, b.phase, b.collective, b.seq, b.waiting) == (
            p.pid, "algo-1", 7, "backward", "all_reduce", 2, False)
        os.kill(p.pid, signal.SIGUSR2)
        within(lambda: "in <module>" in (tmp_path / "stack-rank-0.txt").read_text(), 10)
        assert 'File "<string>", line 11 in <module>' in (tmp_path / "stack-rank-0.txt").read_text()
        assert p.poll() is None  # the dump does not end the process
    finally:
        p.kill()
        p.wait()


def test_host_watch_of_a_driver_fires_once_and_ends_the_hung_ranks(tmp_path):
    """The driver's watch (EC2 nodes): one host's ranks, no progress for the timeout -> the diagnosis, hang.json,
    and the ranks killed."""
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        now = time.time()
        _write(tmp_path, _beat(2, host="algo-2", pid=ranks[0].pid, t=now + 60))  # keeps beating, waits
        _write(tmp_path, _beat(3, host="algo-2", pid=ranks[1].pid, t=now - 60, waiting=False, phase="forward"))
        said = []
        watch = hang.HostHangWatch(str(tmp_path), timeout_s=0.3, say=said.append, poll=0.1).start()
        within(lambda: watch.reason, 15)
        watch.stop()
        assert watch.reason.startswith("Hang: rank 3 (algo-2) stopped in forward at step 41 (no heartbeat for"), \
            watch.reason
        assert "rank 2 waits in all_gather_into_tensor #5123" in watch.reason and said[0] == watch.reason
        report = json.loads((tmp_path / "hang.json").read_text())
        assert report["culprits"] == [3] and len(report["beats"]) == 2
        assert [p.wait(timeout=10) for p in ranks] != [None, None]  # SIGUSR2 (sleep has no handler) or SIGKILL
    finally:
        for p in ranks:
            p.kill()


def test_a_rank_waiting_for_a_dtensor_collective_is_seen_waiting(tmp_path):
    """A sharded gradient's norm (DTensor, functional collectives) whose peer never comes: the heartbeat says the
    rank waits in all_reduce, so a hang names the peer, not nobody (a 2-process gloo world; rank 1 never joins)."""
    code = """
import os, sys, time, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
from trainyard.engine.components import heartbeat
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
assert heartbeat.start()
heartbeat.set_phase("optimizer")
if rank == 0:
    t = DTensor.from_local(torch.ones(4), mesh, [Partial()]).full_tensor()
    print("done", float(t.sum()), flush=True)
time.sleep(60)
"""
    env = {**os.environ, "TRAINYARD_HEARTBEAT_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path / "rendezvous")],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        within(lambda: (b := hang.read_beats(str(tmp_path / "rank-0.json")).get(0)) is not None and b.waiting, 60,
               interval=0.2)
        b = hang.read_beats(str(tmp_path / "rank-0.json")).get(0)
        assert b is not None and (b.phase, b.collective, b.waiting) == ("optimizer", "all_reduce", True), b
        assert procs[0].poll() is None  # still waiting for rank 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
