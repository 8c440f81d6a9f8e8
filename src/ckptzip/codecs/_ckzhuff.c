/* ckz-huff chunks of ckptzip.codecs.ckzhuff (private; that module is the interface), as
 * docs/FORMAT.md specifies them: a size word (form, bytes - 1), then the bytes stored, one byte
 * repeated, or a canonical Huffman code of at most 12-bit codewords and 32 lanes of codes. Byte i
 * of a chunk belongs to lane (i / 16) % 32; a lane's codes lie most significant bit first in
 * bytes filled from their most significant bit, a whole number of 4-byte words, lane after lane.
 *
 * Decoding reads 64 bits at a lane's bit position (a big-endian load: 57 or more of them whole),
 * looks two codewords at a time up in a table of 2^12 entries (one at a time where they do not
 * fit in 12 bits), four per load, and runs eight lanes side by side: each round of 512 bytes, each
 * lane decodes its 16 bytes, so the eight write two 64-byte lines of the output.
 *
 * Encoding is what ckptzip's GPU encoder (kernels/_ckzhuff_triton.py) writes, byte for byte: the
 * Huffman tree of the chunk's byte counts, merging the two nodes of smallest (weight, id) (a
 * leaf's id is its byte, the k-th merged node's 256 + k), its depths limited to 12 as in JPEG's
 * Annex K.3 and dealt shortest first to the bytes by decreasing count (equal counts: smaller byte
 * first); a chunk of one byte value is a constant, and one the code does not shrink is stored.
 *
 * Untrusted input: every length is checked before it is used, reads stay within the chunk's
 * bytes (a lane reads zeros past its end, and using them fails the chunk), writes within the
 * output slot; the work is linear in the chunk's stored and decoded bytes and the memory fixed.
 *
 * decode(rows, sizes) and encode(rows, sizes) release the GIL; rows are (input address, length,
 * output address, capacity), int64. decode: capacity is the decoded size the index declares;
 * sizes receives the decoded sizes; returns None or (row, reason). encode: capacity is at least
 * length + 4; sizes receives the coded sizes; returns None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "../_pybuffers.h"
#include <string.h>

#define LANES 32
#define GROUP 16
#define ROUND (LANES * GROUP)
#define MAX_LEN 12
#define TABLE (1u << MAX_LEN)
#define MAX_CHUNK (1u << 22)
#define MAX_DEPTH 32 /* a Huffman tree of at most 2^22 weight is at most 31 deep */
#define FIXED_HEADER (4 + 2 * LANES + 32)

enum { STORED = 0, CONSTANT = 1, HUFFMAN = 2 };

typedef enum {
    OK = 0, SHORT, SIZE, FORM, STORED_LENGTH, CONSTANT_LENGTH, SYMBOLS, PADDING, LENGTHS, INCOMPLETE, FILL,
    LANE_BITS, NO_MEMORY
} Status;

static const char *const MESSAGES[] = {
    "", "fewer than 4 bytes", "a size word declaring another decoded size", "an unknown form",
    "stored bytes of another length than declared", "a constant of more than one byte",
    "a code of fewer than 2 symbols, or a header longer than the chunk", "header padding that is not zero",
    "a code length outside 1 to 12", "an incomplete or over-subscribed code",
    "lane lengths that do not add up to the chunk", "a lane whose codes do not fill its words exactly",
    "no memory for the decoder",
};

#define PAIR (1u << 16)

typedef struct {
    uint16_t single[TABLE]; /* the symbol (bits 0-7) and code length (8-11) of each 12-bit prefix */
    uint32_t pair[TABLE];   /* the first symbol (bits 0-7), the second where both codes fit (8-15, and bit
                               16 set), and the bits of those (24-31) */
    uint8_t lens[256];
    uint16_t words[LANES];
} Code;

static inline uint32_t load32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w; /* little-endian hosts only (checked at import) */
}

static inline void store16(uint8_t *p, uint32_t w) {
    uint16_t h = (uint16_t)w;
    memcpy(p, &h, 2);
}

