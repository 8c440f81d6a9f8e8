# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
# (Triton reads a parameter's annotation as its type specialisation: kernels carry no type hints.)
"""Triton kernels of :mod:`.ckzhuff` (imported on the first launch on a GPU without shipped code,
or under ``TRITON_INTERPRET=1``): the ``ckz-huff`` coder of docs/FORMAT.md, one program per chunk.

Encoding: ``plan_kernel`` counts a chunk's bytes, builds the encoder's code (the Huffman tree of
smallest (weight, id) merges, its depths limited to 12, dealt by decreasing count), counts each
lane's bits, chooses the form and writes the header; ``pack_kernel`` (one warp: a thread a lane)
writes each lane's codes, or copies a stored chunk. Decoding: ``table_kernel`` checks a chunk's
header and builds its table of 4096 entries; ``decode_kernel`` (one warp) decodes the lanes. Each
chunk's row of a table of int64 gives its source address, its byte counts and its output address;
scratch rows hold what one kernel hands the next. The CPU's coder (codecs/_ckzhuff.c) writes and
reads the same bytes."""

import triton
import triton.language as tl

LANES: tl.constexpr = tl.constexpr(32)
GROUP: tl.constexpr = tl.constexpr(16)
ROUND: tl.constexpr = tl.constexpr(512)
MAX_LEN: tl.constexpr = tl.constexpr(12)
FIXED: tl.constexpr = tl.constexpr(100)  # a Huffman chunk's size word, lanes' word counts and symbol bitmap
INF: tl.constexpr = tl.constexpr(1 << 62)
# (Expressions put a tensor before a constant: Triton's interpreter makes `constant - tensor` a
# constant, which it then checks as a shift amount.)
# scratch rows (int32): the encoder's codes (code << 4 | length), counts and compacted lengths,
# each lane's first word, the form and header bytes; the decoder's lengths, each lane's first
# word, the form, header bytes and the table's entries in canonical order
ENC_ROW: tl.constexpr = tl.constexpr(1024)
E_CODES: tl.constexpr = tl.constexpr(0)
E_COUNTS: tl.constexpr = tl.constexpr(256)
E_NIBBLES: tl.constexpr = tl.constexpr(512)
E_FIRST: tl.constexpr = tl.constexpr(768)
E_FORM: tl.constexpr = tl.constexpr(800)
E_HEAD: tl.constexpr = tl.constexpr(801)
DEC_ROW: tl.constexpr = tl.constexpr(768)
TABLE: tl.constexpr = tl.constexpr(4096 + 256)  # int16 entries of a chunk's tables: all codes, then the first level
D_LENS: tl.constexpr = tl.constexpr(0)
D_FIRST: tl.constexpr = tl.constexpr(256)
D_FORM: tl.constexpr = tl.constexpr(288)
D_HEAD: tl.constexpr = tl.constexpr(289)
D_SORTED: tl.constexpr = tl.constexpr(512)
# the decoder's flaws, numbered as codecs/_ckzhuff.c numbers them (codecs.ckzhuff.FLAWS)
SHORT: tl.constexpr = tl.constexpr(1)
SIZE: tl.constexpr = tl.constexpr(2)
FORM: tl.constexpr = tl.constexpr(3)
STORED_LENGTH: tl.constexpr = tl.constexpr(4)
CONSTANT_LENGTH: tl.constexpr = tl.constexpr(5)
SYMBOLS: tl.constexpr = tl.constexpr(6)
PADDING: tl.constexpr = tl.constexpr(7)
LENGTHS: tl.constexpr = tl.constexpr(8)
INCOMPLETE: tl.constexpr = tl.constexpr(9)
FILL: tl.constexpr = tl.constexpr(10)
LANE_BITS: tl.constexpr = tl.constexpr(11)


