/* Decode attention over Baton's paged fp32 or bf16 KV cache, CPU: per batch row, two passes
 * around a softmax, in one call.
 *
 * One layer's cache is a K and a V pool of [num_blocks, block_size, num_kv_heads, head_dim]
 * fp32 or bf16 elements; sequence b's position t lives in block block_tables[b][t / block_size]
 * at offset t % block_size. The torch path gathers K into a padded copy and sums V rows through
 * embedding_bag, one row of head_dim floats at a time. Here each pass walks a sequence's blocks
 * in place, a whole slot row (every KV head) at a time: K and V are each read once, contiguously
 * within a block, and nothing is copied.
 *
 *   scores: scores[hq, t - s] = scale * q[b, hq] . K[slot(b, t), hq / group]
 *           for s = start[b] <= t < len[b], into the thread's scratch
 *   softmax over each head's scores, in place, in the same call: no scores tensor padded to
 *           the longest row, one meeting of the step's threads a layer, not two
 *   values: out[b, hq] = sum over start[b] <= t < len[b] of probs[hq, t - s] * V[slot(b, t), ..]
 *
 * start[b] is where a sliding window begins (NULL starts: 0 for every row); block table entries
 * below it are never read (their blocks may have been freed).
 * Query head hq uses KV head hq / group (transformers' repeat_kv order). The batch goes out in
 * chunks of rows to up to `parts` threads (disjoint writes; split_rows). Common head sizes are
 * specialised so the inner loops unroll into registers; any other size takes the generic loop.
 *
 * Element types: q, the scores, the probabilities and the output are fp32 whatever the cache
 * holds; a bf16 element widens exactly to fp32 (its 16 bits are a float's top half), so both
 * caches share one code path, each pass compiled once per element type (always_inline with the
 * type a constant: no branch is left in the loops). In bf16 this replaces torch's gather, bmm
 * and embedding_bag, each a widening pass and a fresh tensor of its own. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define INLINE static inline __attribute__((always_inline))

/* Element i of a pool of fp32 (bf16 = 0) or bf16 (bf16 = 1) elements, as fp32. */
INLINE float kv_at(const void *pool, int64_t i, int bf16)
{
    if (!bf16) return ((const float *)pool)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)pool)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE const void *kv_ptr(const void *pool, int64_t i, int bf16)
{
    return (const char *)pool + i * (bf16 ? 2 : 4);
}

/* Ask for the next block's rows while this one is computed: blocks sit anywhere in the pool,
 * so the hardware prefetcher, which follows the current run, would miss the jump. Into L2
 * (locality 1: prefetcht2), not L1: a block is 128 lines asked for at once, more than L1's miss
 * buffers take, and prefetching them into L1 made attention slower than this
 * (docs/perf-log.md, "Decode attention kernel"). */
