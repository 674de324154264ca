/* Fused FP8 quantize + statistics for the CPU: one pass over x that writes the FP8 bytes and every column of
 * the statistics row (base and quality). The specification is fp8_kernels/reference/quantize.py
 * (quantize_with_stats_reference, quantize_current_reference); fp8_kernels/cpu/fused.py compiles this file,
 * loads it with ctypes and checks its arguments.
 *
 * Numerics, as the reference's (bit for bit but for the two sums of squares):
 *   a = |x| * scale in float32 (= |x * scale|), clamped to FP8_MAX, rounded to nearest even on the FP8 grid
 *   with integer operations on its bits (normal range) or by adding and subtracting 2**23 * min_subnormal
 *   (subnormal range: the float32 ulp of that constant is the smallest subnormal). NaN gives code 0x7F
 *   with x's sign, as torch's cast; +-Inf saturate.
 *   sum_sq and err_sq: the float32 squares a*a and (|q| - a)**2 of the finite elements, summed in float32
 *   per vector lane over at most CHUNK / W terms, then in float64 (the reference squares and sums in
 *   float64: the two agree within the kernel tests' bound), then over scale**2 in float64. A chunk whose
 *   float32 squares overflowed (a above 1.8e19) or underflowed (a sum below 2^-100) is summed again
 *   in float64 (exact_sums), as the reference.
 *
 * Written with GCC vector extensions (W lanes), built for the machine it runs on. No globals: safe from
 * several threads at once. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* lanes: the width of the vector registers this build targets (-march=native where the compiler takes it);
 * a vector wider than the hardware's is split by GCC into slow scalar code */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define W 16
#elif defined(__AVX2__)
#define W 8
#else
#define W 4
#endif
#define CHUNK 1024  /* elements per partial sum in float32 (CHUNK / W terms per lane) */
#define PIECE 32768 /* elements per OpenMP work item: fixed, so the sums do not depend on the threads */

typedef float vf __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

#define INLINE static inline __attribute__((always_inline))

enum { IN_F32 = 0, IN_BF16 = 1, IN_F16 = 2 };
/* params (float64, from fp8_kernels/cpu/fused.py, each from the reference's own functions) */
enum { P_FMAX, P_OVF_THR, P_OVF_INCL, P_UNF_THR, P_MIN_NORMAL, P_MIN_SUB, P_MANT, P_BIAS, P_COUNT };
/* row columns (fp8_protocol.stats.STAT_COLUMNS) */
enum { AMAX, SCALE, OVERFLOW, UNDERFLOW, NONFINITE, NUMEL, SUM_SQ, ERR_SQ, SUBNORMAL, MIN_ABS };

typedef struct {
    uint32_t fmax, ovf_above, unf_thr, min_normal, magic, round_half, low_mask, rebias, sub_codes;
    int shift;
    float magic_f;
} fmt_t;

typedef struct {
    uint32_t amax, min_abs; /* float32 bits of non-negative values: ordered as integers */
    int64_t overflow, underflow, nonfinite, subnormal;
    double sum_sq, err_sq;
} acc_t;

INLINE uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

INLINE float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE vu sel(vi m, vu a, vu b) { return (a & (vu)m) | (b & ~(vu)m); }

/* Unsigned min / max, and sums and counts under a condition. GCC does not find vpminud / vpmaxud in the
 * selects above, nor AVX-512's masked adds in (v & mask): intrinsics where the target has them (the
 * quality columns' share of the pass, about a third, shrinks by a third with them). */
