"""The plugin's settings: `StoaSettings`, read once from slime's `args`.

slime sets every key of the `--custom-config-path` YAML as an attribute of `args`, in every
process. `StoaSettings` describes every key stoa reads there: its own fields (the bucket, the
run, the rollout function's and the publisher's knobs) and three nested configs, the rollout
consumer's (`ConsumerConfig`), the publisher's (`PublisherConfig`) and the DPPO loss's
(`DPPOConfig`). `StoaSettings.from_args` walks the fields (into nested dataclasses too) and
parses each key by the field's type:

- a field `x` of StoaSettings, of the consumer or of the publisher config is the key `stoa_x`,
  a field `x` of the DPPO config `dppo_x`; a field `y` of a dataclass nested in those under the
  name `x` is `<prefix>x_y` (`ConsumerConfig.quarantine.min_samples`: `stoa_quarantine_min_samples`);
  a `Spec(key=...)` names a key that does not follow the rule;
- a key that is not set keeps the field's default (or the one `Spec.default_from` derives
  from slime's flags); a YAML null means None, or the default in a `Section(null_is_default)`;
- every error is a ValueError naming the key.

Everything else derives from it: the reference table of docs/slime.md (`reference_table`;
`python -m slime_stoa.trainer.slime.settings docs/slime.md` rewrites it), preflight's checks and
its list of known keys (`StoaSettings.keys`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import re
import sys
import textwrap
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.protocol.pulse.retry import DEFAULT_BACKOFF_S, DEFAULT_RETRIES
from slime_stoa.protocol.signing import SigningKey, read_key_file
from slime_stoa.trainer.consumer.config import ConsumerConfig
from slime_stoa.trainer.loss_config import DPPOConfig

Parser = Callable[[str, Any], Any]
T = TypeVar("T")

PREFIX = "stoa_"
DPPO_PREFIX = "dppo_"
DEFAULT_PUBLISH_GRACE_S = 120.0
_MISSING: Any = object()


# -- parsers: (key, raw value) -> value, or ValueError naming the key ---------------------------------
def as_int(key: str, value: Any) -> int:
    """An integer (an integral float or a numeric string is fine); ValueError naming `key`."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    try:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer, got {value!r}") from None


def as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {value!r}") from None


def as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false, got {value!r}")


def as_str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def as_path(key: str, value: Any) -> Path:
    return Path(as_str(key, value)).expanduser()


def as_store_url(key: str, value: Any) -> str:
    """A store URL (file://, s3://, r2://) that parses."""
    from slime_stoa.protocol.store.url import parse_store_url

    url = as_str(key, value)
    try:
        parse_store_url(url)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    return url