static inline void prefetch_rows(const void *start, int64_t num_bytes)
{
    const char *p = (const char *)start;
    for (int64_t b = 0; b < num_bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

INLINE void scores_one(const float *restrict q, const void *restrict k_pool,
                       const int64_t *restrict table, int64_t start, int64_t len,
                       int64_t num_heads, int64_t group, int64_t head_dim, int64_t block_size,
                       float scale, float *restrict scores, int64_t stride, int bf16)
{
    const int64_t row = num_heads / group * head_dim;
    for (int64_t t0 = start; t0 < len;) { /* the part of one block within [start, len) */
        const int64_t off = t0 % block_size;
        const int64_t n = len - t0 < block_size - off ? len - t0 : block_size - off;
        const int64_t kb = (table[t0 / block_size] * block_size + off) * row;
        for (int64_t i = 0; i < n; i++) {
            const int64_t krow = kb + i * row;
            for (int64_t hq = 0; hq < num_heads; hq++) {
                const int64_t k = krow + hq / group * head_dim;
                const float *qh = q + hq * head_dim;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * kv_at(k_pool, k + d, bf16);
                scores[hq * stride + t0 - start + i] = acc * scale;
            }
        }
        t0 += n;
    }
}

#ifdef VEC16_SHUFFLES
#define BATON_VECTOR_SCORES 1
/* Scores VN tokens at a time (vec16.h: sixteen with AVX-512, eight on AVX2) for head sizes
 * that are multiples of VN: each token's dot product is first folded to a vector of partial
 * sums, then the VN vectors are summed lane-wise in one transpose-and-add tree (sumn).
 * MAX_WIDENED_ROW: the widest KV row (KV heads x head size) a bf16 tile widens into fp32 scratch
 * (64 KiB of stack at most). */
#define MAX_WIDENED_ROW 1024

/* Whether a bf16 tile widens in load_pairs' order (vec16.h: even elements, then odd, per 2 VN),
 * and q is read in the same order (attend_rows permutes it once a row): where the widened rows
 * fit the scratch and each head is whole pairs of vectors. Each dot product sums the same
 * products in another order, so a token's score differs from the in-order widen's by fp32
 * rounding, and is the same whatever the batch, thread or call. */
INLINE int head_in_pairs(int64_t head_dim) { return head_dim % (2 * VN) == 0; }

INLINE int scores_in_pairs(int bf16, int64_t row, int64_t head_dim)
{
    return bf16 && row <= MAX_WIDENED_ROW && head_in_pairs(head_dim);
}

INLINE void scores_one_vec(const float *restrict q, const void *restrict k_pool,
                           const int64_t *restrict table, int64_t start, int64_t len,
                           int64_t num_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, float scale, float *restrict scores,
                           int64_t stride, int bf16)
{
    const int64_t row = num_heads / group * head_dim, esize = bf16 ? 2 : 4;
    /* bf16: the tile's rows are widened once into fp32, not once per query head of a group
     * (Qwen2-0.5B: 7 query heads a KV head); very wide rows convert in place instead. */
    const int widen = bf16 && row <= MAX_WIDENED_ROW;
    const int pairs = scores_in_pairs(bf16, row, head_dim); /* q is in pair order then */
    float tile[widen ? VN * row : 1];
    const void *krows[VN];
    for (int64_t t0 = start; t0 < len; t0 += VN) {
        const int64_t n = len - t0 < VN ? len - t0 : VN;
        for (int64_t j = 0; j < VN; j++) {  /* rows past the context repeat the first */
            const int64_t t = t0 + (j < n ? j : 0);
            krows[j] = kv_ptr(k_pool, (table[t / block_size] * block_size + t % block_size) * row,
                              bf16);
        }
        if (t0 + VN < len && block_size >= VN) { /* the next tile's rows: elsewhere in the pool */
            const int64_t t = t0 + VN, last = len - 1 < t + VN - 1 ? len - 1 : t + VN - 1;
            const int64_t b = last / block_size;
            if (b != (t - 1) / block_size) /* its rows from b's start: one contiguous run */
                prefetch_rows(kv_ptr(k_pool, table[b] * block_size * row, bf16),
                              (last - b * block_size + 1) * row * esize);
        }
        const int in_bf16 = bf16 && !widen; /* what krows point at from here on */
        if (widen)
            for (int j = 0; j < VN; j++) {
                if (pairs) {
                    for (int64_t c = 0; c < row; c += 2 * VN) {
                        vn even, odd;
                        load_pairs(kv_ptr(krows[j], c, 1), &even, &odd);
                        storen(tile + j * row + c, even);
                        storen(tile + j * row + c + VN, odd);
                    }
                } else {
                    for (int64_t c = 0; c < row; c += VN)
                        storen(tile + j * row + c, loadn_as(kv_ptr(krows[j], c, 1), 1));
                }
                krows[j] = tile + j * row;
            }
        for (int64_t hq = 0; hq < num_heads; hq++) {
            const float *qh = q + hq * head_dim;
            const int64_t off = hq / group * head_dim;
            vn a[VN];
            /* chunk-outer: one load of q's chunk for the VN tokens (token-outer loaded it again
             * for each), each token's sum in the same order */
            const vn q0 = loadn(qh);
            for (int j = 0; j < VN; j++)
                a[j] = q0 * loadn_as(kv_ptr(krows[j], off, in_bf16), in_bf16);
            for (int64_t c = VN; c < head_dim; c += VN) {
                const vn qc = loadn(qh + c);
                for (int j = 0; j < VN; j++)
                    a[j] += qc * loadn_as(kv_ptr(krows[j], off + c, in_bf16), in_bf16);
            }
            const vn r = sumn(a) * scale;
            float *to = scores + hq * stride + t0 - start;
            if (n == VN) {
                storen(to, r);
            } else { /* the last tile's first n */
                float out[VN];
                storen(out, r);
                memcpy(to, out, (size_t)n * sizeof *out);
            }
        }
    }
}
#endif

INLINE void values_one(const float *restrict probs, const void *restrict v_pool,
                       const int64_t *restrict table, int64_t start, int64_t len,
                       int64_t num_heads, int64_t group, int64_t head_dim, int64_t block_size,
                       int64_t stride, float *restrict out, int bf16)
{
    const int64_t row = num_heads / group * head_dim, esize = bf16 ? 2 : 4;
    for (int64_t hq = 0; hq < num_heads; hq++) {
        float acc[head_dim];
        memset(acc, 0, sizeof acc);
        const float *p = probs + hq * stride - start; /* p[t]: position t's weight */
        for (int64_t t0 = start; t0 < len;) { /* the part of one block within [start, len) */
            const int64_t off = t0 % block_size, next = t0 - off + block_size;
            const int64_t n = len - t0 < block_size - off ? len - t0 : block_size - off;
            const int64_t vb = (table[t0 / block_size] * block_size + off) * row;
            if (hq == 0 && next < len) /* the first pass fetches; the rest hit cache */
                prefetch_rows(kv_ptr(v_pool, table[next / block_size] * block_size * row, bf16),
                              (len - next < block_size ? len - next : block_size) * row * esize);
            const int64_t vh = vb + hq / group * head_dim;
            t0 += n;
            for (int64_t i = 0; i < n; i++) {
                const float w = p[t0 - n + i];
                const int64_t v = vh + i * row;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[d] += w * kv_at(v_pool, v + d, bf16);
            }
        }
        memcpy(out + hq * head_dim, acc, sizeof acc);
    }
}

#ifdef BATON_VECTOR_SCORES
/* Head sizes that are multiples of VN: each V row (bf16 widened once) is read once for a chunk
 * of its group's query heads, whose sums stay in VALUE_REGS vector registers. values_one walks
 * the tokens once per query head with its sums in memory: per token and query head a load, an
 * FMA and a store for every vector, and bf16 rows widened once per query head. Where a head's
 * sums fill the registers (AVX2's sixteen: a head of 64 is eight), a walk takes up to three
 * heads of the group over a slice of the head's vectors instead, so a V row's slice comes from
 * L2 once for them all, not once per head. Each output is summed in the same order (over t, one
 * FMA each), so the results are values_one's. */
#if defined(__AVX512F__)
#define VALUE_REGS 16 /* of 32 512-bit registers */
#else
#define VALUE_REGS 12 /* of AVX2's 16 */
#endif

/* One walk over a row's tokens: GN query heads' sums (acc[g * CN + c]) over CN vectors of the
 * head, from column `col` of the KV row; constants where inlined (values_grouped's switch), so
 * the sums stay in registers and no test is left in the loop. An fp32 V vector is read once per
 * head (from L1, the FMA's memory operand): one register a vector held for the group ran out of
 * AVX2's sixteen and put a sum on the stack. `fetch`: ask for each next block of V. */
INLINE void values_walk(const int GN, const int64_t CN, const float *restrict p, int64_t stride,
                        const void *restrict v_pool, const int64_t *restrict table,
                        int64_t start, int64_t len, int64_t block_size, int64_t row, int64_t col,
                        int fetch, vn *restrict acc, int bf16, int pairs)
{
    const int64_t esize = bf16 ? 2 : 4;
    for (int64_t t0 = start; t0 < len;) {
        const int64_t off = t0 % block_size, following = t0 - off + block_size;
        const int64_t n = len - t0 < block_size - off ? len - t0 : block_size - off;
        const int64_t vb = (table[t0 / block_size] * block_size + off) * row + col;
        if (fetch && following < len)
            prefetch_rows(kv_ptr(v_pool, table[following / block_size] * block_size * row, bf16),
                          (len - following < block_size ? len - following : block_size) * row *
                              esize);
        for (int64_t i = 0; i < n; i++) {
            const void *vr = kv_ptr(v_pool, vb + i * row, bf16);
            if (bf16) { /* widened once for the group */
                vn v[VALUE_REGS] = {0}; /* (only the first CN are read) */
                if (pairs) {
                    for (int64_t c = 0; c < CN / 2 && 2 * c + 1 < VALUE_REGS; c++)
                        load_pairs(kv_ptr(vr, 2 * c * VN, 1), &v[2 * c], &v[2 * c + 1]);
                } else {
#pragma GCC unroll 16
                    for (int64_t c = 0; c < CN && c < VALUE_REGS; c++)
                        v[c] = loadn_as(kv_ptr(vr, c * VN, 1), 1);
                }
#pragma GCC unroll 4
                for (int g = 0; g < GN; g++) {
                    const float w = p[g * stride + t0 + i];
#pragma GCC unroll 16
                    for (int64_t c = 0; c < CN && c < VALUE_REGS; c++)
                        if (g * CN + c < VALUE_REGS) acc[g * CN + c] += w * v[c];
                }
            } else {
#pragma GCC unroll 4
                for (int g = 0; g < GN; g++) {
                    const float w = p[g * stride + t0 + i];
#pragma GCC unroll 16
                    for (int64_t c = 0; c < CN; c++)
                        if (g * CN + c < VALUE_REGS)
                            acc[g * CN + c] += w * loadn((const float *)vr + c * VN);
                }
            }
        }
        t0 += n;
    }
}

INLINE void values_grouped(const float *restrict probs, const void *restrict v_pool,
                           const int64_t *restrict table, int64_t start, int64_t len,
                           int64_t num_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t stride, float *restrict out, int bf16)
{
    const int64_t num_kv_heads = num_heads / group, row = num_kv_heads * head_dim;
    const int64_t nc = head_dim / VN;
    /* bf16 rows widened in load_pairs' order: the sums too, put back in order when stored */
    const int pairs = bf16 && head_in_pairs(head_dim);
    /* heads a walk sums (gc), and vectors of each head (dc): gc * dc <= VALUE_REGS */
    int64_t gc = VALUE_REGS / nc, dc = nc;
    if (gc < 2) {
        gc = 3;
        dc = VALUE_REGS / gc;
        if (pairs) dc -= dc % 2; /* whole pairs a walk */
    }
    if (gc > group) gc = group;
    for (int64_t h = 0; h < num_kv_heads; h++)
        for (int64_t g0 = 0; g0 < group; g0 += gc)
            for (int64_t c0 = 0; c0 < nc; c0 += dc) {
                const int64_t gn = group - g0 < gc ? group - g0 : gc;
                const int64_t cn = nc - c0 < dc ? nc - c0 : dc;
                vn acc[VALUE_REGS] = {0};
                const float *p = probs + (h * group + g0) * stride - start; /* p[g * stride + t] */
                const int fetch = h == 0 && g0 == 0 && c0 == 0; /* the first walk fetches */
                const int64_t col = h * head_dim + c0 * VN;
#define WALK(GN_, CN_)                                                                       \
    values_walk(GN_, CN_, p, stride, v_pool, table, start, len, block_size, row, col, fetch, acc, \
                bf16, pairs)
                if (cn == dc && gn <= 4 && gn * dc <= VALUE_REGS) {
                    switch (gn) {
                    case 1: WALK(1, dc); break;
                    case 2: WALK(2, dc); break;
                    case 3: WALK(3, dc); break;
                    default: WALK(4, dc); break;
                    }
                } else {
                    WALK((int)gn, cn);
                }
#undef WALK
                for (int64_t g = 0; g < gn; g++) {
                    float *o = out + (h * group + g0 + g) * head_dim + c0 * VN;
                    for (int64_t c = 0; c < cn; c += 1 + pairs)
                        if (pairs)
                            store_pairs(o + c * VN, acc[g * cn + c], acc[g * cn + c + 1]);
                        else
                            storen(o + c * VN, acc[g * cn + c]);
                }
            }
}
#endif

#define SPECIALISED(call, head_dim, ...)                                                     \
    switch (head_dim) {                                                                      \
    case 32: call(__VA_ARGS__, 32); break;                                                   \
    case 64: call(__VA_ARGS__, 64); break;                                                   \
    case 128: call(__VA_ARGS__, 128); break;                                                 \
    default: call(__VA_ARGS__, head_dim);                                                    \
    }

#ifdef BATON_VECTOR_SCORES
#define SCORES(qb, table, start, len, sb, D)                                                 \
    ((D) % VN == 0 ? scores_one_vec(qb, k_pool, table, start, len, num_heads, group, D,      \
                                    block_size, scale, sb, stride, bf16)                     \
                   : scores_one(qb, k_pool, table, start, len, num_heads, group, D,          \
                                block_size, scale, sb, stride, bf16))
#else
#define SCORES(qb, table, start, len, sb, D)                                                 \
    scores_one(qb, k_pool, table, start, len, num_heads, group, D, block_size, scale, sb,    \
               stride, bf16)
#endif
#ifdef BATON_VECTOR_SCORES
#define VALUES(pb, table, start, len, ob, D)                                                 \
    ((D) % VN == 0                                                 \
         ? values_grouped(pb, v_pool, table, start, len, num_heads, group, D, block_size,    \
                          stride, ob, bf16)                                                  \
         : values_one(pb, v_pool, table, start, len, num_heads, group, D, block_size,        \
                      stride, ob, bf16))
#else
#define VALUES(pb, table, start, len, ob, D) \
    values_one(pb, v_pool, table, start, len, num_heads, group, D, block_size, stride, ob, bf16)
#endif

/* softmax over s[0, n) in place, n >= 1: exp(s - max) / sum, as torch's softmax (its exp is
 * ~1 ulp; this one Cephes' polynomial, ~2 ulp, vectorised where GCC's vector types are). A NaN
 * score makes the row NaN. */
#ifdef BATON_VECTOR_SCORES
/* e^x, x <= 0 (or NaN) over VN lanes: x clamped to -87.3 (e^x below it is 2^-126 or less, not
 * a weight a sum of at least 1 notices). */
static inline vn expn(vn x)
{
    const vn zero = {0}, lo = zero - 87.3f;
    const vni below = x < lo; /* NaN: false, kept */
    return expn_clamped((vn)(((vni)lo & below) | ((vni)x & ~below)));
}

static void softmax(float *s, int64_t n)
{
    const vn ninf = {0}; /* lanes past n stay -inf */
    vn vmax = ninf - INFINITY, vnan = ninf;
    int64_t i = 0;
    for (; i + VN <= n; i += VN) {
        const vn v = loadn(s + i);
        vmax = (vn)(((vni)v & (vni)(v > vmax)) | ((vni)vmax & ~(vni)(v > vmax)));
        vnan = (vn)((vni)vnan | ((vni)v & (vni)(v != v))); /* a NaN's bits, or 0 */
    }
    float mx = -INFINITY, nan = 0.f;
    for (int j = 0; j < VN; j++) {
        mx = vmax[j] > mx ? vmax[j] : mx;
        nan = vnan[j] != 0.f ? vnan[j] : nan;
    }
    for (; i < n; i++) {
        mx = s[i] > mx ? s[i] : mx;
        nan = s[i] != s[i] ? s[i] : nan;
    }
    if (nan != nan) mx = nan; /* a NaN score makes every exp, so the row, NaN */
    vn acc = {0};
    i = 0;
    for (; i + VN <= n; i += VN) {
        const vn e = expn(loadn(s + i) - mx);
        storen(s + i, e);
        acc += e;
    }
    if (i < n) { /* the tail through a padded vector, its padding left out of the sum */
        float t[VN] = {0};
        memcpy(t, s + i, (size_t)(n - i) * sizeof *s);
        const vn e = expn(loadn(t) - mx);
        storen(t, e);
        for (int64_t j = n - i; j < VN; j++) t[j] = 0.f;
        memcpy(s + i, t, (size_t)(n - i) * sizeof *s);
        acc += loadn(t);
    }
    float sum = 0.f;
    for (int j = 0; j < VN; j++) sum += acc[j];
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) s[j] *= inv;
}
#else
static void softmax(float *s, int64_t n)
{
    float mx = -INFINITY, sum = 0.f;
    for (int64_t i = 0; i < n; i++) mx = s[i] > mx || s[i] != s[i] ? s[i] : mx;
    for (int64_t i = 0; i < n; i++) sum += s[i] = expf(s[i] - mx);
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++) s[i] *= inv;
}
#endif

