/* Compiled CPU kernels of ckptzip.kernels (private; ckptzip.kernels.cpu is the interface).
 *
 * Byte-plane split and merge fused with the wsum64 checksum (docs/FORMAT.md), sampled byte counts
 * of planes, and checksummed segment gathers: one pass over the data, straight into the output.
 * Work comes as a table of rows (int64), one row per piece of a tensor or segment, with raw
 * addresses (the Triton kernels take the same kind of table); each call releases the GIL and
 * splits its rows between `threads` threads by bytes. wsum64 is linear in the words, so the
 * partial sum of each row is added to its owner's sum (mod 2**64) in any order. Split goes a
 * cache-sized block at a time (the block's checksum read from cache); merge, with SSE2, takes the
 * checksum from the registers it stores, the stores streaming past the cache. SSE2 byte shuffles
 * on x86-64, scalar loops elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "../_pybuffers.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 256
#define MAX_ITEMSIZE 8

typedef struct {
    const int64_t *table;  /* rows of `width` int64 */
    Py_ssize_t width;
    Py_ssize_t begin, end; /* rows of this thread */
    int itemsize;
    uint64_t *partial;     /* one per row */
} Work;

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w; /* little-endian hosts only (checked at import) */
}

/* wsum64 terms of `bytes` bytes at p whose first word is word number w0; the tail zero-padded. */
static uint64_t wsum(const uint8_t *p, uint64_t bytes, uint64_t w0) {
    uint64_t total, words = bytes / 8, i, m = 2 * w0 + 1, t[4] = {0};
    for (i = 0; i + 4 <= words; i += 4, m += 8) { /* four independent sums: one multiply a cycle */
        t[0] += load64(p + 8 * i) * m;
        t[1] += load64(p + 8 * i + 8) * (m + 2);
        t[2] += load64(p + 8 * i + 16) * (m + 4);
        t[3] += load64(p + 8 * i + 24) * (m + 6);
    }
    total = t[0] + t[1] + t[2] + t[3];
    for (; i < words; i++) total += load64(p + 8 * i) * (2 * (w0 + i) + 1);
    if (bytes % 8) {
        uint8_t last[8] = {0};
        memcpy(last, p + 8 * words, bytes % 8);
        total += load64(last) * (2 * (w0 + words) + 1);
    }
    return total;
}

/* Bytes a segment gather copies at once (a multiple of 8), whose checksum is read from cache. */
#define COPY_BLOCK (16 << 10)

/* Elements handled at once by split (and the scalar merge), whose checksum is taken while they are in cache. */
#define BLOCK_ELEMENTS 2048

/* Planes to elements, scalar: d[k*e + j] = p[j][e] for e in [e0, n). A constant k per loop, so
 * the compiler unrolls the byte shuffles. */
static void interleave_scalar(uint8_t *d, const uint8_t *const *p, int k, uint64_t e0, uint64_t n) {
    uint64_t e;
    switch (k) {
    case 2:
        for (e = e0; e < n; e++) { d[2 * e] = p[0][e]; d[2 * e + 1] = p[1][e]; }
        break;
    case 4:
        for (e = e0; e < n; e++) {
            d[4 * e] = p[0][e]; d[4 * e + 1] = p[1][e]; d[4 * e + 2] = p[2][e]; d[4 * e + 3] = p[3][e];
        }
        break;
    default:
        for (e = e0; e < n; e++) {
            d[8 * e] = p[0][e]; d[8 * e + 1] = p[1][e]; d[8 * e + 2] = p[2][e]; d[8 * e + 3] = p[3][e];
            d[8 * e + 4] = p[4][e]; d[8 * e + 5] = p[5][e]; d[8 * e + 6] = p[6][e]; d[8 * e + 7] = p[7][e];
        }
    }
}

/* Elements to planes, scalar: p[j][e] = s[k*e + j] for e in [e0, n). */
static void deinterleave_scalar(uint8_t *const *p, const uint8_t *s, int k, uint64_t e0, uint64_t n) {
    uint64_t e;
    switch (k) {
    case 2:
        for (e = e0; e < n; e++) { p[0][e] = s[2 * e]; p[1][e] = s[2 * e + 1]; }
        break;
    case 4:
        for (e = e0; e < n; e++) {
            p[0][e] = s[4 * e]; p[1][e] = s[4 * e + 1]; p[2][e] = s[4 * e + 2]; p[3][e] = s[4 * e + 3];
        }
        break;
    default:
        for (e = e0; e < n; e++) {
            p[0][e] = s[8 * e]; p[1][e] = s[8 * e + 1]; p[2][e] = s[8 * e + 2]; p[3][e] = s[8 * e + 3];
            p[4][e] = s[8 * e + 4]; p[5][e] = s[8 * e + 5]; p[6][e] = s[8 * e + 6]; p[7][e] = s[8 * e + 7];
        }
    }
}

