/* bf16 linear layers on CPUs with AMX (Intel Xeon from Sapphire Rapids): y = x W^T (+ bias).
 *
 * The weight is the one dpbf16.c reads, packed once at load into panels of 16 output
 * columns with pairs of k interleaved, [panel][K/2][16][2]. That is AMX's B operand
 * layout already: 16 k pairs of one panel, 32 values of k, are one 1 KiB tile loaded
 * with a 64-byte stride. A tiles are 16 rows of x by 32 values of k, loaded from x in
 * place. Each block of 32 rows by 2 panels keeps four 16x16 fp32 accumulator tiles
 * (two A and two B tiles make the eight), stored to a per-thread buffer at the end and
 * rounded once to bf16 after the bias, as a bf16 torch matmul does.
 *
 * Work items are (pair of panels, chunk of M_CHUNK rows) in the packed weight's order,
 * scheduled statically, so each thread streams one contiguous run of the weight. A tile
 * load waits for its lines and the tile arithmetic waits for the load, so the hardware
 * prefetcher alone left the stream idle while tiles ran: each step of k asks for the
 * next step's two B tiles (the next pair's first at a pair's last step), which measured
 * 1.05-1.24x on SmolLM2's projections and LM head from 16 to 256 rows (asking for the
 * whole next pair, into L2 and spread over the pair's steps, measured 0.9-1.05x). The
 * block's result is rounded 16 columns at a time with AVX-512 (a scalar loop over it had
 * cost ~4% of a 64-row projection).
 *
 * K must be a multiple of 32 (amx.py keeps other layers on dpbf16.c); row blocks with
 * fewer than 32 rows are copied, zero-padded, into a per-thread buffer.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"

#define M_CHUNK 256
#define MB 32 /* rows per block: two A tiles */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

/* 1 where this CPU has AMX and Linux lets this process use its tile registers (asked
 * for once: the kernel must grant the tile data state before the first tile instruction). */
int amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    static int state;  /* 0: not asked, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
#else
    return 0;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* y[i][l] = bf16(acc[i][l] + bias[l]) for rows x cols (<= 32) of a block, rounded as
 * bf16_store rounds (to nearest even, NaN kept), 16 columns per vector. */
static void store_rows(const float *acc, int rows, int cols, const uint16_t *bias, uint16_t *y, int64_t ys) {
    for (int h = 0; h < cols; h += 16) {
        const int n = cols - h < 16 ? cols - h : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        const __m512 b = bias ? bf16_widen16(_mm256_maskz_loadu_epi16(m, bias + h)) : _mm512_setzero_ps();
        for (int i = 0; i < rows; i++)
            _mm256_mask_storeu_epi16(y + (int64_t)i * ys + h, m,
                                     bf16_narrow16(_mm512_add_ps(_mm512_loadu_ps(acc + i * 32 + h), b)));
    }
}

/* One block: rows [m0, m0 + rows) of y, panels p0 (and p0 + 1 where two). */
static void block(const uint16_t *a, int64_t a_stride, int rows, const uint16_t *wp, int64_t pstride, int two,
                  int K, const uint16_t *bias, uint16_t *y, int64_t ys, int cols, float *acc,
                  const uint16_t *next, const uint16_t *next_two) {
    const uint16_t *w1 = two ? wp + pstride : wp;  /* one panel: the second pair of tiles repeats it, unwritten */
    const int lower = rows > 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k0 = 0; k0 < K; k0 += 32) {
        const uint16_t *n0 = k0 + 32 < K ? wp + (int64_t)(k0 + 32) * 16 : next;
        const uint16_t *n1 = k0 + 32 < K ? w1 + (int64_t)(k0 + 32) * 16 : next_two;
        if (n0)
            for (int l = 0; l < 512; l += 32) {
                _mm_prefetch((const char *)(n0 + l), _MM_HINT_T0);
                if (n1) _mm_prefetch((const char *)(n1 + l), _MM_HINT_T0);
            }
        _tile_loadd(6, wp + (int64_t)k0 * 16, 64);
        _tile_loadd(7, w1 + (int64_t)k0 * 16, 64);
        _tile_loadd(4, a + k0, a_stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (lower) {
            _tile_loadd(5, a + 16 * a_stride + k0, a_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 32 * 4);
    _tile_stored(1, acc + 16, 32 * 4);
    if (lower) {
        _tile_stored(2, acc + 16 * 32, 32 * 4);
        _tile_stored(3, acc + 16 * 32 + 16, 32 * 4);
    }
    store_rows(acc, rows, cols, bias, y, ys);
}
#endif

/* x [M, K] (row stride xs), packed W [ceil(N/16)][K/2][16][2], y [M, N] (row stride ys);
 * work items [begin, end) over (pair of panels, row chunk), M_CHUNK rows each. */
int gemm_amx(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t ys,
             int M, int N, int K, int begin, int end) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (K % 32 != 0 || !amx_available()) return 1;
    const int NP = (N + 15) / 16, pairs = (NP + 1) / 2;
    const int64_t pstride = (int64_t)(K / 2) * 32;
    int rc = 0;
    #pragma omp parallel if (end - begin >= 2) reduction(|: rc)
    {
        load_tile_config();
        float acc[MB * 32];
        uint16_t *pad = NULL;  /* a short row block, zero-padded to MB rows */
        int padded = -1;  /* the first row of x the pad holds: every pair of panels reads it */
        #pragma omp for schedule(static)
        for (int item = begin; item < end; item++) {
            const int g = item % pairs, c0 = item / pairs * M_CHUNK;
            const int c1 = c0 + M_CHUNK < M ? c0 + M_CHUNK : M;
            const int p0 = 2 * g, two = p0 + 1 < NP;
            const int cols = (int)min64(N - p0 * 16, 32);
            const uint16_t *wp = w + (int64_t)p0 * pstride, *bp = bias ? bias + p0 * 16 : NULL;
            /* the panels after this pair (NULL past the weight's end), asked for at its last step */
            const uint16_t *next = p0 + 2 < NP ? wp + 2 * pstride : NULL, *next_two = p0 + 3 < NP ? wp + 3 * pstride : NULL;
            for (int m0 = c0; m0 < c1; m0 += MB) {
                const int rows = c1 - m0 < MB ? c1 - m0 : MB;
                const uint16_t *a = x + (int64_t)m0 * xs;
                int64_t a_stride = xs;
                if (rows < MB && rows != 16) {
                    if (!pad && !(pad = calloc((size_t)MB * K, sizeof *pad))) { rc |= 2; continue; }
                    /* The one short block of a call is the last chunk's last: copied once per
                     * thread, and the rows past it stay zero from calloc. */
                    if (padded != m0) {
                        for (int i = 0; i < rows; i++) memcpy(pad + (int64_t)i * K, a + (int64_t)i * xs, (size_t)K * 2);
                        padded = m0;
                    }
                    a = pad;
                    a_stride = K;
                }
                block(a, a_stride, rows, wp, pstride, two, K, bp, y + (int64_t)m0 * ys + p0 * 16, ys, cols, acc,
                      next, next_two);
            }
        }
        free(pad);
        _tile_release();
    }
    return rc;
#else
    (void)x; (void)xs; (void)w; (void)bias; (void)y; (void)ys; (void)M; (void)N; (void)K; (void)begin; (void)end;
    return 1;  /* no AMX on this CPU: amx_available() says so */
#endif
}