def as_run_name(key: str, value: Any) -> str:
    from slime_stoa.protocol.layout import check_name

    try:
        return check_name("run", value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def as_key_file(key: str, value: Any) -> SigningKey:
    """The run key in the file `value` names: it must be mode 0600 and an Ed25519 key file."""
    try:
        return read_key_file(as_path(key, value))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def at_least(parse: Parser, low: float) -> Parser:
    """`parse`, then the value must be finite and >= `low`."""

    def checked(key: str, value: Any) -> Any:
        out = parse(key, value)
        if not (math.isfinite(out) and out >= low):
            raise ValueError(f"{key} must be a finite number >= {low:g}, got {value!r}")
        return out

    return checked


def _optional(parse: Parser) -> Parser:
    """`parse`, except that None (YAML null) or an empty string means None."""
    return lambda key, value: None if value is None or value == "" else parse(key, value)


_PARSERS: dict[Any, Parser] = {int: as_int, float: as_float, bool: as_bool, str: as_str, Path: as_path}


def parser_for(hint: Any) -> Parser | None:
    """The parser of a field of type `hint` (None: no parser for that type)."""
    if hint in _PARSERS:
        return _PARSERS[hint]
    if get_origin(hint) is Literal:
        return as_str  # the config's own __post_init__ names the allowed choices
    args = get_args(hint)
    if get_origin(hint) in (Union, UnionType) and len(args) == 2 and type(None) in args:
        inner = parser_for(next(a for a in args if a is not type(None)))
        return _optional(inner) if inner else None
    return None


# -- how a field is read -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Spec:
    """How one field is read, where its key, type or default is not enough."""

    key: str | None = None
    """The key, where it is not the prefix + the field name."""
    parse: Parser | None = None
    """The parser, where the field's type does not choose it."""
    default_from: Callable[[Any, Mapping[str, Any]], Any] | None = None
    """The default when the key is not set, from slime's args and the fields read before it."""
    shown_default: str | None = None
    """The default as the reference table shows it."""
    derived: Callable[[Mapping[str, Any]], Any] | None = None
    """Not a key: the value, from the parent's fields (StoaSettings' own)."""
    part: str = ""
    """Which piece reads it (a heading of the reference table): shared, rollout, publisher, loss."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """How a nested dataclass field is read: the key prefix of its fields and its own rules."""

    prefix: str | None = None
    """The key prefix of the nested fields (default: the parent's prefix + the field name + _)."""
    null_is_default: bool = False
    """A YAML null keeps a field's default (else null means None, an error where None is not allowed)."""
    fields: Mapping[str, Spec] = field(default_factory=dict)
    """Specs of the nested class's own fields (it may not be ours to annotate)."""
    skip: tuple[str, ...] = ()
    """Fields that are no settings: they keep their defaults."""
    part: str = ""
    what: str = ""
    """The section in an error that names no field."""


def spec(**kw: Any) -> Mapping[str, Spec]:
    """The metadata of a field read by a `Spec`."""
    return MappingProxyType({"stoa": Spec(**kw)})


def nested(sec: Section) -> Mapping[str, Section]:
    """The metadata of a nested config read by a `Section`."""
    return MappingProxyType({"stoa": sec})


class SettingError(ValueError):
    """A setting that does not parse; `key` names it when one does, `part` is its piece."""

    def __init__(self, message: str, *, key: str | None = None, part: str = "") -> None:
        super().__init__(message)
        self.key, self.part = key, part


# -- the settings -----------------------------------------------------------------------------------
def _extras_default(args: Any, _read: Mapping[str, Any]) -> Path | None:
    hf = getattr(args, "hf_checkpoint", None)
    return Path(hf) if isinstance(hf, str) and hf and Path(hf).is_dir() else None


def _reduction_default(args: Any, _read: Mapping[str, Any]) -> str:
    return "token_mean" if getattr(args, "calculate_per_token_loss", False) else "seq_mean"


def _drgrpo_default(args: Any, read: Mapping[str, Any]) -> Any:
    return getattr(args, "rollout_max_response_len", None) if read.get("reduction") == "drgrpo" else None


def _worker_metrics_default(args: Any, _read: Mapping[str, Any]) -> bool:
    return bool(getattr(args, "use_wandb", False) or getattr(args, "use_tensorboard", False))


# slime's own flags some default is derived from (part of the cache key of `settings_from_args`).
SLIME_FLAGS_READ = ("hf_checkpoint", "calculate_per_token_loss", "rollout_max_response_len", "use_wandb", "use_tensorboard")

_CONSUMER = Section(
    prefix=PREFIX,
    null_is_default=True,
    part="rollout",
    what="stoa rollout",
    skip=("record_limits",),
    fields={
        "store_url": Spec(derived=lambda top: top["bucket"]),
        "run": Spec(derived=lambda top: top["run"]),
        "rollouts_url": Spec(derived=lambda top: top.get("rollouts_bucket")),
        # the trainer's own run key: the run manifest must name its public half
        "run_key": Spec(derived=lambda top: top["run_key"].public.to_text() if top.get("run_key") else None),
    },
)
_PUBLISHER = Section(
    prefix=PREFIX,
    part="publisher",
    what="stoa publisher",
    fields={
        "extras_dir": Spec(default_from=_extras_default, shown_default="--hf-checkpoint, if a local folder"),
    },
)
_DPPO = Section(
    prefix=DPPO_PREFIX,
    part="loss",
    what="DPPO loss",
    fields={
        "reduction": Spec(
            default_from=_reduction_default,
            shown_default="token_mean with --calculate-per-token-loss, else seq_mean",
        ),
        "drgrpo_max_len": Spec(default_from=_drgrpo_default, shown_default="--rollout-max-response-len for drgrpo"),
    },
)


@dataclass(frozen=True, kw_only=True)
class StoaSettings:
    """Every setting of the slime plugin (the `--custom-config-path` YAML keys), parsed."""

    bucket: str = field(metadata=spec(parse=as_store_url, part="shared"))
    """Required: the store URL of the run's bucket (`file://`, `s3://...?endpoint=...`, `r2://`);
    credentials come from the environment."""
    run: str = field(metadata=spec(parse=as_run_name, part="shared"))
    """Required: the run's name in the bucket."""
    rollouts_bucket: str | None = field(default=None, metadata=spec(parse=_optional(as_store_url), part="shared"))
    """Least privilege: the workers' records and heartbeats in a second bucket (their token
    writes only there)."""
    run_key: SigningKey | None = field(
        default=None, metadata=spec(parse=_optional(as_key_file), shown_default="null (unsigned)", part="shared")
    )
    """A signed run: the run key file (mode 0600, `stoa keys create`). Every version is signed
    with it, the run manifest must name its public half, records need registered worker keys."""

    tokenizer_dir: Path | None = field(default=None, metadata=spec(shown_default="null (the anchor's)", part="rollout"))
    """A local folder with tokenizer.json the completions are re-scored with."""
    state_in_bucket: bool = field(default=True, metadata=spec(part="rollout"))
    """Also write the consumer state to the bucket after every batch
    (`runs/<run>/trainer/consumer.json`, compare-and-swap)."""
    check_publishing: bool = field(default=True, metadata=spec(part="rollout"))
    """Publisher liveness: fail a rollout when the weight pointer did not move after the
    previous train step (section 9). false for slime's train_async.py or
    --update-weights-interval > 1."""
    publish_grace_s: float = field(
        default=DEFAULT_PUBLISH_GRACE_S, metadata=spec(parse=at_least(as_float, 0), part="rollout")
    )
    """How long a rollout waits for the previous step's version before it fails."""
    worker_metrics: bool = field(
        metadata=spec(
            default_from=_worker_metrics_default, shown_default="on with --use-wandb or --use-tensorboard",
            part="rollout",
        )
    )
    """Add each worker's heartbeat (`worker/<id>/*`) and the fleet's totals to each rollout's metrics."""
    eval_prompts: int | None = field(default=None, metadata=spec(shown_default="null (all)", part="rollout"))
    """An eval (`--eval-interval`) covers the split's first N prompts."""
    consumer: ConsumerConfig = field(metadata=nested(_CONSUMER))
    """The rollout consumer's settings."""

    publish: bool = field(default=False, metadata=spec(part="publisher"))
    """Read by stoa's slime patch: the YAML boolean true makes `update_weights` publish the weights."""
    publish_retries: int = field(default=DEFAULT_RETRIES, metadata=spec(parse=at_least(as_int, 0), part="publisher"))
    """Retries of a failed publish (store errors; never a conflict with another publisher; an
    outage is waited out)."""
    publish_backoff_s: float = field(
        default=DEFAULT_BACKOFF_S, metadata=spec(parse=at_least(as_float, 0), part="publisher")
    )
    """The pause before the first retry, doubled after each."""
    background_publish: bool = field(default=True, metadata=spec(part="publisher"))
    """Diff, encode and upload the weights on a background thread while training goes on (false:
    inside `update_weights`)."""
    publisher: PublisherConfig = field(default=PublisherConfig(), metadata=nested(_PUBLISHER))
    """The weight publisher's settings."""

    dppo: DPPOConfig = field(default=DPPOConfig(), metadata=nested(_DPPO))
    """The DPPO loss's settings (slime flags only its built-in loss honours are refused by the loss)."""

    @classmethod
    def from_args(cls, args: Any) -> StoaSettings:
        """The settings from slime's `args`; SettingError (a ValueError) naming a bad key."""
        values, errors = read(cls, args)
        if errors:
            raise errors[0]
        return cls(**values)

    @classmethod
    def check(cls, args: Any) -> list[SettingError]:
        """Every setting that does not parse (a field whose inputs failed is not read)."""
        return read(cls, args)[1]

    @classmethod
    def keys(cls) -> frozenset[str]:
        """Every key the plugin reads."""
        return frozenset(leaf.key for leaf in leaves(cls))


PARTS = {"shared": "Shared", "rollout": "Rollout function", "publisher": "Weight publisher", "loss": "DPPO loss"}


# -- the walk ---------------------------------------------------------------------------------------
def _meta(f: dataclasses.Field) -> Any:
    return f.metadata.get("stoa")


def _nested(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _section_of(f: dataclasses.Field, parent: Section) -> Section:
    """How the nested field `f` of a class read under `parent` is read."""
    own = _meta(f)
    if isinstance(own, Section):
        return own
    return Section(
        prefix=(parent.prefix or "") + f.name + "_", null_is_default=parent.null_is_default, part=parent.part,
        what=parent.what,
    )


def _spec_of(f: dataclasses.Field, parent: Section) -> Spec:
    own = _meta(f)
    return own if isinstance(own, Spec) else parent.fields.get(f.name, Spec())


_TOP = Section(prefix=PREFIX, null_is_default=True)


def read(cls: type, args: Any, parent: Section = _TOP, top: Mapping[str, Any] | None = None,
         only: Collection[str] | None = None) -> tuple[dict[str, Any], list[SettingError]]:
    """(the values of `cls`'s fields read from `args`, the errors): a field whose key is not set
    is left out (it keeps its default); nested dataclasses are built. `only` limits the fields."""
    if args is None:
        return {}, [SettingError("stoa's plugin needs slime's args (with stoa_bucket and stoa_run)")]
    values: dict[str, Any] = {}
    errors: list[SettingError] = []
    failed: set[str] = set()
    top_values = values if top is None else top
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.name in parent.skip:
            continue
        if _nested(hints[f.name]):
            sub = _section_of(f, parent)
            if failed & set(_derived_inputs(sub)):
                continue  # its inputs did not parse: reported once, there
            inner, inner_errors = read(hints[f.name], args, sub, top_values)
            errors += inner_errors
            if not inner_errors:
                try:
                    values[f.name] = _build(hints[f.name], inner, sub)
                except SettingError as exc:
                    errors.append(exc)
            continue
        spec = _spec_of(f, parent)
        try:
            value = _read_leaf(f, hints[f.name], spec, parent, args, values, top_values)
        except SettingError as exc:
            errors.append(exc)
            failed.add(f.name)
            continue
        if value is not _MISSING:
            values[f.name] = value
    return values, errors


def _derived_inputs(sub: Section) -> tuple[str, ...]:
    """The StoaSettings fields the derived fields of `sub` read (all of the shared ones)."""
    return ("bucket", "run", "rollouts_bucket", "run_key") if any(s.derived for s in sub.fields.values()) else ()


def _read_leaf(
    f: dataclasses.Field, hint: Any, spec: Spec, parent: Section, args: Any, read_so_far: Mapping[str, Any],
    top: Mapping[str, Any],
) -> Any:
    if spec.derived is not None:
        return spec.derived(top)
    key = spec.key or (parent.prefix or "") + f.name
    part = spec.part or parent.part
    raw = getattr(args, key, _MISSING)
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if (raw is None and parent.null_is_default) or (required and raw == ""):
        raw = _MISSING
    if raw is _MISSING:
        if spec.default_from is not None:
            return spec.default_from(args, read_so_far)
        if required:
            raise SettingError(
                f"stoa needs the setting {key!r} (e.g. in the --custom-config-path YAML)", key=key, part=part
            )
        return _MISSING
    parse = spec.parse or parser_for(hint)
    assert parse is not None, f"{f.name}: no setting parser for {hint!r}"
    try:
        return parse(key, raw)
    except ValueError as exc:
        raise SettingError(str(exc), key=key, part=part) from None


def _build(cls: type[T], values: Mapping[str, Any], sec: Section) -> T:
    """`cls(**values)`; its ValueError as a SettingError naming the key of the field it names."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        key = _key_named(cls, message, sec)
        text = f"{key}: {message}" if key else f"invalid {sec.what or cls.__name__} settings: {message}"
        raise SettingError(text, key=key, part=sec.part) from None


def _key_named(cls: type, message: str, sec: Section) -> str | None:
    """The key of the field of `cls` the message names first (None: none)."""
    best: tuple[int, str] | None = None
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if _nested(hints[f.name]) or f.name in sec.skip:
            continue
        spec = _spec_of(f, sec)
        if spec.derived is not None:
            continue
        found = re.search(rf"(?<![\w.]){re.escape(f.name)}\b|\.{re.escape(f.name)}\b", message)
        if found and (best is None or found.start() < best[0]):
            best = (found.start(), spec.key or (sec.prefix or "") + f.name)
    return best[1] if best else None


def read_fields(args: Any, *names: str) -> dict[str, Any]:
    """StoaSettings' own fields `names` read from `args` alone (no bucket needed), defaults filled in."""
    values, errors = read(StoaSettings, args, only=names)
    if errors:
        raise errors[0]
    defaults = {f.name: f.default for f in dataclasses.fields(StoaSettings)}
    return {name: values.get(name, defaults[name]) for name in names}


def read_section(args: Any, name: str) -> Any:
    """The nested config `name` of StoaSettings (one that derives nothing from the shared fields)."""
    f = next(f for f in dataclasses.fields(StoaSettings) if f.name == name)
    cls, sec = _hints(StoaSettings)[name], _section_of(f, _TOP)
    assert not any(s.derived for s in sec.fields.values()), f"{name} needs the shared settings"
    values, errors = read(cls, args, sec)
    if errors:
        raise errors[0]
    return _build(cls, values, sec)


# -- one parse per process ----------------------------------------------------------------------------
class SettingsCache:
    """The last value built from args whose relevant attributes were equal (single entry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[tuple[Any, ...], Any] | None = None

    def get(self, args: Any, names: tuple[str, ...], build: Callable[[], T]) -> T:
        seen = tuple(getattr(args, n, _MISSING) for n in names)
        with self._lock:
            entry = self._entry
            if entry is not None and _same(entry[0], seen):
                return entry[1]
        value = build()
        with self._lock:
            self._entry = (seen, value)
        return value


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    try:
        return len(a) == len(b) and all(x is y or (type(x) is type(y) and bool(x == y)) for x, y in zip(a, b, strict=True))
    except Exception:  # a value that does not compare: not the same
        return False


_SETTINGS = SettingsCache()


def cached(cache: SettingsCache, args: Any, names: Collection[str], build: Callable[[], T]) -> T:
    """`build()`, once per distinct values of the attributes `names` of `args`."""
    return cache.get(args, tuple(names), build)


def settings_from_args(args: Any) -> StoaSettings:
    """`StoaSettings.from_args(args)`, parsed once and reused while the settings stay the same."""
    if args is None:
        return StoaSettings.from_args(args)
    return cached(_SETTINGS, args, _READS, lambda: StoaSettings.from_args(args))


# -- the reference table ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    """One key: where it lands (`path` of field names), its default and meaning."""

    key: str
    path: tuple[str, ...]
    part: str
    default: str
    doc: str


def leaves(cls: type = StoaSettings, parent: Section = _TOP, path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every key of `cls`, in field order."""
    hints = _hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in parent.skip:
            continue
        if _nested(hints[f.name]):
            yield from leaves(hints[f.name], _section_of(f, parent), (*path, f.name))
            continue
        spec = _spec_of(f, parent)
        if spec.derived is not None:
            continue
        key = spec.key or (parent.prefix or "") + f.name
        yield Leaf(key, (*path, f.name), spec.part or parent.part, _shown(f, spec), docs.get(f.name, ""))


def _shown(f: dataclasses.Field, spec: Spec) -> str:
    if spec.shown_default is not None:
        return spec.shown_default
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _yaml(f.default_factory())
    return "required"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring (the string literal after it), on one line}; a docstring that only
    names another class's field (`` `QuarantineConfig.min_samples`. ``) is that field's."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
        ):
            out[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    module = sys.modules.get(cls.__module__)
    for name, doc in out.items():
        ref = re.fullmatch(r"`(\w+)\.(\w+)`\.?", doc)
        other = getattr(module, ref.group(1), None) if ref else None
        if ref and isinstance(other, type) and other is not cls:
            out[name] = field_docs(other).get(ref.group(2), doc)
    return out


TABLE_START = "<!-- settings: generated from StoaSettings (slime_stoa/trainer/slime/settings.py) -->"
TABLE_END = "<!-- end of the generated settings -->"


def reference_table() -> str:
    """The YAML keys as markdown, one table per piece (docs/slime.md holds it between the markers)."""
    lines = [TABLE_START]
    rows = list(leaves())
    for part, title in PARTS.items():
        lines += ["", f"**{title}**", "", "| key | default | meaning |", "|---|---|---|"]
        for leaf in (r for r in rows if r.part == part):
            lines.append(f"| `{leaf.key}` | {_cell(leaf.default)} | {_cell(leaf.doc)} |")
    lines += ["", TABLE_END]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def doc_with_table(text: str) -> str:
    """`text` (docs/slime.md) with the part between the markers replaced by `reference_table()`."""
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    return text[:start] + reference_table() + text[end:]


_READS = tuple(sorted(StoaSettings.keys() | set(SLIME_FLAGS_READ)))


if __name__ == "__main__":  # rewrite the table in the file given (docs/slime.md)
    target = Path(sys.argv[1])
    target.write_text(doc_with_table(target.read_text(encoding="utf-8")), encoding="utf-8")
