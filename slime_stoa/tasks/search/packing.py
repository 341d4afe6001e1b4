"""Bit-packed posting blocks: the pure codec of the compact index (`compact`), numpy only.

A term's postings (its documents ascending, each with a term frequency >= 1) are cut into blocks
of `BLOCK` postings (the last one shorter). A block stores two sections, each starting on a byte:

    doc gaps   g_i = doc_i - doc_{i-1} - 1 (doc_{-1}: the previous block's last document, or -1),
               each in `doc_bits` bits
    tf - 1     each in `tf_bits` bits

where a section's width is the bit length of its largest value (0 bits: all zero, no bytes), and
values are written least significant bit first, back to back (little-endian bit order). A block
takes `block_bytes(n, doc_bits, tf_bits)` bytes; its last document and the two widths are kept
outside (the block table), so any block decodes on its own and a lookup decodes only the blocks
that can hold the documents it wants. Widths are at most 32 (ids and frequencies below 2**32).

Values are read 8 bytes at a time from an unaligned view, so the packed buffer must be followed
by `PAD` readable bytes (the writer appends them).
"""

from __future__ import annotations

import math

import numpy as np

BLOCK = 128
PAD = 8  # readable bytes after the last block: the decoder reads 8 bytes at a value's position
MAX_BITS = 32
ENCODE_BLOCKS = 1024  # blocks whose bits are laid out at once (each bit a byte while packing)


def bit_lengths(values: np.ndarray) -> np.ndarray:
    """Each value's bit length (0 for 0), exact below 2**53."""
    return np.frexp(values.astype(np.float64))[1].astype(np.int64)


def block_bytes(n: np.ndarray, doc_bits: np.ndarray, tf_bits: np.ndarray) -> np.ndarray:
    """The bytes of blocks of `n` postings with these widths."""
    return (n * doc_bits + 7) // 8 + (n * tf_bits + 7) // 8


