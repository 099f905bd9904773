import pytest


@pytest.fixture
def src(tmp_path):
    """A source folder holding a one-line `train.py`."""
    d = tmp_path / "src"
    d.mkdir()
    (d / "train.py").write_text("print('hi')\n")
    return str(d)