#if W == 16
#include <immintrin.h>
#define M512(v) ((__m512i)(v))
INLINE vu vminu(vu a, vu b) { return (vu)_mm512_min_epu32(M512(a), M512(b)); }
INLINE vu vmaxu(vu a, vu b) { return (vu)_mm512_max_epu32(M512(a), M512(b)); }
/* acc + v where a < b (unsigned), acc elsewhere */
INLINE vf add_if_lt(vf acc, vu a, vu b, vf v) {
    return (vf)_mm512_mask_add_ps((__m512)acc, _mm512_cmplt_epu32_mask(M512(a), M512(b)), (__m512)acc, (__m512)v);
}
/* acc + 1 where a < b (unsigned): a count, positive */
INLINE vi count_if_lt(vi acc, vu a, vu b) {
    return (vi)_mm512_mask_add_epi32(M512(acc), _mm512_cmplt_epu32_mask(M512(a), M512(b)), M512(acc),
                                     _mm512_set1_epi32(1));
}
#else
#if W == 8 && defined(__AVX2__)
#include <immintrin.h>
INLINE vu vminu(vu a, vu b) { return (vu)_mm256_min_epu32((__m256i)a, (__m256i)b); }
INLINE vu vmaxu(vu a, vu b) { return (vu)_mm256_max_epu32((__m256i)a, (__m256i)b); }
#else
INLINE vu vminu(vu a, vu b) { return sel((vi)(a < b), a, b); }
INLINE vu vmaxu(vu a, vu b) { return sel((vi)(a > b), a, b); }
#endif
INLINE vf add_if_lt(vf acc, vu a, vu b, vf v) { return acc + (vf)((vu)v & (vu)(a < b)); }
INLINE vi count_if_lt(vi acc, vu a, vu b) { return acc - (vi)(a < b); }
#endif

static fmt_t make_fmt(const double *p) {
    fmt_t f;
    int mant = (int)p[P_MANT], bias = (int)p[P_BIAS];
    f.shift = 23 - mant;
    f.fmax = f2u((float)p[P_FMAX]);
    /* overflow: a above the threshold, or at it where the threshold is inclusive (one float32 ulp less) */
    f.ovf_above = f2u((float)p[P_OVF_THR]) - (p[P_OVF_INCL] != 0.0);
    f.unf_thr = f2u((float)p[P_UNF_THR]);
    f.min_normal = f2u((float)p[P_MIN_NORMAL]);
    f.magic_f = (float)(p[P_MIN_SUB] * 8388608.0); /* 2**23 ulps of min_sub */
    f.magic = f2u(f.magic_f);
    f.round_half = (1u << (f.shift - 1)) - 1;
    f.low_mask = (1u << f.shift) - 1;
    f.rebias = (uint32_t)(127 - bias) << mant;
    f.sub_codes = (1u << mant) - 1;
    return f;
}

INLINE vf load_f32(const float *x, int64_t m) {
    vf v = {0};
    memcpy(&v, x, (size_t)m * 4);
    return v;
}

/* bf16 / fp16 to float32, exactly (NaN keeps its sign: all the cast needs) */
INLINE void widen(const void *src, int in_dtype, int64_t m, float *dst) {
    const uint16_t *h = (const uint16_t *)src;
    int64_t i = 0;
    for (; i < m; i += W) {
        vh hv = {0};
        int64_t k = m - i < W ? m - i : W;
        if (k == W)
            memcpy(&hv, h + i, sizeof hv);
        else
            memcpy(&hv, h + i, (size_t)k * 2);
        vu u = __builtin_convertvector(hv, vu);
        vu out;
        if (in_dtype == IN_BF16) {
            out = u << 16;
        } else {
            vu sign = (u & 0x8000) << 16, em = u & 0x7fff;
            vu normal = (em << 13) + (112u << 23);     /* rebias 15 -> 127 */
            vu special = (em << 13) | 0x7f800000u;      /* Inf, NaN */
            vf sub = __builtin_convertvector((vi)em, vf) * 0x1p-24f; /* subnormal: em * 2**-24, exact */
            out = sel((vi)(em < 0x400), (vu)sub, sel((vi)(em >= 0x7c00), special, normal)) | sign;
        }
        if (k == W)
            memcpy(dst + i, &out, sizeof out);
        else
            memcpy(dst + i, &out, (size_t)k * 4);
    }
}

typedef struct {
    vu amax, min_abs;
    vi ovf, unf, nonfin, subn;
    vf ssq, esq;
} lanes_t;

