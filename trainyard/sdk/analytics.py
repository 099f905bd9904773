"""SageMaker's `TrainingJobAnalytics`: a job's metrics (its `metrics.jsonl` rows and the lines that
matched `metric_definitions`) as a long table of (timestamp, metric_name, value)."""
from __future__ import annotations

from trainyard.sdk.backends import open_job


class TrainingJobAnalytics:
    """SageMaker's `TrainingJobAnalytics(training_job_name, metric_names=None)`: the job's metrics as a
    table. `dataframe()` gives pandas' DataFrame (columns timestamp, metric_name, value); `rows()` the same
    as dicts."""

    def __init__(self, training_job_name: str, metric_names: list[str] | None = None, sagemaker_session=None,
                 start_time=None, end_time=None, period=None):
        self.name = training_job_name
        self._job = open_job(training_job_name)
        self._metric_names = metric_names

    def rows(self) -> list[dict]:
        out = []
        start = None
        for row in self._job.metrics():
            t = row.get("timestamp")
            start = t if start is None and t is not None else start
            for k, v in row.items():
                if k in ("timestamp", "step") or not isinstance(v, (int, float)) or isinstance(v, bool):
                    continue
                if self._metric_names is None or k in self._metric_names:
                    rel = None if t is None or start is None else t - start
                    out.append({"timestamp": rel if rel is not None else row.get("step"), "metric_name": k,
                                "value": float(v)})
        return out

    def dataframe(self, force_refresh: bool = False):
        import pandas as pd  # a dependency, imported only here: the SDK's import stays light

        return pd.DataFrame(self.rows(), columns=["timestamp", "metric_name", "value"])