#if defined(__GNUC__) || defined(__clang__)
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define BSWAP32 __builtin_bswap32
#define BSWAP64 __builtin_bswap64
#else
#define LIKELY(x) (x)
static uint32_t BSWAP32(uint32_t x) { return x >> 24 | (x >> 8 & 0xFF00) | (x << 8 & 0xFF0000) | x << 24; }
static uint64_t BSWAP64(uint64_t x) { return (uint64_t)BSWAP32((uint32_t)x) << 32 | BSWAP32((uint32_t)(x >> 32)); }
#endif

/* A 32-bit word most significant byte first (the lanes' bit order), little-endian otherwise. */
static inline void store32_be(uint8_t *p, uint32_t w) {
    w = BSWAP32(w);
    memcpy(p, &w, 4);
}

static inline void store32(uint8_t *p, uint32_t w) { memcpy(p, &w, 4); }

static inline size_t header_size(unsigned symbols) { return (FIXED_HEADER + (symbols + 1) / 2 + 3) & ~(size_t)3; }

/* Bytes of lane l in a chunk of n bytes. */
static size_t lane_bytes(size_t n, unsigned l) {
    size_t rounds = n / ROUND, tail = n % ROUND, at = (size_t)l * GROUP;
    return rounds * GROUP + (tail > at ? (tail - at < GROUP ? tail - at : GROUP) : 0);
}

/* The first code of each length, DEFLATE's canonical rule, from the number of codes of each. */
static void first_codes(const unsigned *bl, uint32_t *next) {
    uint32_t code = 0;
    unsigned n;
    for (n = 1; n <= MAX_LEN; n++) {
        code = (code + (n > 1 ? bl[n - 1] : 0)) << 1;
        next[n] = code;
    }
}

/* ---------------------------------------------------------------- decoding */

/* The code of a Huffman chunk's header: its lengths checked, its tables built. */
static Status read_code(Code *c, const uint8_t *in, size_t len, size_t *payload) {
    unsigned s, k = 0, bl[MAX_LEN + 1] = {0}, i;
    uint32_t next[MAX_LEN + 1], kraft = 0, v;
    size_t size, total = 0;
    const uint8_t *present = in + 4 + 2 * LANES, *nibbles = in + FIXED_HEADER;
    if (len < FIXED_HEADER) return SYMBOLS;
    for (s = 0; s < 256; s++) k += present[s >> 3] >> (s & 7) & 1;
    size = header_size(k);
    if (k < 2 || len < size) return SYMBOLS;
    if ((k & 1) && nibbles[k / 2] >> 4) return PADDING;
    for (i = FIXED_HEADER + (k + 1) / 2; i < size; i++)
        if (in[i]) return PADDING;
    for (s = 0, i = 0; s < 256; s++) {
        unsigned n = 0;
        if (present[s >> 3] >> (s & 7) & 1) {
            n = nibbles[i / 2] >> (4 * (i & 1)) & 15;
            i++;
            if (n < 1 || n > MAX_LEN) return LENGTHS;
            bl[n]++;
            kraft += TABLE >> n;
        }
        c->lens[s] = (uint8_t)n;
    }
    if (kraft != TABLE) return INCOMPLETE;
    for (i = 0; i < LANES; i++) {
        c->words[i] = (uint16_t)(in[4 + 2 * i] | in[5 + 2 * i] << 8);
        total += c->words[i];
    }
    if (size + 4 * total != len) return FILL;
    *payload = size;
    first_codes(bl, next);
    for (s = 0; s < 256; s++) { /* each code fills the entries it begins */
        unsigned n = c->lens[s];
        uint32_t at, end;
        if (!n) continue;
        at = next[n]++ << (MAX_LEN - n);
        for (end = at + (TABLE >> n); at < end; at++) c->single[at] = (uint16_t)(s | n << 8);
    }
    for (v = 0; v < TABLE; v++) {
        uint32_t e = c->single[v], n = e >> 8, f = c->single[(v << n) & (TABLE - 1)], m = f >> 8;
        c->pair[v] = n + m <= MAX_LEN ? (e & 0xFF) | (f & 0xFF) << 8 | PAIR | (n + m) << 24 : (e & 0xFF) | n << 24;
    }
    return OK;
}

