"""The paths to a weight version, and their ranking: by bytes to download (the default) or by
estimated time.

`patch_paths` lists the patch sequences that reach the head from a base version, from the
manifests' step and catch-up patches (`Link`s): the chain of step patches, and each catch-up
that covers the base followed by the step patches after it. Their bytes are the manifests'.

A path (`Route`) is described by what it costs: round trips that cannot overlap, bytes to
download, elements the patches write, elements of the tensors they touch (re-hashed to verify
the state digest), and anchor elements to parse and digest. `Speeds` holds a
receiver's rates; `estimate_s` and `rank` are pure. `SpeedMeter` keeps the rates up to date from
what the receiver observes (exponential moving averages), starting from configured guesses.

`rank` orders routes `by` "bytes" (fewest first, estimated time breaking ties): a lagger never
downloads more than the cheapest path, which is what a worker on a home link waits for and what
the bucket serves; a loopback or LAN receiver, where every path takes a fraction of a second and
the estimates are within their own noise, would otherwise trade 30x the bytes for a guessed
saving. `by="time"` ranks by the estimate (bytes breaking ties), for receivers whose link is
known to be faster than their CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .manifests import PatchRef

RouteBy = Literal["bytes", "time"]
ROUTE_BY: tuple[RouteBy, ...] = ("bytes", "time")


@dataclass(frozen=True, kw_only=True)
class Route:
    """What a path to a version costs."""

    name: str
    requests: int = 0  # round trips in sequence (GETs that do not overlap)
    bytes: int = 0  # to download
    changes: int = 0  # elements written by its patches
    hashed: int = 0  # elements of the tensors its patches touch (re-hashed after applying)
    elements: int = 0  # elements of an anchor to parse and digest (0: no anchor)


_RATES = ("download_bytes_s", "request_s", "apply_s_per_change", "hash_s_per_element", "load_s_per_element")


@dataclass(frozen=True, kw_only=True)
class Speeds:
    """A receiver's rates (the defaults are guesses used until measured)."""

    download_bytes_s: float = 25e6  # sustained download rate
    request_s: float = 0.05  # latency of one GET
    apply_s_per_change: float = 5e-8  # verify + decode + scatter, per changed element
    hash_s_per_element: float = 2e-10  # re-hash a touched tensor, per bf16 element (one thread)
    load_s_per_element: float = 5e-9  # parse + digest an anchor, per bf16 element

    def __post_init__(self) -> None:
        for name in _RATES:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")


def estimate_s(route: Route, speeds: Speeds) -> float:
    """Seconds `route` should take at `speeds`."""
    return (
        route.requests * speeds.request_s
        + route.bytes / speeds.download_bytes_s
        + route.changes * speeds.apply_s_per_change
        + route.hashed * speeds.hash_s_per_element
        + route.elements * speeds.load_s_per_element
    )


def rank(routes: Iterable[Route], speeds: Speeds, by: RouteBy = "bytes") -> list[Route]:
    """Routes best first: fewest bytes (ties: faster, then name), or with `by="time"` fastest
    (ties: fewer bytes, then name)."""
    return sorted(routes, key=lambda r: rank_key(r, speeds, by))


def rank_key(route: Route, speeds: Speeds, by: RouteBy = "bytes") -> tuple[float, float, str]:
    """The sort key `rank` orders routes by."""
    if by == "bytes":
        return (route.bytes, estimate_s(route, speeds), route.name)
    if by == "time":
        return (estimate_s(route, speeds), route.bytes, route.name)
    raise ValueError(f"by must be one of {ROUTE_BY}, got {by!r}")


@dataclass(frozen=True, slots=True)
class Link:
    """What one version's manifest offers to reach it."""

    version: int
    step: PatchRef | None  # from version - 1
    catchup: PatchRef | None  # from any version in its base range


