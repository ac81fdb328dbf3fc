/* Intel AMX for the bf16 panels of kernels/native.pack_panels32, and the table that says, per op and
 * row count, whether the panel kernels (moe_avx512bf16.c) take AMX tiles or AVX-512 BF16 dot products.
 *
 * The panels need no second layout: a panel stores 32 outputs' weights as pairs of inputs, lane o of
 * pair j = (w[o][2j], w[o][2j+1]), 128 bytes a pair. That is AMX's B-tile layout for bf16 (rows of
 * input pairs, each row 16 outputs x 2 values): a 16-row B tile over outputs 0-15 of 16 pairs starts at
 * the panel's pair 16k with a stride of 128 bytes, outputs 16-31 64 bytes further. So one copy of the
 * weights serves both kernels, and the choice between them can change with the row count.
 *
 * amx_panel computes a block of 16 or 32 rows times one panel with 4 accumulator tiles (2 row tiles x
 * 2 output tiles), 2 A tiles and 2 B tiles, all configured 16 rows x 64 bytes. The inputs' last
 * pairs % 16 pairs (an input width not a multiple of 32) are added with AVX-512 BF16 dot products
 * after the tiles are stored. Rows of a partial block are computed from whatever the caller's
 * padded buffer holds there and never stored.
 *
 * The choice table (shuttle_set_kernel_choice) is written by kernels/choice.py after it has timed
 * both kernels on this CPU; it starts all AVX-512, and AMX is used only after shuttle_amx_init has
 * obtained the kernel's permission for the tile data (Linux 5.16+: arch_prctl). */
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KERNEL_OPS 2     /* 0: a dense GEMM on panels, 1: one expert's rows in the fused MoE block */
#define KERNEL_BUCKETS 12 /* rows 1, 2, 3-4, 5-8, ..., 513-1024, over 1024 */

static int8_t choice_table[KERNEL_OPS][KERNEL_BUCKETS]; /* 0: AVX-512 BF16, 1: AMX */
static int amx_ready;

static int row_bucket(int64_t rows) {
    int b = 0;
    while (b < KERNEL_BUCKETS - 1 && ((int64_t)1 << b) < rows) b++;
    return b;
}

int shuttle_kernel_buckets(void) { return KERNEL_BUCKETS; }

/* Whether op's kernel for `rows` rows (per expert, for the MoE block) is the AMX one. */
int shuttle_use_amx(int op, int64_t rows) { return amx_ready && rows > 0 && choice_table[op][row_bucket(rows)]; }

/* Set one entry (which: 0 AVX-512, 1 AMX); returns what the entry was, or -1 for an entry out of
 * range or AMX asked for where it is not ready. */
int shuttle_set_kernel_choice(int op, int bucket, int which) {
    if (op < 0 || op >= KERNEL_OPS || bucket < 0 || bucket >= KERNEL_BUCKETS || (which && !amx_ready)) return -1;
    const int was = choice_table[op][bucket];
    choice_table[op][bucket] = (int8_t)(which != 0);
    return was;
}

#if (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11) && defined(__x86_64__)
#include <immintrin.h>
#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

int shuttle_amx_built(void) { return 1; }

/* Ask the kernel for AMX's tile state for this process (once; kernels/native.py calls it only where
 * /proc/cpuinfo lists amx_bf16 and amx_tile). Returns 1 if AMX can be used. */
int shuttle_amx_init(void) {
    if (!amx_ready) amx_ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows x 64 bytes. A constant: filled on the stack, gcc dropped the stores to the
 * fields ldtilecfg reads (its operand does not tell the compiler the 64 bytes are read). */
static const tile_config TILES = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

/* Configure the tiles in the calling thread; each thread that calls amx_panel first. */
TAMX void shuttle_amx_begin(void) { _tile_loadconfig(&TILES); }

TAMX void shuttle_amx_end(void) { _tile_release(); }

/* c (32 x 32 float32, rows 32 floats apart) = rows of a (bf16, lda_bytes apart; 16 rows, or 32 if two)
 * times one panel (pw, `pairs` input pairs; the first pairs - pairs % 16 by tiles, the rest by AVX-512
 * for the first `valid` rows). a must be readable for 16 (32) rows of pairs * 4 bytes. Meanwhile it
 * asks for pf_lines cache lines from pf into L2, spread over its loop: a share of the panel the
 * caller takes next, so that weights stream from memory while the tiles compute (the AVX-512
 * kernels' tile_prefetch; without it a block of 16 rows per expert ran at ~60% of the read rate). */
TAMX void shuttle_amx_panel(const uint16_t *a, int64_t lda_bytes, const uint32_t *pw, int64_t pairs, int two,
                            int valid, float *c, const char *pf, int64_t pf_lines) {
    const int64_t kb = pairs / 16;
    int64_t owed = 0;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const char *a0 = (const char *)a, *a1 = a0 + 16 * lda_bytes;
    for (int64_t k = 0; k < kb; k++) {
        for (owed += pf_lines; owed >= kb; owed -= kb, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        _tile_loadd(6, pw + k * 512, 128);
        _tile_loadd(7, pw + k * 512 + 16, 128);
        _tile_loadd(4, a0 + k * 64, lda_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + k * 64, lda_bytes);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
    if (pairs % 16 == 0) return;
    for (int r = 0; r < valid; r++) { /* the tail pairs, row by row */
        const uint32_t *xr = (const uint32_t *)(a0 + r * lda_bytes);
        __m512 s0 = _mm512_loadu_ps(c + r * 32), s1 = _mm512_loadu_ps(c + r * 32 + 16);
        for (int64_t j = kb * 16; j < pairs; j++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[j]);
            s0 = _mm512_dpbf16_ps(s0, xb, (__m512bh)_mm512_loadu_si512(pw + j * 32));
            s1 = _mm512_dpbf16_ps(s1, xb, (__m512bh)_mm512_loadu_si512(pw + j * 32 + 16));
        }
        _mm512_storeu_ps(c + r * 32, s0);
        _mm512_storeu_ps(c + r * 32 + 16, s1);
    }
}
#else
int shuttle_amx_built(void) { return 0; }
int shuttle_amx_init(void) { return 0; }
void shuttle_amx_begin(void) {}
void shuttle_amx_end(void) {}
void shuttle_amx_panel(void) {}
#endif
