/* GDeflate decoder of ckptzip.codecs.gdeflate_cpu (private; that module is the interface).
 *
 * A chunk is one bare GDeflate stream, as nvCOMP writes it: DEFLATE blocks (RFC 1951, with
 * Deflate64's meanings of length symbol 285, 3 + 16 extra bits, and distance symbols 30 and 31)
 * whose bits are dealt to 32 lanes. Each lane reads its own little-endian 64-bit buffer; the
 * stream opens with one 32-bit word per lane, and after each operation a lane that took bits
 * and holds fewer than 32 takes the stream's next word. An operation is one symbol with its
 * extra bits. Lane 0 reads the block headers and a stored block's 16-bit length (no
 * alignment, no complement); the code-length code's lengths go to lanes 0, 1, ... in turn;
 * the code lengths, a stored block's bytes and the literal/length symbols go round-robin from
 * lane 0 at each block. A lane that reads a length reads its distance in the next round, in
 * place of a new symbol, while the match keeps its place in the output; after the end-of-block
 * symbol only those distances are read.
 *
 * Untrusted input: every write stays within the chunk's output slot, reads stay within its
 * bytes (words past the end read as zeros, and taking any of those bits fails the chunk as
 * truncated), and the work is linear in the input and output: a block costs work (a dynamic
 * block's tables most), paid by the bytes the chunk has read and decoded before it, so blocks
 * that decode next to nothing fail the chunk after a few instead of costing their tables each.
 * Codes must be complete, except a code of no codeword or of one 1-bit codeword (reading its
 * unused half fails).
 *
 * decode(rows, sizes) releases the GIL; rows are (input address, length, output address,
 * capacity), int64, and sizes receives the decoded lengths.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_pybuffers.h"

#define LANES 32
#define LIT_BITS 11 /* bits of the first-level tables; longer codes go through a second level */
#define DIST_BITS 8
#define PRE_BITS 7 /* the longest code-length code */
#define MAX_LEN 15
#define LIT_SYMS 288
#define DIST_SYMS 32
#define PRE_SYMS 19
/* a first level and, per longer codeword at most, a second level of up to 2^(15 - bits) entries */
#define LIT_ENTRIES ((1 << LIT_BITS) + LIT_SYMS * (1 << (MAX_LEN - LIT_BITS)))
#define DIST_ENTRIES ((1 << DIST_BITS) + DIST_SYMS * (1 << (MAX_LEN - DIST_BITS)))
/* A block's work, in bytes of ordinary decoding: a dynamic block's tables (some 5000 entries
 * written) cost about what decoding 2-4 KiB does, any other block's header a few dozen; the
 * first dynamic block of a chunk is free, and every byte read or decoded pays one. nvCOMP's
 * encoders write one dynamic block per chunk on a GPU, blocks of over 10 KiB on the CPU. */
#define TABLE_WORK 2048
#define BLOCK_WORK 32
#define FREE_WORK TABLE_WORK

/* A table entry: code length (bits 0-4), kind (5-7), extra bits or second-level bits (8-12),
 * value (16-31: the literal, the length or distance base, or the second level's offset). */
enum { LITERAL = 0, LENGTH = 1 << 5, END = 2 << 5, SUBTABLE = 3 << 5, INVALID = 4 << 5, KIND = 7 << 5 };
#define ENTRY(kind, extra, value) ((uint32_t)(kind) | (uint32_t)(extra) << 8 | (uint32_t)(value) << 16)
#define CODE_LEN(e) ((e) & 31)
#define EXTRA(e) (((e) >> 8) & 31)
#define VALUE(e) ((e) >> 16)

typedef enum {
    OK = 0, BAD_BLOCK, BAD_CODE, BAD_LENGTHS, BAD_SYMBOL, BAD_DISTANCE, TOO_LONG, TRUNCATED, TOO_MANY_BLOCKS, NO_MEMORY
} Status;

static const char *const MESSAGES[] = {
    "", "a block of reserved type 3", "an over-subscribed or incomplete Huffman code",
    "code lengths that repeat nothing or run past their count", "a symbol its code does not allow",
    "a distance beyond the start of the output", "more output than its declared size",
    "its bits end before its last block does",
    "more blocks than its bytes pay for (blocks that decode next to nothing)", "no memory for the decoder",
};

static const uint8_t PRECODE_ORDER[PRE_SYMS] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};

