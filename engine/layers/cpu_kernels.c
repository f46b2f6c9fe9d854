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

static float dot(const float *a, const float *b, int64_t n) {
    float partial[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int lane = 0; lane < LANES; lane++) partial[lane] += a[i + lane] * b[i + lane];
    float sum = 0.0f;
    for (int lane = 0; lane < LANES; lane++) sum += partial[lane];
    for (; i < n; i++) sum += a[i] * b[i];
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
 * once per tile (flash attention's online softmax), in float32, in entry order. */
#define TILE 64
#define MAX_ROWS 1024 /* a task's rows: queries per sequence x query heads per K/V head */
void paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int64_t *tables, int64_t max_blocks, const uint8_t *mask,
                     const int64_t *first_token, const int64_t *num_new, int64_t batch,
                     int64_t num_queries, int64_t block_size, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, float scale, float *out, float *scratch, int threads) {
    const int64_t entries = max_blocks * block_size, group = heads / kv_heads;
    const int64_t slot_row = kv_heads * head_dim;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t g = 0; g < kv_heads; g++) {
            /* row r: query i = r / group of the sequence, through query head g * group + r % group */
            const int64_t rows = num_new[b] * group;
            const float *query[MAX_ROWS];
            float *acc[MAX_ROWS];
            const uint8_t *allowed[MAX_ROWS];
            for (int64_t r = 0; r < rows; r++) {
                const int64_t token = first_token[b] + r / group, head = g * group + r % group;
                query[r] = q + token * q_stride + head * head_dim;
                acc[r] = out + (token * heads + head) * head_dim;
                allowed[r] = mask + (b * num_queries + r / group) * entries;
                for (int64_t d = 0; d < head_dim; d++) acc[r][d] = 0.0f;
            }
            float *task = scratch + (b * kv_heads + g) * group * num_queries * (TILE + 2);
            float *probability = task, *top = task + rows * TILE, *total = top + rows;
            for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.0f;
            const int64_t *table = tables + b * max_blocks;
            const float *key_row[TILE], *value_row[TILE];
            for (int64_t start = 0; start < entries; start += TILE) {
                const int64_t width = entries - start < TILE ? entries - start : TILE;
                int64_t block = start / block_size, offset = start % block_size;
                for (int64_t e = 0; e < width; e++) {
                    const int64_t slot = table[block] * block_size + offset;
                    key_row[e] = k_cache + slot * slot_row + g * head_dim;
                    value_row[e] = v_cache + slot * slot_row + g * head_dim;
                    if (++offset == block_size) offset = 0, block++;
                }
                for (int64_t e = 0; e < width; e++)
                    for (int64_t r = 0; r < rows; r++)
                        probability[r * TILE + e] = allowed[r][start + e]
                            ? dot(query[r], key_row[e], head_dim) * scale : -INFINITY;
                for (int64_t r = 0; r < rows; r++) {
                    float *p = probability + r * TILE, tile_top = -INFINITY;
                    for (int64_t e = 0; e < width; e++) tile_top = p[e] > tile_top ? p[e] : tile_top;
                    if (tile_top == -INFINITY) {  /* nothing allowed in this tile */
                        for (int64_t e = 0; e < width; e++) p[e] = 0.0f;
                        continue;
                    }
                    if (tile_top > top[r] && top[r] != -INFINITY) {
                        const float shrink = expf(top[r] - tile_top);
                        for (int64_t d = 0; d < head_dim; d++) acc[r][d] *= shrink;
                        total[r] *= shrink;
                    }
                    if (tile_top > top[r]) top[r] = tile_top;
                    for (int64_t e = 0; e < width; e++) {
                        p[e] = p[e] == -INFINITY ? 0.0f : expf(p[e] - top[r]);
                        total[r] += p[e];
                    }
                }
                for (int64_t e = 0; e < width; e++)
                    for (int64_t r = 0; r < rows; r++) {
                        const float weight = probability[r * TILE + e];
                        if (weight == 0.0f) continue;
                        for (int64_t d = 0; d < head_dim; d++) acc[r][d] += weight * value_row[e][d];
                    }
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t d = 0; d < head_dim; d++) acc[r][d] /= total[r];
        }
    }
}
