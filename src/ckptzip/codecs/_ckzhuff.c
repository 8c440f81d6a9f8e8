/* ckz-huff chunks of ckptzip.codecs.ckzhuff (private; that module is the interface), as
 * docs/FORMAT.md specifies them: a size word (form, bytes - 1), then the bytes stored, one byte
 * repeated, or a canonical Huffman code of at most 12-bit codewords and 32 lanes of codes. Byte i
 * of a chunk belongs to lane (i / 16) % 32; a lane's codes lie most significant bit first in
 * bytes filled from their most significant bit, a whole number of 4-byte words, lane after lane.
 *
 * Decoding reads 64 bits at a lane's bit position (a big-endian load: 57 or more of them whole)
 * and looks them up 12 bits at a time, four times, in a table of 2^12 entries that gives every
 * symbol whose code lies whole in the 12 bits, up to 3 of them, so each lookup decodes 1 to 3
 * bytes. Eight lanes run side by side, their lookups interleaved (independent work for the CPU),
 * each into its own run of a staging buffer; a group's runs are then copied, 16 bytes at a time,
 * to their places in the chunk while the next group decodes.
 *
 * Encoding is what ckptzip's GPU encoder (kernels/_ckzhuff_triton.py) writes, byte for byte: the
 * Huffman tree of the chunk's byte counts, merging the two nodes of smallest (weight, id) (a
 * leaf's id is its byte, the k-th merged node's 256 + k), its depths limited to 12 as in JPEG's
 * Annex K.3 and dealt shortest first to the bytes by decreasing count (equal counts: smaller byte
 * first); a chunk of one byte value is a constant, and one the code does not shrink is stored.
 *
 * Untrusted input: every length is checked before it is used, reads stay within the chunk's
 * bytes (a lane reads zeros past its end, and using them fails the chunk), writes within the
 * output slot; the work is linear in the chunk's stored and decoded bytes, and the memory bounded
 * by the largest decoded size a call declares.
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
#define MAX_DECLARED ((size_t)1 << 24) /* the most bytes a size word declares */
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

/* A table entry's fields: the symbols (bits 0-23, the first lowest, zero past the last); its top
 * byte, the symbols' bits (its low 6 bits: a shift by the whole byte on a CPU that masks shift
 * counts to 6 bits, as x86 and arm64 do, is a shift by them) and their number (its top 2 bits). */
#define ENTRY(symbols, bits, count) ((uint32_t)(symbols) | (uint32_t)(bits) << 24 | (uint32_t)(count) << 30)
#define COUNT(e) ((e) >> 30)
#define BITS(e) ((e) >> 24 & 63)

typedef struct {
    uint32_t multi[TABLE];  /* entry v: the symbols whose codes lie whole in the 12 bits v, up to 3 */
    uint8_t lens[256];
    uint16_t words[LANES];
} Code;

static inline uint32_t load32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w; /* little-endian hosts only (checked at import) */
}

#if defined(__GNUC__) || defined(__clang__)
#define BSWAP32 __builtin_bswap32
#define BSWAP64 __builtin_bswap64
#define CTZ64 __builtin_ctzll
#define PREFETCH_W(p) __builtin_prefetch((p), 1)
#else
static uint32_t BSWAP32(uint32_t x) { return x >> 24 | (x >> 8 & 0xFF00) | (x << 8 & 0xFF0000) | x << 24; }
static uint64_t BSWAP64(uint64_t x) { return (uint64_t)BSWAP32((uint32_t)x) << 32 | BSWAP32((uint32_t)(x >> 32)); }
#define PREFETCH_W(p) ((void)(p))
#if defined(_MSC_VER)
#include <intrin.h>
static unsigned CTZ64(uint64_t x) { /* x is not 0 */
    unsigned long i;
    _BitScanForward64(&i, x);
    return (unsigned)i;
}
#else
static unsigned CTZ64(uint64_t x) { /* x is not 0 */
    unsigned n = 0;
    for (; !(x & 1); x >>= 1) n++;
    return n;
}
#endif
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

/* Entries at..end of the table: `count` symbols of `bits` bits in all. */
static inline void fill(uint32_t *table, uint32_t at, uint32_t end, uint32_t symbols, uint32_t bits, uint32_t count) {
    uint32_t e = ENTRY(symbols, bits, count);
    for (; at < end; at++) table[at] = e;
}