typedef struct {
    const uint8_t *in;
    size_t in_len, pos;     /* the input, and the offset of its next word */
    size_t whole;           /* where the input's whole words end */
    uint64_t buf[LANES];    /* each lane's next bits, the first lowest */
    uint32_t cnt[LANES];    /* bits in buf: 32 or more between operations */
    uint32_t past[LANES];   /* how many of buf's top bits lie past the input's end */
} Lanes;

typedef struct {
    uint8_t *out;
    size_t cap, n;                      /* the slot's size, and the bytes decoded */
    size_t match_at[LANES];             /* where each lane's pending match goes ... */
    uint32_t match_len[LANES];          /* ... and its length */
} Output;

typedef struct {
    uint32_t lit[LIT_ENTRIES], dist[DIST_ENTRIES], pre[1 << PRE_BITS], pairs[1 << LIT_BITS];
    uint32_t fixed_lit[LIT_ENTRIES], fixed_dist[DIST_ENTRIES], fixed_pairs[1 << LIT_BITS];
    int fixed_built;
    uint8_t lens[LIT_SYMS + DIST_SYMS];
} Tables;

static inline uint32_t load32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w; /* little-endian hosts only (checked at import) */
}

/* The stream's next word, for lane l; past the end, zeros (counted in lane l's past bits). */
static inline uint32_t next_word(Lanes *s, unsigned l) {
    uint32_t w = 0;
    if (s->pos < s->whole) {
        w = load32(s->in + s->pos);
    } else {
        size_t have = s->pos < s->in_len ? s->in_len - s->pos : 0;
        memcpy(&w, s->in + (have ? s->pos : 0), have);
        s->past[l] += 32 - 8 * (uint32_t)have;
    }
    s->pos += 4;
    return w;
}

/* Give lane l the next word if it holds fewer than 32 bits. */
static inline void refill(Lanes *s, unsigned l) {
    if (s->cnt[l] < 32) {
        s->buf[l] |= (uint64_t)next_word(s, l) << s->cnt[l];
        s->cnt[l] += 32;
    }
}

static inline void consume(Lanes *s, unsigned l, unsigned n) {
    s->buf[l] >>= n;
    s->cnt[l] -= n;
}

static inline uint32_t pop(Lanes *s, unsigned l, unsigned n) {
    uint32_t v = (uint32_t)s->buf[l] & ((1u << n) - 1);
    consume(s, l, n);
    return v;
}

/* Whether some lane has taken bits from past the input's end. */
static int overrun(const Lanes *s) {
    unsigned l;
    if (s->pos <= s->in_len) return 0;
    for (l = 0; l < LANES; l++)
        if (s->cnt[l] < s->past[l]) return 1;
    return 0;
}

static inline uint32_t lookup(const uint32_t *table, unsigned bits, uint64_t b) {
    uint32_t e = table[b & ((1u << bits) - 1)];
    if ((e & KIND) == SUBTABLE) e = table[VALUE(e) + ((b >> bits) & ((1u << EXTRA(e)) - 1))];
    return e;
}

static uint32_t reverse(uint32_t code, unsigned len) {
    uint32_t r = 0;
    while (len--) {
        r = r << 1 | (code & 1);
        code >>= 1;
    }
    return r;
}

/* Entry (without its code length) of literal/length symbol s. */
static uint32_t lit_entry(unsigned s) {
    unsigned i = s - 257, extra;
    if (s < 256) return ENTRY(LITERAL, 0, s);
    if (s == 256) return ENTRY(END, 0, 0);
    if (s > 285) return ENTRY(INVALID, 0, 0);
    if (s == 285) return ENTRY(LENGTH, 16, 3); /* Deflate64 */
    if (i < 8) return ENTRY(LENGTH, 0, i + 3);
    extra = (i >> 2) - 1;
    return ENTRY(LENGTH, extra, ((4 + (i & 3)) << extra) + 3);
}

/* Entry (without its code length) of distance symbol s (30 and 31 as in Deflate64). */
static uint32_t dist_entry(unsigned s) {
    unsigned extra;
    if (s < 4) return ENTRY(LITERAL, 0, s + 1);
    extra = (s >> 1) - 1;
    return ENTRY(LITERAL, extra, ((2 + (s & 1)) << extra) + 1);
}

/* Decode table of the canonical code of lengths lens[0..n) in `bits` first-level bits (and
 * second levels after them); entry(s) gives symbol s's entry. BAD_CODE where the lengths
 * over-subscribe the code space or leave part of it unused (but for none or one 1-bit code). */
