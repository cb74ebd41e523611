/* A decode step's layers as one call: a list of kernel calls recorded once per batch size
 * (kernels/cpu/decode_program.py), run in order, with the step's own values (RoPE tables, slot
 * mapping, block tables) read from a small array written once per step.
 *
 * Why: a small model's decode step makes ~10 kernel calls a layer, each a few to a few hundred
 * microseconds, and the Python around each call (argument checks, a fresh output tensor, the
 * ctypes conversion) cost about as much as the smaller ones: ~3 ms of an 8 ms step at batch 1
 * (docs/perf-log.md, "A decode step as one call"). Here the same entry points are called with
 * the same arguments the eager path gives them, so a step's numbers are the eager path's, bit
 * for bit: the kernels are the other libraries' (their addresses are in the ops), and the steps
 * done here are a row copy (the KV store), the residual add (fp32, or bf16 rounded as torch
 * rounds it) and the bf16 <-> fp32 conversions around the kernels that take fp32 (torch's
 * rounding: to nearest, ties to even), as torch does them.
 *
 * An argument slot holds a value, or STEP_ARG | i: the step array's element i. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define STEP_ARG (INT64_C(1) << 62)
#define MAX_ARGS 18

enum {
    OP_RMS_NORM = 1,  /* layer_ops.c rms_norm (x, rows, cols, stride, w, eps, out, parts) */
    OP_ADD_RMS_NORM,  /* layer_ops.c add_rms_norm (h, delta, rows, cols, w, eps, out, parts) */
    OP_SILU_MUL,      /* layer_ops.c silu_mul (gu, rows, inter, stride, out, parts) */
    OP_ROPE,          /* rope.c (x, tokens, heads, head_dim, stride, cos, sin) */
    OP_DENSE_LINEAR,  /* dense_tiles.c (x, m, n, k, w, bias, y, parts) -> int */
    OP_QUANT_LINEAR,  /* quant_linear.c / quant_tiles.c (w, qtype, n, k, x, m, ldx, bias, y,
                         parts) -> int */
    OP_ATTEND,        /* paged_decode_attention.c (q, q_stride, k_pool, v_pool, tables,
                         max_blocks, lens, starts, batch, parts, heads, kv_heads, head_dim,
                         block_size, scale, max_len, out) */
    OP_STORE_KV,      /* here: (k_src, v_src, src_stride, row, slots, rows, k_pool, v_pool,
                         num_slots, element_bytes, pool_element_bytes) in elements */
    OP_ADD,           /* here: (h, delta, n): h += delta in fp32 */
    OP_ROPE_PARTS,    /* layer_ops.c bf16 rope (x, tokens, heads, head_dim, stride, cos, sin,
                         parts) */
    OP_TO_F32,        /* here: (src bf16, src_stride, rows, cols, dst fp32, dst_stride) */
    OP_TO_BF16,       /* here: (src fp32, src_stride, rows, cols, dst bf16, dst_stride) */
    OP_ADD_BF16,      /* here: (h, delta, n): h = bf16(h + delta), as torch adds bf16 */
};

struct op {
    int64_t kind;
    void *fn;
    float f; /* eps, scale */
    int64_t a[MAX_ARGS];
};

typedef void (*norm_fn)(const float *, int64_t, int64_t, int64_t, const float *, float, float *,
                        int64_t);
typedef void (*add_norm_fn)(float *, const float *, int64_t, int64_t, const float *, float,
                            float *, int64_t);
typedef void (*silu_fn)(const float *, int64_t, int64_t, int64_t, float *, int64_t);
typedef void (*rope_fn)(float *, int64_t, int64_t, int64_t, int64_t, const float *,
                        const float *);
typedef int (*dense_fn)(const float *, int64_t, int64_t, int64_t, const float *, const float *,
                        float *, int64_t);
typedef int (*quant_fn)(const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t,
                        int64_t, const float *, float *, int64_t);
typedef void (*rope_parts_fn)(void *, int64_t, int64_t, int64_t, int64_t, const void *,
                              const void *, int64_t);
typedef void (*attend_fn)(const float *, int64_t, const float *, const float *, const int64_t *,
                          int64_t, const int64_t *, const int64_t *, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, int64_t, float *);

static inline int64_t arg(const struct op *o, int i, const int64_t *step)
{
    const int64_t v = o->a[i];
    return v & STEP_ARG ? step[v & ~STEP_ARG] : v;
}

/* Rows of K and V into their slots; -1 (nothing stored) where a slot is outside the pools. Rows
 * of fp32 into a bf16 cache (an fp32 model's bf16 KV) round as torch's copy does. */
