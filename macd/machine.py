"""This machine's unified memory, and the memory tiers: what a worker with that much should run."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Tier:
    """A unified-memory tier and what a worker on it should run."""

    min_gib: int
    model: str  # largest recommended model size (bf16 plane unless noted)
    batch: int  # prompts generated together
    group_size: int


TIERS = (
    Tier(min_gib=0, model="0.5B", batch=4, group_size=8),
    Tier(min_gib=16, model="1.5B", batch=8, group_size=8),
    Tier(min_gib=32, model="3B", batch=8, group_size=16),
    Tier(min_gib=64, model="7B", batch=16, group_size=16),
    Tier(min_gib=128, model="14B", batch=16, group_size=16),
)


def memory_bytes() -> int:
    """Physical (unified) memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tier_for(memory: int) -> Tier:
    gib = memory / 2**30
    return [t for t in TIERS if gib >= t.min_gib][-1]