static Status build(uint32_t *table, unsigned bits, const uint8_t *lens, unsigned n, uint32_t (*entry)(unsigned)) {
    unsigned count[MAX_LEN + 1] = {0}, first[MAX_LEN + 2], sorted[LIT_SYMS + DIST_SYMS];
    unsigned len, s, i, used = 0, next_sub = 1u << bits;
    uint32_t code[MAX_LEN + 1], left = 1;
    uint8_t sub_bits[1 << LIT_BITS];
    for (s = 0; s < n; s++) count[lens[s]]++;
    for (len = 1; len <= MAX_LEN; len++) {
        left = (left << 1) - count[len];
        if ((int32_t)left < 0) return BAD_CODE;
        used += count[len];
    }
    if (left) { /* incomplete: allowed with no codeword, or one of 1 bit; the rest reads as invalid */
        if (used > 1 || (used == 1 && count[1] != 1)) return BAD_CODE;
        for (i = 0; i < 1u << bits; i++) table[i] = ENTRY(INVALID, 0, 0);
    }
    /* symbols by (length, symbol), and the first canonical code of each length */
    first[1] = 0;
    code[0] = 0;
    for (len = 1; len <= MAX_LEN; len++) {
        first[len + 1] = first[len] + count[len];
        code[len] = (code[len - 1] + (len > 1 ? count[len - 1] : 0)) << 1;
    }
    for (s = 0; s < n; s++)
        if (lens[s]) sorted[first[lens[s]]++] = s;
    memset(sub_bits, 0, sizeof(sub_bits));
    for (i = 0; i < used; i++) { /* second-level sizes: the longest codeword under each prefix */
        s = sorted[i];
        len = lens[s];
        if (len > bits) {
            uint32_t c = code[len] + (i - (first[len] - count[len]));
            unsigned prefix = reverse(c >> (len - bits), bits);
            if (len - bits > sub_bits[prefix]) sub_bits[prefix] = (uint8_t)(len - bits);
        }
    }
    for (i = 0; i < 1u << bits; i++)
        if (sub_bits[i]) {
            table[i] = ENTRY(SUBTABLE, sub_bits[i], next_sub) | bits;
            next_sub += 1u << sub_bits[i];
        }
    for (i = 0; i < used; i++) {
        uint32_t c, e, step, r;
        s = sorted[i];
        len = lens[s];
        c = code[len] + (i - (first[len] - count[len]));
        e = entry(s) | len;
        if (len <= bits) {
            for (r = reverse(c, len), step = 1u << len; r < 1u << bits; r += step) table[r] = e;
        } else {
            unsigned prefix = reverse(c >> (len - bits), bits), rest = len - bits;
            uint32_t *sub = table + VALUE(table[prefix]);
            for (r = reverse(c & ((1u << rest) - 1), rest), step = 1u << rest; r < 1u << sub_bits[prefix]; r += step)
                sub[r] = e;
        }
    }
    return OK;
}

/* Pairs of literals: for each LIT_BITS bits, the two literals whose codes they begin with where
 * both are there (a literal's own code may be the whole of them): literals in bits 0-15, the
 * first code's length in bits 16-20, both codes' length in bits 24-28, and PAIR. */
#define PAIR (1u << 31)

static void build_pairs(uint32_t *pairs, const uint32_t *lit) {
    uint32_t i;
    for (i = 0; i < 1u << LIT_BITS; i++) {
        uint32_t e = lit[i], n = CODE_LEN(e), f = lit[i >> n];
        pairs[i] = 0;
        if ((e & KIND) == LITERAL && (f & KIND) == LITERAL && n + CODE_LEN(f) <= LIT_BITS)
            pairs[i] = VALUE(e) | VALUE(f) << 8 | n << 16 | (n + CODE_LEN(f)) << 24 | PAIR;
    }
}

static uint32_t pre_entry(unsigned s) { return ENTRY(LITERAL, 0, s); }

