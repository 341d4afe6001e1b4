"""A commit whose pointer write got no answer (an outage): it may have landed all the same.

The publisher keeps what the commit would change (`advance`) until the pointer is read again:
if the write landed, that version is committed (adopted, not published twice, not taken for
another publisher's); `settled_result` is its result for a caller retrying the same publish.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .manifests import VersionManifest
from .publish_types import PublishResult


@dataclass(frozen=True, slots=True)
class UnsureCommit:
    manifest: VersionManifest  # the version whose pointer write got no answer
    advance: Callable[[], None]  # what its commit changes in the publisher, run once it is known to have landed
    seconds: float  # the publish's time up to the lost answer


def settled_result(unsure: UnsureCommit) -> PublishResult:
    """The result of the publish whose pointer write landed without an answer."""
    manifest = unsure.manifest
    step = manifest.patch("step")
    return PublishResult(
        manifest.version, manifest.anchor.version == manifest.version, step.count if step else 0,
        manifest.elements, step.bytes if step else 0, 0, 0, unsure.seconds, epoch=manifest.origin.epoch,
    )
