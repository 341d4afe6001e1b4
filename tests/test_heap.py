"""`heap.return_freed_heap`: safe to call anywhere, and on glibc it gives freed weight-sized
blocks back to the OS (measured on the resident set, in bytes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from slime_stoa.trainer.heap import return_freed_heap

ON_GLIBC = (getattr(os, "confstr", lambda _: None)("CS_GNU_LIBC_VERSION") or "").startswith("glibc")

# In a fresh process (its own heap, glibc's thresholds at their defaults): a freed 20 MiB block
# raises the mmap threshold above 16 MiB, as the trainer's first large free does; then 16 blocks
# of 16 MiB come from the heap, each followed by a small block that stays alive, so the freed
# blocks sit inside the heap (not at its top, which free() trims by itself), as a freed host
# state does in the trainer's heap.
CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from slime_stoa.trainer.heap import return_freed_heap

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    block, count = 16 << 20, 16
    warm = np.ones(20 << 20, np.uint8)
    del warm
    blocks, pins = [], []
    for _ in range(count):
        blocks.append(np.ones(block, np.uint8))  # written: resident
        pins.append(np.ones(64 << 10, np.uint8))
    held = rss()
    del blocks
    freed = rss()
    trimmed = return_freed_heap()
    after = rss()
    print(json.dumps({"held": held, "freed": freed, "after": after, "trimmed": trimmed,
                      "blocks": block * count, "pins": len(pins)}))
    """
)


def test_it_is_safe_to_call_and_says_a_bool() -> None:
    for _ in range(2):  # the second call finds nothing left to return, and still answers
        assert isinstance(return_freed_heap(), bool)


@pytest.mark.skipif(not ON_GLIBC, reason="malloc_trim is glibc's; elsewhere return_freed_heap does nothing")
def test_freed_heap_blocks_leave_the_resident_set() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.splitlines()[-1])
    # glibc kept the freed blocks: without the trim they would still count (the finding it fixes)
    assert m["held"] - m["freed"] < m["blocks"] // 4
    assert m["trimmed"] is True
    assert m["freed"] - m["after"] > m["blocks"] * 3 // 4


def test_the_device_path_drops_the_released_host_copy_at_its_rebuild() -> None:
    """The trim is only worth its call where the released state's last reference goes: after the
    device path's rebuild from it, nothing holds its arrays."""
    import weakref

    torch = pytest.importorskip("torch")
    import numpy as np

    from slime_stoa.trainer.slime.device_publish import DeviceCollector, DevicePath
    from slime_stoa.trainer.slime.hf_names import HeadPlan

    weights = {f"model.layers.{i}.w": torch.randn(8, 8).to(torch.bfloat16) for i in range(3)}
    released = {n: w.view(torch.int16).numpy().view(np.uint16).copy() for n, w in weights.items()}
    alive = [weakref.ref(bits) for bits in released.values()]
    path = DevicePath(device_budget_bytes=1 << 20)
    path.adopt(released, "root-of-v0")
    del released
    collector = DeviceCollector(path, HeadPlan())
    assert all(ref() is not None for ref in alive)  # held until the copy is rebuilt
    collector.add(list(weights.items())[:1])  # the first tensor rebuilds the copy
    assert path.released is None and path.held == "root-of-v0"
    assert all(ref() is None for ref in alive)
