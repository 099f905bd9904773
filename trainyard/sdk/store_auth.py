"""Who may use the embedded store: its owner's key, checked on every request.

The store listens on 127.0.0.1, which every local user can reach. So the first use creates a random key pair
for this user (`credentials`: `$TRAINYARD_HOME/store/credentials.json`, mode 0600 in a 0700 folder), the SDK
and the jobs it starts sign their requests with it (boto3, s3fs and the AWS CLI sign with AWS Signature
Version 4), and the server (`store_server.py`) refuses every request whose signature is not this key's
(`verify`): no signature, another key, a wrong signature, a request older than 15 minutes, a body that is not
the one signed. What this does not protect: anyone who can read the owner's files (root, or the owner's other
processes) can read the key; a request's body sent with an unsigned payload hash (`UNSIGNED-PAYLOAD`, or
aws-chunked streaming) is covered by its signed headers only.

Signature Version 4 (AWS's "Create a signed AWS API request"): the signature is HMAC-SHA256, under a key
derived from the secret, the date, the region and the service, of the string
"AWS4-HMAC-SHA256\\n<X-Amz-Date>\\n<scope>\\n<sha256 of the canonical request>", where the canonical request is
the method, the URI-encoded path (as sent: S3 does not normalise it), the sorted URI-encoded query (without
X-Amz-Signature), the signed headers with trimmed values, their names, and the payload's hash
(`x-amz-content-sha256` for S3; the other services, EC2 and CloudWatch Logs here, send no such header and the
hash is the body's own). Presigned URLs carry the same fields in the query, with an unsigned payload.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote

CREDENTIALS_FILE = "credentials.json"
MAX_SKEW_S = 15 * 60  # S3 refuses requests whose X-Amz-Date is further off than this (RequestTimeTooSkewed)
_UNSIGNED = ("UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
             "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER", "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD",
             "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD-TRAILER")


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key_id: str
    secret_access_key: str

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key}


def private_folder(path: str) -> None:
    """Create `path` if needed and make it the owner's alone (0700)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def credentials(root: str) -> Credentials:
    """This user's store key, created on first use (0600 file in the 0700 store folder; created whole with
    O_EXCL, so two processes starting at once agree on one key)."""
    private_folder(root)
    path = os.path.join(root, CREDENTIALS_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    tmp_key = Credentials("TY" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30))
    with os.fdopen(fd, "w") as fh:
        json.dump({"access_key_id": tmp_key.access_key_id, "secret_access_key": tmp_key.secret_access_key}, fh)
    return tmp_key


def _read(path: str) -> Credentials:
    for _ in range(100):  # another process created it an instant ago and is still writing it
        try:
            with open(path) as fh:
                data = json.load(fh)
            if os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)
            return Credentials(data["access_key_id"], data["secret_access_key"])
        except (ValueError, KeyError):
            import time

            time.sleep(0.02)
    raise RuntimeError(f"{path} is not a Trainyard store key file; remove it and its store restarts with a new key")


class Refused(Exception):
    """Why a request is refused: an S3 error code and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class NeedsBody(Exception):
    """The request passed every check but its signature, which covers its body's hash (not sent in a header)."""


def _uri_encode(text: str) -> str:
    return quote(text, safe="-_.~")


def _canonical_query(query: str, *, drop: str | None = None) -> str:
    pairs = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != drop]
    return "&".join(f"{_uri_encode(k)}={_uri_encode(v)}" for k, v in sorted(pairs))


def _header(environ: dict, name: str) -> str | None:
    key = {"content-type": "CONTENT_TYPE", "content-length": "CONTENT_LENGTH"}.get(name) or \
        "HTTP_" + name.upper().replace("-", "_")
    return environ.get(key)


def _signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    key = f"AWS4{secret}".encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def _fields(environ: dict, query: str) -> dict[str, str]:
    """The signature's fields, from the Authorization header or a presigned URL's query."""
    auth = _header(environ, "authorization")
    if auth:
        algorithm, _, rest = auth.partition(" ")
        if algorithm != "AWS4-HMAC-SHA256":
            raise Refused("AccessDenied", "the store accepts AWS Signature Version 4 (AWS4-HMAC-SHA256) only")
        parts = dict(p.strip().partition("=")[::2] for p in rest.split(","))
        fields = {"credential": parts.get("Credential", ""), "signed": parts.get("SignedHeaders", ""),
                  "signature": parts.get("Signature", ""), "date": _header(environ, "x-amz-date") or "",
                  "payload": _header(environ, "x-amz-content-sha256") or "", "presigned": ""}
    else:
        q = dict(parse_qsl(query, keep_blank_values=True))
        if "AWSAccessKeyId" in q:
            raise Refused("AccessDenied", "Signature Version 2 is not accepted: presign with Version 4 (boto3: "
                                          "Config(signature_version='s3v4'))")
        if q.get("X-Amz-Algorithm") != "AWS4-HMAC-SHA256":
            raise Refused("AccessDenied", "the request is not signed: use the store's key (`trainyard store creds`)")
        fields = {"credential": q.get("X-Amz-Credential", ""), "signed": q.get("X-Amz-SignedHeaders", ""),
                  "signature": q.get("X-Amz-Signature", ""), "date": q.get("X-Amz-Date", ""),
                  "payload": "UNSIGNED-PAYLOAD", "presigned": q.get("X-Amz-Expires", "0")}
    return fields