/* The arguments of one exported call. */
struct attend_args {
    const float *q; /* [batch, num_heads, head_dim], rows q_stride floats apart */
    int64_t q_stride;
    const void *k_pool, *v_pool; /* fp32 or bf16 elements: the entry point says which */
    const int64_t *block_tables;
    int64_t max_blocks;
    const int64_t *context_lens;
    const int64_t *starts; /* NULL: every row from position 0 */
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    float *out; /* [batch, num_heads, head_dim] */
    int64_t max_len; /* the longest row's span: the scores scratch a row needs per head */
};

/* Ask for the first PREFETCH_SPAN bytes of row b's K and of its V at once, into L2 (all of a
 * row of the bench shape at a context of ~170): the passes' own prefetch, one block ahead, kept
 * few of a thread's memory requests in flight, and the step waited on each block's latency.
 * Past the span (long contexts, which would not fit L2) that prefetch alone serves. Called at the
 * row's start: V arrives while K is scored. */
#define PREFETCH_SPAN (128 << 10)

INLINE void prefetch_span(const struct attend_args *a, int64_t b, int64_t row_bytes)
{
    const int64_t *table = a->block_tables + b * a->max_blocks, bs = a->block_size;
    const int64_t start = a->starts ? a->starts[b] : 0, len = a->context_lens[b];
    const int64_t end = len - start > PREFETCH_SPAN / row_bytes ? start + PREFETCH_SPAN / row_bytes
                                                                : len;
    for (int pool = 0; pool < 2; pool++) /* K first: the scores pass reads it first */
        for (int64_t t0 = start; t0 < end;) {
            const int64_t off = t0 % bs, n = end - t0 < bs - off ? end - t0 : bs - off;
            const int64_t at = table[t0 / bs] * bs + off;
            prefetch_rows((const char *)(pool ? a->v_pool : a->k_pool) + at * row_bytes,
                          n * row_bytes);
            t0 += n;
        }
}