@triton.jit
def _bswap(w):
    """A 32-bit word's bytes reversed (the lanes' words lie most significant byte first)."""
    w = w.to(tl.uint32)
    return (w << 24) | ((w & 0xFF00) << 8) | ((w >> 8) & 0xFF00) | (w >> 24)


@triton.jit
def _upto(index, cond):
    """``cond`` (a scalar) over a vector of non-negative indices (Triton's interpreter broadcasts
    no scalar bool into a mask)."""
    return index < tl.where(cond, 1 << 30, 0)


@triton.jit
def _lane_bytes(n, lane):
    """Bytes of each lane in a chunk of n bytes."""
    tail = n % ROUND - lane * GROUP
    return (n // ROUND) * GROUP + tl.minimum(tl.maximum(tail, 0), GROUP)


@triton.jit
def _store_bytes(ptr, word, N: tl.constexpr):
    """The N low bytes of a scalar, little-endian."""
    i = tl.arange(0, N)
    tl.store(ptr + i, ((word >> (8 * i).to(word.dtype)) & 0xFF).to(tl.uint8))


@triton.jit
def _code_lengths(counts, present, k, row):
    """The encoder's code lengths (int32 [256]) of byte counts with k >= 2 symbols present."""
    sym = tl.arange(0, 256)
    leaf = tl.where(present, counts.to(tl.int64) << 9 | sym, INF)  # (weight, id) in one key
    merged = tl.full((256,), INF, tl.int64)
    root = sym  # the id of the tree each leaf is in so far
    depth = tl.zeros((256,), tl.int32)
    for j in range(k - 1):
        a = tl.minimum(tl.min(leaf), tl.min(merged))
        leaf = tl.where(leaf == a, INF, leaf)
        merged = tl.where(merged == a, INF, merged)
        b = tl.minimum(tl.min(leaf), tl.min(merged))
        leaf = tl.where(leaf == b, INF, leaf)
        merged = tl.where(merged == b, INF, merged)
        merged = tl.where(sym == j, ((a >> 9) + (b >> 9)) << 9 | (256 + j), merged)
        hit = (root == (a & 511)) | (root == (b & 511))
        depth += hit.to(tl.int32)
        root = tl.where(hit, 256 + j, root)
    length = tl.arange(0, 32)
    bl = tl.histogram(depth, 32, mask=present)
    i = tl.max(tl.where(present, depth, 0))
    while i > MAX_LEN:  # JPEG Annex K.3
        deepest = tl.sum(tl.where(length == i, bl, 0))
        j = tl.max(tl.where((length <= i - 2) & (bl > 0), length, 0))
        move = (length == j + 1).to(tl.int32) * 2 - (length == j).to(tl.int32) + (length == i - 1).to(tl.int32)
        bl = tl.where(deepest > 0, bl + move - 2 * (length == i).to(tl.int32), bl)
        i = tl.where(deepest > 0, i, i - 1)
    # each symbol's rank by decreasing count, equal counts the smaller symbol first
    tl.store(row + E_COUNTS + sym, tl.where(present, counts, -1))
    tl.debug_barrier()
    rank = tl.zeros((256,), tl.int32)
    for block in tl.static_range(8):
        other = block * 32 + tl.arange(0, 32)
        theirs = tl.load(row + E_COUNTS + other)
        ahead = (theirs[None, :] > counts[:, None]) | ((theirs[None, :] == counts[:, None]) & (other[None, :] < sym[:, None]))
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    cum = tl.cumsum(bl, axis=0)  # codes of each length or shorter
    lengths = tl.sum((cum[None, :] <= rank[:, None]).to(tl.int32), axis=1)  # cum[0] == 0 counts length 0
    return tl.where(present, lengths, 0)


@triton.jit
def _canonical_codes(lengths, present, row, OFFSET: tl.constexpr):
    """Each symbol's canonical code (DEFLATE's rule), its place in canonical order, and the
    number of codes of each length (int32 [16]); the lengths stored at row + OFFSET on the way."""
    sym = tl.arange(0, 256)
    tl.store(row + OFFSET + sym, lengths)
    tl.debug_barrier()
    before = tl.zeros((256,), tl.int32)  # symbols of the same length before it
    for block in tl.static_range(8):
        other = block * 32 + tl.arange(0, 32)
        theirs = tl.load(row + OFFSET + other)
        before += tl.sum(((theirs[None, :] == lengths[:, None]) & (other[None, :] < sym[:, None])).to(tl.int32), axis=1)
    bl = tl.histogram(lengths, 16, mask=present)
    length = tl.arange(0, 16)
    first = tl.cumsum(bl, axis=0) - bl  # canonical place of each length's first code
    code = tl.zeros((16,), tl.int32)  # each length's first code (DEFLATE's next_code)
    for n in tl.static_range(1, 16):
        previous = tl.sum(tl.where(length == n - 1, code + bl, 0))
        code = tl.where(length == n, previous << 1, code)
    mine = tl.where(length[None, :] == lengths[:, None], 1, 0)
    codes = tl.sum(mine * code[None, :], axis=1) + before
    return codes, tl.sum(mine * first[None, :], axis=1) + before, bl


@triton.jit
def plan_kernel(table, scratch, sizes, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # rows of thousands of entries: past 2**31 in large calls
    src = tl.load(table + pid * 4).to(tl.pointer_type(tl.uint8))
    n = tl.load(table + pid * 4 + 1)
    out = tl.load(table + pid * 4 + 2).to(tl.pointer_type(tl.uint8))
    row = scratch + pid * ENC_ROW
    sym = tl.arange(0, 256)
    counts = tl.zeros((256,), tl.int32)
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        x = tl.load(src + at, mask=at < n, other=0)
        counts += tl.histogram(x.to(tl.int32), 256, mask=at < n)
    present = counts > 0
    k = tl.sum(present.to(tl.int32))
    if k == 1:
        _store_bytes(out, (1 | (n - 1) << 8).to(tl.uint32), 4)
        tl.store(out + 4, tl.max(tl.where(present, sym, 0)).to(tl.uint8))
        tl.store(row + E_FORM, 1)
        tl.store(sizes + pid, 5)
    else:
        lengths = _code_lengths(counts, present, k, row)
        codes, _, _ = _canonical_codes(lengths, present, row, E_NIBBLES)
        tl.store(row + E_CODES + sym, codes << 4 | lengths)
        tl.debug_barrier()
        # each lane's bits: tiles of rounds, [round, lane, byte]
        r = tl.arange(0, BLOCK // ROUND)[:, None, None] * ROUND
        lane = tl.arange(0, LANES)
        b = tl.arange(0, GROUP)[None, None, :]
        bits = tl.zeros((LANES,), tl.int32)
        for start in range(0, n, BLOCK):
            at = start + r + lane[None, :, None] * GROUP + b
            x = tl.load(src + at, mask=at < n, other=0)
            e = tl.load(row + E_CODES + x.to(tl.int32), mask=at < n, other=0)
            bits += tl.sum(tl.sum(e & 15, axis=2), axis=0)
        words = (bits + 31) >> 5
        head = ((k + 1) // 2 + FIXED + 3) // 4 * 4
        size = head + 4 * tl.sum(words)
        if size < n + 4:
            _store_bytes(out, (2 | (n - 1) << 8).to(tl.uint32), 4)
            tl.store(out + 4 + 2 * lane, (words & 0xFF).to(tl.uint8))
            tl.store(out + 5 + 2 * lane, (words >> 8).to(tl.uint8))
            bitmap = tl.reshape(present.to(tl.int32) << (sym % 8), (32, 8))
            tl.store(out + 68 + tl.arange(0, 32), tl.sum(bitmap, axis=1).to(tl.uint8))
            # the lengths of the present symbols, compacted, two to a byte
            place = tl.cumsum(present.to(tl.int32), axis=0) - present.to(tl.int32)
            tl.store(row + E_NIBBLES + place, lengths, mask=present)
            tl.debug_barrier()
            pairs = tl.arange(0, 128)
            low = tl.load(row + E_NIBBLES + 2 * pairs, mask=2 * pairs < k, other=0)
            high = tl.load(row + E_NIBBLES + 2 * pairs + 1, mask=2 * pairs + 1 < k, other=0)
            tl.store(out + FIXED + pairs, (low | high << 4).to(tl.uint8), mask=2 * pairs < k)
            pad = tl.arange(0, 4) + (k + 1) // 2 + FIXED
            tl.store(out + pad, tl.zeros((4,), tl.uint8), mask=pad < head)
            tl.store(row + E_FIRST + lane, tl.cumsum(words, axis=0) - words)
            tl.store(row + E_FORM, 2)
            tl.store(row + E_HEAD, head)
            tl.store(sizes + pid, size.to(tl.int64))
        else:
            _store_bytes(out, ((n - 1) << 8).to(tl.uint32), 4)
            tl.store(row + E_FORM, 0)
            tl.store(sizes + pid, n + 4)


@triton.jit
def _put(acc, nbits, words, code, length, lane_ptr):
    """Append codes to each lane's pending bits; a lane holding 32 writes its next word."""
    acc = acc << length.to(tl.uint64) | code.to(tl.uint64)
    nbits += length
    full = nbits >= 32
    nbits = tl.where(full, nbits - 32, nbits)
    tl.store(lane_ptr + words, _bswap((acc >> nbits.to(tl.uint64)) & 0xFFFFFFFF).to(tl.int32), mask=full)
    return acc, nbits, words + full.to(tl.int32)


@triton.jit
def _pack_round(src, at, n, codes, acc, nbits, words, lane_ptr, WHOLE: tl.constexpr):
    """One round of each lane's 16 bytes at src + at (a whole round: read as words)."""
    for q in tl.static_range(GROUP // 4):
        if WHOLE:
            w = tl.load(src.to(tl.pointer_type(tl.int32)) + (at // 4 + q)).to(tl.uint32)
            x = (w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF, w >> 24)
            valid = (True, True, True, True)
        else:
            x = (tl.load(src + at + 4 * q, mask=at + 4 * q < n, other=0).to(tl.uint32),
                 tl.load(src + at + 4 * q + 1, mask=at + 4 * q + 1 < n, other=0).to(tl.uint32),
                 tl.load(src + at + 4 * q + 2, mask=at + 4 * q + 2 < n, other=0).to(tl.uint32),
                 tl.load(src + at + 4 * q + 3, mask=at + 4 * q + 3 < n, other=0).to(tl.uint32))
            valid = (at + 4 * q < n, at + 4 * q + 1 < n, at + 4 * q + 2 < n, at + 4 * q + 3 < n)
        for p in tl.static_range(2):  # two codes at a time: 24 bits at most
            e0 = tl.where(valid[2 * p], tl.load(codes + x[2 * p].to(tl.int32)), 0)
            e1 = tl.where(valid[2 * p + 1], tl.load(codes + x[2 * p + 1].to(tl.int32)), 0)
            code = (e0 >> 4) << (e1 & 15) | (e1 >> 4)
            acc, nbits, words = _put(acc, nbits, words, code, (e0 & 15) + (e1 & 15), lane_ptr)
    return acc, nbits, words


@triton.jit
def pack_kernel(table, scratch, COPY: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # rows of thousands of entries: past 2**31 in large calls
    src = tl.load(table + pid * 4).to(tl.pointer_type(tl.uint8))
    n = tl.load(table + pid * 4 + 1)
    out = tl.load(table + pid * 4 + 2).to(tl.pointer_type(tl.uint8))
    row = scratch + pid * ENC_ROW
    form = tl.load(row + E_FORM)
    if form == 0:
        for start in range(0, n, COPY):
            at = start + tl.arange(0, COPY)
            tl.store(out + 4 + at, tl.load(src + at, mask=at < n), mask=at < n)
    if form == 2:
        lane = tl.arange(0, LANES)
        lane_ptr = out.to(tl.pointer_type(tl.int32)) + tl.load(row + E_HEAD) // 4 + tl.load(row + E_FIRST + lane)
        acc = tl.zeros((LANES,), tl.uint64)
        nbits = tl.zeros((LANES,), tl.int32)
        words = tl.zeros((LANES,), tl.int32)
        codes = row + E_CODES
        whole = n // ROUND
        for r in range(0, whole):
            acc, nbits, words = _pack_round(src, r * ROUND + lane * GROUP, n, codes, acc, nbits, words, lane_ptr, True)
        acc, nbits, words = _pack_round(src, whole * ROUND + lane * GROUP, n, codes, acc, nbits, words, lane_ptr, False)
        last = _bswap((acc << (32 - nbits).to(tl.uint64)) & 0xFFFFFFFF).to(tl.int32)
        tl.store(lane_ptr + words, last, mask=nbits > 0)


@triton.jit
def table_kernel(table, scratch, tables, status, FIRST: tl.constexpr):
    # table row per chunk: stored address, stored bytes, output address, decoded bytes (the index's)
    # A chunk's tables hold TABLE entries: the 4096 of all codes, then a first level of 2**FIRST
    # (FIRST <= 8) or none (FIRST == 12); a larger first level would write over the next chunk's.
    tl.static_assert(FIRST <= 8 or FIRST == MAX_LEN, "FIRST: 8 bits or fewer, or 12 (a single level)")
    pid = tl.program_id(0).to(tl.int64)  # rows of thousands of entries: past 2**31 in large calls
    src = tl.load(table + pid * 4).to(tl.pointer_type(tl.uint8))
    length = tl.load(table + pid * 4 + 1)
    n = tl.load(table + pid * 4 + 3)
    row = scratch + pid * DEC_ROW
    four = tl.arange(0, 4)
    head_bytes = tl.load(src + four, mask=four < length, other=0).to(tl.int64)
    word = tl.sum(head_bytes << (8 * four).to(tl.int64))
    form = (word & 0xFF).to(tl.int32)
    st = tl.where(length < 4, SHORT, tl.where((word >> 8) + 1 != n, SIZE, 0))
    st = tl.where((st == 0) & (form > 2), FORM, st)
    st = tl.where((st == 0) & (form == 0) & (length != n + 4), STORED_LENGTH, st)
    st = tl.where((st == 0) & (form == 1) & (length != 5), CONSTANT_LENGTH, st)
    if (st == 0) & (form == 2):
        sym = tl.arange(0, 256)
        bitmap = tl.load(src + 68 + sym // 8, mask=_upto(sym, length >= FIXED), other=0).to(tl.int32)
        present = (bitmap >> (sym % 8)) & 1
        k = tl.sum(present.to(tl.int32))
        head = ((k + 1) // 2 + FIXED + 3) // 4 * 4
        short = (length < FIXED) | (k < 2) | (length < head)
        place = tl.cumsum(present.to(tl.int32), axis=0) - present.to(tl.int32)
        nibble = tl.load(src + FIXED + place // 2, mask=(present == 1) & _upto(sym, ~short), other=0).to(tl.int32)
        lengths = tl.where(present == 1, (nibble >> (4 * (place % 2))) & 15, 0)
        pad = tl.arange(0, 4) + (k + 1) // 2 + FIXED
        stray = tl.load(src + pad, mask=(pad < head) & _upto(pad, ~short), other=0)
        half = tl.load(src + FIXED + k // 2, mask=(k % 2 == 1) & ~short, other=0).to(tl.int32) >> 4
        lane = tl.arange(0, LANES)
        whole = _upto(lane, ~short)
        words = (tl.load(src + 4 + 2 * lane, mask=whole, other=0).to(tl.int32)
                 | tl.load(src + 5 + 2 * lane, mask=whole, other=0).to(tl.int32) << 8)
        bad_length = (present == 1) & ((lengths < 1) | (lengths > MAX_LEN))
        kraft = tl.sum(tl.where(present == 1, tl.full((256,), 4096, tl.int32) >> tl.minimum(lengths, MAX_LEN), 0))
        st = tl.where(short, SYMBOLS,
             tl.where((half != 0) | (tl.sum(stray.to(tl.int32)) != 0), PADDING,
             tl.where(tl.sum(bad_length.to(tl.int32)) > 0, LENGTHS,
             tl.where(kraft != 4096, INCOMPLETE,
             tl.where(head + 4 * tl.sum(words).to(tl.int64) != length, FILL,
             tl.where(tl.sum((words > (_lane_bytes(n, lane) * MAX_LEN + 31) // 32).to(tl.int32)) > 0, LANE_BITS, 0))))))
        if st == 0:
            # the entries in canonical order, then each entry's from the length its 12 bits begin with
            _, place, bl = _canonical_codes(lengths, present == 1, row, D_LENS)
            tl.store(row + D_SORTED + place, sym | lengths << 8, mask=present == 1)
            tl.debug_barrier()
            bits = tl.arange(0, 16)
            shift = tl.maximum(bits * -1 + MAX_LEN, 0)
            span = tl.where((bits >= 1) & (bits <= MAX_LEN), bl << shift, 0)
            start = tl.cumsum(span, axis=0) - span  # each length's first entry
            first = tl.cumsum(bl, axis=0) - bl
            for block in range(16):
                v = block * 256 + tl.arange(0, 256)
                inside = (start[None, :] <= v[:, None]) & (v[:, None] < (start + span)[None, :])
                at = tl.sum(tl.where(inside, first[None, :] + ((v[:, None] - start[None, :]) >> shift[None, :]), 0), axis=1)
                entry = tl.load(row + D_SORTED + at)
                tl.store(tables + pid * TABLE + v, entry.to(tl.int16))
                if FIRST < MAX_LEN:  # the single-level decoder (FIRST == 12) reads only the table of all codes
                    # the first level: codes of up to FIRST bits by their first FIRST bits, longer ones 0
                    prefix = v >> (MAX_LEN - FIRST)
                    tl.store(tables + pid * TABLE + 4096 + prefix,
                             tl.where((entry >> 8) <= FIRST, entry, 0).to(tl.int16), mask=prefix << (MAX_LEN - FIRST) == v)
            tl.store(row + D_FIRST + lane, tl.cumsum(words, axis=0) - words)
            tl.store(row + D_HEAD, head)
    tl.store(row + D_FORM, form)
    tl.store(status + pid, st)


@triton.jit
def _refill(buf, cnt, wp, words, end):
    """A lane holding 32 bits or fewer takes its next word (zeros past its end)."""
    need = cnt <= 32
    w = _bswap(tl.load(words + wp, mask=need & (wp < end), other=0))
    buf = buf | (w.to(tl.uint64) << tl.where(need, 32 - cnt, 0).to(tl.uint64))
    return buf, cnt + need.to(tl.int32) * 32, wp + need.to(tl.int32)


@triton.jit
def _symbol(buf, cnt, dtable, valid, FIRST: tl.constexpr):
    """Each lane's next symbol (where ``valid``) and what remains of its bits: looked up by its
    first FIRST bits (a table of few lines, which the warp's 32 lookups mostly share), codes
    longer than that by all 12."""
    if FIRST == MAX_LEN:
        e = tl.load(dtable + (buf >> 52).to(tl.int32)).to(tl.int32)
    else:
        e = tl.load(dtable + 4096 + (buf >> (64 - FIRST)).to(tl.int32)).to(tl.int32)
        long = e == 0
        e = tl.where(long, tl.load(dtable + (buf >> 52).to(tl.int32), mask=long, other=0).to(tl.int32), e)
    used = tl.where(valid, e >> 8, 0)
    return e & 0xFF, buf << used.to(tl.uint64), cnt - used


@triton.jit
def _decode_round(out, at, count, buf, cnt, wp, words, end, dtable, WHOLE: tl.constexpr, FIRST: tl.constexpr):
    """One round of each lane's symbols (``count`` of them; in a whole round all 16, written as words)."""
    for q in tl.static_range(GROUP // 4):
        value = tl.zeros(buf.shape, tl.uint32)
        for p in tl.static_range(2):  # two symbols after each refill: 33 bits or more held
            buf, cnt, wp = _refill(buf, cnt, wp, words, end)
            i = 4 * q + 2 * p
            s0, buf, cnt = _symbol(buf, cnt, dtable, i < count, FIRST)
            s1, buf, cnt = _symbol(buf, cnt, dtable, i + 1 < count, FIRST)
            if WHOLE:
                value = value | (s0 | s1 << 8).to(tl.uint32) << (16 * p)
            else:
                tl.store(out + at + i, s0.to(tl.uint8), mask=i < count)
                tl.store(out + at + i + 1, s1.to(tl.uint8), mask=i + 1 < count)
        if WHOLE:
            tl.store(out.to(tl.pointer_type(tl.int32)) + (at // 4 + q), value.to(tl.int32))
    return buf, cnt, wp


@triton.jit
def decode_kernel(table, scratch, tables, status, COPY: tl.constexpr, FIRST: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # rows of thousands of entries: past 2**31 in large calls
    src = tl.load(table + pid * 4).to(tl.pointer_type(tl.uint8))
    out = tl.load(table + pid * 4 + 2).to(tl.pointer_type(tl.uint8))
    n = tl.load(table + pid * 4 + 3)
    row = scratch + pid * DEC_ROW
    form = tl.load(row + D_FORM)
    st = tl.load(status + pid)
    if (st == 0) & (form == 0):
        for start in range(0, n, COPY):
            at = start + tl.arange(0, COPY)
            tl.store(out + at, tl.load(src + 4 + at, mask=at < n), mask=at < n)
    if (st == 0) & (form == 1):
        value = tl.load(src + 4)
        for start in range(0, n, COPY):
            at = start + tl.arange(0, COPY)
            tl.store(out + at, tl.full((COPY,), value, tl.uint8), mask=at < n)
    if (st == 0) & (form == 2):
        lane = tl.arange(0, LANES)
        words = (src + tl.load(row + D_HEAD)).to(tl.pointer_type(tl.int32))
        first = tl.load(row + D_FIRST + lane)
        end = first + (tl.load(src + 4 + 2 * lane).to(tl.int32) | tl.load(src + 5 + 2 * lane).to(tl.int32) << 8)
        dtable = tables + pid * TABLE
        buf = tl.zeros((LANES,), tl.uint64)
        cnt = tl.zeros((LANES,), tl.int32)
        wp = first
        whole = n // ROUND
        for r in range(0, whole):
            buf, cnt, wp = _decode_round(out, r * ROUND + lane * GROUP, GROUP, buf, cnt, wp, words, end, dtable, True,
                                         FIRST)
        tail = tl.minimum(tl.maximum(n % ROUND - lane * GROUP, 0), GROUP)
        buf, cnt, wp = _decode_round(out, whole * ROUND + lane * GROUP, tail, buf, cnt, wp, words, end, dtable, False,
                                     FIRST)
        used = 32 * (wp - first) - cnt
        have = 32 * (end - first)
        bad = (used > have) | (have - used >= 32) | (buf != 0)
        tl.store(status + pid, LANE_BITS, mask=tl.sum(bad.to(tl.int32)) > 0)
