"""LIST pages read in one C pass (`s3_list`): the same fields, keys and times botocore reads,
any key a bucket writer can put included, and botocore's own parse wherever this one cannot."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import botocore.session
import pytest
from botocore.handlers import decode_list_object_v2
from botocore.parsers import create_parser

from slime_stoa.protocol.store.s3 import S3Store
from slime_stoa.protocol.store.s3_list import EVENT, parse_list_page, read_list_answer
from tests.s3server import LocalS3Server, random_bucket_name

NS = "http://s3.amazonaws.com/doc/2006-03-01/"


def page_xml(*, keys: list[str], truncated: bool, token: str | None = None, encoded: bool = True) -> bytes:
    """A ListObjectsV2 answer as S3 writes it (keys URL-encoded when `encoded`)."""
    contents = "".join(
        f"<Contents><Key>{key}</Key><LastModified>2026-12-06T03:0{i % 10}:54.{i:03d}Z</LastModified>"
        f"<ETag>&quot;{i:032x}&quot;</ETag><Size>{i * 7}</Size><StorageClass>STANDARD</StorageClass></Contents>"
        for i, key in enumerate(keys)
    )
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{NS}"><Name>b</Name><Prefix>p%2F</Prefix>'
        f"<KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>"
        + ("<EncodingType>url</EncodingType>" if encoded else "")
        + f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{contents}"
        + (f"<NextContinuationToken>{token}</NextContinuationToken>" if token else "")
        + "</ListBucketResult>"
    ).encode()


def botocore_reads(body: bytes) -> dict[str, Any]:
    """What botocore's own parser and URL-decoding handler make of `body`."""
    shape = botocore.session.get_session().get_service_model("s3").operation_model("ListObjectsV2").output_shape
    parsed = create_parser("rest-xml").parse({"body": body, "headers": {}, "status_code": 200}, shape)
    decode_list_object_v2(parsed, context={"encoding_type_auto_set": True})
    return parsed


def fields(page: dict[str, Any]) -> dict[str, Any]:
    """What `S3Store.list` reads of a page."""
    return {
        "Contents": [{k: c.get(k) for k in ("Key", "Size", "ETag", "LastModified")} for c in page.get("Contents", ())],
        "IsTruncated": bool(page.get("IsTruncated")),
        "NextContinuationToken": page.get("NextContinuationToken"),
    }


@pytest.mark.parametrize("encoded", [True, False])
def test_a_page_reads_as_botocore_reads_it(encoded: bool) -> None:
    keys = ["p%2F1765000000000-mac-a-0000000001.rec", "p%2Fsp%20ace", "p%2F%C3%BCn%C3%AF", "p%2Fa%2Bb", "p%2Fx%26y"]
    if not encoded:
        keys = ["p/1765000000000-mac-a-0000000001.rec", "p/a+b", "p/x&amp;y"]
    for truncated, token in ((True, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM="), (False, None)):
        body = page_xml(keys=keys, truncated=truncated, token=token, encoded=encoded)
        ours = parse_list_page(body)
        assert ours is not None
        decode_list_object_v2(ours, context={"encoding_type_auto_set": True})
        assert fields(ours) == fields(botocore_reads(body))
    assert fields(ours)["Contents"][1]["Key"] == ("p/sp ace" if encoded else "p/a+b")


def test_an_empty_page_and_one_without_a_namespace() -> None:
    empty = page_xml(keys=[], truncated=False)
    assert fields(parse_list_page(empty) or {}) == fields(botocore_reads(empty))
    bare = b"<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>k</Key><Size>3</Size></Contents></ListBucketResult>"
    assert fields(parse_list_page(bare) or {}) == fields(botocore_reads(bare))


def test_a_declared_encoding_is_read_as_botocore_reads_it() -> None:
    body = page_xml(keys=["p/\u00fc"], truncated=False, encoded=False).replace(b"UTF-8", b"ISO-8859-1")
    ours = parse_list_page(body)
    assert ours is not None and fields(ours) == fields(botocore_reads(body))
    assert ours["Contents"][0]["Key"] == "p/\u00fc"


@pytest.mark.parametrize(
    "body",
    [
        b"not xml <",
        # children outside the root's namespace: botocore reads them, this pass would not
        b'<s:ListBucketResult xmlns:s="urn:x"><IsTruncated>true</IsTruncated><Contents><Key>k</Key><Size>1</Size>'
        b"</Contents></s:ListBucketResult>",
        b"<Error><Code>SlowDown</Code></Error>",
        page_xml(keys=["k"], truncated=False).replace(b"<Size>0</Size>", b""),  # no size
        page_xml(keys=["k"], truncated=False).replace(b"<Size>0</Size>", b"<Size>zero</Size>"),
        page_xml(keys=["k"], truncated=False).replace(b"2026-12-06T03:00:54.000Z", b"yesterday"),
    ],
)
def test_what_it_cannot_read_whole_is_left_to_botocore(body: bytes) -> None:
    assert parse_list_page(body) is None
    answer: dict[str, Any] = {"status_code": 200, "body": body}
    custom: dict[str, Any] = {}
    read_list_answer(answer, custom)
    assert answer["body"] == body and custom == {}


def test_only_a_successful_answer_is_taken() -> None:
    body = page_xml(keys=["k"], truncated=False)
    refused: dict[str, Any] = {"status_code": 403, "body": body}
    read_list_answer(refused, {})
    assert refused["body"] == body
    taken: dict[str, Any] = {"status_code": 200, "body": body}
    custom: dict[str, Any] = {}
    read_list_answer(taken, custom)
    assert taken["body"] == b"" and [c["Key"] for c in custom["Contents"]] == ["k"]


@pytest.fixture
async def s3store(s3_server: LocalS3Server, s3_bucket: str) -> AsyncIterator[S3Store]:
    async with s3_server.store(s3_bucket, f"t/{random_bucket_name('l')}") as s:
        yield s


async def test_a_real_servers_pages_list_the_same_with_and_without_it(s3_server: LocalS3Server, s3store: S3Store) -> None:
    """Keys a bucket writer puts with its own S3 client (any characters), over several pages:
    listed the same through this module as through botocore's parser."""
    raw = s3_server.client()
    root = s3store._root
    odd = ["sp ace", "per%cent", "ünï", "a+b", "x&y", "q?uery", "tab\there", "1765000000000-mac-a-0000000001.rec"]
    for name in odd:
        raw.put_object(Bucket=s3store.bucket, Key=f"{root}r/{name}", Body=name.encode())
    s3store._list_page_size = 3  # several pages, continuation tokens included

    async def listing() -> list[tuple[str, int, str, float | None]]:
        return [(i.key, i.size, i.etag, i.last_modified) async for i in s3store.list("r/")]

    fast = await listing()
    client = await s3store._s3()
    client.meta.events.unregister(EVENT, read_list_answer)
    try:
        slow = await listing()
    finally:
        client.meta.events.register(EVENT, read_list_answer)
    assert fast == slow
    assert sorted(key.removeprefix("r/") for key, *_ in fast) == sorted(odd)
    assert all(modified is not None for *_, modified in fast)