/* The 64 bits from bit `pos` of the payload on (57 or more whole). */
static inline uint64_t window(const uint8_t *payload, uint64_t pos) {
    uint64_t w;
    memcpy(&w, payload + (pos >> 3), 8);
    return BSWAP64(w) << (pos & 7);
}

/* The same anywhere: bytes past the payload's `len` read as zeros. */
static uint64_t window_safe(const uint8_t *payload, size_t len, uint64_t pos) {
    uint8_t bytes[8] = {0};
    uint64_t at = pos >> 3;
    if (at < len) memcpy(bytes, payload + at, len - at < 8 ? (size_t)(len - at) : 8);
    return window(bytes, pos & 7);
}

/* One symbol from the window w to out[0]; returns its bits. */
static inline uint32_t one(const Code *c, uint64_t w, uint8_t *out) {
    uint32_t e = c->single[w >> (64 - MAX_LEN)];
    out[0] = (uint8_t)e;
    return e >> 8;
}

/* Two symbols from the window w (24 bits or more whole) to out[0] and out[1]; returns their bits. */
static inline uint32_t two(const Code *c, uint64_t w, uint8_t *out) {
    uint32_t e = c->pair[w >> (64 - MAX_LEN)], n = e >> 24;
    store16(out, e);
    return LIKELY(e & PAIR) ? n : n + one(c, w << n, out + 1);
}

/* Four symbols from the window w (48 bits or more whole). */
static inline uint32_t four(const Code *c, uint64_t w, uint8_t *out) {
    uint32_t n = two(c, w, out);
    return n + two(c, w << n, out + 2);
}

/* `count` (at most GROUP) symbols of the lane at bit *pos, reading within the payload's len bytes. */
static void lane_group(const Code *c, const uint8_t *payload, size_t len, uint64_t *pos, uint8_t *out, size_t count) {
    size_t i;
    for (i = 0; i + 4 <= count; i += 4) *pos += four(c, window_safe(payload, len, *pos), out + i);
    for (; i < count; i++) *pos += one(c, window_safe(payload, len, *pos), out + i);
}

#define SIDE 8 /* lanes decoded side by side */

/* Full rounds of SIDE lanes side by side from round r while none of them can read past the
 * payload (a round takes at most 24 bytes of a lane, a window 8 more; bit positions in locals,
 * which the output's byte stores cannot alias); returns the next round. */
static size_t lanes_side_by_side(const Code *c, const uint8_t *payload, size_t len, uint64_t *pos, uint8_t *out,
                                 size_t r, size_t rounds) {
    uint64_t p0 = pos[0], p1 = pos[1], p2 = pos[2], p3 = pos[3], p4 = pos[4], p5 = pos[5], p6 = pos[6], p7 = pos[7];
    for (; r < rounds; r++) {
        uint8_t *o = out + r * ROUND;
        uint64_t a = p0 > p1 ? p0 : p1, b = p2 > p3 ? p2 : p3, d = p4 > p5 ? p4 : p5, e = p6 > p7 ? p6 : p7;
        unsigned i;
        a = a > b ? a : b;
        d = d > e ? d : e;
        if ((a > d ? a : d) / 8 + 32 > len) break;
        for (i = 0; i < GROUP; i += 4) {
            p0 += four(c, window(payload, p0), o + i);
            p1 += four(c, window(payload, p1), o + GROUP + i);
            p2 += four(c, window(payload, p2), o + 2 * GROUP + i);
            p3 += four(c, window(payload, p3), o + 3 * GROUP + i);
            p4 += four(c, window(payload, p4), o + 4 * GROUP + i);
            p5 += four(c, window(payload, p5), o + 5 * GROUP + i);
            p6 += four(c, window(payload, p6), o + 6 * GROUP + i);
            p7 += four(c, window(payload, p7), o + 7 * GROUP + i);
        }
    }
    pos[0] = p0, pos[1] = p1, pos[2] = p2, pos[3] = p3, pos[4] = p4, pos[5] = p5, pos[6] = p6, pos[7] = p7;
    return r;
}