/* A dynamic block's header (after its 3 bits): the two codes' tables. */
static Status read_codes(Tables *t, Lanes *s) {
    unsigned hlit, hdist, hclen, total, i, k, item;
    uint8_t pre_lens[PRE_SYMS] = {0};
    Status st;
    hlit = pop(s, 0, 5) + 257;
    hdist = pop(s, 0, 5) + 1;
    hclen = pop(s, 0, 4) + 4;
    refill(s, 0);
    for (i = 0; i < hclen; i++) {
        pre_lens[PRECODE_ORDER[i]] = (uint8_t)pop(s, i, 3);
        refill(s, i);
    }
    if ((st = build(t->pre, PRE_BITS, pre_lens, PRE_SYMS, pre_entry)) != OK) return st;
    total = hlit + hdist;
    for (k = 0, item = 0; k < total; item++) {
        unsigned l = item & (LANES - 1), sym, rep;
        uint32_t e = t->pre[s->buf[l] & ((1u << PRE_BITS) - 1)];
        uint8_t value = 0;
        if ((e & KIND) == INVALID) return BAD_SYMBOL;
        consume(s, l, CODE_LEN(e));
        sym = VALUE(e);
        if (sym < 16) {
            t->lens[k++] = (uint8_t)sym;
        } else {
            if (sym == 16) {
                if (k == 0) return BAD_LENGTHS;
                value = t->lens[k - 1];
                rep = 3 + pop(s, l, 2);
            } else {
                rep = sym == 17 ? 3 + pop(s, l, 3) : 11 + pop(s, l, 7);
            }
            if (rep > total - k) return BAD_LENGTHS;
            memset(t->lens + k, value, rep);
            k += rep;
        }
        refill(s, l);
    }
    if ((st = build(t->lit, LIT_BITS, t->lens, hlit, lit_entry)) != OK) return st;
    build_pairs(t->pairs, t->lit);
    return build(t->dist, DIST_BITS, t->lens + hlit, hdist, dist_entry);
}

static Status fixed_codes(Tables *t) {
    unsigned i;
    Status st;
    if (t->fixed_built) return OK;
    for (i = 0; i < LIT_SYMS; i++) t->lens[i] = i < 144 ? 8 : i < 256 ? 9 : i < 280 ? 7 : 8;
    if ((st = build(t->fixed_lit, LIT_BITS, t->lens, LIT_SYMS, lit_entry)) != OK) return st;
    build_pairs(t->fixed_pairs, t->fixed_lit);
    memset(t->lens, 5, DIST_SYMS);
    if ((st = build(t->fixed_dist, DIST_BITS, t->lens, DIST_SYMS, dist_entry)) != OK) return st;
    t->fixed_built = 1;
    return OK;
}

static inline void copy8(uint8_t *dst, const uint8_t *src) { memcpy(dst, src, 8); }

/* Copy a match of len (3 or more) bytes from dist back, each byte maybe one just written; never
 * past the match's end, where later lanes' bytes may lie. 8 bytes at a time once the source lies
 * 8 bytes back or more (a multiple of dist is as good as dist), the last 8 again where they
 * overlap (the same bytes). */
static inline void copy_match(uint8_t *dst, size_t dist, size_t len) {
    const uint8_t *src = dst - dist;
    size_t i = 0, step = dist;
    if (dist == 1) {
        memset(dst, src[0], len);
        return;
    }
    if (len < 8 && dist >= len) {
        if (len == 3) {
            memcpy(dst, src, 3);
        } else {
            memcpy(dst, src, 4);
            memcpy(dst + len - 4, src + len - 4, 4);
        }
        return;
    }
    while (step < 8) step += dist;
    for (; i < step - dist && i < len; i++) dst[i] = src[i];
    for (; i + 8 <= len; i += 8) copy8(dst + i, dst + i - step);
    if (i < len) {
        if (len >= 8 && step == dist) copy8(dst + len - 8, src + len - 8);
        else for (; i < len; i++) dst[i] = src[i];
    }
}

#define BATCH 4 /* rounds of literals decoded at once: two pairs a lane */

/* BATCH rounds of literals, each lane's from the bits it holds: lane by lane, its symbols and
 * the round after which it takes a word; then the words, in the stream's order (by round,
 * then lane). Returns 1; or, having changed nothing (the output past o->n aside), 0 where some
 * lane meets another symbol, -1 where one meets a long code or runs out of bits. */
