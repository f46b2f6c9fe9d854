/* Fused float32 kernels for the engine's CPU passes (loaded by engine/layers/cpu_kernels.py).
 *
 * Each replaces a chain of small PyTorch kernels whose dispatch, allocation and thread wake-up
 * cost more than their arithmetic at the few rows of a decode step. Every row is computed alone,
 * in the same order whatever else is in the batch, so results do not depend on batch size.
 * Built with -ffp-contract=off: a product and a sum round as PyTorch's separate kernels do.
 */
#include <math.h>
#include <stdint.h>

#define LANES 8 /* independent partial sums: the compiler maps them onto one AVX2 register */

static inline float dot(const float *a, const float *b, int64_t n) {
    const int64_t whole = n - n % LANES;
    float partial[LANES] = {0};
    for (int64_t i = 0; i < whole; i += LANES)
        for (int lane = 0; lane < LANES; lane++) partial[lane] += a[i + lane] * b[i + lane];
    float sum = 0.0f;
    for (int lane = 0; lane < LANES; lane++) sum += partial[lane];
    for (int64_t i = whole; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void normalize_row(const float *x, const float *weight, float *out, int64_t n, float eps) {
    const float inverse_rms = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inverse_rms * weight[i];
}

/* out[r] = rms_norm(x[r]) * weight for rows of n floats, x's rows `x_stride` floats apart. */
void rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows,
              int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) normalize_row(x + r * x_stride, weight, out + r * n, n, eps);
}

/* residual[r] += x[r], then out[r] = rms_norm(residual[r]) * weight: a decoder layer's residual
 * add fused with the norm after it. Every buffer is contiguous [rows, n]. */
void add_rms_norm(float *residual, const float *x, const float *weight, float *out, int64_t rows,
                  int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *sum = residual + r * n;
        const float *added = x + r * n;
        for (int64_t i = 0; i < n; i++) sum[i] += added[i];
        normalize_row(sum, weight, out + r * n, n, eps);
    }
}

/* out[r] = silu(gate) * up, where gate_up[r] = [gate (n floats), up (n floats)]. */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n, *up = gate + n;
        float *row = out + r * n;
        for (int64_t i = 0; i < n; i++) row[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Rotary embedding in place: each head x of token t becomes x * cos[t] + swap(x) * signed_sin[t],
 * where swap exchanges x's halves and signed_sin = [-sin, sin] (engine/layers/rotary.py).
 * x is [tokens, heads, head_dim] with tokens `token_stride` floats apart; cos and signed_sin are
 * contiguous [tokens, head_dim]. */
void rotary(float *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t head_dim,
            const float *cos, const float *signed_sin) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = signed_sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *first = x + t * token_stride + h * head_dim, *second = first + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = first[i], b = second[i];
                first[i] = a * c[i] + b * s[i];
                second[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* Write the new tokens' K and V ([tokens, row] each, tokens k_stride and v_stride floats apart) to
 * their cache slots: slot s of a cache holds `row` floats at s * row. */
void store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
              const int64_t *slots, int64_t tokens, int64_t row, float *k_cache, float *v_cache) {
    for (int64_t t = 0; t < tokens; t++) {
        float *k_slot = k_cache + slots[t] * row, *v_slot = v_cache + slots[t] * row;
        const float *k_row = k + t * k_stride, *v_row = v + t * v_stride;
        for (int64_t i = 0; i < row; i++) k_slot[i] = k_row[i];
        for (int64_t i = 0; i < row; i++) v_slot[i] = v_row[i];
    }
}

#define TILE 64
#define MAX_ROWS 1024 /* a task's rows: queries per sequence x query heads per K/V head */
#define MAX_HEAD_DIM 256 /* heads larger than this run in PyTorch (cpu_kernels.py) */

/* exp(x) for x in [EXP_FLOOR, 0], to about 1 ulp, in arithmetic the compiler vectorizes (libm's
 * expf is a call per entry): x = n ln2 + f with |f| <= ln2 / 2, exp(f) = 1 + f + f^2 P(f) with
 * Cephes' minimax P of degree 5, times 2^n built from n's bits. */
#define EXP_FLOOR -87.0f /* float's normal range ends near exp(-87.3) */
static inline float exp_in_range(float x) {
    const int32_t whole = (int32_t)(x * 1.44269504f - 0.5f); /* round to nearest, as x <= 0 */
    const float n = (float)whole;
    const float f = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    const float exp_f = p * f * f + f + 1.0f;
    const int32_t bits = (whole + 127) << 23;
    float power;
    __builtin_memcpy(&power, &bits, sizeof power);
    return exp_f * power;
}

/* x[i] = exp(x[i] - top) for x[i] <= top, 0 below top + EXP_FLOOR (and for -INFINITY). Two loops,
 * as GCC vectorizes neither a select before a float-to-int conversion nor one after it. */
static void exp_shifted(float *x, int64_t n, float top) {
    float keep[TILE];
    for (int64_t i = 0; i < n; i++) {
        const float shifted = x[i] - top;
        keep[i] = shifted < EXP_FLOOR ? 0.0f : 1.0f;
        x[i] = shifted < EXP_FLOOR ? EXP_FLOOR : shifted;
    }
    for (int64_t i = 0; i < n; i++) x[i] = exp_in_range(x[i]) * keep[i];
}

/* The largest and the sum of n floats, in LANES interleaved partials (fixed order, vectorized). */
static float largest(const float *x, int64_t n) {
    float partial[LANES];
    for (int lane = 0; lane < LANES; lane++) partial[lane] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int lane = 0; lane < LANES; lane++)
            partial[lane] = x[i + lane] > partial[lane] ? x[i + lane] : partial[lane];
    float result = -INFINITY;
    for (int lane = 0; lane < LANES; lane++) result = partial[lane] > result ? partial[lane] : result;
    for (; i < n; i++) result = x[i] > result ? x[i] : result;
    return result;
}