static Status decode_huffman(Code *c, const uint8_t *in, size_t len, uint8_t *out, size_t n) {
    size_t start = 0, rounds = n / ROUND, r, tail = n % ROUND, body;
    uint64_t pos[LANES];
    const uint8_t *payload;
    unsigned l, g;
    Status st = read_code(c, in, len, &start);
    if (st != OK) return st;
    payload = in + start;
    body = len - start;
    for (l = 0, r = 0; l < LANES; l++) {
        if (c->words[l] > (lane_bytes(n, l) * MAX_LEN + 31) / 32) return LANE_BITS; /* more than its codes fill */
        pos[l] = 32 * (uint64_t)r;
        r += c->words[l];
    }
    for (g = 0; g < LANES; g += SIDE)
        for (r = lanes_side_by_side(c, payload, body, pos + g, out + g * GROUP, 0, rounds); r < rounds; r++)
            for (l = g; l < g + SIDE; l++) lane_group(c, payload, body, &pos[l], out + r * ROUND + l * GROUP, GROUP);
    for (l = 0; l < LANES && l * GROUP < tail; l++)
        lane_group(c, payload, body, &pos[l], out + rounds * ROUND + l * GROUP,
                   tail - l * GROUP < GROUP ? tail - l * GROUP : GROUP);
    for (l = 0, r = 0; l < LANES; l++) { /* each lane ends in its last word, whose unused bits are zero */
        uint64_t end = 32 * (uint64_t)(r + c->words[l]);
        r += c->words[l];
        if (pos[l] > end || end - pos[l] >= 32) return LANE_BITS;
        if (pos[l] < end && BSWAP32(load32(payload + end / 8 - 4)) << (32 - (end - pos[l]))) return LANE_BITS;
    }
    return OK;
}

static Status decode_chunk(Code *c, const uint8_t *in, size_t len, uint8_t *out, size_t n) {
    uint32_t word, form;
    if (len < 4) return SHORT;
    word = load32(in);
    form = word & 0xFF;
    if ((size_t)(word >> 8) + 1 != n) return SIZE;
    if (form == STORED) {
        if (len - 4 != n) return STORED_LENGTH;
        memcpy(out, in + 4, n);
        return OK;
    }
    if (form == CONSTANT) {
        if (len != 5) return CONSTANT_LENGTH;
        memset(out, in[4], n);
        return OK;
    }
    if (form != HUFFMAN) return FORM;
    return decode_huffman(c, in, len, out, n);
}

/* ---------------------------------------------------------------- encoding */

/* Code lengths of the counts (two or more present): see the top of this file. */
static void code_lengths(const uint32_t *counts, uint8_t *lens) {
    uint64_t leaves[256];             /* (count, symbol) ascending */
    uint32_t weight[255], parent[512]; /* merged nodes' weights; each node's parent */
    uint8_t depth[512];
    unsigned k = 0, s, i, li = 0, mi = 0, made = 0, bl[MAX_DEPTH + 1] = {0}, n;
    for (s = 0; s < 256; s++)
        if (counts[s]) leaves[k++] = (uint64_t)counts[s] << 8 | s;
    for (i = 1; i < k; i++) { /* insertion sort: few symbols, mostly */
        uint64_t x = leaves[i];
        unsigned j = i;
        for (; j > 0 && leaves[j - 1] > x; j--) leaves[j] = leaves[j - 1];
        leaves[j] = x;
    }
    for (made = 0; made + 1 < k; made++) { /* two queues: leaves, then merged nodes in the order made */
        uint32_t w = 0, pick;
        for (pick = 0; pick < 2; pick++) {
            unsigned id;
            if (li < k && (mi >= made || (leaves[li] >> 8) <= weight[mi])) { /* a leaf wins ties: its id is smaller */
                id = (unsigned)(leaves[li] & 0xFF);
                w += (uint32_t)(leaves[li++] >> 8);
            } else {
                id = 256 + mi;
                w += weight[mi++];
            }
            parent[id] = 256 + made;
        }
        weight[made] = w;
    }
    depth[256 + k - 2] = 0; /* the root */
    for (i = k - 2; i-- > 0;) depth[256 + i] = (uint8_t)(depth[parent[256 + i]] + 1);
    for (i = 0; i < k; i++) bl[depth[parent[leaves[i] & 0xFF]] + 1]++;
    for (i = MAX_DEPTH; i > MAX_LEN;) { /* JPEG Annex K.3 */
        if (bl[i]) {
            unsigned j = i - 2;
            while (!bl[j]) j--;
            bl[i] -= 2;
            bl[i - 1]++;
            bl[j + 1] += 2;
            bl[j]--;
        } else {
            i--;
        }
    }
    /* by decreasing count, the smaller symbol first: leaves[] backwards, runs of equal counts forwards */
    for (i = k, n = 1; i > 0;) {
        unsigned end = i, start = i - 1;
        while (start > 0 && leaves[start - 1] >> 8 == leaves[i - 1] >> 8) start--;
        for (i = start; i < end; i++) {
            while (!bl[n]) n++;
            lens[leaves[i] & 0xFF] = (uint8_t)n;
            bl[n]--;
        }
        i = start;
    }
}

