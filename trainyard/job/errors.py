"""The errors a user sees. Each names what is wrong and how to fix it."""


class ConfigError(ValueError):
    """Bad input, found before anything is uploaded, provisioned or started.

    `field` is the Estimator/fit argument at fault (dotted for nested values: `inputs.train`).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class JobFailedError(RuntimeError):
    """A training job ended Failed (or ran past max_run). `describe()` holds the same FailureReason."""

    def __init__(self, job_name: str, status: str, reason: str):
        self.job_name = job_name
        self.status = status
        self.reason = reason
        super().__init__(f"training job {job_name} {status}: {reason}")


class ImageError(RuntimeError):
    """Building or pushing the training image failed: no builder, the builder failed, a registry refused."""