static int literal_batch(const uint32_t *pairs, const uint32_t *lit, Lanes *s, Output *o) {
    static const uint64_t one_more[BATCH + 1] = {1, 1 << 8, 1 << 16, 1 << 24, (uint64_t)1 << 32};
    uint8_t *out = o->out + o->n;
    uint64_t left[LANES], counts = 0; /* lanes taking a word after each round (and none), a byte each */
    uint32_t held[LANES], takers[LANES], next[BATCH], n = 0, l, r;
    for (l = 0; l < LANES; l++) {
        uint64_t b = s->buf[l];
        uint32_t spare = s->cnt[l] - 32, e = pairs[b & ((1u << LIT_BITS) - 1)], t = e >> 24 & 31, f, early;
        f = pairs[(b >> t) & ((1u << LIT_BITS) - 1)];
        if (e & f & PAIR) { /* 4 literals in at most 22 bits: all held */
            /* whether the lane holds 32 bits after the first pair (then it takes its word in the second), and the
             * end of the first literal of the pair it takes it in: chosen without a branch, either is as likely */
            uint32_t second = t <= spare, mid = (e >> 16 & 31) ^ (((t + (f >> 16 & 31)) ^ (e >> 16 & 31)) & (0 - second));
            out[l] = (uint8_t)e;
            out[LANES + l] = (uint8_t)(e >> 8);
            out[2 * LANES + l] = (uint8_t)f;
            out[3 * LANES + l] = (uint8_t)(f >> 8);
            early = 2 * second + (mid <= spare);
            t += f >> 24 & 31;
            early += t <= spare; /* rounds after which the lane still holds 32 bits */
        } else {
            for (r = t = early = 0; r < BATCH; r++) {
                e = lit[(b >> t) & ((1u << LIT_BITS) - 1)];
                out[r * LANES + l] = (uint8_t)VALUE(e);
                t += CODE_LEN(e);
                early += t <= spare;
                if ((e & KIND) == SUBTABLE || t > spare + 32) return -1; /* a long code, or one not all held */
                if (e & KIND) return 0;
            }
        }
        left[l] = b >> t;
        held[l] = spare + 32 - t;
        takers[n] = l | early << 8;
        n += early < BATCH;
        counts += one_more[early];
    }
    memcpy(s->buf, left, sizeof(left));
    memcpy(s->cnt, held, sizeof(held));
    for (r = 0, next[0] = 0; r + 1 < BATCH; r++) next[r + 1] = next[r] + (uint32_t)(counts >> (8 * r) & 0xff);
    for (r = 0; r < n; r++) { /* the words in the stream's order: by round, then lane */
        uint32_t lane = takers[r] & 0xff, at = next[takers[r] >> 8]++;
        s->buf[lane] |= (uint64_t)load32(s->in + s->pos + 4 * at) << s->cnt[lane];
        s->cnt[lane] += 32;
    }
    s->pos += 4 * n;
    o->n += BATCH * LANES;
    return 1;
}

/* Whole rounds of 32 literals while every lane reads one, the output has room and the input
 * words: returns the lane whose symbol is not a literal (0 at a round's start). After a batch
 * meets another symbol, the next `*wait` rounds go one at a time (a block of matches would fail
 * most batches). */
static unsigned literal_rounds(const uint32_t *pairs, const uint32_t *lit, Lanes *s, Output *o, unsigned *wait) {
    unsigned l = 0;
    while (o->cap - o->n >= BATCH * LANES && s->in_len >= 4 * LANES && s->pos <= s->in_len - 4 * LANES) {
        uint8_t *out = o->out + o->n;
        if (*wait) {
            --*wait;
        } else {
            int batch = literal_batch(pairs, lit, s, o);
            if (batch > 0) continue;
            if (batch == 0) *wait = 16;
        }
        for (l = 0; l < LANES; l++) {
            uint32_t e = lookup(lit, LIT_BITS, s->buf[l]);
            if (e & KIND) goto stop;
            out[l] = (uint8_t)VALUE(e);
            consume(s, l, CODE_LEN(e));
            refill(s, l);
        }
        o->n += LANES;
    }
    l = 0;
stop:
    o->n += l;
    return l;
}

/* The lowest lane of a non-empty set. */
static inline unsigned lowest(uint32_t m) {
#if defined(__GNUC__) || defined(__clang__)
    return (unsigned)__builtin_ctz(m);
#else
    unsigned l = 0;
    while (!(m >> l & 1)) l++;
    return l;
#endif
}

/* A compressed block's symbols, with the tables of its codes: round by round, each lane in turn
 * reads a literal/length symbol or, after a length, its distance; literal rounds in batches.
 * Within a round, the lanes reading distances go first, then those reading symbols, then every
 * lane that fell below 32 bits takes its word in lane order: the same output (no match reads
 * bytes this round's symbols write, and the matches keep their order), the same words to the
 * same lanes, and the error of the lowest failing lane. */
