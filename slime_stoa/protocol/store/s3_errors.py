"""What an S3 error says: its code, HTTP status and message, and whether another try may help."""

from __future__ import annotations

import asyncio

import aiohttp
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestThrottled",
        "BandwidthLimitExceeded",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "ConditionalRequestConflict",
    }
)
CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "Unauthorized",
        "Forbidden",
        "403",
        "401",
    }
)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def error_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def error_message(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")) or str(exc)


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, timeouts and dropped connections: worth another try."""
    if isinstance(exc, ClientError):
        code, status = error_code(exc), error_status(exc)
        if status == 409:
            return code == "ConditionalRequestConflict"
        return code in RETRY_CODES or status == 429 or status >= 500
    if isinstance(exc, SSLError):
        return False  # a TLS setup problem does not heal by retrying
    return isinstance(
        exc,
        (
            BotoConnectionError,
            HTTPClientError,
            IncompleteReadError,
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ConnectionError,
        ),
    )