static float sum(const float *x, int64_t n) {
    float partial[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int lane = 0; lane < LANES; lane++) partial[lane] += x[i + lane];
    float result = 0.0f;
    for (int lane = 0; lane < LANES; lane++) result += partial[lane];
    for (; i < n; i++) result += x[i];
    return result;
}

/* Softmax step for one row over one tile: p holds its scaled scores (-INFINITY where masked) and
 * becomes the exp weights; the row's running top and total, and its accumulator, are rescaled
 * when the top rises. */
static void tile_softmax(float *p, int64_t width, float *top, float *total, float *acc,
                         int64_t head_dim) {
    const float tile_top = largest(p, width);
    if (tile_top == -INFINITY) { /* nothing allowed in this tile */
        for (int64_t e = 0; e < width; e++) p[e] = 0.0f;
        return;
    }
    if (tile_top > *top) {
        if (*top != -INFINITY) {
            float shrink = *top;
            exp_shifted(&shrink, 1, tile_top);
            for (int64_t d = 0; d < head_dim; d++) acc[d] *= shrink;
            *total *= shrink;
        }
        *top = tile_top;
    }
    exp_shifted(p, width, *top); /* masked entries: 0 */
    *total += sum(p, width);
}

/* row += sum over the tile's entries of p[e] * value[e]: the weighted values of one row, summed in
 * entry order in a local copy (registers, for a head size known at compile time). */
static inline void weigh_values(const float *p, const float *const *value_row, int64_t width,
                                int64_t head_dim, float *row) {
    float local[MAX_HEAD_DIM];
    for (int64_t d = 0; d < head_dim; d++) local[d] = row[d];
    for (int64_t e = 0; e < width; e++) {
        const float weight = p[e], *value = value_row[e];
        if (weight == 0.0f) continue;
        for (int64_t d = 0; d < head_dim; d++) local[d] += weight * value[d];
    }
    for (int64_t d = 0; d < head_dim; d++) row[d] = local[d];
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *tables, *first_token, *num_new;
    const uint8_t *mask;
    int64_t q_stride, max_blocks, num_queries, block_size, heads, kv_heads;
    float scale;
    float *out, *scratch;
} Attention;

