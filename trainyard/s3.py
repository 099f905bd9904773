"""SageMaker's `sagemaker.s3` import path: `S3Uploader`, `S3Downloader`, `parse_s3_url`, `s3_path_join`.

They go through a `trainyard.Session` (the one given as `sagemaker_session`, else `Session()`): the embedded store
when no AWS account is configured, real S3 through `Session(boto_session=...)`, as the Session's own uploads do.
"""
from trainyard.sdk.s3 import S3Downloader, S3Uploader, parse_s3_url, s3_path_join

__all__ = ["S3Downloader", "S3Uploader", "parse_s3_url", "s3_path_join"]
