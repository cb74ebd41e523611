/* Decode attention over Baton's paged fp32 KV cache, CPU, in two passes around a softmax.
 *
 * One layer's cache is a K and a V pool of [num_blocks, block_size, num_kv_heads, head_dim]
 * floats; sequence b's position t lives in block block_tables[b][t / block_size] at offset
 * t % block_size. The torch path gathers K into a padded copy and sums V rows through
 * embedding_bag, one row of head_dim floats at a time. Here each pass walks a sequence's blocks
 * in place, a whole slot row (every KV head) at a time: K and V are each read once, contiguously
 * within a block, and nothing is copied.
 *
 *   scores: scores[b, hq, t] = scale * q[b, hq] . K[slot(b, t), hq / group]   for t < len[b],
 *           -inf for len[b] <= t < stride          (the softmax between the passes is torch's)
 *   values: out[b, hq] = sum over t < len[b] of probs[b, hq, t] * V[slot(b, t), hq / group]
 *
 * Query head hq uses KV head hq / group (transformers' repeat_kv order). Both take a batch range
 * [b0, b1) so a caller can split a batch across threads (disjoint writes). Common head sizes are
 * specialised so the inner loops unroll into registers; any other size takes the generic loop. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline void scores_one(const float *restrict q, const float *restrict k_pool,
                              const int64_t *restrict table, int64_t len, int64_t num_heads,
                              int64_t group, int64_t head_dim, int64_t block_size, float scale,
                              float *restrict scores, int64_t stride)
{
    const int64_t row = num_heads / group * head_dim;
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        const float *kb = k_pool + table[t0 / block_size] * block_size * row;
        for (int64_t i = 0; i < n; i++) {
            const float *krow = kb + i * row;
            for (int64_t hq = 0; hq < num_heads; hq++) {
                const float *k = krow + hq / group * head_dim, *qh = q + hq * head_dim;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * k[d];
                scores[hq * stride + t0 + i] = acc * scale;
            }
        }
    }
    for (int64_t hq = 0; hq < num_heads; hq++)
        for (int64_t t = len; t < stride; t++) scores[hq * stride + t] = -INFINITY;
}

static inline void values_one(const float *restrict probs, const float *restrict v_pool,
                              const int64_t *restrict table, int64_t len, int64_t num_heads,
                              int64_t group, int64_t head_dim, int64_t block_size,
                              int64_t stride, float *restrict out)
{
    const int64_t row = num_heads / group * head_dim;
    for (int64_t hq = 0; hq < num_heads; hq++) {
        float acc[head_dim];
        memset(acc, 0, sizeof acc);
        const float *p = probs + hq * stride;
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;
            const float *vb = v_pool + table[t0 / block_size] * block_size * row;
            vb += hq / group * head_dim;
            for (int64_t i = 0; i < n; i++) {
                const float w = p[t0 + i], *v = vb + i * row;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[d] += w * v[d];
            }
        }
        memcpy(out + hq * head_dim, acc, sizeof acc);
    }
}

#define SPECIALISED(call, head_dim, ...)                                                     \
    switch (head_dim) {                                                                      \
    case 32: call(__VA_ARGS__, 32); break;                                                   \
    case 64: call(__VA_ARGS__, 64); break;                                                   \
    case 128: call(__VA_ARGS__, 128); break;                                                 \
    default: call(__VA_ARGS__, head_dim);                                                    \
    }

#define SCORES(qb, table, len, sb, D) \
    scores_one(qb, k_pool, table, len, num_heads, group, D, block_size, scale, sb, stride)
#define VALUES(pb, table, len, ob, D) \
    values_one(pb, v_pool, table, len, num_heads, group, D, block_size, stride, ob)

void baton_paged_decode_scores_f32(const float *q, const float *k_pool,
                                   const int64_t *block_tables, int64_t max_blocks,
                                   const int64_t *context_lens, int64_t b0, int64_t b1,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, float *scores, int64_t stride)
{
    const int64_t group = num_heads / num_kv_heads;
    for (int64_t b = b0; b < b1; b++) {
        const float *qb = q + b * num_heads * head_dim;
        float *sb = scores + b * num_heads * stride;
        SPECIALISED(SCORES, head_dim, qb, block_tables + b * max_blocks, context_lens[b], sb)
    }
}

void baton_paged_decode_values_f32(const float *probs, const float *v_pool,
                                   const int64_t *block_tables, int64_t max_blocks,
                                   const int64_t *context_lens, int64_t b0, int64_t b1,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t stride, float *out)
{
    const int64_t group = num_heads / num_kv_heads;
    for (int64_t b = b0; b < b1; b++) {
        const float *pb = probs + b * num_heads * stride;
        float *ob = out + b * num_heads * head_dim;
        SPECIALISED(VALUES, head_dim, pb, block_tables + b * max_blocks, context_lens[b], ob)
    }
}
