"""Store URLs: where a run's bucket lives.

- `file:///abs/dir` or `file://rel/dir` — a local folder (the zero-setup default).
- `s3://bucket/prefix` — any S3-compatible service. The endpoint comes from `?endpoint=URL`, else
  `STOA_S3_ENDPOINT` / `AWS_ENDPOINT_URL`, else AWS. Region from `?region=`, else `AWS_REGION`,
  else `us-east-1`.
- `r2://<account-id>/<bucket>/prefix` — Cloudflare R2; the endpoint is derived from the account id.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ACCOUNT = re.compile(r"^[0-9a-f]{32}$")
SCHEMES = ("file", "s3", "r2")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreLocation:
    scheme: str  # "file", "s3" or "r2"
    url: str  # the URL as given, for messages
    path: Path | None = None  # file: the root folder
    bucket: str = ""
    prefix: str = ""  # key prefix inside the bucket, no leading/trailing '/'
    endpoint_url: str | None = None
    region: str = "us-east-1"


def _clean_prefix(raw: str) -> str:
    prefix = raw.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"invalid key prefix {raw!r}")
    return prefix


def parse_store_url(url: str, environ: Mapping[str, str] | None = None) -> StoreLocation:
    """Parse a store URL into a StoreLocation; ValueError with the accepted forms if it is bad."""
    env = os.environ if environ is None else environ
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(
            f"unsupported store URL {url!r}: use file:///path/to/dir, s3://bucket/prefix "
            f"(with ?endpoint=https://host for non-AWS services) or r2://<account-id>/<bucket>/prefix"
        )
    if scheme == "file":
        if not rest:
            raise ValueError(f"store URL {url!r} names no folder: use file:///path/to/dir")
        return StoreLocation(scheme="file", url=url, path=Path(rest).expanduser())

    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"endpoint", "region"}
    if unknown:
        raise ValueError(f"store URL {url!r}: unknown option(s) {sorted(unknown)}; known: endpoint, region")
    path_parts = parts.path.strip("/")
    if scheme == "s3":
        bucket, prefix = parts.netloc, path_parts
        endpoint = query.get("endpoint") or env.get("STOA_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL")
        region = query.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    else:
        account = parts.netloc
        if not _ACCOUNT.match(account):
            raise ValueError(
                f"store URL {url!r}: {account!r} is not an R2 account id (32 hex characters, shown "
                f"in the Cloudflare dashboard under R2); the form is r2://<account-id>/<bucket>/prefix"
            )
        bucket, _, prefix = path_parts.partition("/")
        endpoint = query.get("endpoint") or f"https://{account}.r2.cloudflarestorage.com"
        region = query.get("region") or "auto"
    if not _BUCKET.match(bucket or ""):
        raise ValueError(
            f"store URL {url!r}: {bucket!r} is not a valid bucket name "
            f"(3-63 lowercase letters, digits, '.' or '-')"
        )
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"store URL {url!r}: endpoint {endpoint!r} must start with http:// or https://")
    return StoreLocation(
        scheme=scheme,
        url=url,
        bucket=bucket,
        prefix=_clean_prefix(prefix),
        endpoint_url=endpoint,
        region=region,
    )
