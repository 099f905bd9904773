"""What a job records besides its metrics rows: TensorBoard event files and profiler traces, one typed value each in
the JobSpec (validated once, when the Estimator is built; the contract, the driver and the report read them).

- `TensorBoardOutput` is SageMaker's `TensorBoardOutputConfig`: the container folder `container_local_output_path`
  (default `/opt/ml/output/tensorboard`, SageMaker's) is synced while the job runs to
  `<s3_output_path>/<job>/tensorboard-output/`, SageMaker's layout (its `latest_job_tensorboard_artifacts_path()`).
- `Profiler`: torch.profiler over `steps` on `ranks`, its Chrome traces (and, on CUDA, memory snapshots) written to
  `local_path` (default `/opt/ml/output/profiler`, SageMaker's) and synced to
  `<s3_output_path or output_path>/<job>/profiler-output/` (SageMaker's `latest_job_profiler_artifacts_path()`).

Steps are counted as the engine counts them: the first step is 1 (`te.mark_step(1)`, the built-in trainer's
`step 1/N`).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

from trainyard.job.uris import check_s3_uri, check_storage_uri, join

DEFAULT_TENSORBOARD_PATH = "/opt/ml/output/tensorboard"
DEFAULT_PROFILER_PATH = "/opt/ml/output/profiler"
# SageMaker's folder names under `<s3_output_path>/<job>/`
TENSORBOARD_FOLDER = "tensorboard-output"
PROFILER_FOLDER = "profiler-output"
# a trace of every operator of a few steps is tens of MB per rank; more steps than this is a mistake, not a plan
MAX_PROFILED_STEPS = 50


def _absolute(v: object, example: str) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise ValueError(f"must be an absolute path inside the container such as '{example}', got {v!r}")
    return v


class TensorBoardOutput(BaseModel):
    """SageMaker's `TensorBoardOutputConfig(s3_output_path, container_local_output_path)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    s3_output_path: str
    """Where the event files go: `<s3_output_path>/<job>/tensorboard-output/`."""
    container_local_output_path: str = DEFAULT_TENSORBOARD_PATH
    """The folder the job writes event files to (`tensorboardoutputconfig.json`'s `LocalPath`)."""

    @field_validator("s3_output_path", mode="before")
    @classmethod
    def _s3(cls, v: object) -> str:
        return check_s3_uri("tensorboard_output_config.s3_output_path", v)

    @field_validator("container_local_output_path", mode="before")
    @classmethod
    def _local(cls, v: object) -> str:
        return DEFAULT_TENSORBOARD_PATH if v is None else _absolute(v, DEFAULT_TENSORBOARD_PATH)

    def uri(self, job_name: str) -> str:
        return join(self.s3_output_path, job_name, TENSORBOARD_FOLDER)


class Profiler(BaseModel):
    """torch.profiler over some steps of some ranks (the Estimator's `profiler`, or SageMaker's `profiler_config`
    with `FrameworkProfile(start_step, num_steps)`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    steps: tuple[int, ...]
    """The steps profiled (the first step is 1), sorted; each run of consecutive steps is one trace."""
    ranks: tuple[int, ...] = (0,)
    """The global ranks profiled (each writes its own trace)."""
    s3_output_path: str | None = None
    """Where the traces go: `<s3_output_path>/<job>/profiler-output/`; default the job's `output_path`."""
    local_path: str = DEFAULT_PROFILER_PATH
    """The folder the engine writes the traces to in the container."""

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, v: object) -> tuple[int, ...]:
        steps = _whole_numbers(v, minimum=1, example="[5, 6]")
        if not steps:
            raise ValueError("give at least one step to profile, such as [5, 6]")
        if len(steps) > MAX_PROFILED_STEPS:
            raise ValueError(f"{len(steps)} steps; profile at most {MAX_PROFILED_STEPS} (a trace holds every "
                             "operator: a few steps show a steady state)")
        return steps

    @field_validator("ranks", mode="before")
    @classmethod
    def _ranks(cls, v: object) -> tuple[int, ...]:
        ranks = _whole_numbers(v, minimum=0, example="[0]")
        if not ranks:
            raise ValueError("give at least one rank to profile, such as [0]")
        return ranks

    @field_validator("s3_output_path", mode="before")
    @classmethod
    def _s3(cls, v: object) -> str | None:
        return None if v is None else check_storage_uri("profiler.s3_output_path", v)

    @field_validator("local_path", mode="before")
    @classmethod
    def _local(cls, v: object) -> str:
        return DEFAULT_PROFILER_PATH if v is None else _absolute(v, DEFAULT_PROFILER_PATH)

    def uri(self, output_path: str, job_name: str) -> str:
        return join(self.s3_output_path or output_path, job_name, PROFILER_FOLDER)

    def runs(self) -> list[tuple[int, int]]:
        """The runs of consecutive steps, (first, last) each: one trace per run and rank."""
        out: list[tuple[int, int]] = []
        for s in self.steps:
            if out and s == out[-1][1] + 1:
                out[-1] = (out[-1][0], s)
            else:
                out.append((s, s))
        return out


def _whole_numbers(v: object, *, minimum: int, example: str) -> tuple[int, ...]:
    """A list of distinct whole numbers >= minimum, sorted."""
    if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
        raise ValueError(f"expected a list of whole numbers such as {example}, got {v!r}")
    items = list(v)
    bad = [x for x in items if isinstance(x, bool) or not isinstance(x, int) or x < minimum]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a whole number >= {minimum}; give a list such as {example}")
    dup = sorted({x for x in items if items.count(x) > 1})
    if dup:
        raise ValueError(f"{dup} given more than once")
    return tuple(sorted(items))
