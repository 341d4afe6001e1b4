"""PULSE codec core on bf16 bit patterns: diff, merge, relative codes, entry byte layout, errors.

A *state* maps tensor names to numpy arrays of dtype uint16 holding bf16 bit patterns in their
logical shape (0-d and empty tensors included). A *delta* maps the name of every changed tensor
to `(indices, values)`: strictly increasing int64 flat (row-major) indices and the uint16 new bits
at those positions. "Changed" means the bit pattern differs, so a sign flip of a zero and a new
NaN payload are changes, and an unchanged NaN is not.

Values travel either as the new bits ("abs", idempotent, valid on any base that only differs at
the listed positions) or as base-relative codes ("rel": the zigzag of the wrapping int16
difference `new - old`, 40-50% smaller, valid only on the exact base state).

One delta entry is serialised (`encode_entry`) as four byte sections, which zstd compresses far
better than interleaved integers (a frame stores each section of all its entries together):
0. the low bytes of the index codes. The first code is the absolute flat index, each later one
   is `gap - 1` (a run of consecutive changes is all zeros), unsigned, `width` bytes (1, 2, 4 or
   8: the smallest that fits);
1. if width > 1: a bitmap (`np.packbits`) marking the `high` codes >= 256, then only those
   codes' upper bytes, as width - 1 byte planes. At ~1% density over 90% of upper bytes are
   zero, and a plane of them would cost zstd's Huffman coder a full bit each (measured: 8.3
   instead of 8.6 bits per index at 1% density; the entropy bound is 8.1);
2. the low bytes of the values (new bits or relative codes);
3. the high bytes of the values.

Frames and patch objects live in `frames.py`; in-place apply with an undo log in `apply.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .parallel import ordered_map

State = Mapping[str, np.ndarray]
Delta = dict[str, tuple[np.ndarray, np.ndarray]]

# Elements per pass of the chunked loops: their temporaries stay in cache.
_CHUNK = 1 << 18
# Elements of a tensor `diff` compares as one task: large tensors spread over the threads.
DIFF_SEGMENT = 1 << 22
# Changes of a tensor `merge_deltas` merges as one task.
MERGE_SEGMENT = 1 << 20
INDEX_WIDTHS = (1, 2, 4, 8)


class PatchError(Exception):
    """A PULSE patch cannot be applied."""


class PatchCorrupt(PatchError):
    """A patch frame or index is damaged or inconsistent (digest, size, content)."""


def check_bits(name: str, bits: np.ndarray) -> np.ndarray:
    """Return `bits` if it is a numpy uint16 array (bf16 bit patterns), else raise ValueError."""
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16:
        kind = bits.dtype if isinstance(bits, np.ndarray) else type(bits).__name__
        raise ValueError(f"tensor {name!r}: expected a uint16 numpy array of bf16 bits, got {kind}")
    return bits


def shapes_of(state: State) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in `state`."""
    return {name: tuple(arr.shape) for name, arr in state.items()}