def block_starts(term_starts: np.ndarray, term_counts: np.ndarray) -> np.ndarray:
    """The first posting of every block of terms whose postings begin at `term_starts` (ascending,
    in a flat array) with `term_counts` postings each (>= 1)."""
    blocks = (term_counts + BLOCK - 1) // BLOCK
    first = np.repeat(term_starts, blocks)
    within = np.arange(int(blocks.sum()), dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    return first + within * BLOCK


def _write_bits(out_bits: np.ndarray, values: np.ndarray, widths: np.ndarray, starts: np.ndarray) -> None:
    """Write `values[i]` in `widths[i]` bits at bit `starts[i]` of the 0/1 array `out_bits`."""
    total = int(widths.sum())
    if not total:
        return
    owner = np.repeat(np.arange(len(values), dtype=np.int64), widths)
    first = np.cumsum(widths) - widths
    bit = np.arange(total, dtype=np.int64) - np.repeat(first, widths)
    out_bits[np.repeat(starts, widths) + bit] = (values[owner] >> bit) & 1


def encode(docs: np.ndarray, tfs: np.ndarray, term_starts: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pack the postings of consecutive terms (flat `docs` ascending within each term, `tfs` >= 1;
    term t's postings start at `term_starts[t]`) into blocks.

    Returns the packed bytes (no padding) and, per block: its last document, its doc and tf
    widths, and its byte offset in the packed bytes; blocks are in term order."""
    n = len(docs)
    docs = docs.astype(np.int64)
    counts = np.diff(np.append(term_starts, n))
    starts = block_starts(term_starts, counts)
    ends = np.append(starts[1:], n)
    prev = np.empty(n, dtype=np.int64)
    prev[0:1] = -1
    prev[1:] = docs[:-1]
    prev[term_starts] = -1
    gaps = docs - prev - 1
    tf1 = tfs.astype(np.int64) - 1
    if n and (gaps.min() < 0 or tf1.min() < 0):
        raise ValueError("postings must be ascending within a term, with frequencies >= 1")
    doc_bits = bit_lengths(np.maximum.reduceat(gaps, starts)) if n else np.zeros(0, np.int64)
    tf_bits = bit_lengths(np.maximum.reduceat(tf1, starts)) if n else np.zeros(0, np.int64)
    if n and max(int(doc_bits.max()), int(tf_bits.max())) > MAX_BITS:
        raise ValueError(f"posting values need more than {MAX_BITS} bits")
    sizes = ends - starts
    doc_len = (sizes * doc_bits + 7) // 8
    nbytes = doc_len + (sizes * tf_bits + 7) // 8
    offsets = np.cumsum(nbytes) - nbytes
    pieces = []
    for lo in range(0, len(starts), ENCODE_BLOCKS):  # the bit arrays of a few MB at a time
        hi = min(lo + ENCODE_BLOCKS, len(starts))
        span = slice(int(starts[lo]), int(ends[hi - 1]))
        piece_sizes = sizes[lo:hi]
        block_of = np.repeat(np.arange(lo, hi, dtype=np.int64), piece_sizes)
        within = np.arange(span.start, span.stop, dtype=np.int64) - starts[block_of]
        at = (offsets - offsets[lo])[block_of] * 8
        bits = np.zeros(int(nbytes[lo:hi].sum()) * 8, dtype=np.uint8)
        _write_bits(bits, gaps[span], doc_bits[block_of], at + within * doc_bits[block_of])
        _write_bits(bits, tf1[span], tf_bits[block_of], at + doc_len[block_of] * 8 + within * tf_bits[block_of])
        pieces.append(np.packbits(bits, bitorder="little").tobytes())
    return b"".join(pieces), docs[ends - 1] if n else docs[:0], doc_bits, tf_bits, offsets


def _read(buf: np.ndarray, bit_pos: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The values of `widths` bits at bit positions `bit_pos` of `buf` (uint8, PAD bytes after)."""
    words = np.ndarray(shape=(max(len(buf) - PAD + 1, 0),), dtype="<u8", buffer=buf, strides=(1,))
    raw = words[bit_pos >> 3] >> (bit_pos & 7).astype(np.uint64)
    return (raw & ((np.uint64(1) << widths.astype(np.uint64)) - np.uint64(1))).astype(np.int64)


def _unpack_rows(rows: np.ndarray, width: int) -> np.ndarray:
    """The BLOCK values of `width` bits packed in each row of `rows` (uint8, BLOCK * width / 8
    bytes a row), as int64 (rows, BLOCK). A run of g = 8 / gcd(width, 8) values fills m whole
    bytes, so value j of every run is read from the same byte columns: one vectorised pass per
    lane (g <= 8), never a gather per value."""
    g = 8 // math.gcd(width, 8)
    m = width * g // 8
    runs = rows.reshape(-1, m)
    out = np.empty((len(runs), g), dtype=np.uint64)
    mask = np.uint64((1 << width) - 1)
    for j in range(g):
        bit = j * width
        first, last, shift = bit // 8, (bit + width - 1) // 8, bit % 8
        v = runs[:, first].astype(np.uint64) >> np.uint64(shift)
        for byte in range(first + 1, last + 1):
            v |= runs[:, byte].astype(np.uint64) << np.uint64(8 * (byte - first) - shift)
        out[:, j] = v & mask
    return out.reshape(len(rows), BLOCK).astype(np.int64)


def _unpack_full(buf: np.ndarray, starts: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The values of full blocks whose sections start at byte `starts` with `widths`, (blocks, BLOCK)."""
    out = np.zeros((len(starts), BLOCK), dtype=np.int64)
    for width in np.unique(widths).tolist():
        if width:
            rows = np.flatnonzero(widths == width)
            at = starts[rows][:, None] + np.arange(BLOCK * width // 8, dtype=np.int64)
            out[rows] = _unpack_rows(buf[at], width)
    return out


def decode(
    buf: np.ndarray, offsets: np.ndarray, counts: np.ndarray, doc_bits: np.ndarray, tf_bits: np.ndarray,
    prev_last: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The documents and frequencies of the blocks at byte `offsets` of `buf` (uint8, followed by
    PAD bytes), `counts` postings each, with these widths; `prev_last`: each block's previous
    block's last document (-1 for a term's first block). Returns (docs, tfs) as int64.

    Full blocks are unpacked a width at a time (`_unpack_full`); shorter ones (a term's last)
    value by value (`_decode_values`)."""
    counts = counts.astype(np.int64)
    full = counts == BLOCK
    if not full.any() or len(counts) < 4:
        return _decode_values(buf, offsets, counts, doc_bits, tf_bits, prev_last)
    offsets, doc_bits, tf_bits, prev_last = (a.astype(np.int64) for a in (offsets, doc_bits, tf_bits, prev_last))
    rows = np.flatnonzero(full)
    gaps = _unpack_full(buf, offsets[rows], doc_bits[rows])
    tfs = _unpack_full(buf, offsets[rows] + doc_bits[rows] * (BLOCK // 8), tf_bits[rows]) + 1
    docs = np.cumsum(gaps + 1, axis=1) + prev_last[rows][:, None]
    if full.all():
        return docs.ravel(), tfs.ravel()
    short = np.flatnonzero(~full)
    s_docs, s_tfs = _decode_values(buf, offsets[short], counts[short], doc_bits[short], tf_bits[short], prev_last[short])
    # blocks back in their order: each block's postings after those of the blocks before it
    where = np.cumsum(counts) - counts
    dest_full = (where[rows][:, None] + np.arange(BLOCK, dtype=np.int64)).ravel()
    dest_short = np.repeat(where[short], counts[short]) + np.arange(len(s_docs), dtype=np.int64) - np.repeat(
        np.cumsum(counts[short]) - counts[short], counts[short])
    out_docs, out_tfs = np.empty(int(counts.sum()), dtype=np.int64), np.empty(int(counts.sum()), dtype=np.int64)
    out_docs[dest_full], out_tfs[dest_full] = docs.ravel(), tfs.ravel()
    out_docs[dest_short], out_tfs[dest_short] = s_docs, s_tfs
    return out_docs, out_tfs


def _decode_values(
    buf: np.ndarray, offsets: np.ndarray, counts: np.ndarray, doc_bits: np.ndarray, tf_bits: np.ndarray,
    prev_last: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """`decode` reading each value on its own (an unaligned 8-byte read at its bit position)."""
    counts = counts.astype(np.int64)
    n = int(counts.sum())
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    block_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    within = np.arange(n, dtype=np.int64) - first[block_of]
    db, tb = doc_bits.astype(np.int64)[block_of], tf_bits.astype(np.int64)[block_of]
    base = offsets.astype(np.int64)[block_of] * 8
    step = _read(buf, base + within * db, db) + 1
    tf_base = base + ((counts * doc_bits.astype(np.int64) + 7) // 8)[block_of] * 8
    tfs = _read(buf, tf_base + within * tb, tb) + 1
    running = np.cumsum(step)
    start = running[first] - step[first]
    docs = running - start[block_of] + prev_last.astype(np.int64)[block_of]
    return docs, tfs