/* Rows [b0, b1): each row's scores into scratch (num_heads x its span), their softmax, then the
 * values: K and V are read once each, the probabilities never leave the thread's cache. */
INLINE void attend_rows(const struct attend_args *a, int64_t b0, int64_t b1, int bf16)
{
    const int64_t num_heads = a->num_heads, group = num_heads / a->num_kv_heads;
    const int64_t block_size = a->block_size;
    const void *k_pool = a->k_pool, *v_pool = a->v_pool;
    const float scale = a->scale;
    const int64_t row = a->num_kv_heads * a->head_dim, esize = bf16 ? 2 : 4;
#ifdef BATON_VECTOR_SCORES
    const int q_pairs = scores_in_pairs(bf16, row, a->head_dim);
#else
    const int q_pairs = 0;
#endif
    /* the scores, then (q_pairs) the row's q in pair order */
    const int64_t q_size = q_pairs ? num_heads * a->head_dim : 0;
    float *scratch = malloc((size_t)(num_heads * a->max_len + q_size) * sizeof(float));
    if (scratch == NULL) { /* no memory: NaN out, which the engine's sampler cannot hide */
        for (int64_t i = b0 * num_heads * a->head_dim; i < b1 * num_heads * a->head_dim; i++)
            a->out[i] = NAN;
        return;
    }
    float *q_pair = scratch + num_heads * a->max_len;
    for (int64_t b = b0; b < b1; b++) {
        const float *qb = a->q + b * a->q_stride;
        if (q_pairs) {
            pair_order(qb, num_heads * a->head_dim, q_pair);
            qb = q_pair;
        }
        const int64_t *table = a->block_tables + b * a->max_blocks;
        const int64_t len = a->context_lens[b], start = a->starts ? a->starts[b] : 0;
        const int64_t stride = len - start; /* this row's scores per head, back to back */
        prefetch_span(a, b, row * esize);
        SPECIALISED(SCORES, a->head_dim, qb, table, start, len, scratch)
        for (int64_t hq = 0; hq < num_heads; hq++) softmax(scratch + hq * stride, stride);
        float *ob = a->out + b * num_heads * a->head_dim;
        SPECIALISED(VALUES, a->head_dim, scratch, table, start, len, ob)
    }
    free(scratch);
}

