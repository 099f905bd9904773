"""The data-corruption check (trainyard/engine/components/sdc.py): the digests, the majority, the retry class, and
the check on 3 processes (gloo) whose replicas one bit flip sets apart. The retried job that ends with the clean
run's weights is tests/e2e/test_auto_resume.py's."""
import os

import pytest
import torch

from trainyard.container.failure import retry_class
from trainyard.engine.components.sdc import digests, odd_ones


def test_a_single_flipped_bit_changes_the_digest_of_any_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        t = torch.arange(-50, 51, dtype=torch.float32).to(dtype)
        before = digests([t])
        for bit in range(t.element_size() * 8):
            flipped = t.clone()
            raw = flipped.view(torch.uint8)
            raw[7] ^= 1 << (bit % 8) if bit < 8 else 0
            raw[8 + bit // 8 - 1 if bit >= 8 else 7] ^= 1 << (bit % 8) if bit >= 8 else 0
            assert digests([flipped]) != before, (dtype, bit)
    assert digests([torch.empty(0)]).tolist() == [0]


@pytest.mark.parametrize("values,odd", [
    ([[1, 2], [1, 2], [1, 2]], []),
    ([[1, 2], [1, 3], [1, 2]], [1]),
    ([[1, 2], [1, 3], [1, 2], [1, 2]], [1]),
    ([[1, 2], [1, 3]], [0, 1]),  # 2 replicas: no majority, both named
    ([[1], [2], [3]], [0, 1, 2]),
    ([[1], [1], [2], [2]], [0, 1, 2, 3]),
])
def test_the_copies_that_differ_from_the_majority(values, odd):
    assert odd_ones(values) == odd


def test_its_failure_is_retried_as_data_corruption():
    reason = ("algo-2 rank 3 (local rank 1) exited with code 1:\nTraceback (most recent call last):\n...\n"
              "trainyard.engine.components.sdc.DataCorruption: data corruption: at step 10 the parameters of rank 3 "
              "(algo-2) differ from the other replicas of their shard (4 copies; tok_embeddings.weight first)")
    assert retry_class(reason) == "data corruption"


def test_a_flipped_bit_on_one_replica_names_its_rank_on_every_rank(tmp_path):
    """4 processes: as one group of 4 replicas, the odd one is named and a clean run raises nothing; as 2 groups of
    2, no majority says which copy is damaged, and both ranks of that group are named, on every rank."""
    from .launch import run_on_two_hosts

    worker = os.path.join(os.path.dirname(__file__), "sdc_worker.py")
    got = run_on_two_hosts(worker, [dict(name="clean", flip=None), dict(name="flip-rank-2", flip=2),
                                    dict(name="pairs-flip-rank-1", flip=1, groups=[[0, 1], [2, 3]])],
                           tmp_path, processes_per_host=4, hosts=1)
    assert got["clean"] == [""] * 4
    assert got["flip-rank-2"] == ["data corruption: at step 2 the parameters of rank 2 (algo-2) differ from the "
                                  "other replicas of their shard (4 copies; 0.weight first); its GPU or host memory "
                                  "may be faulty"] * 4  # every rank raised the same
    assert got["pairs-flip-rank-1"] == ["data corruption: at step 2 the 2 replicas of a shard differ (rank 0 "
                                        "(algo-1), rank 1 (algo-1); 0.weight first): with 2 replicas no majority says "
                                        "which copy is damaged; a GPU or host memory of one of them may be faulty"] * 4