#if defined(__SSE2__)
#define LD(p) _mm_loadu_si128((const __m128i *)(p))
#define ST(p, v) _mm_storeu_si128((__m128i *)(p), (v))

/* Stores 16 bytes of elements (words w and w + 1 of their tensor) and returns their wsum64 terms,
 * taken from the register: the stores may bypass the cache. */
static inline uint64_t put(uint8_t *d, __m128i v, uint64_t w, int stream) {
    if (stream) _mm_stream_si128((__m128i *)d, v);
    else ST(d, v);
    return (uint64_t)_mm_cvtsi128_si64(v) * (2 * w + 1) +
           (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(v, v)) * (2 * w + 3);
}

/* Planes to elements, 16 at a time with SSE2 byte unpacks (the tail scalar); returns their wsum64
 * terms, d[0] being word w0. Where d is 16-byte aligned the stores stream past the cache: a load
 * writes far more than the cache holds, and a cached store first reads the line it fills. */
static uint64_t interleave(uint8_t *d, const uint8_t *const *p, int k, uint64_t n, uint64_t w0) {
    const int stream = (uintptr_t)d % 16 == 0;
    uint64_t e = 0, total = 0;
    if (k == 2) {
        for (; e + 16 <= n; e += 16) {
            __m128i a = LD(p[0] + e), b = LD(p[1] + e);
            uint64_t w = w0 + e / 4;
            total += put(d + 2 * e, _mm_unpacklo_epi8(a, b), w, stream);
            total += put(d + 2 * e + 16, _mm_unpackhi_epi8(a, b), w + 2, stream);
        }
    } else if (k == 4) {
        for (; e + 16 <= n; e += 16) {
            __m128i a = LD(p[0] + e), b = LD(p[1] + e), c = LD(p[2] + e), f = LD(p[3] + e);
            __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
            __m128i cf0 = _mm_unpacklo_epi8(c, f), cf1 = _mm_unpackhi_epi8(c, f);
            uint64_t w = w0 + e / 2;
            total += put(d + 4 * e, _mm_unpacklo_epi16(ab0, cf0), w, stream);
            total += put(d + 4 * e + 16, _mm_unpackhi_epi16(ab0, cf0), w + 2, stream);
            total += put(d + 4 * e + 32, _mm_unpacklo_epi16(ab1, cf1), w + 4, stream);
            total += put(d + 4 * e + 48, _mm_unpackhi_epi16(ab1, cf1), w + 6, stream);
        }
    } else {
        for (; e + 16 <= n; e += 16) {
            __m128i b8[8], b16[8];
            int j, h;
            for (j = 0; j < 4; j++) { /* bytes 2j, 2j+1 of elements 0-7, then of elements 8-15 */
                __m128i x = LD(p[2 * j] + e), y = LD(p[2 * j + 1] + e);
                b8[j] = _mm_unpacklo_epi8(x, y);
                b8[4 + j] = _mm_unpackhi_epi8(x, y);
            }
            for (h = 0; h < 2; h++) { /* bytes 0-3 and 4-7 of elements 8h + (0-3, 4-7) */
                b16[4 * h] = _mm_unpacklo_epi16(b8[4 * h], b8[4 * h + 1]);
                b16[4 * h + 1] = _mm_unpackhi_epi16(b8[4 * h], b8[4 * h + 1]);
                b16[4 * h + 2] = _mm_unpacklo_epi16(b8[4 * h + 2], b8[4 * h + 3]);
                b16[4 * h + 3] = _mm_unpackhi_epi16(b8[4 * h + 2], b8[4 * h + 3]);
            }
            for (h = 0; h < 4; h++) { /* elements 4h .. 4h+3: their bytes 0-3 and 4-7 */
                __m128i lo = b16[(h / 2) * 4 + h % 2], hi = b16[(h / 2) * 4 + 2 + h % 2];
                uint64_t w = w0 + e + 4 * h;
                total += put(d + 8 * e + 32 * h, _mm_unpacklo_epi32(lo, hi), w, stream);
                total += put(d + 8 * e + 32 * h + 16, _mm_unpackhi_epi32(lo, hi), w + 2, stream);
            }
        }
    }
    if (stream) _mm_sfence(); /* streamed stores are weakly ordered: done before the caller reads */
    interleave_scalar(d, p, k, e, n);
    return total + wsum(d + k * e, k * (n - e), w0 + k * e / 8);
}

