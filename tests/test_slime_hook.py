"""The slime trainer hook: bf16 bit extraction, settings, the synchronous publisher, the patch script.

slime itself is not installed in tests: `publish_weights` runs once against a tiny stand-in for
the three slime modules it imports, on a one-process Gloo group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slime_stoa.protocol.pulse.publisher import (
    PublishConflict,
    PublisherConfig,
    PublishError,
)
from slime_stoa.protocol.pulse.retry import DEFAULT_BACKOFF_S, DEFAULT_RETRIES, publish_with_retries
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.store import StoreUnavailable, open_store
from slime_stoa.trainer.slime import patching as aps
from slime_stoa.trainer.slime import publish as slime_hook
from slime_stoa.trainer.slime.publish import SyncPublisher, chunks_to_state
from slime_stoa.trainer.slime.settings import StoaSettings, leaves


def publisher_settings(args: Namespace) -> tuple[str, str, PublisherConfig]:
    settings = StoaSettings.from_args(args)
    return settings.bucket, settings.run, settings.publisher


def retry_settings(args: Namespace) -> tuple[int, float]:
    settings = StoaSettings.from_args(Namespace(stoa_bucket="file:///b", stoa_run="r", **vars(args)))
    return settings.publish_retries, settings.publish_backoff_s

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "patches" / "slime_publish_weights.patch"
TARGET = "slime/backends/megatron_utils/actor.py"




# -- chunks_to_state ------------------------------------------------------------------------------
def bf16_from_bits(bits: np.ndarray):
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


SPECIAL_BF16 = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x8001, 0x3F80], np.uint16)


def test_bf16_tensors_keep_their_exact_bits_in_every_shape() -> None:
    rng = np.random.default_rng(0)
    shapes = {"scalar": (), "empty": (0, 5), "vector": (17,), "matrix": (8, 12), "cube": (2, 3, 4)}
    chunk, expected = [], {}
    for name, shape in shapes.items():
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)  # every pattern, NaN payloads too
        chunk.append((name, bf16_from_bits(bits)))
        expected[name] = bits
    chunk.append(("special", bf16_from_bits(SPECIAL_BF16)))
    expected["special"] = SPECIAL_BF16
    state = chunks_to_state([chunk[:3], chunk[3:]])
    assert state.keys() == expected.keys()
    for name, bits in expected.items():
        assert state[name].dtype == np.uint16 and state[name].shape == bits.shape
        assert np.array_equal(state[name], bits), name


def test_float_tensors_match_torchs_bf16_cast() -> None:
    values = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3.3e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32)
    f32 = torch.from_numpy(np.concatenate([values, np.random.default_rng(1).standard_normal(1000).astype(np.float32)]))
    f16 = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 65504.0, 6e-8], dtype=torch.float16)
    wide = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # not contiguous
    state = chunks_to_state([[("f32", f32), ("f16", f16), ("wide", wide)]])
    for name, tensor in (("f32", f32), ("f16", f16), ("wide", wide)):
        reference = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        assert state[name].shape == tuple(tensor.shape)
        assert np.array_equal(state[name], reference), name
    # Finite values: round to nearest even on the top 16 bits of the float32 pattern.
    u = values[np.isfinite(values)].view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(state["f32"][: len(values)][np.isfinite(values)], rne)
    assert state["f32"][2] == 0x7F80 and state["f32"][3] == 0xFF80 and state["f32"][1] == 0x8000


def test_state_does_not_alias_the_source_tensor() -> None:
    source = bf16_from_bits(np.arange(6, dtype=np.uint16))
    state = chunks_to_state([[("w", source)]])
    source.view(torch.int16).fill_(7)
    assert np.array_equal(state["w"], np.arange(6, dtype=np.uint16))


@pytest.mark.parametrize(
    "chunks, match",
    [
        ([[("w", torch.zeros(2))], [("w", torch.ones(2))]], "duplicate HF tensor 'w'"),
        ([[("q", torch.zeros(2, dtype=torch.int8))]], "dtype torch.int8"),
        ([[("n", np.zeros(2))]], "expected a torch.Tensor"),
        ([[], []], "no weight tensors"),
    ],
)
def test_chunks_to_state_rejects_bad_chunks(chunks, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        chunks_to_state(chunks)


# -- settings -------------------------------------------------------------------------------------
def test_config_needs_bucket_and_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stoa_bucket"):
        publisher_settings(Namespace(stoa_run="r"))
    with pytest.raises(ValueError, match="stoa_run"):
        publisher_settings(Namespace(stoa_bucket=f"file://{tmp_path}"))
    with pytest.raises(ValueError, match="stoa_bucket: unsupported store URL"):
        publisher_settings(Namespace(stoa_bucket="ftp://x", stoa_run="r"))
    with pytest.raises(ValueError, match="stoa_run: invalid run name"):
        publisher_settings(Namespace(stoa_bucket=f"file://{tmp_path}", stoa_run="a/b"))


def test_config_reads_every_publisher_field(tmp_path: Path) -> None:
    keys = {leaf.key for leaf in leaves() if leaf.path[0] == "publisher"}
    assert keys == {"stoa_" + f.name for f in dataclasses.fields(PublisherConfig)}
    hf = tmp_path / "hf"
    hf.mkdir()
    url = "s3://bucket/prefix?endpoint=http://127.0.0.1:9"
    args = Namespace(stoa_bucket=url, stoa_run="run-1", hf_checkpoint=str(hf))
    assert publisher_settings(args) == (url, "run-1", PublisherConfig(extras_dir=hf))
    args = Namespace(
        stoa_bucket=url, stoa_run="run-1", hf_checkpoint=str(hf), stoa_anchor_every="10", stoa_anchor_fraction=0.25,
        stoa_catchup="false", stoa_catchup_budget="2", stoa_frame_bytes=1 << 20, stoa_shard_bytes=1 << 22,
        stoa_retain_anchors=0, stoa_extras_dir="", stoa_concurrency=2, stoa_threads=None,
    )
    _, _, config = publisher_settings(args)
    assert config == PublisherConfig(
        anchor_every=10, anchor_fraction=0.25, catchup=False, catchup_budget=2.0, frame_bytes=1 << 20,
        shard_bytes=1 << 22, retain_anchors=0, extras_dir=None, concurrency=2, threads=None,
    )
    for key, bad, match in [
        ("stoa_anchor_every", "often", "stoa_anchor_every must be an integer"),
        ("stoa_catchup", "maybe", "stoa_catchup must be true or false"),
        ("stoa_catchup_budget", -1, "stoa_catchup_budget: catchup_budget must be >= 0"),
        ("stoa_anchor_every", 0, "anchor_every must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            publisher_settings(Namespace(stoa_bucket=url, stoa_run="r", **{key: bad}))
    assert retry_settings(Namespace()) == (DEFAULT_RETRIES, DEFAULT_BACKOFF_S)
    assert retry_settings(Namespace(stoa_publish_retries=5, stoa_publish_backoff_s="0.5")) == (5, 0.5)
    with pytest.raises(ValueError, match="stoa_publish_retries"):
        retry_settings(Namespace(stoa_publish_retries=-1))


def test_waits_out_outages_retries_other_failures_but_never_a_conflict() -> None:
    calls, sleeps = [], []

    async def sleep(delay: float) -> None:
        sleeps.append(delay)

    def retried(op, retries: int, backoff_s: float):
        return asyncio.run(publish_with_retries(op, retries=retries, backoff_s=backoff_s, what="x", sleep=sleep))

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise PublishError("boom")
        return "ok"

    assert retried(flaky, 2, 0.5) == "ok"
    assert sleeps == [0.5, 1.0]  # doubling, no jitter
    calls.clear()
    with pytest.raises(PublishError, match="x failed after 2 attempt"):
        retried(flaky, 1, 0)

    async def long_outage() -> str:  # far more failed tries than `retries`: the outage is waited out
        calls.append(1)
        if len(calls) <= 40 and len(calls) % 2:
            raise StoreUnavailable("down")
        if len(calls) <= 40:  # as the publisher reports it: wrapped, with the outage as the cause
            raise PublishError("store down") from StoreUnavailable("down")
        return "ok"

    calls.clear()
    sleeps.clear()
    assert retried(long_outage, 1, 0) == "ok" and len(calls) == 41
    assert len(sleeps) == 40 and max(sleeps) <= 30.0  # backoff with jitter, capped

    async def conflict() -> None:
        calls.append(1)
        raise PublishConflict("another publisher")

    calls.clear()
    with pytest.raises(PublishConflict):
        retried(conflict, 5, 0)
    assert len(calls) == 1


# -- SyncPublisher on a real local store ----------------------------------------------------------
def model_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (64, 16), "model.norm.weight": (16,), "lm_head.weight": (64, 16)}
    return {n: rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for n, s in shapes.items()}


def perturb(state: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    new = {n: b.copy() for n, b in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        where = rng.random(flat.size) < 0.05
        flat[where] ^= 1
    return new


async def read_back(url: str, run: str) -> tuple[int | None, dict[str, np.ndarray] | None]:
    async with open_store(url) as store:
        sub = Subscriber(store, run)
        await sub.sync()
        return sub.version, sub.state


def assert_same(got: dict[str, np.ndarray] | None, want: dict[str, np.ndarray]) -> None:
    assert got is not None and got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_sync_publisher_publishes_versions_a_subscriber_reads(tmp_path: Path) -> None:
    url, run = f"file://{tmp_path / 'bucket'}", "hook-test"
    rng = np.random.default_rng(2)
    states = [model_state(rng)]
    states += [perturb(states[-1], rng)]
    states += [perturb(states[-1], rng)]
    with SyncPublisher(url, run, PublisherConfig(anchor_every=10), create=True) as pub:
        assert pub.open() is None
        results = [pub.publish(s) for s in states]
        assert [r.version for r in results] == [0, 1, 2]
        assert [r.anchored for r in results] == [True, False, False]
        assert 0 < results[1].density < 0.2 and results[1].patch_bytes < results[1].full_bytes
        assert "v1 anchored=False" in slime_hook.format_result(results[1])
    version, state = asyncio.run(read_back(url, run))
    assert version == 2
    assert_same(state, states[2])

    # A restarted trainer resumes from the bucket; a second publisher on the run is refused.
    with SyncPublisher(url, run, retries=3, backoff_s=60) as resumed, SyncPublisher(url, run) as rival:
        assert resumed.open() == 2 and rival.open() == 2
        states.append(perturb(states[-1], rng))
        assert resumed.publish(states[3]).version == 3
        with pytest.raises(PublishConflict):  # raised at once: the 60 s backoff would time the test out
            rival.publish(states[3])
    version, state = asyncio.run(read_back(url, run))
    assert version == 3
    assert_same(state, states[3])


# -- publish_weights against a stand-in for slime ------------------------------------------------
FAKE_SLIME = {
    "slime/__init__.py": "",
    "slime/utils/__init__.py": "",
    "slime/utils/accelerator.py": "def empty_cache():\n    pass\n",
    "slime/utils/distributed_utils.py": (
        "import torch.distributed as dist\n\ndef get_gloo_group():\n    return dist.group.WORLD\n"
    ),
    "slime/backends/__init__.py": "",
    "slime/backends/megatron_utils/__init__.py": "",
    "slime/backends/megatron_utils/update_weight/__init__.py": "",
    "slime/backends/megatron_utils/update_weight/hf_weight_iterator_direct.py": textwrap.dedent(
        """
        class HfWeightIteratorDirect:
            def __init__(self, args, model, model_name, quantization_config, transform_ue8m0=True):
                assert quantization_config is None
                self.model_name = model_name

            def get_hf_weight_chunks(self, megatron_local_weights, progress_desc="", should_convert_chunk=None):
                names = sorted(megatron_local_weights)
                for idx in range(0, len(names), 2):
                    convert = should_convert_chunk is None or should_convert_chunk(idx // 2)
                    yield [("model." + n, megatron_local_weights[n]) for n in names[idx : idx + 2]] if convert else []
        """
    ),
}


class FakeBackuper:
    def __init__(self, weights):
        self.weights = weights

    def get(self, tag: str):
        assert tag == "actor"
        return self.weights


class QwenConfig:  # stands for the HF config class whose lowercased name slime uses as model name
    pass


@pytest.fixture
def fake_slime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if importlib.util.find_spec("slime") is not None:
        pytest.skip("a real slime is importable; this test uses a stand-in")
    root = tmp_path / "fake_slime"
    for rel, text in FAKE_SLIME.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(root))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    monkeypatch.setattr(slime_hook, "_PUBLISHER", None)
    yield
    if slime_hook._PUBLISHER is not None:
        slime_hook._PUBLISHER.close()
    dist.destroy_process_group()
    for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
        del sys.modules[name]


def test_publish_weights_gathers_and_publishes(fake_slime, tmp_path: Path) -> None:
    """The synchronous path (`stoa_background_publish: false`); the background one is in
    tests/test_background_publish.py."""
    url, run = f"file://{tmp_path / 'bucket'}", "hook-e2e"
    (tmp_path / "bucket").mkdir()
    rng = np.random.default_rng(3)
    weights = {n: bf16_from_bits(b) for n, b in model_state(rng).items()}
    weights["extra.weight"] = torch.randn(5, dtype=torch.float32)
    actor = Namespace(weights_backuper=FakeBackuper(weights), hf_config=QwenConfig(), model=[object()])
    args = Namespace(
        stoa_publish=True, stoa_bucket=url, stoa_run=run, model_name=None, offload_train=False,
        stoa_background_publish=False,
    )
    first = slime_hook.publish_weights(actor, args)
    assert first is not None and first.version == 0 and first.anchored
    assert actor._stoa_hf_iterator.model_name == "qwenconfig"
    weights["model.norm.weight"] = weights["model.norm.weight"].clone().view(torch.int16).add_(1).view(torch.bfloat16)
    second = slime_hook.publish_weights(actor, args)
    assert second is not None and second.version == 1 and second.changed == weights["model.norm.weight"].numel()
    version, state = asyncio.run(read_back(url, run))
    assert version == 1
    assert_same(state, chunks_to_state([[("model." + n, t) for n, t in weights.items()]]))

    with pytest.raises(ValueError, match="stoa_run"):
        slime_hook.publish_weights(actor, Namespace(stoa_publish=True, stoa_bucket=url))


# -- the patch and its apply script ---------------------------------------------------------------
def synthetic_slime(root: Path, *, edit: tuple[str, str] | None = None) -> Path:
    """A file at slime's path holding exactly the patch's context lines, inside a valid method."""
    patch = aps.parse_patch(PATCH.read_text(), PATCH.name)
    (hunk,) = patch.files[0].hunks
    body = "\n".join(hunk.old) + "\n"
    if edit is not None:
        assert edit[0] in body
        body = body.replace(edit[0], edit[1])
    text = (
        "import logging\n\nimport torch.distributed as dist\n\nlogger = logging.getLogger(__name__)\n\n\n"
        "class MegatronTrainRayActor:\n    def update_weights(self):\n"
        "        rollout_engines = []\n" + body + "        print('engines')\n"
    )
    target = root / TARGET
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def run_script(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = aps.main([*argv, "--patch", str(PATCH)])
    return code, capsys.readouterr().out


def test_patch_records_the_slime_commit_and_marker() -> None:
    patch = aps.parse_patch(PATCH.read_text(), PATCH.name)
    assert patch.commit == "624b824a898ab0ec1fcb4d373004c7f3852bf515"
    assert patch.marker == "stoa-patch: publish_weights"
    assert [fp.path for fp in patch.files] == [TARGET]


def test_apply_script_applies_once_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = synthetic_slime(tmp_path)
    original = target.read_text()
    assert run_script(capsys, str(tmp_path), "--check") == (1, f"{PATCH.name}: not applied\n")
    assert target.read_text() == original

    code, out = run_script(capsys, str(tmp_path))
    assert code == 0 and f"patched {TARGET}" in out
    patched = target.read_text()
    assert "from slime_stoa import publish_weights" in patched and "stoa-patch: publish_weights" in patched
    compile(patched, str(target), "exec")
    assert len(patched.splitlines()) == len(original.splitlines()) + 5

    mtime = target.stat().st_mtime_ns
    code, out = run_script(capsys, str(tmp_path))
    assert code == 0 and "already applied" in out
    assert target.read_text() == patched and target.stat().st_mtime_ns == mtime
    assert run_script(capsys, str(tmp_path), "--check") == (0, f"{PATCH.name}: applied\n")


def test_apply_script_refuses_changed_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = synthetic_slime(tmp_path, edit=("skip weight update.", "skipping the weight update."))
    original = target.read_text()
    for argv in ([str(tmp_path), "--check"], [str(tmp_path)]):
        code, out = run_script(capsys, *argv)
        assert code == 3
        assert f"{PATCH.name}: not applicable" in out and f"slime's code in {TARGET} no longer matches" in out
        assert "skipping the weight update." in out and "624b824a898ab0ec1fcb4d373004c7f3852bf515" in out
    assert target.read_text() == original


def test_apply_script_refuses_edited_patch_and_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_script(capsys, str(tmp_path), "--check")
    assert code == 3 and f"{TARGET} does not exist" in out

    target = synthetic_slime(tmp_path)
    assert run_script(capsys, str(tmp_path))[0] == 0
    target.write_text(target.read_text().replace("publish_weights(self, self.args)", "publish_weights(self)"))
    code, out = run_script(capsys, str(tmp_path))
    assert code == 3 and "carries the marker" in out and "git checkout --" in out

    assert aps.main([str(tmp_path / "nowhere"), "--patch", str(PATCH)]) == 2


def test_apply_script_keeps_crlf_line_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = synthetic_slime(tmp_path)
    target.write_bytes(target.read_bytes().replace(b"\n", b"\r\n"))
    assert run_script(capsys, str(tmp_path))[0] == 0
    data = target.read_bytes()
    assert b"stoa-patch" in data and data.count(b"\n") == data.count(b"\r\n")


def test_the_names_slime_is_given_resolve_to_stoas_functions() -> None:
    """The patch imports `slime_stoa.publish_weights`; launch scripts name the rollout function and
    the loss by their public paths."""
    import slime_stoa
    from slime_stoa.trainer.slime.loss import dppo_loss
    from slime_stoa.trainer.slime.rollout import generate_rollout

    assert slime_stoa.publish_weights is slime_hook.publish_weights
    assert slime_stoa.generate_rollout is generate_rollout
    assert slime_stoa.dppo_loss is dppo_loss
    with pytest.raises(AttributeError):
        slime_stoa.no_such_entry_point  # noqa: B018 - the access itself must raise


def test_the_script_in_scripts_is_the_patching_main(tmp_path: Path) -> None:
    import subprocess

    synthetic_slime(tmp_path)
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "apply_slime_patches.py"), str(tmp_path), "--check"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1 and "not applied" in done.stdout, done.stderr
