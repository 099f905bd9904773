"""`trainyard.s3` (SageMaker's `sagemaker.s3`): static uploads, downloads, reads and listings of s3:// URIs through a
Session (sdk/session.py): the embedded store locally, real S3 through `Session(boto_session=...)`."""
from __future__ import annotations


from trainyard.sdk.session import Session


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/key` -> (bucket, key)."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"expecting an s3:// URL, got {url!r}")
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return bucket, key


def s3_path_join(*args: str, with_end_slash: bool = False) -> str:
    """Joins URI parts with single slashes, keeping a leading `s3://`; empty parts are skipped."""
    parts = [str(a) for a in args if a]
    if not parts:
        return ""
    head = "s3://" if parts[0].startswith("s3://") else ""
    parts[0] = parts[0][len(head):]
    path = head + "/".join(p.strip("/") for p in parts if p.strip("/"))
    return path + "/" if with_end_slash else path


def _session(sagemaker_session) -> Session:
    return sagemaker_session if sagemaker_session is not None else Session()


class S3Uploader:
    @staticmethod
    def upload(local_path: str, desired_s3_uri: str, kms_key: str | None = None, sagemaker_session=None,
               callback=None) -> str:
        """A file, or a folder's files, under `desired_s3_uri`; returns the URI (of the file for a file)."""
        bucket, prefix = parse_s3_url(desired_s3_uri)
        return _session(sagemaker_session).upload_data(local_path, bucket=bucket, key_prefix=prefix, callback=callback)

    @staticmethod
    def upload_string_as_file_body(body: str, desired_s3_uri: str, kms_key: str | None = None,
                                   sagemaker_session=None) -> str:
        bucket, key = parse_s3_url(desired_s3_uri)
        return _session(sagemaker_session).upload_string_as_file_body(body, bucket, key)

    @staticmethod
    def upload_bytes(b: bytes, s3_uri: str, kms_key: str | None = None, sagemaker_session=None) -> str:
        bucket, key = parse_s3_url(s3_uri)
        _session(sagemaker_session)._s3().put_object(Bucket=bucket, Key=key, Body=bytes(b))
        return s3_uri


class S3Downloader:
    @staticmethod
    def download(s3_uri: str, local_path: str, kms_key: str | None = None, sagemaker_session=None) -> list[str]:
        """Every object under `s3_uri` into the folder `local_path`; returns the files written."""
        bucket, prefix = parse_s3_url(s3_uri)
        return _session(sagemaker_session).download_data(local_path, bucket, prefix)

    @staticmethod
    def read_file(s3_uri: str, sagemaker_session=None) -> str:
        bucket, key = parse_s3_url(s3_uri)
        return _session(sagemaker_session).read_s3_file(bucket, key)

    @staticmethod
    def read_bytes(s3_uri: str, sagemaker_session=None) -> bytes:
        bucket, key = parse_s3_url(s3_uri)
        return _session(sagemaker_session)._s3().get_object(Bucket=bucket, Key=key)["Body"].read()

    @staticmethod
    def list(s3_uri: str, sagemaker_session=None) -> list[str]:
        """The s3:// URIs of the objects under `s3_uri`."""
        bucket, prefix = parse_s3_url(s3_uri)
        return [f"s3://{bucket}/{k}" for k in _session(sagemaker_session).list_s3_files(bucket, prefix)
                if not k.endswith("/")]


__all__ = ["S3Downloader", "S3Uploader", "parse_s3_url", "s3_path_join"]