/* Elements to planes, 16 at a time with SSE2 shifts and saturating packs (the tail scalar). */
static void deinterleave(uint8_t *const *p, const uint8_t *s, int k, uint64_t n) {
    const __m128i low = _mm_set1_epi16(0xff);
    uint64_t e = 0;
    int j;
    if (k == 2) {
        for (; e + 16 <= n; e += 16) {
            __m128i a = LD(s + 2 * e), b = LD(s + 2 * e + 16);
            ST(p[0] + e, _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low)));
            ST(p[1] + e, _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        }
    } else if (k == 4) {
        const __m128i byte = _mm_set1_epi32(0xff);
        for (; e + 16 <= n; e += 16) {
            __m128i v0 = LD(s + 4 * e), v1 = LD(s + 4 * e + 16), v2 = LD(s + 4 * e + 32), v3 = LD(s + 4 * e + 48);
            for (j = 0; j < 4; j++) {
                __m128i c = _mm_cvtsi32_si128(8 * j);
                __m128i t0 = _mm_and_si128(_mm_srl_epi32(v0, c), byte), t1 = _mm_and_si128(_mm_srl_epi32(v1, c), byte);
                __m128i t2 = _mm_and_si128(_mm_srl_epi32(v2, c), byte), t3 = _mm_and_si128(_mm_srl_epi32(v3, c), byte);
                ST(p[j] + e, _mm_packus_epi16(_mm_packs_epi32(t0, t1), _mm_packs_epi32(t2, t3)));
            }
        }
    } else {
        const __m128i byte = _mm_set1_epi64x(0xff);
        for (; e + 16 <= n; e += 16) {
            __m128i v[8];
            int i;
            for (i = 0; i < 8; i++) v[i] = LD(s + 8 * e + 16 * i);
            for (j = 0; j < 8; j++) {
                __m128i c = _mm_cvtsi32_si128(8 * j), w[4];
                for (i = 0; i < 4; i++) { /* the byte of 4 elements as the low halves of 32-bit lanes */
                    __m128i x = _mm_and_si128(_mm_srl_epi64(v[2 * i], c), byte);
                    __m128i y = _mm_and_si128(_mm_srl_epi64(v[2 * i + 1], c), byte);
                    w[i] = _mm_unpacklo_epi64(_mm_shuffle_epi32(x, _MM_SHUFFLE(3, 1, 2, 0)),
                                              _mm_shuffle_epi32(y, _MM_SHUFFLE(3, 1, 2, 0)));
                }
                ST(p[j] + e, _mm_packus_epi16(_mm_packs_epi32(w[0], w[1]), _mm_packs_epi32(w[2], w[3])));
            }
        }
    }
    deinterleave_scalar(p, s, k, e, n);
}
#else
static uint64_t interleave(uint8_t *d, const uint8_t *const *p, int k, uint64_t n, uint64_t w0) {
    uint64_t a, total = 0;
    for (a = 0; a < n; a += BLOCK_ELEMENTS) { /* a block's wsum64 while it is in cache */
        uint64_t end = n - a < BLOCK_ELEMENTS ? n : a + BLOCK_ELEMENTS;
        interleave_scalar(d, p, k, a, end);
        total += wsum(d + k * a, k * (end - a), w0 + k * a / 8);
    }
    return total;
}
static void deinterleave(uint8_t *const *p, const uint8_t *s, int k, uint64_t n) { deinterleave_scalar(p, s, k, 0, n); }
#endif

/* Split and merge rows: element address, first element, elements, owner, K plane addresses
 * (element 0). The row's elements and its planes from its first element on. */
static uint8_t *row_planes(const int64_t *row, int k, uint8_t **p) {
    uint64_t first = (uint64_t)row[1];
    int j;
    for (j = 0; j < k; j++) p[j] = (uint8_t *)(uintptr_t)row[4 + j] + first;
    return (uint8_t *)(uintptr_t)row[0] + first * k;
}