/* W values (m of them real: a short tail is padded with +0, which adds nothing to any column) */
INLINE void step(const float *x, int64_t m, float scale, const fmt_t *restrict f, uint32_t *restrict codes,
                 lanes_t *restrict l, int quality) {
    vf xv = load_f32(x, m);
    vu xb = (vu)xv;
    vu axb = xb & 0x7fffffffu;
    vi isnan_ = (vi)(axb > 0x7f800000u);
    vi finite = (vi)(axb < 0x7f800000u);
    l->amax = vmaxu(l->amax, axb & ~(vu)isnan_);
    vf a = (vf)axb * scale; /* |x * scale|: rounding is sign-symmetric */
    vu ab = (vu)a;
    vu cb = sel((vi)(ab < f->fmax), ab, (vu){0} + f->fmax); /* saturate (NaN too: replaced below) */
    vu rn = (cb + f->round_half + ((cb >> f->shift) & 1u)) & ~f->low_mask; /* RNE, normal range */
    vf sub = (vf)cb + f->magic_f;                                             /* RNE, subnormals */
    vi is_sub = (vi)(cb < f->min_normal);
    vu code = sel(is_sub, (vu)sub - f->magic, (rn >> f->shift) - f->rebias);
    vu out = sel(isnan_, (vu){0} + 0x7fu, code) | ((xb >> 24) & 0x80u);
    memcpy(codes, &out, sizeof out); /* narrowed to bytes by the caller's loop (packs, not per lane) */
    l->ovf += finite & (vi)(ab > f->ovf_above);
    l->unf += finite & (vi)(axb != 0) & (vi)(ab <= f->unf_thr);
    l->nonfin += ~finite;
    if (quality) {
        /* min over |x| bits - 1: zero wraps to the top, and NaN / Inf (0x7F800000 and above) stay above
         * every finite value; the caller adds the 1 back. A NaN or Inf x has the code of FP8_MAX here
         * (saturated above), no subnormal's: no mask needed for either */
        l->min_abs = vminu(l->min_abs, axb - 1u);
        l->subn = count_if_lt(l->subn, code - 1u, (vu){0} + f->sub_codes);
        vf qv = (vf)sel(is_sub, (vu)(sub - f->magic_f), rn);
        vf d = qv - a;
        vu inf = (vu){0} + 0x7f800000u; /* the finite elements: |x| below Inf */
        l->ssq = add_if_lt(l->ssq, axb, inf, a * a);
        l->esq = add_if_lt(l->esq, axb, inf, d * d);
    }
}

/* A chunk's two sums again, element by element in float64, for a chunk whose float32 squares overflowed
 * (a finite |x * scale| above 1.8e19: a stale delayed scale meeting a spike) or may have lost their bits
 * (a sum below 2^-100: a scale far too small, or errors of elements flushed to zero), as the reference
 * takes them:
 * a = |x| * scale in float32, or the exact float64 product where that overflowed too; |q| decoded from its
 * code; the finite elements only. Rare, so plain scalar code. */
static void exact_sums(const float *x, int64_t n, float scale, const fmt_t *f, const uint32_t *codes,
                       double *s1, double *s2) {
    float min_sub = f->magic_f * 0x1p-23f;
    double sum = 0, err = 0;
    for (int64_t k = 0; k < n; k++) {
        float ax = fabsf(x[k]);
        if (!(ax < INFINITY)) /* NaN, Inf */
            continue;
        float a32 = ax * scale;
        double a = isinf(a32) ? (double)ax * (double)scale : (double)a32;
        uint32_t c = codes[k] & 0x7fu;
        float qa = c <= f->sub_codes ? (float)c * min_sub : u2f((c + f->rebias) << f->shift);
        double d = (double)qa - a;
        sum += a * a, err += d * d;
    }
    *s1 = sum, *s2 = err;
}