/* Sequence b's queries through the query heads that share K/V head g (see paged_attention). */
static inline void attend(const Attention *a, int64_t b, int64_t g, int64_t head_dim) {
    const int64_t entries = a->max_blocks * a->block_size, group = a->heads / a->kv_heads;
    const int64_t slot_row = a->kv_heads * head_dim, rows = a->num_new[b] * group;
    /* row r: query i = r / group of the sequence, through query head g * group + r % group */
    const float *query[MAX_ROWS];
    float *acc[MAX_ROWS];
    const uint8_t *allowed[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = a->first_token[b] + r / group, head = g * group + r % group;
        query[r] = a->q + token * a->q_stride + head * head_dim;
        acc[r] = a->out + (token * a->heads + head) * head_dim;
        allowed[r] = a->mask + (b * a->num_queries + r / group) * entries;
        for (int64_t d = 0; d < head_dim; d++) acc[r][d] = 0.0f;
    }
    float *task = a->scratch + (b * a->kv_heads + g) * group * a->num_queries * (TILE + 2);
    float *probability = task, *top = task + rows * TILE, *total = top + rows;
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.0f;
    const int64_t *table = a->tables + b * a->max_blocks;
    const float *key_row[TILE], *value_row[TILE];
    for (int64_t start = 0; start < entries; start += TILE) {
        const int64_t width = entries - start < TILE ? entries - start : TILE;
        int64_t block = start / a->block_size, offset = start % a->block_size;
        for (int64_t e = 0; e < width; e++) {
            const int64_t slot = table[block] * a->block_size + offset;
            key_row[e] = a->k_cache + slot * slot_row + g * head_dim;
            value_row[e] = a->v_cache + slot * slot_row + g * head_dim;
            if (++offset == a->block_size) offset = 0, block++;
        }
        for (int64_t e = 0; e < width; e++)
            for (int64_t r = 0; r < rows; r++)
                probability[r * TILE + e] = dot(query[r], key_row[e], head_dim);
        for (int64_t r = 0; r < rows; r++) {
            float *p = probability + r * TILE;
            const uint8_t *may = allowed[r] + start;
            for (int64_t e = 0; e < width; e++) p[e] = may[e] ? p[e] * a->scale : -INFINITY;
            tile_softmax(p, width, top + r, total + r, acc[r], head_dim);
            weigh_values(p, value_row, width, head_dim, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < head_dim; d++) acc[r][d] /= total[r];
}

/* Attention of a few queries per sequence over its paged K/V, for one group of sequences
 * (engine/layers/paged_attention.py's AttentionGroup):
 *   q         [tokens, heads, head_dim], tokens `q_stride` floats apart
 *   k_cache   [num_blocks, block_size, kv_heads, head_dim], v_cache alike
 *   tables    [batch, max_blocks] each sequence's blocks; entry e is slot e % block_size of
 *             block tables[e / block_size]
 *   mask      [batch, num_queries, max_blocks * block_size] nonzero where a query may attend
 *   first_token, num_new [batch]: sequence b's queries are tokens first_token[b] + i, i < num_new[b]
 *   out       [tokens, heads * head_dim]: each query's row, also the running sums
 *   scratch   [batch * heads * num_queries, TILE + 2]
 * One task per (sequence, K/V head), on `threads` OpenMP threads (PyTorch's count): its rows are
 * the sequence's queries times the query heads sharing that K/V head, so each K and V row is read
 * once for all of them. Entries go by tiles, with the softmax's running maximum and sum rescaled
 * once per tile (flash attention's online softmax), in float32, in entry order. The task's code
 * is compiled apart for head sizes 64 and 128, whose loops then unroll and whose accumulators stay
 * in registers (each cut about a fifth of the kernel's time in an A/B timing of its variants). */
void paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int64_t *tables, int64_t max_blocks, const uint8_t *mask,
                     const int64_t *first_token, const int64_t *num_new, int64_t batch,
                     int64_t num_queries, int64_t block_size, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, float scale, float *out, float *scratch, int threads) {
    const Attention a = {q, k_cache, v_cache, tables, first_token, num_new, mask, q_stride,
                         max_blocks, num_queries, block_size, heads, kv_heads, scale, out, scratch};
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t g = 0; g < kv_heads; g++) {
            if (head_dim == 64) attend(&a, b, g, 64);
            else if (head_dim == 128) attend(&a, b, g, 128);
            else attend(&a, b, g, head_dim);
        }
    }
}
