"""One async object store over a local folder, any S3-compatible service, or Cloudflare R2.

    async with open_store("file:///tmp/bucket") as store:
        etag = await store.put_if_absent("runs/demo/run.json", b"{}")

See `base.Store` for the operations and the commit rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .base import (
    GetResult,
    NotFound,
    ObjectInfo,
    PreconditionFailed,
    ServerDate,
    Store,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
)
from .credentials import Credentials, load_credentials, require_credentials
from .url import StoreLocation, parse_store_url

__all__ = [
    "Credentials",
    "GetResult",
    "NotFound",
    "ObjectInfo",
    "PreconditionFailed",
    "ServerDate",
    "Store",
    "StoreConfigError",
    "StoreError",
    "StoreLocation",
    "StoreUnavailable",
    "load_credentials",
    "open_store",
    "parse_store_url",
]


def open_store(
    url: str,
    *,
    credentials: Credentials | None = None,
    environ: Mapping[str, str] | None = None,
    create: bool = False,
) -> Store:
    """Open the store at `url` (see `url.parse_store_url` for the forms).

    `create=True` creates a missing local folder (buckets are never created implicitly).
    Credentials for s3:// and r2:// come from the environment or an env file unless given.
    """
    location = parse_store_url(url, environ)
    if location.scheme == "file":
        from .local import LocalStore

        assert location.path is not None
        if create:
            Path(location.path).mkdir(parents=True, exist_ok=True)
        return LocalStore(location.path, url=url)

    creds = credentials or require_credentials(location.scheme, url, environ)
    from .s3 import S3Store  # aiobotocore is only imported when a bucket is used

    return S3Store(
        bucket=location.bucket,
        prefix=location.prefix,
        endpoint_url=location.endpoint_url,
        region=location.region,
        credentials=creds,
        url=url,
    )