def changed_indices(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted int64 flat indices where the bits of two same-shaped arrays differ.

    Compares in fixed-size chunks through one reused mask: several times faster than
    `np.flatnonzero(old != new)`, which must page in a full-size boolean array.
    """
    a, b = old.reshape(-1), new.reshape(-1)
    mask = np.empty(min(a.size, _CHUNK), dtype=bool)
    found = []
    for start in range(0, a.size, _CHUNK):
        stop = min(start + _CHUNK, a.size)
        part = mask[: stop - start]
        np.not_equal(a[start:stop], b[start:stop], out=part)
        hits = np.flatnonzero(part)
        if hits.size:
            found.append(hits + start)
    if not found:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(found).astype(np.int64, copy=False)


def diff(base: State, new: State, *, threads: int | None = 1) -> Delta:
    """The delta taking `base` to `new`: one entry per tensor whose bits changed.

    The tensors are compared in segments of DIFF_SEGMENT elements on `threads` threads (None:
    `parallel.thread_count`); numpy releases the GIL while comparing, and the result does not
    depend on the thread count. Raises ValueError if the states differ in names, shapes or dtypes.
    """
    if base.keys() != new.keys():
        missing = sorted(set(base) - set(new))
        extra = sorted(set(new) - set(base))
        raise ValueError(f"states differ in tensor names: missing {missing}, extra {extra}")
    names = sorted(new)
    work: list[tuple[str, int, int]] = []
    for name in names:
        old_bits, new_bits = check_bits(name, base[name]), check_bits(name, new[name])
        if old_bits.shape != new_bits.shape:
            raise ValueError(f"tensor {name!r}: shape {old_bits.shape} != {new_bits.shape}")
        work += [(name, start, min(start + DIFF_SEGMENT, new_bits.size)) for start in range(0, new_bits.size, DIFF_SEGMENT)]

    def segment(item: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray]:
        name, start, stop = item
        after = new[name].reshape(-1)[start:stop]
        found = changed_indices(base[name].reshape(-1)[start:stop], after)
        return found + start, after[found]

    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for (name, _, _), (indices, values) in zip(work, ordered_map(segment, work, threads), strict=True):
        if indices.size:
            parts.setdefault(name, []).append((indices, values))
    return {
        name: (found[0] if len(found) == 1 else (np.concatenate([i for i, _ in found]), np.concatenate([v for _, v in found])))
        for name, found in parts.items()
    }


def check_entry(
    name: str, indices: np.ndarray, values: np.ndarray, size: int | None = None
) -> None:
    """Raise ValueError unless `(indices, values)` is a well-formed delta entry.

    Indices must be 1-D int64, strictly increasing and (if `size` is given) below `size`;
    values must be 1-D uint16 of the same length.
    """
    if not isinstance(indices, np.ndarray) or indices.dtype != np.int64 or indices.ndim != 1:
        raise ValueError(f"tensor {name!r}: indices must be a 1-D int64 array")
    check_bits(name, values)
    if values.shape != indices.shape:
        raise ValueError(f"tensor {name!r}: {indices.size} indices but {values.size} values")
    if indices.size == 0:
        return
    if indices[0] < 0 or (indices.size > 1 and not np.all(indices[1:] > indices[:-1])):
        raise ValueError(f"tensor {name!r}: indices must be non-negative and strictly increasing")
    if size is not None and indices[-1] >= size:
        last = int(indices[-1])
        raise ValueError(f"tensor {name!r}: index {last} out of range for {size} elements")


def merge_deltas(deltas: Sequence[Delta], *, threads: int | None = 1) -> Delta:
    """Merge deltas given oldest first into one delta; at a shared position the newest wins.

    Applying the result equals applying the deltas in order (used for catch-up patches
    anchor -> latest). Positions changed and later changed back are kept, with their final bits.
    Tensors are merged on `threads` threads (None: `parallel.thread_count`), and so are ranges of
    positions of a tensor with over MERGE_SEGMENT changes that more than two deltas change; the
    result does not depend on the thread count.

    What it costs per version (the publisher merges its catch-up union with each step, and keeps
    the union it had until the version commits): a tensor only one delta changes keeps that
    delta's arrays (read-only views, no copy), and a tensor two deltas change is merged in one
    pass over both sorted entries straight into its new arrays (`_merge_two`: beside them, the
    kept older entries and step-sized bookkeeping for that tensor only); more deltas (a resume's)
    are sorted together.
    """
    names = sorted({name for delta in deltas for name in delta})
    work: list[tuple[str, list[tuple[np.ndarray, np.ndarray]]]] = []
    for name in names:
        parts = [delta[name] for delta in deltas if name in delta]
        for indices, values in parts:
            check_entry(name, indices, values)
        if len(parts) <= 2:  # shared, or merged in one pass into one new array (no pieces to join)
            work.append((name, parts))
            continue
        largest = max((p[0] for p in parts), key=len)
        bounds = [int(b) for b in largest[MERGE_SEGMENT::MERGE_SEGMENT]]  # ranges of positions
        for lo, hi in zip([None, *bounds], [*bounds, None], strict=True):
            sliced = []
            for indices, values in parts:
                start = 0 if lo is None else int(np.searchsorted(indices, lo))
                stop = indices.size if hi is None else int(np.searchsorted(indices, hi))
                sliced.append((indices[start:stop], values[start:stop]))
            work.append((name, sliced))

    def merged(item: tuple[str, list[tuple[np.ndarray, np.ndarray]]]) -> tuple[np.ndarray, np.ndarray]:
        parts = item[1]
        if len(parts) == 1:
            return _read_only(parts[0][0]), _read_only(parts[0][1])
        if len(parts) == 2:
            return _merge_two(parts[0], parts[1])
        indices = np.concatenate([p[0] for p in parts])
        values = np.concatenate([p[1] for p in parts])
        # A stable sort keeps equal positions in delta order: the last of each run is newest.
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
        last = np.ones(indices.size, dtype=bool)
        last[:-1] = indices[1:] != indices[:-1]
        return indices[last], values[last]

    pieces: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for (name, _), piece in zip(work, ordered_map(merged, work, threads), strict=True):
        pieces.setdefault(name, []).append(piece)
    return {
        name: found[0] if len(found) == 1 else (np.concatenate([i for i, _ in found]), np.concatenate([v for _, v in found]))
        for name, found in pieces.items()
    }


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of `array`: a merged delta shares it, so nobody may write it through there."""
    view = array.view()
    view.flags.writeable = False
    return view


def _merge_two(older: tuple[np.ndarray, np.ndarray], newer: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Two entries of one tensor (strictly increasing indices) merged in one pass, `newer`
    winning at a shared position: each of newer's positions lands after the older positions
    below it that it does not replace, and the older ones fill the other slots in order."""
    (a, a_values), (b, b_values) = older, newer
    if not b.size:
        return _read_only(a), _read_only(a_values)
    if not a.size:
        return _read_only(b), _read_only(b_values)
    below = np.searchsorted(a, b)  # older positions below each newer one
    shared = np.zeros(b.size, dtype=bool)
    inside = below < a.size
    shared[inside] = a[below[inside]] == b[inside]
    replaced_before = np.cumsum(shared) - shared  # shared positions among the newer ones before each
    slots = below - replaced_before + np.arange(b.size)
    size = a.size + b.size - int(np.count_nonzero(shared))
    indices = np.empty(size, dtype=np.int64)
    values = np.empty(size, dtype=np.uint16)
    indices[slots], values[slots] = b, b_values
    free = np.ones(size, dtype=bool)
    free[slots] = False
    if shared.any():
        kept = np.ones(a.size, dtype=bool)
        kept[below[shared]] = False
        indices[free], values[free] = a[kept], a_values[kept]
    else:
        indices[free], values[free] = a, a_values
    return indices, values


def rel_codes(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Base-relative codes: zigzag of the wrapping int16 difference `new - old` of bit patterns.

    A one-ULP move codes as 1 or 2, so the high byte of a code is almost always zero. (Measured on
    an Adam-like step at ~1% density: ~3.5 bits per code after zstd, against ~4.3 for XOR.)
    """
    d = (new - old).astype(np.uint16, copy=False)  # wraps modulo 2**16
    return (d << 1) ^ (0 - (d >> 15)).astype(np.uint16, copy=False)


def from_rel_codes(old: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Inverse of `rel_codes`: the new bits given the old bits and the codes."""
    d = (codes >> 1) ^ (0 - (codes & 1)).astype(np.uint16, copy=False)
    return (old + d).astype(np.uint16, copy=False)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bf16 bit patterns (round to nearest, ties to even).

    NaNs stay NaN (quieted, sign and top payload bits kept); overflow rounds to infinity, as a
    hardware bf16 cast does. Works in cache-sized chunks.
    """
    x = np.asarray(x, dtype=np.float32)
    flat = np.ascontiguousarray(x).reshape(-1)
    bits = flat.view(np.uint32)
    out = np.empty(flat.size, dtype=np.uint16)
    tmp = np.empty(min(flat.size, _CHUNK), dtype=np.uint32)
    for start in range(0, flat.size, _CHUNK):
        part = slice(start, start + _CHUNK)
        b = bits[part]
        t = tmp[: b.size]
        np.right_shift(b, 16, out=t)
        t &= 1
        t += 0x7FFF
        t += b  # NaNs may wrap here; they are rewritten below
        t >>= 16
        out[part] = t
        nan = np.isnan(flat[part])
        if nan.any():
            out[part][nan] = (b[nan] >> 16).astype(np.uint16) | 0x0040
    return out.reshape(x.shape)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bf16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def index_codes(indices: np.ndarray) -> np.ndarray:
    """First index absolute, then `gap - 1`, as uint64 (inverse: `indices_from_codes`)."""
    codes = np.empty(indices.size, dtype=np.uint64)
    if indices.size:
        codes[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=codes[1:], casting="unsafe")
        codes[1:] -= 1
    return codes


def indices_from_codes(codes: np.ndarray, size: int, where: str) -> np.ndarray:
    """Inverse of `index_codes`, checking every index is below `size` (else PatchCorrupt)."""
    largest = int(codes.max()) if codes.size else 0
    if largest >= size:
        raise PatchCorrupt(f"{where}: index code {largest} out of range for {size} elements")
    steps = codes.astype(np.int64)
    steps[1:] += 1
    indices = np.cumsum(steps)
    # Every step is below `size`, so the sum can only wrap for tensors over ~3e9 elements.
    wrapped = codes.size * size >= 1 << 63 and not np.all(indices[1:] > indices[:-1])
    if indices.size and (wrapped or indices[-1] >= size):
        raise PatchCorrupt(f"{where}: index out of range for {size} elements")
    return indices


def index_width(max_code: int) -> int:
    """Smallest width in INDEX_WIDTHS (bytes) holding `max_code`."""
    for width in INDEX_WIDTHS:
        if max_code < 1 << (8 * width):
            return width
    raise ValueError(f"index code {max_code} does not fit in 8 bytes")


def section_sizes(count: int, width: int, high: int) -> tuple[int, int, int, int]:
    """Bytes of each of the four sections (see the module doc) of an entry of `count` changes
    with index code `width` and `high` codes >= 256."""
    upper = 0 if width == 1 else (count + 7) // 8 + (width - 1) * high
    return count, upper, count, count


def entry_nbytes(count: int, width: int, high: int) -> int:
    """Total payload bytes of an entry."""
    return sum(section_sizes(count, width, high))


def entry_shape(codes: np.ndarray) -> tuple[int, int]:
    """(width, high) of the index codes of a non-empty entry."""
    return index_width(int(codes.max())), int(np.count_nonzero(codes >> 8))


def encode_entry(indices: np.ndarray, values: np.ndarray) -> tuple[int, int, list[np.ndarray]]:
    """Serialise a non-empty entry; return (width, high, its four sections as uint8 arrays)."""
    codes = index_codes(indices)
    width, high = entry_shape(codes)
    upper_parts = []
    if width > 1:
        upper = codes >> 8
        big = upper != 0
        upper = upper[big]
        upper_parts = [np.packbits(big)]
        upper_parts += [(upper >> (8 * k)).astype(np.uint8) for k in range(width - 1)]
    sections = [
        codes.astype(np.uint8),  # the cast keeps the low 8 bits
        np.concatenate(upper_parts) if upper_parts else np.empty(0, dtype=np.uint8),
        values.astype(np.uint8),
        (values >> 8).astype(np.uint8),
    ]
    assert tuple(a.size for a in sections) == section_sizes(indices.size, width, high)
    return width, high, sections


def decode_entry(
    sections: Sequence[np.ndarray], count: int, width: int, high: int, size: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `encode_entry`, given sections of exactly `section_sizes(count, width, high)`
    bytes; PatchCorrupt (naming `where`) if they are inconsistent or index past `size`."""
    low, upper_bytes, value_low, value_high = sections
    assert tuple(a.size for a in sections) == section_sizes(count, width, high)
    codes = low.astype(np.uint64)
    if width > 1:
        mask_bytes = (count + 7) // 8
        big = np.unpackbits(upper_bytes[:mask_bytes], count=count).view(bool)
        if np.count_nonzero(big) != high:
            marked = np.count_nonzero(big)
            raise PatchCorrupt(f"{where}: bitmap marks {marked} long codes, index says {high}")
        upper = np.zeros(high, dtype=np.uint64)
        for k in range(width - 1):
            start = mask_bytes + k * high
            upper |= upper_bytes[start : start + high].astype(np.uint64) << (8 * k)
        codes[big] |= upper << 8
    values = value_low.astype(np.uint16) | (value_high.astype(np.uint16) << 8)
    return indices_from_codes(codes, size, where), values
