"""Store URLs and credentials: pure parsing and the env-file permission rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slime_stoa.protocol.store import StoreConfigError, open_store, parse_store_url
from slime_stoa.protocol.store.credentials import (
    load_credentials,
    parse_env_file,
    require_credentials,
)

pytestmark = pytest.mark.both_backends  # the store itself: every test on both backends

ACCOUNT = "0123456789abcdef0123456789abcdef"


def test_file_url() -> None:
    loc = parse_store_url("file:///tmp/bucket")
    assert loc.scheme == "file" and loc.path == Path("/tmp/bucket")


def test_s3_url_with_endpoint_and_prefix() -> None:
    loc = parse_store_url("s3://my-bucket/some/prefix/?endpoint=http://127.0.0.1:9000&region=eu-west-1", {})
    assert (loc.bucket, loc.prefix, loc.endpoint_url, loc.region) == (
        "my-bucket",
        "some/prefix",
        "http://127.0.0.1:9000",
        "eu-west-1",
    )


def test_s3_endpoint_from_environment() -> None:
    loc = parse_store_url("s3://bkt", {"STOA_S3_ENDPOINT": "https://minio.local"})
    assert loc.endpoint_url == "https://minio.local" and loc.prefix == ""


def test_r2_url_derives_endpoint() -> None:
    loc = parse_store_url(f"r2://{ACCOUNT}/runs-bucket/team/a", {})
    assert loc.endpoint_url == f"https://{ACCOUNT}.r2.cloudflarestorage.com"
    assert (loc.bucket, loc.prefix, loc.region) == ("runs-bucket", "team/a", "auto")


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://x", "unsupported store URL"),
        ("file://", "names no folder"),
        ("s3://Bad_Bucket/x", "not a valid bucket name"),
        ("r2://not-an-account/bkt", "not an R2 account id"),
        ("s3://bkt/x?endpoint=localhost:9000", "must start with http"),
        ("s3://bkt/x?colour=red", "unknown option"),
        ("s3://bkt/a/../b", "invalid key prefix"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_store_url(url, {})


def test_env_file_parsing() -> None:
    text = "# comment\nexport AWS_ACCESS_KEY_ID=abc\nAWS_SECRET_ACCESS_KEY='s e c'\n\n"
    assert parse_env_file(text) == {"AWS_ACCESS_KEY_ID": "abc", "AWS_SECRET_ACCESS_KEY": "s e c"}
    with pytest.raises(ValueError, match="line 1"):
        parse_env_file("not a pair")


def test_credentials_from_environment_hide_the_secret() -> None:
    creds = load_credentials("s3", {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "topsecret"})
    assert creds is not None and creds.secret_access_key == "topsecret"
    assert "topsecret" not in repr(creds) and "topsecret" not in str(creds)


def test_env_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    env_file = tmp_path / "r2env"
    env_file.write_text("R2_ACCESS_KEY_ID=id\nR2_SECRET_ACCESS_KEY=secret\n")
    env_file.chmod(0o644)
    with pytest.raises(StoreConfigError, match="chmod 600"):
        load_credentials("r2", {"STOA_ENV_FILE": str(env_file)})
    env_file.chmod(0o600)
    creds = load_credentials("r2", {"STOA_ENV_FILE": str(env_file)})
    assert creds is not None and creds.access_key_id == "id" and creds.source == str(env_file)


def test_env_file_without_keys_is_refused(tmp_path: Path) -> None:
    env_file = tmp_path / "env"
    env_file.write_text("OTHER=1\n")
    env_file.chmod(0o600)
    with pytest.raises(StoreConfigError, match="must set an access key"):
        load_credentials("s3", {"STOA_ENV_FILE": str(env_file)})


def test_missing_credentials_say_how_to_set_them(tmp_path: Path) -> None:
    env = {"STOA_ENV_FILE": str(tmp_path / "absent")}
    with pytest.raises(StoreConfigError, match="does not exist"):
        require_credentials("s3", "s3://bkt", env)
    with pytest.raises(StoreConfigError, match="AWS_ACCESS_KEY_ID"):
        open_store("s3://bkt/x", environ={"HOME": str(tmp_path)} | {"STOA_ENV_FILE": ""})


def test_store_import_is_light() -> None:
    code = (
        "import sys, slime_stoa.protocol.store, slime_stoa.protocol.layout;"
        "heavy = [m for m in ('torch', 'mlx', 'slime', 'aiobotocore', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