/* The table of a complete code of bl[n] codes of each length n (the lengths in c->lens): entry v
 * holds the symbols, up to 3, whose codes lie whole within the 12 bits of v, first to last.
 *
 * It is filled by sequences of symbols rather than entry by entry, in canonical order (by length,
 * then symbol), where the codes are consecutive: code i begins at the 12-bit value at[i] and takes
 * 2^(12 - length) values, at[i + 1] = at[i] + 2^(12 - length of i). The codes of at most r bits
 * are the first le[r] of that order and fill the values below at[le[r]]: so within a symbol's
 * values, whose low r bits are the bits after its code, a second symbol of at most r bits begins
 * at its at[] shifted right by the first's length, and the rest (from at[le[r]] so shifted on)
 * hold no second symbol; likewise a third within the values of a pair. Each entry is written once. */
static void build_table(Code *c, const unsigned *bl) {
    unsigned order[256], le[MAX_LEN + 1], start[MAX_LEN + 1], n, s, i, j, m;
    uint32_t at[257];
    for (n = 1, le[0] = 0; n <= MAX_LEN; n++) le[n] = le[n - 1] + bl[n];
    for (n = 1; n <= MAX_LEN; n++) start[n] = le[n - 1];
    for (s = 0; s < 256; s++)
        if (c->lens[s]) order[start[c->lens[s]]++] = s;
    for (i = 0, at[0] = 0; i < le[MAX_LEN]; i++) at[i + 1] = at[i] + (TABLE >> c->lens[order[i]]);
    for (i = 0; i < le[MAX_LEN]; i++) {
        uint32_t s1 = order[i], n1 = c->lens[s1], r1 = MAX_LEN - n1, base1 = at[i];
        for (j = 0; j < le[r1]; j++) {
            uint32_t s2 = order[j], n2 = c->lens[s2], r2 = r1 - n2, shift = n1 + n2, base2 = base1 + (at[j] >> n1);
            uint32_t pair = s1 | s2 << 8;
            for (m = 0; m < le[r2]; m++)
                fill(c->multi, base2 + (at[m] >> shift), base2 + (at[m + 1] >> shift), pair | order[m] << 16,
                     shift + c->lens[order[m]], 3);
            fill(c->multi, base2 + (at[le[r2]] >> shift), base2 + (1u << r2), pair, shift, 2);
        }
        fill(c->multi, base1 + (at[le[r1]] >> n1), base1 + (1u << r1), s1, n1, 1);
    }
}

/* The code of a Huffman chunk's header: its lengths checked, its table built. */
static Status read_code(Code *c, const uint8_t *in, size_t len, size_t *payload) {
    unsigned s, k = 0, bl[MAX_LEN + 1] = {0}, i;
    uint32_t kraft = 0;
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
    build_table(c, bl);
    return OK;
}

/* The 64 bits from p on, the first the most significant. */
static inline uint64_t load64_be(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return BSWAP64(w);
}

/* The 64 bits from bit `pos` of the payload on (57 or more whole). */
static inline uint64_t window(const uint8_t *payload, uint64_t pos) { return load64_be(payload + (pos >> 3)) << (pos & 7); }

/* The same anywhere: bytes past the payload's `len` read as zeros. */
static uint64_t window_safe(const uint8_t *payload, size_t len, uint64_t pos) {
    uint8_t bytes[8] = {0};
    uint64_t at = pos >> 3;
    if (at + 8 <= len) return window(payload, pos);
    if (at < len) memcpy(bytes, payload + at, (size_t)(len - at));
    return window(bytes, pos & 7);
}

#define SIDE 8 /* lanes decoded side by side: enough lookups in flight for a core; more spill registers */
#define STEP_BYTES 12 /* the most bytes a step decodes: four lookups of 3 */
#define STEP_BITS (4 * MAX_LEN) /* the most bits it reads */
#if defined(__GNUC__) && !defined(__clang__)
#define UNROLLED _Pragma("GCC unroll 8")
#else
#define UNROLLED
#endif

/* A step of SIDE lanes at bits p[j] to o[j]: four lookups of `multi` in each one's window (four
 * take at most STEP_BITS of its 57), lane after lane for each lookup, so that the CPU finds the
 * lanes' independent lookups next to each other. A lookup stores its entry's 4 bytes, of which
 * the symbols it decoded (1 to 3) are kept and the rest overwritten by the next: the step writes
 * up to 3 bytes past its last symbol. Each window's lowest bit that came from the payload is set
 * (it lies past the STEP_BITS + 7 bits a step looks at), so that after the step's shifts its
 * trailing zeros count the bits the step took, plus the position's bits within its byte. */