def verify(environ: dict, body: bytes | None, creds: Credentials, now: datetime.datetime | None = None, *,
           hosts: tuple[str, ...] = ()) -> str:
    """Refused unless the WSGI request `environ` is signed with `creds`, for a host in `hosts` (when given: a
    request signed for another address, captured there, is not replayed here). `body`: the request's body, checked
    against the payload hash the signature covers; None checks the signature only (before a body is read, so
    that a request without the key costs no memory) and returns the hash to check the body against ("" when the
    payload is unsigned)."""
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ.get("PATH_INFO", "/")
    path, _, query = raw.partition("?")
    fields = _fields(environ, query)
    akid, _, scope = fields["credential"].partition("/")
    if akid != creds.access_key_id:
        raise Refused("InvalidAccessKeyId", "the access key is not this store's: use `trainyard store creds`")
    date, region, service, terminal = (scope.split("/") + ["", "", "", ""])[:4]
    if terminal != "aws4_request" or not fields["date"].startswith(date):
        raise Refused("AuthorizationHeaderMalformed", f"bad credential scope {scope!r}")
    try:
        signed_at = datetime.datetime.strptime(fields["date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        raise Refused("AccessDenied", f"bad X-Amz-Date {fields['date']!r}") from None
    now = now or datetime.datetime.now(datetime.timezone.utc)
    age = (now - signed_at).total_seconds()
    try:
        limit = int(fields["presigned"]) if fields["presigned"] else MAX_SKEW_S
    except ValueError:
        raise Refused("AuthorizationQueryParametersError", "X-Amz-Expires must be a number of seconds") from None
    if age > limit or age < -MAX_SKEW_S:
        raise Refused("RequestTimeTooSkewed" if not fields["presigned"] else "AccessDenied",
                      "the request's signature is too old (or dated in the future)")
    names = [n for n in fields["signed"].split(";") if n]
    if "host" not in names:
        raise Refused("AccessDenied", "the signature must cover the host header")
    if hosts and (_header(environ, "host") or "") not in hosts:
        raise Refused("AccessDenied", "the request was signed for another address than this store's")
    headers = "".join(f"{n}:{' '.join((_header(environ, n) or '').split())}\n" for n in names)
    payload = fields["payload"]
    if not payload:  # the services other than S3 (EC2, CloudWatch Logs) sign the body's hash without sending it
        if body is None:
            raise NeedsBody("the request's payload hash is not in a header: its body is needed to check it")
        payload = hashlib.sha256(body).hexdigest()
    if payload not in _UNSIGNED and body is not None:
        check_body(body, payload)
    canonical = "\n".join([environ.get("REQUEST_METHOD", "GET"), path or "/",
                           _canonical_query(query, drop="X-Amz-Signature" if fields["presigned"] else None),
                           headers, ";".join(names), payload])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", fields["date"], scope, hashlib.sha256(canonical.encode()).hexdigest()])
    want = hmac.new(_signing_key(creds.secret_access_key, date, region, service), to_sign.encode(),
                    hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, fields["signature"]):
        raise Refused("SignatureDoesNotMatch", "the request's signature is not the store key's")
    return "" if payload in _UNSIGNED else payload


def check_body(body: bytes, payload_hash: str) -> None:
    if hashlib.sha256(body).hexdigest() != payload_hash:
        raise Refused("XAmzContentSHA256Mismatch", "the body is not the one the request signed")


def proof(creds: Credentials, nonce: str) -> str:
    """What the store answers to a health check's nonce: only the holder of the secret can compute it, so a client
    tells its own store from another user's server on the same port."""
    return hmac.new(creds.secret_access_key.encode(), b"trainyard-store-health\0" + nonce.encode(),
                    hashlib.sha256).hexdigest()