static int store_kv(const struct op *o, const int64_t *step)
{
    const int64_t es = arg(o, 9, step), pes = arg(o, 10, step); /* bytes an element: rows, pool */
    const char *k = (const char *)(intptr_t)arg(o, 0, step);
    const char *v = (const char *)(intptr_t)arg(o, 1, step);
    const int64_t stride = arg(o, 2, step) * es, n = arg(o, 3, step), row = n * pes;
    const int64_t *slots = (const int64_t *)(intptr_t)arg(o, 4, step);
    const int64_t rows = arg(o, 5, step), num_slots = arg(o, 8, step);
    char *k_pool = (char *)(intptr_t)arg(o, 6, step), *v_pool = (char *)(intptr_t)arg(o, 7, step);
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    for (int64_t r = 0; r < rows; r++) {
        if (pes == es) {
            memcpy(k_pool + slots[r] * row, k + r * stride, (size_t)row);
            memcpy(v_pool + slots[r] * row, v + r * stride, (size_t)row);
            continue;
        }
        const float *kr = (const float *)(k + r * stride), *vr = (const float *)(v + r * stride);
        uint16_t *kd = (uint16_t *)(k_pool + slots[r] * row);
        uint16_t *vd = (uint16_t *)(v_pool + slots[r] * row);
        for (int64_t c = 0; c < n; c++) {
            kd[c] = f32_to_bf16(kr[c]);
            vd[c] = f32_to_bf16(vr[c]);
        }
    }
    return 0;
}

/* rows x cols elements from src to dst (their row strides apart), widened to fp32 or narrowed
 * to bf16 (OP_TO_F32, OP_TO_BF16). */
static void convert(const struct op *o, const int64_t *step, int narrow)
{
    const char *src = (const char *)(intptr_t)arg(o, 0, step);
    const int64_t ss = arg(o, 1, step), rows = arg(o, 2, step), cols = arg(o, 3, step);
    char *dst = (char *)(intptr_t)arg(o, 4, step);
    const int64_t ds = arg(o, 5, step);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            if (narrow)
                ((uint16_t *)dst)[r * ds + c] = f32_to_bf16(((const float *)src)[r * ss + c]);
            else
                ((float *)dst)[r * ds + c] = bf16_to_f32(((const uint16_t *)src)[r * ss + c]);
        }
}

/* Runs ops[0 .. n) in order: 0, or -(i + 1) where op i failed (a kernel refused its inputs,
 * a slot outside the cache); the ops after it are not run. */
int64_t baton_run_program(const struct op *ops, int64_t n, const int64_t *step)
{
    for (int64_t i = 0; i < n; i++) {
        const struct op *o = ops + i;
#define A(j) arg(o, j, step)
#define P(T, j) ((T)(intptr_t)arg(o, j, step))
        int rc = 0;
        switch (o->kind) {
        case OP_RMS_NORM:
            ((norm_fn)o->fn)(P(const float *, 0), A(1), A(2), A(3), P(const float *, 4), o->f,
                             P(float *, 5), A(6));
            break;
        case OP_ADD_RMS_NORM:
            ((add_norm_fn)o->fn)(P(float *, 0), P(const float *, 1), A(2), A(3),
                                 P(const float *, 4), o->f, P(float *, 5), A(6));
            break;
        case OP_SILU_MUL:
            ((silu_fn)o->fn)(P(const float *, 0), A(1), A(2), A(3), P(float *, 4), A(5));
            break;
        case OP_ROPE:
            ((rope_fn)o->fn)(P(float *, 0), A(1), A(2), A(3), A(4), P(const float *, 5),
                             P(const float *, 6));
            break;
        case OP_DENSE_LINEAR:
            rc = ((dense_fn)o->fn)(P(const float *, 0), A(1), A(2), A(3), P(const float *, 4),
                                   P(const float *, 5), P(float *, 6), A(7));
            break;
        case OP_QUANT_LINEAR:
            rc = ((quant_fn)o->fn)(P(const uint8_t *, 0), A(1), A(2), A(3), P(const float *, 4),
                                   A(5), A(6), P(const float *, 7), P(float *, 8), A(9));
            break;
        case OP_ATTEND:
            ((attend_fn)o->fn)(P(const float *, 0), A(1), P(const float *, 2),
                               P(const float *, 3), P(const int64_t *, 4), A(5),
                               P(const int64_t *, 6), P(const int64_t *, 7), A(8), A(9), A(10),
                               A(11), A(12), A(13), o->f, A(14), P(float *, 15));
            break;
        case OP_STORE_KV:
            rc = store_kv(o, step);
            break;
        case OP_ADD: {
            float *h = P(float *, 0);
            const float *d = P(const float *, 1);
            const int64_t count = A(2);
            for (int64_t j = 0; j < count; j++) h[j] += d[j];
            break;
        }
        case OP_ROPE_PARTS:
            ((rope_parts_fn)o->fn)(P(void *, 0), A(1), A(2), A(3), A(4), P(const void *, 5),
                                   P(const void *, 6), A(7));
            break;
        case OP_TO_F32:
        case OP_TO_BF16:
            convert(o, step, o->kind == OP_TO_BF16);
            break;
        case OP_ADD_BF16: {
            uint16_t *h = P(uint16_t *, 0);
            const uint16_t *d = P(const uint16_t *, 1);
            const int64_t count = A(2);
            for (int64_t j = 0; j < count; j++)
                h[j] = f32_to_bf16(bf16_to_f32(h[j]) + bf16_to_f32(d[j]));
            break;
        }
        default:
            rc = -1;
        }
#undef A
#undef P
        if (rc) return -(i + 1);
    }
    return 0;
}