/* The parts run on the OpenMP team torch's own ops use (this library links libgomp, and the
 * process already holds torch's copy under that name, so both share one runtime and one
 * team). Threads started per call, as this file once did, met torch's team still spinning
 * after the step's last GEMM (libgomp spins before it sleeps): on two cores they took turns
 * on one core and attention got slower with two threads than with one. Rows are independent
 * and each is computed the same way whichever thread takes it. */
typedef void (*rows_fn)(const struct attend_args *, int64_t, int64_t);

/* Once per element type. */
static void attend_rows_f32(const struct attend_args *a, int64_t b0, int64_t b1)
{
    attend_rows(a, b0, b1, 0);
}
static void attend_rows_bf16(const struct attend_args *a, int64_t b0, int64_t b1)
{
    attend_rows(a, b0, b1, 1);
}

/* The batch goes out in chunks of about ROWS_PER_CHUNK rows, each taken by whichever thread of
 * the `parts` is free (a dynamic schedule), not in one fixed range a thread. Two reasons: rows
 * cost what their context costs, so fixed halves of a batch of mixed lengths finish apart; and
 * on a machine shared with the broker and the light services, a thread the kernel preempts no
 * longer leaves its whole range to wait for it (only the chunk it holds). A small gain: most of
 * what a preempted thread costs a step is in the GEMMs, whose split is the library's
 * (docs/perf-log.md, "Decode attention kernel"). A row is computed the same way whichever
 * thread takes it. */