/* A block at a time: its planes split, then its wsum64 terms while it is in cache. */
static void split_row(const int64_t *row, int k, uint64_t *partial) {
    uint8_t *p[MAX_ITEMSIZE], *q[MAX_ITEMSIZE];
    const uint8_t *elements = row_planes(row, k, p);
    uint64_t n = (uint64_t)row[2], w0 = (uint64_t)row[1] * k / 8, a, total = 0;
    int j;
    for (a = 0; a < n; a += BLOCK_ELEMENTS) {
        uint64_t m = n - a < BLOCK_ELEMENTS ? n - a : BLOCK_ELEMENTS;
        for (j = 0; j < k; j++) q[j] = p[j] + a;
        deinterleave(q, elements + a * k, k, m);
        total += wsum(elements + a * k, m * k, w0 + a * k / 8);
    }
    *partial = total;
}

static void merge_row(const int64_t *row, int k, uint64_t *partial) {
    uint8_t *p[MAX_ITEMSIZE];
    uint8_t *elements = row_planes(row, k, p);
    *partial = interleave(elements, (const uint8_t *const *)p, k, (uint64_t)row[2], (uint64_t)row[1] * k / 8);
}

/* Segment rows: source address, destination address (0: checksum only), bytes, owner, first word.
 * Copies a block at a time, each block's wsum64 then read from cache. */
static void segment_row(const int64_t *row, int unused, uint64_t *partial) {
    const uint8_t *src = (const uint8_t *)(uintptr_t)row[0];
    uint8_t *dst = (uint8_t *)(uintptr_t)row[1];
    uint64_t n = (uint64_t)row[2], w0 = (uint64_t)row[4], a, total = 0;
    (void)unused;
    if (!dst) {
        *partial = wsum(src, n, w0);
        return;
    }
    for (a = 0; a < n; a += COPY_BLOCK) {
        uint64_t m = n - a < COPY_BLOCK ? n - a : COPY_BLOCK;
        memcpy(dst + a, src + a, m);
        total += wsum(dst + a, m, w0 + a / 8);
    }
    *partial = total;
}

typedef void (*RowFn)(const int64_t *, int, uint64_t *);

typedef struct {
    Work work;
    RowFn fn;
} Job;

static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    Py_ssize_t r;
    for (r = job->work.begin; r < job->work.end; r++)
        job->fn(job->work.table + r * job->work.width, job->work.itemsize, job->work.partial + r);
    return NULL;
}

/* Run fn over every row on up to `threads` threads (rows split by their bytes, column 2 times
 * `scale`), then add each row's partial sum to sums[owner] (column 3). */
static int run_rows(const int64_t *table, Py_ssize_t rows, Py_ssize_t width, int itemsize, int scale,
                    int threads, RowFn fn, uint64_t *sums, Py_ssize_t nsums) {
    uint64_t *partial;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    uint64_t total = 0, done = 0;
    Py_ssize_t r, begin = 0;
    int t;
    for (r = 0; r < rows; r++) {
        int64_t owner = table[r * width + 3];
        if (owner < 0 || owner >= nsums || table[r * width + 2] < 0) return -1;
        total += (uint64_t)table[r * width + 2] * scale;
    }
    partial = (uint64_t *)PyMem_RawMalloc(sizeof(uint64_t) * (rows ? rows : 1));
    if (!partial) return -2;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((Py_ssize_t)threads > rows) threads = rows ? (int)rows : 1;
    for (t = 0; t < threads; t++) { /* contiguous rows, about total / threads bytes each */
        Py_ssize_t end = begin;
        uint64_t goal = total / threads * (t + 1);
        while (end < rows && (t == threads - 1 || done < goal)) done += (uint64_t)table[end++ * width + 2] * scale;
        jobs[t].work = (Work){table, width, begin, end, itemsize, partial};
        jobs[t].fn = fn;
        begin = end;
    }
    Py_BEGIN_ALLOW_THREADS
    for (t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_job(&jobs[t]); /* no thread to be had: this one does the work */
    }
    Py_END_ALLOW_THREADS
    for (r = 0; r < rows; r++) sums[table[r * width + 3]] += partial[r];
    PyMem_RawFree(partial);
    return 0;
}