typedef struct {
    uint8_t *out;
    uint64_t acc; /* pending bits, the last in the lowest */
    uint32_t nbits;
} Writer;

static inline void put(Writer *w, uint32_t code, uint32_t len) {
    w->acc = w->acc << len | code;
    w->nbits += len;
    if (w->nbits >= 32) {
        w->nbits -= 32;
        store32_be(w->out, (uint32_t)(w->acc >> w->nbits));
        w->out += 4;
    }
}

/* Bits of each lane's codes (the exact sizes, where the total alone does not decide the form). */
static void lane_bits(const uint8_t *in, size_t n, const uint8_t *lens, uint64_t *bits) {
    size_t r, j;
    unsigned l;
    for (r = 0; r < n; r += ROUND)
        for (l = 0; l < LANES && r + (size_t)l * GROUP < n; l++) {
            const uint8_t *g = in + r + (size_t)l * GROUP;
            size_t m = n - (r + (size_t)l * GROUP) < GROUP ? n - (r + (size_t)l * GROUP) : GROUP;
            for (j = 0; j < m; j++) bits[l] += lens[g[j]];
        }
}

static size_t stored(const uint8_t *in, size_t n, uint8_t *out) {
    store32(out, STORED | (uint32_t)(n - 1) << 8);
    memcpy(out + 4, in, n);
    return n + 4;
}

static size_t encode_chunk(const uint8_t *in, size_t n, uint8_t *out) {
    uint32_t counts[4][256], code[256], next[MAX_LEN + 1];
    uint8_t lens[256] = {0};
    unsigned bl[MAX_LEN + 1] = {0}, k = 0, s, l;
    uint64_t total = 0, bits[LANES] = {0};
    size_t i, head, size;
    memset(counts, 0, sizeof(counts));
    for (i = 0; i + 4 <= n; i += 4) {
        counts[0][in[i]]++;
        counts[1][in[i + 1]]++;
        counts[2][in[i + 2]]++;
        counts[3][in[i + 3]]++;
    }
    for (; i < n; i++) counts[0][in[i]]++;
    for (s = 0; s < 256; s++) {
        counts[0][s] += counts[1][s] + counts[2][s] + counts[3][s];
        k += counts[0][s] != 0;
    }
    if (k == 1) {
        store32(out, CONSTANT | (uint32_t)(n - 1) << 8);
        out[4] = in[0];
        return 5;
    }
    code_lengths(counts[0], lens);
    for (s = 0; s < 256; s++) {
        bl[lens[s]] += lens[s] != 0;
        total += (uint64_t)counts[0][s] * lens[s];
    }
    head = header_size(k);
    /* the lanes' words are total / 32 and at most 31 more: where that decides, no pass counts them */
    if (head + 4 * ((total + 31) / 32) >= n + 4) return stored(in, n, out);
    if (head + 4 * (total / 32 + LANES - 1) >= n + 4) {
        lane_bits(in, n, lens, bits);
        for (l = 0, size = head; l < LANES; l++) size += 4 * ((bits[l] + 31) / 32);
        if (size >= n + 4) return stored(in, n, out);
    }
    first_codes(bl, next);
    for (s = 0; s < 256; s++)
        if (lens[s]) code[s] = next[lens[s]]++ << 4 | lens[s];
    store32(out, HUFFMAN | (uint32_t)(n - 1) << 8);
    memset(out + 4, 0, head - 4);
    for (s = 0, i = 0; s < 256; s++)
        if (lens[s]) {
            out[4 + 2 * LANES + s / 8] |= (uint8_t)(1u << (s % 8));
            out[FIXED_HEADER + i / 2] |= (uint8_t)(lens[s] << (4 * (i & 1)));
            i++;
        }
    {
        Writer w = {out + head, 0, 0};
        for (l = 0; l < LANES; l++) { /* lane after lane, each ending in a whole word */
            uint8_t *start = w.out;
            size_t r, words;
            for (r = (size_t)l * GROUP; r < n; r += ROUND) {
                const uint8_t *g = in + r;
                size_t j, m = n - r < GROUP ? n - r : GROUP;
                for (j = 0; j + 2 <= m; j += 2) { /* two codes at a time: 24 bits at most */
                    uint32_t a = code[g[j]], b = code[g[j + 1]];
                    put(&w, (a >> 4) << (b & 15) | b >> 4, (a & 15) + (b & 15));
                }
                if (j < m) put(&w, code[g[j]] >> 4, code[g[j]] & 15);
            }
            if (w.nbits) {
                store32_be(w.out, (uint32_t)(w.acc << (32 - w.nbits)));
                w.out += 4;
                w.nbits = 0;
            }
            words = (size_t)(w.out - start) / 4;
            out[4 + 2 * l] = (uint8_t)words;
            out[5 + 2 * l] = (uint8_t)(words >> 8);
        }
        return (size_t)(w.out - out);
    }
}