static inline void step(const uint32_t *multi, const uint8_t *payload, uint64_t *p, uint8_t **o) {
    uint64_t w[SIDE];
    unsigned i, j;
    UNROLLED
    for (j = 0; j < SIDE; j++) w[j] = (load64_be(payload + (p[j] >> 3)) | 1) << (p[j] & 7);
    UNROLLED
    for (i = 0; i < 4; i++) {
        UNROLLED
        for (j = 0; j < SIDE; j++) {
            const uint32_t *t = &multi[w[j] >> (64 - MAX_LEN)];
            uint32_t e = *t;
            store32(o[j], e);
            o[j] += COUNT(e);
            w[j] <<= ((const uint8_t *)t)[3] & 63; /* BITS(e): its top byte (little-endian), loaded, not shifted out */
        }
    }
    UNROLLED
    for (j = 0; j < SIDE; j++) p[j] = (p[j] & ~(uint64_t)7) + CTZ64(w[j]);
}

/* Steps every lane of a group can take unchecked: steps whose reads stay within the payload's
 * len bytes (a step reads 8 bytes from its position's byte on and advances STEP_BITS at most),
 * and that leave no lane with fewer bytes to decode than a step may decode. */
static size_t safe_steps(const uint64_t *pos, uint8_t *const *out, uint8_t *const *end, size_t len) {
    size_t k = SIZE_MAX, j;
    for (j = 0; j < SIDE; j++) {
        size_t left = (size_t)(end[j] - out[j]), at = (size_t)(pos[j] >> 3), by_bytes, by_bits;
        if (left < STEP_BYTES || at + 8 > len) return 0;
        by_bytes = (left - STEP_BYTES) / STEP_BYTES + 1;
        by_bits = (len - 8 - at) / (STEP_BITS / 8) + 1;
        by_bytes = by_bytes < by_bits ? by_bytes : by_bits;
        k = k < by_bytes ? k : by_bytes;
    }
    return k;
}

/* A decoded group's rounds on their way to the chunk: lane j's k-th 16 bytes, from stage + j *
 * stride + k * GROUP, are the chunk's bytes from dest + k * ROUND + j * GROUP on; rounds `next`
 * to `rounds` are still to go. */
typedef struct {
    const uint8_t *stage;
    uint8_t *dest;
    size_t stride, next, rounds;
} Pending;

static inline void copy_round(Pending *q) {
    unsigned j;
    for (j = 0; j < SIDE; j++)
        memcpy(q->dest + q->next * ROUND + j * GROUP, q->stage + j * q->stride + q->next * GROUP, GROUP);
    q->next++;
}

/* The SIDE lanes of a group side by side, each into its own run of bytes (out[j] to end[j]), as
 * long as every one of them can step unchecked: independent lanes keep the CPU's table lookups
 * in flight together. The lanes' state lives in locals, which the byte stores cannot alias.
 * Each step also sends a round of the group before (q) to the chunk, so that those writes wait
 * on memory while the lookups run, and fetches a round of this group's places in the chunk
 * (from `dest` to `last`) for writing, so that they are in cache when their turn comes (a lane
 * takes more steps than rounds). */
static void lanes_side_by_side(const uint32_t *multi, const uint8_t *payload, size_t len, uint64_t *pos,
                               uint8_t **out, uint8_t *const *end, Pending *q, const uint8_t *dest,
                               const uint8_t *last) {
    uint64_t p[SIDE];
    uint8_t *o[SIDE];
    size_t j, k;
    for (j = 0; j < SIDE; j++) p[j] = pos[j], o[j] = out[j];
    while ((k = safe_steps(p, o, end, len)) > 0)
        for (; k > 0; k--) {
            step(multi, payload, p, o);
            if (q->next < q->rounds) copy_round(q);
            if (dest < last) {
                PREFETCH_W(dest);
                PREFETCH_W(dest + SIDE * GROUP - 1);
                dest += ROUND;
            }
        }
    for (j = 0; j < SIDE; j++) pos[j] = p[j], out[j] = o[j];
}

/* The rest of a lane, one lookup at a time: a lookup's symbols where the lane has room for them
 * all, else its first alone (store32's 3 extra bytes fall in the gap after the lane's bytes). */
static void lane_rest(const Code *c, const uint8_t *payload, size_t len, uint64_t *pos, uint8_t *o,
                      const uint8_t *end) {
    while (o < end) {
        uint64_t w = window_safe(payload, len, *pos);
        uint32_t e = c->multi[w >> (64 - MAX_LEN)];
        if (COUNT(e) <= (size_t)(end - o)) {
            store32(o, e);
            o += COUNT(e);
            *pos += BITS(e);
        } else { /* its first symbol alone */
            *o++ = (uint8_t)e;
            *pos += c->lens[e & 0xFF];
        }
    }
}