#define ROWS_PER_CHUNK 4

static void split_rows(rows_fn fn, const struct attend_args *a, int64_t batch, int64_t parts)
{
    if (parts > batch) parts = batch;
    if (parts <= 1) {
        fn(a, 0, batch);
        return;
    }
    const int64_t chunks = batch / ROWS_PER_CHUNK > parts ? batch / ROWS_PER_CHUNK : parts;
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
    for (int64_t i = 0; i < chunks; i++) fn(a, batch * i / chunks, batch * (i + 1) / chunks);
}

/* The exported call: the pools' element type is in the name (q and out: fp32). max_len: at least
 * every row's context_lens[b] - starts[b]. */
#define ATTEND_ENTRY(name, pool_t, rows)                                                     \
    void name(const float *q, int64_t q_stride, const pool_t *k_pool, const pool_t *v_pool,  \
              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,  \
              const int64_t *starts, int64_t batch, int64_t parts, int64_t num_heads,        \
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,       \
              int64_t max_len, float *out)                                                   \
    {                                                                                        \
        const struct attend_args a = {q, q_stride, k_pool, v_pool, block_tables, max_blocks, \
                                      context_lens, starts, num_heads, num_kv_heads,         \
                                      head_dim, block_size, scale, out, max_len};            \
        split_rows(rows, &a, batch, parts);                                                  \
    }

ATTEND_ENTRY(baton_paged_decode_attend_f32, float, attend_rows_f32)
ATTEND_ENTRY(baton_paged_decode_attend_bf16, uint16_t, attend_rows_bf16)