def patch_paths(base: int, digest: str | None, links: Sequence[Link]) -> list[tuple[str, list[PatchRef]]]:
    """Every patch sequence from the state of version `base` (state digest `digest`) to the last
    of `links` (versions base + 1 .. head, oldest first, contiguous), as (name, patches):

    - the step patches of every version: ``"step"`` (one) or ``"chain"``;
    - a catch-up at version c covering `base` (and, if base-relative, made on `digest`) and the
      step patches after c: ``"catchup"`` (c is the head) or ``"catchup+chain"``.

    A sequence is listed only when every patch it needs is there; the first patch's base digest,
    if it has one, must be `digest` (later ones are checked by the final state digest)."""
    if not links or [link.version for link in links] != list(range(base + 1, base + 1 + len(links))):
        return []
    paths: list[tuple[str, list[PatchRef]]] = []
    steps = [link.step for link in links]
    if all(s is not None and s.covers(link.version - 1) for s, link in zip(steps, links, strict=True)):
        chain = [s for s in steps if s is not None]
        if chain[0].base_digest in (None, digest):
            paths.append(("step" if len(chain) == 1 else "chain", chain))
    for i, link in enumerate(links):
        cu = link.catchup
        if cu is None or not cu.covers(base) or cu.base_digest not in (None, digest):
            continue
        after = steps[i + 1 :]
        if all(s is not None for s in after):
            rest = [s for s in after if s is not None]
            paths.append(("catchup+chain" if rest else "catchup", [cu, *rest]))
    return paths


def chain_guess(behind: int, step: Route) -> Route:
    """A chain of `behind` patches each like `step` (before walking its manifests)."""
    return Route(
        name="chain", requests=behind * step.requests, bytes=behind * step.bytes, changes=behind * step.changes,
        hashed=step.hashed,
    )


class SpeedMeter:
    """Running estimates of a receiver's `Speeds`.

    The first measurement of a rate replaces its initial guess (unless `measured`: the initial
    speeds were measured before, e.g. saved by a previous run); later ones are averaged in with
    `weight`. Small downloads (< `LARGE_BYTES`) measure the request latency; large ones the
    bandwidth, as decayed sums of bytes over transfer time (each download's time less one
    latency), so a large transfer counts for its size: a link that moves 1 MB objects slowly
    may still move an anchor fast. Applies and anchor loads count only when large enough to time.
    """

    LARGE_BYTES = 256 << 10
    MIN_CHANGES = 10_000
    MIN_ELEMENTS = 1_000_000

    def __init__(self, initial: Speeds = Speeds(), weight: float = 0.3, *, measured: bool = False) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.speeds = initial
        self.weight = weight
        self._measured: set[str] = set(_RATES) if measured else set()
        self._bytes = self._transfer_s = 0.0  # decayed sums behind download_bytes_s

    @property
    def measured(self) -> frozenset[str]:
        """The rates measured so far (the others are still the initial guesses)."""
        return frozenset(self._measured)

    def _fold(self, field: str, sample: float) -> None:
        if math.isfinite(sample) and sample > 0:
            old = getattr(self.speeds, field)
            new = old + self.weight * (sample - old) if field in self._measured else sample
            self.speeds = replace(self.speeds, **{field: new})
            self._measured.add(field)

    def download(self, nbytes: int, seconds: float) -> None:
        """A download of `nbytes` (one GET, or concurrent ranged GETs together) took `seconds`."""
        if seconds <= 0:
            return
        if nbytes < self.LARGE_BYTES:
            self._fold("request_s", seconds)
            return
        transfer = max(seconds - self.speeds.request_s, seconds / 2)
        if "download_bytes_s" not in self._measured:
            self._fold("download_bytes_s", nbytes / transfer)
            self._bytes, self._transfer_s = float(nbytes), transfer
            return
        if not self._transfer_s:  # measured before this meter existed: weigh it as one such transfer
            self._bytes, self._transfer_s = float(nbytes), nbytes / self.speeds.download_bytes_s
        keep = 1 - self.weight
        self._bytes = keep * self._bytes + nbytes
        self._transfer_s = keep * self._transfer_s + transfer
        self.speeds = replace(self.speeds, download_bytes_s=self._bytes / self._transfer_s)

    def apply(self, changes: int, seconds: float) -> None:
        """Applying `changes` changed elements took `seconds`."""
        if changes >= self.MIN_CHANGES:
            self._fold("apply_s_per_change", seconds / changes)

    def hash(self, elements: int, seconds: float) -> None:
        """Hashing tensors of `elements` elements in all took `seconds` of one thread's time."""
        if elements >= self.MIN_ELEMENTS:
            self._fold("hash_s_per_element", seconds / elements)

    def load(self, elements: int, seconds: float) -> None:
        """Parsing and digesting an anchor of `elements` elements took `seconds`."""
        if elements >= self.MIN_ELEMENTS:
            self._fold("load_s_per_element", seconds / elements)