static Status huffman_block(const uint32_t *pairs, const uint32_t *lit, const uint32_t *dist, Lanes *s, Output *o) {
    uint8_t *const out = o->out;
    const size_t cap = o->cap;
    size_t n = o->n;
    uint32_t pending = 0; /* lanes whose match waits for its distance */
    unsigned l, wait = 0;
    int ended = 0;
    uint8_t sink;
    while (pending || !ended) {
        uint32_t m, lanes, symbols, low = 0, failed = LANES; /* low: lanes below 32 bits */
        Status st = OK;
        if (overrun(s)) return TRUNCATED;
        l = 0;
        if (!pending) {
            o->n = n;
            l = literal_rounds(pairs, lit, s, o, &wait);
            n = o->n;
        }
        lanes = ~0u << l; /* l < 32 */
        symbols = ended ? 0 : ~pending & lanes;
        for (m = pending & lanes; m; m &= m - 1) { /* distances, lane by lane */
            size_t d, at;
            uint64_t b;
            uint32_t e;
            l = lowest(m);
            b = s->buf[l];
            at = o->match_at[l];
            e = lookup(dist, DIST_BITS, b);
            if (e & KIND) {
                st = BAD_SYMBOL;
                failed = l;
                break;
            }
            d = VALUE(e) + ((b >> CODE_LEN(e)) & ((1u << EXTRA(e)) - 1));
            if (d > at) {
                st = BAD_DISTANCE;
                failed = l;
                break;
            }
            consume(s, l, CODE_LEN(e) + EXTRA(e));
            low |= (uint32_t)(s->cnt[l] < 32) << l;
            copy_match(out + at, d, o->match_len[l]);
            pending &= ~(1u << l);
        }
        for (m = symbols; m; m &= m - 1) { /* literals and lengths, lane by lane */
            uint64_t b;
            uint32_t e, value, is_len, need;
            l = lowest(m);
            if (l > failed) break;
            b = s->buf[l];
            e = lookup(lit, LIT_BITS, b);
            if (e & (6 << 5)) { /* neither a literal nor a length */
                if ((e & KIND) != END) {
                    st = BAD_SYMBOL;
                    failed = l;
                    break;
                }
                consume(s, l, CODE_LEN(e));
                low |= (uint32_t)(s->cnt[l] < 32) << l;
                ended = 1;
                break;
            }
            is_len = (e >> 5) & 1; /* LENGTH */
            value = VALUE(e) + (uint32_t)((b >> CODE_LEN(e)) & ((1u << EXTRA(e)) - 1));
            need = is_len ? value : 1;
            if (need > cap - n) {
                st = TOO_LONG;
                failed = l;
                break;
            }
            consume(s, l, CODE_LEN(e) + EXTRA(e));
            low |= (uint32_t)(s->cnt[l] < 32) << l;
            *(is_len ? &sink : out + n) = (uint8_t)value; /* a match's bytes wait for its distance */
            o->match_at[l] = n;
            o->match_len[l] = value;
            n += need;
            pending |= is_len << l;
        }
        if (st != OK) return st;
        if (s->whole >= 4 * LANES && s->pos <= s->whole - 4 * LANES) {
            for (m = low; m; m &= m - 1) { /* the lanes below 32 bits take the next words, in lane order */
                l = lowest(m);
                s->buf[l] |= (uint64_t)load32(s->in + s->pos) << s->cnt[l];
                s->cnt[l] += 32;
                s->pos += 4;
            }
        } else {
            for (l = 0; l < LANES; l++) refill(s, l);
        }
    }
    o->n = n;
    return OK;
}

/* Whole groups of 4 rounds of a stored block's bytes (as many as fit in `len`, the output and the
 * input): every lane takes 8 bits a round, so each takes one word a group, after the same round
 * in every group (its count is back where it was), and the words come in that order. */
