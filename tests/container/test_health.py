"""The health check's verdict (trainyard/container/health.py), from made-up figures; the check in a real job is
tests/e2e/test_health_check.py's."""
from trainyard.container.health import verdict

EFA = {"provider": None, "devices": 0}


def _rank(host: str, tflops: float, intra=1.0, inter=0.5) -> dict:
    return {"host": host, "compute_tflops": tflops, "intra_gbps": intra, "inter_gbps": inter, "efa": EFA}


def test_a_host_far_below_the_median_of_the_others_is_named_with_its_figures():
    ranks = [_rank("algo-1", 100), _rank("algo-1", 104), _rank("algo-2", 98), _rank("algo-2", 102, intra=0.8),
             _rank("algo-3", 30), _rank("algo-3", 34)]
    got = verdict(ranks, min_ratio=0.7, expected_tflops=None)
    assert got["slow"] == ["algo-3"]
    assert got["hosts"]["algo-2"] == {"intra_gbps": 0.8, "inter_gbps": 0.5, "rank_tflops": [98, 102], "efa": EFA,
                                      "ranks": 2, "compute_tflops": 100, "expected_tflops": None, "ratio": 1.493}
    # each against the median of the others (with 3 hosts, the mean of the other two: 100 / 67, 32 / 101)
    assert got["hosts"]["algo-3"]["ratio"] == 0.317
    assert got["reason"] == ("Health check: algo-3's compute 32 TFLOP/s is 0.32x the median of the other hosts (101), "
                             "below the 0.7x the check allows: a throttled or faulty host, found before training "
                             "started")


def test_hosts_within_the_ratio_pass_and_a_lone_host_is_held_to_its_expected_figure():
    assert verdict([_rank("algo-1", 100), _rank("algo-2", 75)], min_ratio=0.7, expected_tflops=None)["slow"] == []
    alone = verdict([_rank("algo-1", 200, inter=None)], min_ratio=0.7, expected_tflops=593.6)
    assert alone["slow"] == ["algo-1"] and "0.34x the instance type's expected figure (594)" in alone["reason"]
    assert alone["hosts"]["algo-1"]["inter_gbps"] is None
    cpu = verdict([_rank("algo-1", 0.1)], min_ratio=0.7, expected_tflops=None)  # nothing to compare with
    assert cpu["slow"] == [] and cpu["hosts"]["algo-1"]["ratio"] is None and cpu["reason"] == ""
    assert cpu["unjudged"] == ["algo-1"] and alone["unjudged"] == []  # said: not judged, rather than passed
