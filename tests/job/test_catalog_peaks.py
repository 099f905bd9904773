"""The catalog's peak figures (read by the planner) agree with the one peak table (parallel/shapes.py), which the
engine's MFU uses: a GPU's bf16 peak is written twice only as the same number."""
from trainyard.job import catalog
from trainyard.parallel import shapes

# the catalog's accelerators are the SXM parts of the P4/P5 instances; the table is keyed by device names
PARTS = {"NVIDIA H100": "NVIDIA H100 SXM", "NVIDIA H200": "NVIDIA H200", "NVIDIA A100": "NVIDIA A100-SXM4-80GB"}


def test_the_catalogs_peaks_are_the_tables():
    accelerators = catalog.performance()["accelerators"]
    assert set(accelerators) == set(PARTS), "a new accelerator in the catalog: name its part here"
    for name, facts in accelerators.items():
        found = shapes.table_peak(PARTS[name], "bfloat16")
        assert found is not None, f"{name} is in the catalog and not in PEAK_TFLOPS"
        assert facts["bf16_dense_tflops"] == found[0], (name, facts, found)