static uint32_t stored_groups(Lanes *s, uint8_t *out, uint32_t len) {
    uint32_t at[LANES], per_round[4] = {0}, first[4], l, r, done = 0;
    for (l = 0; l < LANES; l++) per_round[(s->cnt[l] - 32) / 8]++; /* it holds 32 bits until then */
    for (r = 0, first[0] = 0; r < 3; r++) first[r + 1] = first[r] + per_round[r];
    for (l = 0; l < LANES; l++) at[l] = 4 * first[(s->cnt[l] - 32) / 8]++;
    for (; len - done >= 4 * LANES && s->in_len >= 4 * LANES && s->pos <= s->in_len - 4 * LANES; done += 4 * LANES) {
        for (l = 0; l < LANES; l++) {
            uint64_t b = s->buf[l];
            for (r = 0; r < 4; r++) out[done + r * LANES + l] = (uint8_t)(b >> (8 * r));
            s->buf[l] = b >> 32 | (uint64_t)load32(s->in + s->pos + at[l]) << (s->cnt[l] - 32);
        }
        s->pos += 4 * LANES;
    }
    return done;
}

/* A stored block (after its 3 bits): a 16-bit length, then the bytes round-robin. */
static Status stored_block(Lanes *s, Output *o) {
    uint32_t len = pop(s, 0, 16), i;
    refill(s, 0);
    if (len > o->cap - o->n) return TOO_LONG;
    i = len >= 4 * LANES ? stored_groups(s, o->out + o->n, len) : 0;
    for (o->n += i; i < len; i++) {
        unsigned l = i & (LANES - 1);
        o->out[o->n++] = (uint8_t)pop(s, l, 8);
        refill(s, l);
        if (l == LANES - 1 && overrun(s)) return TRUNCATED;
    }
    return OK;
}

static Status decode_chunk(Tables *t, const uint8_t *in, size_t in_len, uint8_t *out, size_t cap, size_t *size) {
    Lanes s;
    Output o;
    unsigned l;
    int final;
    size_t work = 0;
    memset(&s, 0, sizeof(s));
    s.in = in;
    s.in_len = in_len;
    s.whole = in_len & ~(size_t)3;
    o.out = out;
    o.cap = cap;
    o.n = 0;
    for (l = 0; l < LANES; l++) refill(&s, l);
    do {
        uint32_t type;
        Status st;
        if (overrun(&s)) return TRUNCATED;
        final = (int)pop(&s, 0, 1);
        type = pop(&s, 0, 2);
        refill(&s, 0);
        work += type == 2 ? TABLE_WORK : BLOCK_WORK;
        if (work > FREE_WORK + s.pos + o.n) return TOO_MANY_BLOCKS;
        if (type == 0) {
            st = stored_block(&s, &o);
        } else if (type == 1) {
            st = fixed_codes(t);
            if (st == OK) st = huffman_block(t->fixed_pairs, t->fixed_lit, t->fixed_dist, &s, &o);
        } else if (type == 2) {
            st = read_codes(t, &s);
            if (st == OK) st = huffman_block(t->pairs, t->lit, t->dist, &s, &o);
        } else {
            st = BAD_BLOCK;
        }
        if (st != OK) return st;
    } while (!final);
    if (overrun(&s)) return TRUNCATED;
    *size = o.n;
    return OK;
}

/* decode(rows, sizes) -> None, or (row, reason) of the first row that does not decode. */
static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer rows, sizes;
    Py_ssize_t n, r = 0;
    Status st = OK;
    Tables *t;
    (void)self;
    if ((n = get_rows(args, &rows, &sizes)) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    t = (Tables *)malloc(sizeof(Tables));
    if (t == NULL) {
        st = NO_MEMORY;
    } else {
        t->fixed_built = 0;
        for (r = 0; r < n; r++) {
            const int64_t *row = (const int64_t *)rows.buf + 4 * r;
            size_t got = 0;
            st = decode_chunk(t, (const uint8_t *)(uintptr_t)row[0], (size_t)row[1], (uint8_t *)(uintptr_t)row[2],
                              (size_t)row[3], &got);
            if (st != OK) break;
            ((uint64_t *)sizes.buf)[r] = got;
        }
        free(t);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&sizes);
    if (st == NO_MEMORY) return PyErr_NoMemory();
    if (st != OK) return Py_BuildValue("(ns)", r, MESSAGES[st]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "decode(rows, sizes): GDeflate chunks into their slots; None or (row, reason)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gdeflate", "ckptzip's GDeflate decoder.", -1, methods};

PyMODINIT_FUNC PyInit__gdeflate(void) {
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "ckptzip's GDeflate decoder needs a little-endian CPU");
        return NULL;
    }
    return PyModule_Create(&module);
}