/* One chunk of at most CHUNK float32 values: quantize into q (if given) and accumulate the statistics. */
INLINE void chunk(const float *x, int64_t n, float scale, const fmt_t *f, uint8_t *q, acc_t *acc,
                  int quality) {
    lanes_t l = {{0}, (vu){0} + 0x7f7fffffu, {0}, {0}, {0}, {0}, {0}, {0}};
    const fmt_t fl = *f; /* a local copy: the stores to codes cannot alias it, its fields stay in registers */
    uint32_t codes[CHUNK + W];
    int64_t i = 0;
    for (; i + W <= n; i += W)
        step(x + i, W, scale, &fl, codes + i, &l, quality);
    if (i < n)
        step(x + i, n - i, scale, &fl, codes + i, &l, quality);
    if (q)
        for (int64_t k = 0; k < n; k++)
            q[k] = (uint8_t)codes[k];
    int64_t o = 0, u = 0, nf = 0, s = 0;
    double s1 = 0, s2 = 0;
    uint32_t low = 0xffffffffu; /* below 0x7f7fffff: the chunk has a non-zero finite element */
    for (int j = 0; j < W; j++) {
        acc->amax = l.amax[j] > acc->amax ? l.amax[j] : acc->amax;
        low = l.min_abs[j] < low ? l.min_abs[j] : low;
        uint32_t m = l.min_abs[j] < 0x7f7fffffu ? l.min_abs[j] + 1u : 0x7f800000u; /* none: +inf */
        acc->min_abs = m < acc->min_abs ? m : acc->min_abs;
        o -= l.ovf[j], u -= l.unf[j], nf -= l.nonfin[j], s += l.subn[j];
        s1 += (double)l.ssq[j], s2 += (double)l.esq[j];
    }
    /* float32 squares out of range: one overflowed (only finite elements were added), or a sum is below
     * 2^-100 with a non-zero finite element there, whose terms may have lost their bits (float32 squares
     * below 2^-126 are subnormal, below 2^-149 zero; at or above 2^-100 that loss is nothing to the sum) */
    int tiny = (s1 < 0x1p-100 || s2 < 0x1p-100) && low < 0x7f7fffffu;
    if (quality && (!(isfinite(s1) && isfinite(s2)) || tiny))
        exact_sums(x, n, scale, f, codes, &s1, &s2);
    acc->overflow += o, acc->underflow += u, acc->nonfinite += nf, acc->subnormal += s;
    acc->sum_sq += s1, acc->err_sq += s2;
}

/* elements [i, i + m) of x as float32: in place for a float32 input, else widened into buf */
INLINE const float *as_f32(const void *x, int in_dtype, int64_t i, int64_t m, float *buf) {
    if (in_dtype == IN_F32)
        return (const float *)x + i;
    widen((const uint16_t *)x + i, in_dtype, m, buf);
    return buf;
}

INLINE void pass(const void *x, int in_dtype, int64_t n, float scale, const fmt_t *f, uint8_t *q, acc_t *acc,
                 int quality) {
    float buf[CHUNK];
    for (int64_t i = 0; i < n; i += CHUNK) {
        int64_t m = n - i < CHUNK ? n - i : CHUNK;
        const float *xf = as_f32(x, in_dtype, i, m, buf);
        if (quality)
            chunk(xf, m, scale, f, q ? q + i : 0, acc, 1);
        else
            chunk(xf, m, scale, f, q ? q + i : 0, acc, 0);
    }
}

/* max |x| over the non-NaN elements (float32 bits): the amax pass of current scaling */
INLINE uint32_t amax_pass(const void *x, int in_dtype, int64_t n) {
    vu amax = {0};
    float buf[CHUNK];
    for (int64_t i = 0; i < n; i += CHUNK) {
        int64_t m = n - i < CHUNK ? n - i : CHUNK;
        const float *xf = as_f32(x, in_dtype, i, m, buf);
        for (int64_t k = 0; k < m; k += W) {
            vu axb = (vu)(m - k >= W ? load_f32(xf + k, W) : load_f32(xf + k, m - k)) & 0x7fffffffu;
            amax = vmaxu(amax, axb & ~(vu)(axb > 0x7f800000u));
        }
    }
    uint32_t r = 0;
    for (int j = 0; j < W; j++)
        r = amax[j] > r ? amax[j] : r;
    return r;
}

/* Quantize x (n elements, contiguous, in_dtype) to q and write or accumulate its statistics row.
 *   scale: delayed scaling's float32 scale (read here, never on the Python side), or current scaling
 *   (current != 0): FP8_MAX / amax from an amax pass, as current_scale_reference, written to *scale_out.
 *   amax_in: the amax to record (the caller's, already |amax| with NaN read as 0), or NULL.
 *   row: float64 of width 6 or 10 (10: the quality columns); accumulate != 0 merges into it as the
 *   reference does (fp8_protocol.stats.MERGE, the scale of the call that set the amax), else overwrites.
 * Returns 0, 1 for a scale that is not finite and positive, 2 when out of memory (nothing written: the
 * caller then runs the reference). Tensors of more than PIECE elements are split over OpenMP threads
 * (torch's own OpenMP runtime when built with it: the process has loaded libgomp.so.1 already). */