/* Bytes between the starts of two lanes in the staging buffer: a lane's most bytes, and a gap
 * of one group for the bytes a lookup writes past the lane's last. */
static size_t lane_stride(size_t n) { return (n / ROUND + 1) * GROUP + GROUP; }

/* The staging buffer's bytes for chunks of at most n bytes: two groups (one decoding, the one
 * before on its way to the chunk). */
static size_t stage_bytes(size_t n) { return 2 * SIDE * lane_stride(n); }

/* The lanes, SIDE at a time: each lane's bytes decoded into its run of the staging buffer (a lane
 * takes 1 to 3 bytes a lookup, so its bytes are contiguous there), then copied to the chunk while
 * the next group decodes. */
static Status decode_huffman(Code *c, uint8_t *stage, const uint8_t *in, size_t len, uint8_t *out, size_t n) {
    size_t start = 0, r, body, stride = lane_stride(n), rounds = n / ROUND, tail = n % ROUND;
    uint64_t pos[LANES];
    const uint8_t *payload;
    unsigned l, g, j;
    Pending q = {NULL, NULL, 0, 0, 0};
    Status st = read_code(c, in, len, &start);
    if (st != OK) return st;
    payload = in + start;
    body = len - start;
    for (l = 0, r = 0; l < LANES; l++) {
        if (c->words[l] > (lane_bytes(n, l) * MAX_LEN + 31) / 32) return LANE_BITS; /* more than its codes fill */
        pos[l] = 32 * (uint64_t)r;
        r += c->words[l];
    }
    for (g = 0; g < LANES; g += SIDE) {
        uint8_t *o[SIDE], *end[SIDE], *half = stage + (g / SIDE % 2) * SIDE * stride, *dest = out + g * GROUP;
        for (j = 0; j < SIDE; j++) {
            o[j] = half + j * stride;
            end[j] = o[j] + lane_bytes(n, g + j);
        }
        lanes_side_by_side(c->multi, payload, body, pos + g, o, end, &q, dest, out + rounds * ROUND);
        for (j = 0; j < SIDE; j++) lane_rest(c, payload, body, &pos[g + j], o[j], end[j]);
        while (q.next < q.rounds) copy_round(&q);
        for (j = 0; j < SIDE && (g + j) * GROUP < tail; j++) /* the last round, short of a whole one */
            memcpy(dest + rounds * ROUND + j * GROUP, half + j * stride + rounds * GROUP,
                   tail - (g + j) * GROUP < GROUP ? tail - (g + j) * GROUP : GROUP);
        q.stage = half, q.dest = dest, q.stride = stride, q.next = 0, q.rounds = rounds;
    }
    while (q.next < q.rounds) copy_round(&q);
    for (l = 0, r = 0; l < LANES; l++) { /* each lane ends in its last word, whose unused bits are zero */
        uint64_t end = 32 * (uint64_t)(r + c->words[l]);
        r += c->words[l];
        if (pos[l] > end || end - pos[l] >= 32) return LANE_BITS;
        if (pos[l] < end && BSWAP32(load32(payload + end / 8 - 4)) << (32 - (end - pos[l]))) return LANE_BITS;
    }
    return OK;
}

static Status decode_chunk(Code *c, uint8_t *stage, const uint8_t *in, size_t len, uint8_t *out, size_t n) {
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
    return decode_huffman(c, stage, in, len, out, n);
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
    uint8_t *stage;
    size_t most = 1;
    (void)self;
    if ((n = get_rows(args, &rows, &sizes)) < 0) return NULL;
    for (r = 0; r < n; r++) { /* the staging buffer's size: the largest chunk a size word can declare, at most */
        int64_t want = ((const int64_t *)rows.buf)[4 * r + 3];
        if (want > (int64_t)most) most = want < (int64_t)MAX_DECLARED ? (size_t)want : MAX_DECLARED;
    }
    Py_BEGIN_ALLOW_THREADS
    c = (Code *)malloc(sizeof(Code));
    stage = (uint8_t *)malloc(stage_bytes(most));
    if (c == NULL || stage == NULL) {
        st = NO_MEMORY;
    } else {
        for (r = 0; r < n; r++) {
            const int64_t *row = (const int64_t *)rows.buf + 4 * r;
            st = decode_chunk(c, stage, (const uint8_t *)(uintptr_t)row[0], (size_t)row[1],
                              (uint8_t *)(uintptr_t)row[2], (size_t)row[3]);
            if (st != OK) break;
            ((uint64_t *)sizes.buf)[r] = (uint64_t)row[3];
        }
    }
    free(c);
    free(stage);
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