/* ---------------------------------------------------------------- Python */

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer rows, sizes;
    Py_ssize_t n, r = 0;
    Status st = OK;
    Code *c;
    (void)self;
    if ((n = get_rows(args, &rows, &sizes)) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    c = (Code *)malloc(sizeof(Code));
    if (c == NULL) {
        st = NO_MEMORY;
    } else {
        for (r = 0; r < n; r++) {
            const int64_t *row = (const int64_t *)rows.buf + 4 * r;
            st = decode_chunk(c, (const uint8_t *)(uintptr_t)row[0], (size_t)row[1], (uint8_t *)(uintptr_t)row[2],
                              (size_t)row[3]);
            if (st != OK) break;
            ((uint64_t *)sizes.buf)[r] = (uint64_t)row[3];
        }
        free(c);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&sizes);
    if (st == NO_MEMORY) return PyErr_NoMemory();
    if (st != OK) return Py_BuildValue("(ns)", r, MESSAGES[st]);
    Py_RETURN_NONE;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer rows, sizes;
    Py_ssize_t n, r;
    (void)self;
    if ((n = get_rows(args, &rows, &sizes)) < 0) return NULL;
    for (r = 0; r < n; r++) {
        const int64_t *row = (const int64_t *)rows.buf + 4 * r;
        if (row[1] < 1 || row[1] > (int64_t)MAX_CHUNK || row[3] < row[1] + 4) {
            PyBuffer_Release(&rows);
            PyBuffer_Release(&sizes);
            return PyErr_Format(PyExc_ValueError, "row %zd: %lld bytes into %lld; chunks hold 1 to %u bytes and "
                                "need 4 more of room", r, (long long)row[1], (long long)row[3], MAX_CHUNK);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (r = 0; r < n; r++) {
        const int64_t *row = (const int64_t *)rows.buf + 4 * r;
        ((uint64_t *)sizes.buf)[r] = encode_chunk((const uint8_t *)(uintptr_t)row[0], (size_t)row[1],
                                                  (uint8_t *)(uintptr_t)row[2]);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&sizes);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "decode(rows, sizes): ckz-huff chunks into their slots; None or (row, reason)"},
    {"encode", encode, METH_VARARGS, "encode(rows, sizes): chunks into ckz-huff chunks in their slots"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ckzhuff", "ckptzip's ckz-huff coder.", -1, methods};

PyMODINIT_FUNC PyInit__ckzhuff(void) {
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "ckptzip's ckz-huff coder needs a little-endian CPU");
        return NULL;
    }
    return PyModule_Create(&module);
}
