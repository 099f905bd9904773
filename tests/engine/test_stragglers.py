"""The straggler check (trainyard/engine/components/stragglers.py): the detector on made-up step times, and the
watch's gather on a one-process group. The named rank of a real 2 x 2 job is tests/e2e/test_stragglers.py's."""
import random

import pytest
import torch.distributed as dist

from trainyard.engine.components.stragglers import Detector, Straggler, StragglerWatch

HOSTS = ["algo-1", "algo-1", "algo-2", "algo-2"]


def _detector(**kw) -> Detector:
    return Detector(stages=kw.pop("stages", [0, 0, 0, 0]), hosts=kw.pop("hosts", HOSTS), **kw)


def test_a_rank_slow_for_the_window_is_named_once_with_its_host_and_again_after_it_recovered():
    d = _detector(ratio=1.3, steps=20)
    rng = random.Random(0)
    found = {}
    for step in range(1, 141):
        times = [0.1 * rng.uniform(0.95, 1.05) for _ in range(4)]
        if 11 <= step <= 60 or step >= 101:  # rank 2 at 1.5x twice, with 40 normal steps between
            times[2] *= 1.5
        for s in d.observe(times):
            found[step] = s
        if step in (45, 85, 140):  # still named 25 steps after it recovered: a whole window back is needed
            assert d.slow() == [2], step
        if step == 95:
            assert d.slow() == []
    assert sorted(found) == [21, 111], found  # the 11th slow step of each stretch: most of the last 20 steps
    first = found[21]
    assert (first.rank, first.host, first.steps) == (2, "algo-2", 20) and 1.4 < first.ratio < 1.6
    assert str(first) == f"rank 2 (algo-2) {first.ratio:.2f}x the median step for 20 steps"


def test_a_few_ms_more_than_its_peers_is_not_a_straggler():
    """Steps of 25 ms: the rank that prints the progress is 8 ms (1.33x) slower every step; one at 60 ms is named."""
    d = _detector()
    assert all(d.observe([0.033, 0.025, 0.025, 0.025]) == [] for _ in range(100))
    assert [s.rank for _ in range(20) for s in d.observe([0.025, 0.025, 0.06, 0.025])] == [2]


def test_scattered_slow_steps_and_a_rank_just_under_the_ratio_are_not_named():
    """A shared host deschedules some rank now and then: every other step (at random) one rank at random 2x; rank 0
    always at 1.25x."""
    d = _detector(ratio=1.3, steps=20)
    rng = random.Random(1)
    for _ in range(300):
        times = [0.1] * 4
        times[0] = 0.125
        if rng.random() < 0.5:
            times[rng.randrange(4)] *= 2
        assert d.observe(times) == []


def test_ranks_are_compared_within_their_pipeline_stage():
    """Stage 1 does twice stage 0's work: nobody is slow; a stage of one rank has no peers to compare with."""
    d = _detector(stages=[0, 0, 1, 1])
    assert all(d.observe([0.1, 0.1, 0.2, 0.2]) == [] for _ in range(50))
    alone = _detector(stages=[0, 1], hosts=["algo-1", "algo-2"], steps=3)
    assert all(alone.observe([0.1, 0.9]) == [] for _ in range(10))
    mixed = _detector(stages=[0, 0, 1, 1], steps=5)
    named = [s for _ in range(5) for s in mixed.observe([0.1, 0.1, 0.2, 0.5])]
    assert named == [Straggler(3, "algo-2", 2.5, 5)]


def test_a_rank_hovering_at_the_ratio_is_named_once():
    """Throttled in bursts, its typical step swings around 1.3x, and now and then under 1.15x: named once, not at
    every crossing."""
    d = _detector(steps=4)
    pattern = [0.14] * 8 + [0.122] * 8 + [0.1] * 3  # 3 steps back among its peers: less than a window
    named = [s for step in range(200) for s in d.observe([0.1, 0.1, 0.1, pattern[step % len(pattern)] * 1.0])]
    assert [s.rank for s in named] == [3] and d.slow() == [3]


@pytest.mark.parametrize("kw,text", [({"ratio": 1.0}, "straggler_ratio must be > 1"),
                                     ({"steps": 0}, "straggler_steps must be >= 1")])
def test_bad_thresholds_are_refused_by_name(kw, text):
    with pytest.raises(ValueError, match=text):
        _detector(**kw)


def test_the_watch_gathers_every_n_steps_after_the_warm_up(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        watch = StragglerWatch(Detector(stages=[0], hosts=["algo-1"], steps=2), every=3, warmup=2)
        got = [watch.record(step, 0.1 * step) for step in range(1, 10)]
    finally:
        dist.destroy_process_group()
    assert [bool(g) for g, _ in got] == [False, False, False, False, True, False, False, True, False]
    assert got[4][0] == {3: [pytest.approx(0.3)], 4: [pytest.approx(0.4)], 5: [pytest.approx(0.5)]}
    assert all(named == [] for _, named in got)
    with pytest.raises(ValueError, match="straggler_check_every must be >= 1"):
        StragglerWatch(Detector(stages=[0], hosts=["a"]), every=0)