/* kernel(table, width, itemsize, scale, sums, threads) for one of the row functions. */
static PyObject *run_table(PyObject *args, RowFn fn, Py_ssize_t width, int planes) {
    PyObject *table_obj, *sums_obj;
    int itemsize, threads, status;
    Py_buffer table, sums;
    if (!PyArg_ParseTuple(args, "OiOi", &table_obj, &itemsize, &sums_obj, &threads)) return NULL;
    if (planes && itemsize != 2 && itemsize != 4 && itemsize != 8)
        return PyErr_Format(PyExc_ValueError, "item size %d: expected 2, 4 or 8", itemsize);
    if (get_buffer(table_obj, &table, 0, (Py_ssize_t)sizeof(int64_t) * width, "table") < 0) return NULL;
    if (get_buffer(sums_obj, &sums, 1, sizeof(uint64_t), "sums") < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    status = run_rows((const int64_t *)table.buf, table.len / (Py_ssize_t)sizeof(int64_t) / width, width,
                      itemsize, planes ? itemsize : 1, threads, fn, (uint64_t *)sums.buf,
                      sums.len / (Py_ssize_t)sizeof(uint64_t));
    PyBuffer_Release(&table);
    PyBuffer_Release(&sums);
    if (status == -1) return PyErr_Format(PyExc_ValueError, "a row's owner or length is out of range");
    if (status == -2) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *split(PyObject *self, PyObject *args) {
    (void)self;
    return run_table(args, split_row, 4 + MAX_ITEMSIZE, 1);
}

static PyObject *merge(PyObject *self, PyObject *args) {
    (void)self;
    return run_table(args, merge_row, 4 + MAX_ITEMSIZE, 1);
}

static PyObject *segments(PyObject *self, PyObject *args) {
    (void)self;
    return run_table(args, segment_row, 5, 0);
}

/* sample_counts(table, itemsize, hist, sample): rows (source address, elements, histogram row);
 * adds the bytes of every max(1, elements // sample)-th element to hist[row][plane][byte]
 * (int32, 8 x 256 per row). */
static PyObject *sample_counts(PyObject *self, PyObject *args) {
    PyObject *table_obj, *hist_obj;
    int itemsize;
    long long sample;
    Py_buffer table, hist;
    Py_ssize_t rows, r, nhist;
    int bad = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiOL", &table_obj, &itemsize, &hist_obj, &sample)) return NULL;
    if (itemsize < 1 || itemsize > MAX_ITEMSIZE || sample < 1)
        return PyErr_Format(PyExc_ValueError, "item size %d or sample %lld out of range", itemsize, sample);
    if (get_buffer(table_obj, &table, 0, sizeof(int64_t) * 3, "table") < 0) return NULL;
    if (get_buffer(hist_obj, &hist, 1, sizeof(int32_t) * MAX_ITEMSIZE * 256, "hist") < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    rows = table.len / (Py_ssize_t)(sizeof(int64_t) * 3);
    nhist = hist.len / (Py_ssize_t)(sizeof(int32_t) * MAX_ITEMSIZE * 256);
    Py_BEGIN_ALLOW_THREADS
    for (r = 0; r < rows && !bad; r++) {
        const int64_t *row = (const int64_t *)table.buf + 3 * r;
        const uint8_t *src = (const uint8_t *)(uintptr_t)row[0];
        int64_t n = row[1], step = n / sample > 1 ? n / sample : 1, e;
        int32_t *counts = (int32_t *)hist.buf + row[2] * MAX_ITEMSIZE * 256;
        int j;
        if (row[2] < 0 || row[2] >= nhist || n < 0) {
            bad = 1;
            break;
        }
        for (e = 0; e < n; e += step)
            for (j = 0; j < itemsize; j++) counts[j * 256 + src[e * itemsize + j]]++;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&table);
    PyBuffer_Release(&hist);
    if (bad) return PyErr_Format(PyExc_ValueError, "a row's histogram or length is out of range");
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(table, itemsize, sums, threads): byte planes and wsum64 of rows"},
    {"merge", merge, METH_VARARGS, "merge(table, itemsize, sums, threads): elements from planes, and wsum64"},
    {"segments", segments, METH_VARARGS, "segments(table, 1, sums, threads): copies and wsum64 of segments"},
    {"sample_counts", sample_counts, METH_VARARGS, "sample_counts(table, itemsize, hist, sample)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", "Compiled CPU kernels of ckptzip.", -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) {
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "ckptzip's compiled kernels need a little-endian CPU");
        return NULL;
    }
    return PyModule_Create(&module);
}