int fp8_quantize_stats(const void *x, int in_dtype, int64_t n, const float *scale_in, float *scale_out,
                       int current, int pow2, const double *params, uint8_t *q, double *row, int width,
                       int accumulate, const float *amax_in) {
    fmt_t f = make_fmt(params);
    int64_t pieces = (n + PIECE - 1) / PIECE;
    size_t esize = in_dtype == IN_F32 ? 4 : 2;
    float scale;
    if (current) {
        uint32_t amax_bits = 0;
#pragma omp parallel for schedule(static) reduction(max : amax_bits) if (pieces > 1)
        for (int64_t p = 0; p < pieces; p++) {
            int64_t lo = p * PIECE, m = n - lo < PIECE ? n - lo : PIECE;
            uint32_t b = amax_pass((const char *)x + lo * esize, in_dtype, m);
            amax_bits = b > amax_bits ? b : amax_bits;
        }
        float amax = u2f(amax_bits);
        float fmax = (float)params[P_FMAX];
        float s = fmax / amax; /* one float32 division, as the reference's */
        scale = s > 3.4028234663852886e38f ? 3.4028234663852886e38f : s;
        if (!(isfinite(amax) && amax > 0))
            scale = 1.0f;
        if (pow2)
            scale = u2f(f2u(scale) & 0xff800000u);
        *scale_out = scale;
    } else {
        scale = *scale_in;
    }
    if (!(scale > 0 && isfinite(scale)))
        return 1;
    int quality = width == 10;
    /* fixed pieces, each with its own partial row, combined in order: the same bits for any thread count */
    acc_t one, *part = pieces > 1 ? malloc((size_t)pieces * sizeof(acc_t)) : &one;
    if (!part)
        return 2;
#pragma omp parallel for schedule(static) if (pieces > 1)
    for (int64_t p = 0; p < pieces; p++) {
        int64_t lo = p * PIECE, m = n - lo < PIECE ? n - lo : PIECE;
        acc_t a = {0, 0x7f800000u, 0, 0, 0, 0, 0.0, 0.0};
        pass((const char *)x + lo * esize, in_dtype, m, scale, &f, q ? q + lo : 0, &a, quality);
        part[p] = a;
    }
    acc_t acc = {0, 0x7f800000u, 0, 0, 0, 0, 0.0, 0.0};
    for (int64_t p = 0; p < pieces; p++) {
        acc.amax = part[p].amax > acc.amax ? part[p].amax : acc.amax;
        acc.min_abs = part[p].min_abs < acc.min_abs ? part[p].min_abs : acc.min_abs;
        acc.overflow += part[p].overflow, acc.underflow += part[p].underflow;
        acc.nonfinite += part[p].nonfinite, acc.subnormal += part[p].subnormal;
        acc.sum_sq += part[p].sum_sq, acc.err_sq += part[p].err_sq;
    }
    if (part != &one)
        free(part);
    double amax64 = amax_in ? (double)*amax_in : (double)u2f(acc.amax);
    double inv = 1.0 / (double)scale, inv2 = inv * inv;
    double counts[4] = {(double)acc.overflow, (double)acc.underflow, (double)acc.nonfinite, (double)n};
    double qual[4] = {acc.sum_sq * inv2, acc.err_sq * inv2, (double)acc.subnormal, (double)u2f(acc.min_abs)};
    if (!accumulate) {
        row[AMAX] = amax64;
        row[SCALE] = (double)scale;
        for (int c = 0; c < 4; c++)
            row[OVERFLOW + c] = counts[c];
        if (quality)
            for (int c = 0; c < 4; c++)
                row[SUM_SQ + c] = qual[c];
        return 0;
    }
    if (amax64 >= row[AMAX] || isnan(row[AMAX]))
        row[SCALE] = (double)scale;
    row[AMAX] = fmax(row[AMAX], amax64);
    for (int c = 0; c < 4; c++)
        row[OVERFLOW + c] += counts[c];
    if (quality) {
        for (int c = 0; c < 3; c++)
            row[SUM_SQ + c] += qual[c];
        row[MIN_ABS] = fmin(row[MIN_ABS], qual[3]);
    }
    return 0;
}
