# Fused optimizer kernels over flat CPU buffers (SGD, Adam, AdamW; float32 and float64).
#
# Exactness contract: every element is updated with the same rounding sequence as torch 2.13's
# own CPU kernels for the configured path, so a fused run is bitwise equal to an unfused one.
# torch's ATen kernels are compiled with FMA contraction (gcc's default -ffp-contract=fast in the
# AVX2 translation unit), so "a * b + c" in ATen often is one fma; this file is compiled with
# -ffp-contract=off and spells every fma out (fmaf/fma, or _mm256_fmadd_*) exactly where torch has
# one. Do not "simplify" an expression here: the order of operations *is* the specification.
#
# torch's fused=True Adam uses one formula in its vector body and a slightly different one in the
# scalar tail of each tensor (the last numel % vector_width elements, see tests/optim), so the
# Python layer passes segments (one per parameter) with a "body" length, and this file applies the
# body formula to [0, body) and the tail formula to [body, length) of each segment. Fused SGD has
# the same split (its tail rounds the momentum update differently).
#
# torch's for-loop/foreach Adam takes exp_avg_sq.sqrt() from MKL's vmsSqrt/vmdSqrt, which is not
# correctly rounded; adam_loop_step calls that very function (address installed by the Python
# layer after a bit-for-bit check against torch.sqrt) on L1-sized blocks between the two halves.
#
# Threading: the Python layer hands over a plan of work items (segment pieces of at most a few
# hundred KiB); prange distributes items over OpenMP threads with the GIL released. Items never
# overlap, so no two threads ever write the same element. Indices are int64 throughout: flat
# buffers larger than 2**31 elements are addressed correctly.

from cython.parallel cimport prange
from libc.math cimport fabs, fabsf
from libc.stdint cimport int64_t, intptr_t, uint8_t

cimport cython
from cpython.dict cimport PyDict_Next
from cpython.list cimport PyList_GET_ITEM
from cpython.object cimport PyObject

from _tl_omp cimport TL_OPENMP_ENABLED

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>

    /* Hyper-parameters of one Adam/AdamW call, already rounded to the parameter dtype by the
       caller exactly where torch rounds them (float(...) casts of double scalars). */
    typedef struct {
        double w;          /* lerp weight, 1 - beta1 (as the kernel's dtype) */
        double lerp_small; /* 1.0 when |w| < 0.5 in the kernel's dtype (torch's lerp branch), else 0.0 */
        double b2, c2;     /* beta2, 1 - beta2 */
        double bc2s;       /* sqrt(bias_correction2) */
        double eps;
        double nss;        /* -lr / bias_correction1 */
        double wd;         /* L2 weight decay (Adam), 0 when unused */
        double decay;      /* 1 - lr * weight_decay (AdamW), 1 when unused */
        int amsgrad, maximize, l2, decoupled;
        int tail_v_alt;    /* tail formula for exp_avg_sq: 0 fma(c*g, g, v*b2), 1 fma(v, b2, (c*g)*g) */
        int body_v_alt;
    } tl_adam_args;

    typedef struct {
        double lr_neg;     /* -lr */
        double wd, momentum, damp1; /* damp1 = 1 - dampening */
        int has_momentum, first, nesterov, maximize;
        int tail_alt;      /* tail momentum formula: 0 fma(g, 1-d, buf*m), 1 fma(buf, m, g*(1-d)) */
    } tl_sgd_args;

    /* AMSGrad's maximum(max_exp_avg_sq, exp_avg_sq) as ATen computes it, NaN bit patterns included
       (a is max_exp_avg_sq, b exp_avg_sq, in torch's operand order):
       tl_vmax_*: ATen's AVX2 Vectorized maximum, _mm256_max(a, b) | unordered(a, b): a NaN in
                  either input gives the all-ones NaN. The vector loop of torch.maximum (for-loop and
                  foreach AMSGrad) and fused=True's vector body.
       tl_smax_*: the scalar tail of torch.maximum's loop (cpu_kernel_vec's basic loop): the quiet
                  NaN std::numeric_limits<T>::quiet_NaN() if either input is NaN, else std::max(a, b).
       tl_fmax_*: fused=True's scalar tail, a bare std::max(a, b) = (a < b) ? b : a: a NaN maximum
                  stays, a NaN exp_avg_sq is dropped.
       Where each applies is the caller's "body" (see tl_adam_*, tl_mom_*). */
    static inline float tl_vmax_f32(float a, float b) {
        if (a != a || b != b) { const uint32_t u = 0xffffffffu; float r; memcpy(&r, &u, sizeof r); return r; }
        return a > b ? a : b;
    }
    static inline double tl_vmax_f64(double a, double b) {
        if (a != a || b != b) { const uint64_t u = 0xffffffffffffffffull; double r; memcpy(&r, &u, sizeof r); return r; }
        return a > b ? a : b;
    }
    static inline float tl_smax_f32(float a, float b) {
        if (a != a || b != b) { const uint32_t u = 0x7fc00000u; float r; memcpy(&r, &u, sizeof r); return r; }
        return a < b ? b : a;
    }
    static inline double tl_smax_f64(double a, double b) {
        if (a != a || b != b) { const uint64_t u = 0x7ff8000000000000ull; double r; memcpy(&r, &u, sizeof r); return r; }
        return a < b ? b : a;
    }
    static inline float tl_fmax_f32(float a, float b) { return a < b ? b : a; }
    static inline double tl_fmax_f64(double a, double b) { return a < b ? b : a; }

    /* TAIL: fused=True's scalar tail, p - (step_size * m) / den as torch writes it there: the same
       bits as p + (-step_size * m) / den, but a NaN p keeps its own NaN, as in torch (an addition
       leaves the compiler free to swap its operands, and with them which of two NaNs comes out). */
    #define TL_ADAM_SCALAR(T, FMA, SQRT, VALT, MAXF, TAIL)                                   \\
        {                                                                                  \\
            T gv = g[i];                                                                   \\
            T pv = p[i];                                                                   \\
            if (a->maximize) gv = -gv;                                                     \\
            if (a->l2) gv = FMA(pv, wd, gv);                                               \\
            if (a->decoupled) pv = pv * decay;                                             \\
            T mv = m[i];                                                                   \\
            mv = small ? FMA(w, gv - mv, mv) : FMA((TAIL) ? nwm1 : wm1, gv - mv, gv);      \\
            T vv = v[i];                                                                   \\
            vv = (VALT) ? FMA(vv, b2, (c2 * gv) * gv) : FMA(c2 * gv, gv, vv * b2);         \\
            m[i] = mv;                                                                     \\
            v[i] = vv;                                                                     \\
            if (a->amsgrad) { T mx = vmax[i]; mx = MAXF(mx, vv); vmax[i] = mx; vv = mx; }  \\
            T den = SQRT(vv) / bc2s + eps;                                                 \\
            p[i] = (TAIL) ? pv - (ss * mv) / den : pv + (nss * mv) / den;                  \\
        }

    #define TL_ADAM_LOCALS(T)                                                              \\
        const T w = (T)a->w, wm1 = (T)a->w - (T)1, b2 = (T)a->b2, c2 = (T)a->c2;           \\
        /* lerp's scalar tail computes end - (end - self) * (1 - w): the same bits as the vector */ \\
        /* loop's fmadd(w - 1, end - self, end) but for the sign of a zero when w == 1, which */  \\
        /* FMA(-(1 - w), ...) keeps (-0 there, +0 in w - 1) */                                \\
        const T nwm1 = -((T)1 - (T)a->w);                                                  \\
        const T bc2s = (T)a->bc2s, eps = (T)a->eps, nss = (T)a->nss, ss = -nss;            \\
        const T wd = (T)a->wd, decay = (T)a->decay;                                        \\
        const int small = a->lerp_small != 0.0;                                            \\
        /* flags in locals: with -fno-strict-aliasing every store to the arrays could change */ \\
        /* *a, so reading a->flag in a loop would reload and re-test it each iteration. */    \\
        const int f_max = a->maximize, f_l2 = a->l2, f_dec = a->decoupled;                 \\
        const int f_ams = a->amsgrad, f_valt = a->body_v_alt;                              \\
        (void)f_max; (void)f_l2; (void)f_dec; (void)f_ams; (void)f_valt;

    /* Portable scalar versions: fmaf/fma are exact by definition (libm uses the hardware
       instruction when there is one), sqrt and division are correctly rounded, so these give the
       same bits as the vector versions on every CPU, only slower. */
    static void tl_adam_f32_scalar(float *p, const float *g, float *m, float *v, float *vmax,
                                   int64_t body, int64_t n, const tl_adam_args *a) {
        TL_ADAM_LOCALS(float)
        int64_t i;
        for (i = 0; i < body; i++) TL_ADAM_SCALAR(float, fmaf, sqrtf, a->body_v_alt, tl_vmax_f32, 0)
        for (; i < n; i++) TL_ADAM_SCALAR(float, fmaf, sqrtf, a->tail_v_alt, tl_fmax_f32, 1)
    }
    static void tl_adam_f64_scalar(double *p, const double *g, double *m, double *v, double *vmax,
                                   int64_t body, int64_t n, const tl_adam_args *a) {
        TL_ADAM_LOCALS(double)
        int64_t i;
        for (i = 0; i < body; i++) TL_ADAM_SCALAR(double, fma, sqrt, a->body_v_alt, tl_vmax_f64, 0)
        for (; i < n; i++) TL_ADAM_SCALAR(double, fma, sqrt, a->tail_v_alt, tl_fmax_f64, 1)
    }

    /* Two halves of the for-loop/foreach Adam, around torch's own sqrt (see adam_moments). */
    #define TL_MOM_SCALAR(T, FMA, MAXF, TAIL)                                              \
        {                                                                                  \
            T gv = g[i];                                                                   \
            if (a->maximize) gv = -gv;                                                     \
            if (a->l2) gv = FMA(p[i], wd, gv);                                             \
            T mv = m[i];                                                                   \
            m[i] = small ? FMA(w, gv - mv, mv) : FMA((TAIL) ? nwm1 : wm1, gv - mv, gv);    \
            T vv = FMA(c2 * gv, gv, v[i] * b2);                                            \
            v[i] = vv;                                                                     \
            if (a->amsgrad) { T mx = vmax[i]; vmax[i] = MAXF(mx, vv); }                    \
        }
    #define TL_APPLY_SCALAR(T)                                                             \
        {                                                                                  \
            T pv = p[i];                                                                   \
            if (a->decoupled) pv = pv * decay;                                             \
            T den = sq[i] / bc2s + eps;                                                    \
            p[i] = pv + (nss * m[i]) / den;                                                \
        }
    /* body: the first elements, those torch.maximum computes in its vector loop (AMSGrad's NaN
       bits; the other elements are its scalar tail). */
    static void tl_mom_f32_scalar(const float *p, const float *g, float *m, float *v, float *vmax,
                                  int64_t body, int64_t n, const tl_adam_args *a) {
        TL_ADAM_LOCALS(float)
        (void)bc2s; (void)eps; (void)nss; (void)ss; (void)decay;
        int64_t i = 0;
        for (; i < body; i++) TL_MOM_SCALAR(float, fmaf, tl_vmax_f32, 0)
        for (; i < n; i++) TL_MOM_SCALAR(float, fmaf, tl_smax_f32, 1)
    }
    static void tl_mom_f64_scalar(const double *p, const double *g, double *m, double *v,
                                  double *vmax, int64_t body, int64_t n, const tl_adam_args *a) {
        TL_ADAM_LOCALS(double)
        (void)bc2s; (void)eps; (void)nss; (void)ss; (void)decay;
        int64_t i = 0;
        for (; i < body; i++) TL_MOM_SCALAR(double, fma, tl_vmax_f64, 0)
        for (; i < n; i++) TL_MOM_SCALAR(double, fma, tl_smax_f64, 1)
    }
    static void tl_apply_f32_scalar(float *p, const float *m, const float *sq, int64_t n,
                                    const tl_adam_args *a) {
        TL_ADAM_LOCALS(float)
        (void)w; (void)wm1; (void)nwm1; (void)b2; (void)c2; (void)wd; (void)small; (void)ss;
        for (int64_t i = 0; i < n; i++) TL_APPLY_SCALAR(float)
    }
    static void tl_apply_f64_scalar(double *p, const double *m, const double *sq, int64_t n,
                                    const tl_adam_args *a) {
        TL_ADAM_LOCALS(double)
        (void)w; (void)wm1; (void)nwm1; (void)b2; (void)c2; (void)wd; (void)small; (void)ss;
        for (int64_t i = 0; i < n; i++) TL_APPLY_SCALAR(double)
    }

    #define TL_SGD_SCALAR(T, FMA, ALT)                                                     \\
        {                                                                                  \\
            T gv = g[i];                                                                   \\
            if (a->maximize) gv = -gv;                                                     \\
            if (has_wd) gv = FMA(p[i], wd, gv);                                            \\
            if (a->has_momentum) {                                                         \\
                T bv;                                                                      \\
                if (a->first) bv = gv;                                                     \\
                else bv = (ALT) ? FMA(buf[i], mom, gv * damp1) : FMA(gv, damp1, buf[i] * mom); \\
                buf[i] = bv;                                                               \\
                gv = a->nesterov ? FMA(bv, mom, gv) : bv;                                  \\
            }                                                                              \\
            p[i] = FMA(gv, lrn, p[i]);                                                     \\
        }

    static void tl_sgd_f32_scalar(float *p, const float *g, float *buf, int64_t body, int64_t n,
                                  const tl_sgd_args *a) {
        const float lrn = (float)a->lr_neg, wd = (float)a->wd, mom = (float)a->momentum;
        const float damp1 = (float)a->damp1;
        const int has_wd = a->wd != 0.0;
        int64_t i = 0;
        for (; i < body; i++) TL_SGD_SCALAR(float, fmaf, 0)
        for (; i < n; i++) TL_SGD_SCALAR(float, fmaf, a->tail_alt)
    }
    static void tl_sgd_f64_scalar(double *p, const double *g, double *buf, int64_t body, int64_t n,
                                  const tl_sgd_args *a) {
        const double lrn = a->lr_neg, wd = a->wd, mom = a->momentum, damp1 = a->damp1;
        const int has_wd = a->wd != 0.0;
        int64_t i = 0;
        for (; i < body; i++) TL_SGD_SCALAR(double, fma, 0)
        for (; i < n; i++) TL_SGD_SCALAR(double, fma, a->tail_alt)
    }

    #if defined(__x86_64__) && defined(__GNUC__)
    #include <immintrin.h>
    #define TL_HAVE_X86 1
    /* AVX2+FMA versions, compiled for that target only (the rest of the module stays baseline
       x86-64) and selected at run time with __builtin_cpu_supports. */
    /* Vector body of the fused Adam for one combination of flags. Expanded once per
       (amsgrad, L2, decoupled) combination by the switch below, so that the loop has no
       per-iteration tests, keeps its constants in registers and can be unrolled. */
    #define TL_ADAM_VLOOP(V, SUF, VL, AMS, L2, DEC)                                        \\
        _Pragma("GCC unroll 2")                                                            \\
        for (; i < vend; i += VL) {                                                        \\
            V gv = _mm256_loadu_##SUF(g + i), pv = _mm256_loadu_##SUF(p + i);              \\
            if (f_max) gv = _mm256_xor_##SUF(gv, NEG);                                     \\
            if (L2) gv = _mm256_fmadd_##SUF(pv, WD, gv);                                   \\
            if (DEC) pv = _mm256_mul_##SUF(pv, DEC_V);                                     \\
            V mv = _mm256_loadu_##SUF(m + i);                                              \\
            mv = _mm256_fmadd_##SUF(W, _mm256_sub_##SUF(gv, mv), _mm256_blendv_##SUF(gv, mv, SMALL_M)); \\
            V vv = _mm256_loadu_##SUF(v + i);                                              \\
            vv = f_valt ? _mm256_fmadd_##SUF(vv, B2, _mm256_mul_##SUF(_mm256_mul_##SUF(C2, gv), gv)) \\
                        : _mm256_fmadd_##SUF(_mm256_mul_##SUF(C2, gv), gv, _mm256_mul_##SUF(vv, B2)); \\
            _mm256_storeu_##SUF(m + i, mv);                                                \\
            _mm256_storeu_##SUF(v + i, vv);                                                \\
            if (AMS) {                                                                     \\
                /* ATen's maximum(max, v): the larger value; the all-ones NaN for any NaN */ \\
                V mx = _mm256_loadu_##SUF(vmax + i);                                       \\
                V r = _mm256_or_##SUF(_mm256_max_##SUF(mx, vv),                            \\
                                      _mm256_cmp_##SUF(mx, vv, _CMP_UNORD_Q));             \\
                _mm256_storeu_##SUF(vmax + i, r);                                          \\
                vv = r;                                                                    \\
            }                                                                              \\
            V den = _mm256_add_##SUF(_mm256_div_##SUF(_mm256_sqrt_##SUF(vv), BC), EPS);   \\
            _mm256_storeu_##SUF(p + i, _mm256_add_##SUF(pv, _mm256_div_##SUF(_mm256_mul_##SUF(NSS, mv), den))); \\
        }
    #define TL_ADAM_VSWITCH(V, SUF, VL)                                                    \\
        switch ((f_ams ? 4 : 0) | (f_l2 ? 2 : 0) | (f_dec ? 1 : 0)) {                      \\
            case 0: TL_ADAM_VLOOP(V, SUF, VL, 0, 0, 0) break;                              \\
            case 1: TL_ADAM_VLOOP(V, SUF, VL, 0, 0, 1) break;                              \\
            case 2: TL_ADAM_VLOOP(V, SUF, VL, 0, 1, 0) break;                              \\
            case 3: TL_ADAM_VLOOP(V, SUF, VL, 0, 1, 1) break;                              \\
            case 4: TL_ADAM_VLOOP(V, SUF, VL, 1, 0, 0) break;                              \\
            case 5: TL_ADAM_VLOOP(V, SUF, VL, 1, 0, 1) break;                              \\
            case 6: TL_ADAM_VLOOP(V, SUF, VL, 1, 1, 0) break;                              \\
            default: TL_ADAM_VLOOP(V, SUF, VL, 1, 1, 1) break;                             \\
        }

    __attribute__((target("avx2,fma")))
    static void tl_adam_f32_avx2(float *p, const float *g, float *m, float *v, float *vmax,
                                 int64_t body, int64_t n, const tl_adam_args *a) {
        TL_ADAM_LOCALS(float)
        const __m256 W = _mm256_set1_ps(small ? w : wm1), B2 = _mm256_set1_ps(b2);
        const __m256 C2 = _mm256_set1_ps(c2), BC = _mm256_set1_ps(bc2s);
        const __m256 EPS = _mm256_set1_ps(eps), NSS = _mm256_set1_ps(nss);
        const __m256 WD = _mm256_set1_ps(wd), DEC_V = _mm256_set1_ps(decay);
        const __m256 NEG = _mm256_set1_ps(-0.0f);
        /* all-ones lanes pick exp_avg as the lerp base (weight < 0.5), else the gradient */
        const __m256 SMALL_M = _mm256_castsi256_ps(_mm256_set1_epi32(small ? -1 : 0));
        int64_t i = 0;
        const int64_t vend = body - body % 8;
        TL_ADAM_VSWITCH(__m256, ps, 8)
        for (; i < body; i++) TL_ADAM_SCALAR(float, fmaf, sqrtf, a->body_v_alt, tl_vmax_f32, 0)
        for (; i < n; i++) TL_ADAM_SCALAR(float, fmaf, sqrtf, a->tail_v_alt, tl_fmax_f32, 1)
    }
    __attribute__((target("avx2,fma")))
    static void tl_adam_f64_avx2(double *p, const double *g, double *m, double *v, double *vmax,
                                 int64_t body, int64_t n, const tl_adam_args *a) {
        TL_ADAM_LOCALS(double)
        const __m256d W = _mm256_set1_pd(small ? w : wm1), B2 = _mm256_set1_pd(b2);
        const __m256d C2 = _mm256_set1_pd(c2), BC = _mm256_set1_pd(bc2s);
        const __m256d EPS = _mm256_set1_pd(eps), NSS = _mm256_set1_pd(nss);
        const __m256d WD = _mm256_set1_pd(wd), DEC_V = _mm256_set1_pd(decay);
        const __m256d NEG = _mm256_set1_pd(-0.0);
        const __m256d SMALL_M = _mm256_castsi256_pd(_mm256_set1_epi64x(small ? -1 : 0));
        int64_t i = 0;
        const int64_t vend = body - body % 4;
        TL_ADAM_VSWITCH(__m256d, pd, 4)
        for (; i < body; i++) TL_ADAM_SCALAR(double, fma, sqrt, a->body_v_alt, tl_vmax_f64, 0)
        for (; i < n; i++) TL_ADAM_SCALAR(double, fma, sqrt, a->tail_v_alt, tl_fmax_f64, 1)
    }
    __attribute__((target("avx2,fma")))
    static void tl_sgd_f32_avx2(float *p, const float *g, float *buf, int64_t body, int64_t n,
                                const tl_sgd_args *a) {
        const float lrn = (float)a->lr_neg, wd = (float)a->wd, mom = (float)a->momentum;
        const float damp1 = (float)a->damp1;
        const int has_wd = a->wd != 0.0;
        const __m256 LRN = _mm256_set1_ps(lrn), WD = _mm256_set1_ps(wd);
        const __m256 MOM = _mm256_set1_ps(mom), D1 = _mm256_set1_ps(damp1);
        const __m256 NEG = _mm256_set1_ps(-0.0f);
        int64_t i = 0;
        const int64_t vend = body - body % 8;
        for (; i < vend; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i), pv = _mm256_loadu_ps(p + i);
            if (a->maximize) gv = _mm256_xor_ps(gv, NEG);
            if (has_wd) gv = _mm256_fmadd_ps(pv, WD, gv);
            if (a->has_momentum) {
                __m256 bv = a->first ? gv
                    : _mm256_fmadd_ps(gv, D1, _mm256_mul_ps(_mm256_loadu_ps(buf + i), MOM));
                _mm256_storeu_ps(buf + i, bv);
                gv = a->nesterov ? _mm256_fmadd_ps(bv, MOM, gv) : bv;
            }
            _mm256_storeu_ps(p + i, _mm256_fmadd_ps(gv, LRN, pv));
        }
        for (; i < body; i++) TL_SGD_SCALAR(float, fmaf, 0)
        for (; i < n; i++) TL_SGD_SCALAR(float, fmaf, a->tail_alt)
    }
    __attribute__((target("avx2,fma")))
    static void tl_sgd_f64_avx2(double *p, const double *g, double *buf, int64_t body, int64_t n,
                                const tl_sgd_args *a) {
        const double lrn = a->lr_neg, wd = a->wd, mom = a->momentum, damp1 = a->damp1;
        const int has_wd = a->wd != 0.0;
        const __m256d LRN = _mm256_set1_pd(lrn), WD = _mm256_set1_pd(wd);
        const __m256d MOM = _mm256_set1_pd(mom), D1 = _mm256_set1_pd(damp1);
        const __m256d NEG = _mm256_set1_pd(-0.0);
        int64_t i = 0;
        const int64_t vend = body - body % 4;
        for (; i < vend; i += 4) {
            __m256d gv = _mm256_loadu_pd(g + i), pv = _mm256_loadu_pd(p + i);
            if (a->maximize) gv = _mm256_xor_pd(gv, NEG);
            if (has_wd) gv = _mm256_fmadd_pd(pv, WD, gv);
            if (a->has_momentum) {
                __m256d bv = a->first ? gv
                    : _mm256_fmadd_pd(gv, D1, _mm256_mul_pd(_mm256_loadu_pd(buf + i), MOM));
                _mm256_storeu_pd(buf + i, bv);
                gv = a->nesterov ? _mm256_fmadd_pd(bv, MOM, gv) : bv;
            }
            _mm256_storeu_pd(p + i, _mm256_fmadd_pd(gv, LRN, pv));
        }
        for (; i < body; i++) TL_SGD_SCALAR(double, fma, 0)
        for (; i < n; i++) TL_SGD_SCALAR(double, fma, a->tail_alt)
    }
    /* The vector versions of the two Adam halves: one generic body per element type. */
    #define TL_MOM_AVX(T, V, SUF, VL, FMA, VMAX, SMAX)                                     \
        TL_ADAM_LOCALS(T)                                                                  \
        (void)bc2s; (void)eps; (void)nss; (void)ss; (void)decay;                           \
        const V W = _mm256_set1_##SUF(small ? w : wm1), B2 = _mm256_set1_##SUF(b2);        \
        const V C2 = _mm256_set1_##SUF(c2), WD = _mm256_set1_##SUF(wd);                    \
        const V NEG = _mm256_set1_##SUF(-0.0);                                             \
        int64_t i = 0;                                                                     \
        /* AMSGrad, and beta1 == 0 (w == 1, where lerp's scalar tail gives zeros of the other */ \
        /* sign): the vector loop stops where torch's vector loop does */                    \
        const int64_t vlim = (f_ams || wm1 == (T)0) ? body : n;                            \
        const int64_t vend = vlim - vlim % VL;                                             \
        for (; i < vend; i += VL) {                                                        \
            V gv = _mm256_loadu_##SUF(g + i);                                              \
            if (a->maximize) gv = _mm256_xor_##SUF(gv, NEG);                               \
            if (f_l2) gv = _mm256_fmadd_##SUF(_mm256_loadu_##SUF(p + i), WD, gv);          \
            V mv = _mm256_loadu_##SUF(m + i);                                              \
            mv = _mm256_fmadd_##SUF(W, _mm256_sub_##SUF(gv, mv), small ? mv : gv);         \
            V vv = _mm256_fmadd_##SUF(_mm256_mul_##SUF(C2, gv), gv,                        \
                                      _mm256_mul_##SUF(_mm256_loadu_##SUF(v + i), B2));     \
            _mm256_storeu_##SUF(m + i, mv);                                                \
            _mm256_storeu_##SUF(v + i, vv);                                                \
            if (f_ams) {                                                                   \
                V mx = _mm256_loadu_##SUF(vmax + i);                                       \
                V r = _mm256_or_##SUF(_mm256_max_##SUF(mx, vv),                            \
                                      _mm256_cmp_##SUF(mx, vv, _CMP_UNORD_Q));             \
                _mm256_storeu_##SUF(vmax + i, r);                                          \
            }                                                                              \
        }                                                                                  \
        for (; i < body; i++) TL_MOM_SCALAR(T, FMA, VMAX, 0)                               \
        for (; i < n; i++) TL_MOM_SCALAR(T, FMA, SMAX, 1)
    #define TL_APPLY_AVX(T, V, SUF, VL)                                                    \
        TL_ADAM_LOCALS(T)                                                                  \
        (void)w; (void)wm1; (void)nwm1; (void)b2; (void)c2; (void)wd; (void)small; (void)ss;           \
        const V BC = _mm256_set1_##SUF(bc2s), EPS = _mm256_set1_##SUF(eps);                \
        const V NSS = _mm256_set1_##SUF(nss), DEC = _mm256_set1_##SUF(decay);              \
        int64_t i = 0;                                                                     \
        const int64_t vend = n - n % VL;                                                   \
        for (; i < vend; i += VL) {                                                        \
            V pv = _mm256_loadu_##SUF(p + i);                                              \
            if (f_dec) pv = _mm256_mul_##SUF(pv, DEC);                              \
            V den = _mm256_add_##SUF(_mm256_div_##SUF(_mm256_loadu_##SUF(sq + i), BC), EPS); \
            V up = _mm256_div_##SUF(_mm256_mul_##SUF(NSS, _mm256_loadu_##SUF(m + i)), den); \
            _mm256_storeu_##SUF(p + i, _mm256_add_##SUF(pv, up));                          \
        }                                                                                  \
        for (; i < n; i++) TL_APPLY_SCALAR(T)

    __attribute__((target("avx2,fma")))
    static void tl_mom_f32_avx2(const float *p, const float *g, float *m, float *v, float *vmax,
                                int64_t body, int64_t n, const tl_adam_args *a) {
        TL_MOM_AVX(float, __m256, ps, 8, fmaf, tl_vmax_f32, tl_smax_f32) }
    __attribute__((target("avx2,fma")))
    static void tl_mom_f64_avx2(const double *p, const double *g, double *m, double *v,
                                double *vmax, int64_t body, int64_t n, const tl_adam_args *a) {
        TL_MOM_AVX(double, __m256d, pd, 4, fma, tl_vmax_f64, tl_smax_f64) }
    __attribute__((target("avx2,fma")))
    static void tl_apply_f32_avx2(float *p, const float *m, const float *sq, int64_t n,
                                  const tl_adam_args *a) { TL_APPLY_AVX(float, __m256, ps, 8) }
    __attribute__((target("avx2,fma")))
    static void tl_apply_f64_avx2(double *p, const double *m, const double *sq, int64_t n,
                                  const tl_adam_args *a) { TL_APPLY_AVX(double, __m256d, pd, 4) }

    static int tl_cpu_has_avx2_fma(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    #else
    #define TL_HAVE_X86 0
    static int tl_cpu_has_avx2_fma(void) { return 0; }
    #define tl_adam_f32_avx2 tl_adam_f32_scalar
    #define tl_adam_f64_avx2 tl_adam_f64_scalar
    #define tl_sgd_f32_avx2 tl_sgd_f32_scalar
    #define tl_sgd_f64_avx2 tl_sgd_f64_scalar
    #define tl_mom_f32_avx2 tl_mom_f32_scalar
    #define tl_mom_f64_avx2 tl_mom_f64_scalar
    #define tl_apply_f32_avx2 tl_apply_f32_scalar
    #define tl_apply_f64_avx2 tl_apply_f64_scalar
    #endif

    /* torch's for-loop/foreach Adam in one cache-blocked pass: for each block of TL_BLK elements,
       the moments, then the square root from the very function torch's sqrt calls on this build
       (MKL's vmsSqrt/vmdSqrt, looked up and checked bit for bit against torch.sqrt by the Python
       layer), then the update. Every array is read or written once per step, as in a one-pass
       kernel, while each intermediate stays in L1. */
    #define TL_BLK 1024
    typedef void (*tl_vml_f32)(int, const float *, float *, long long);
    typedef void (*tl_vml_f64)(int, const double *, double *, long long);
    static void tl_adam_loop_f32(float *p, const float *g, float *m, float *v, float *vmax,
                                 int64_t body, int64_t n, const tl_adam_args *a, tl_vml_f32 sq,
                                 long long mode, int avx) {
        float tmp[TL_BLK];
        for (int64_t s = 0; s < n; s += TL_BLK) {
            const int64_t k = (n - s) < TL_BLK ? (n - s) : TL_BLK;
            float *vm = a->amsgrad ? vmax + s : NULL;
            const int64_t kb = body - s < 0 ? 0 : (body - s > k ? k : body - s);
            if (avx) tl_mom_f32_avx2(p + s, g + s, m + s, v + s, vm, kb, k, a);
            else tl_mom_f32_scalar(p + s, g + s, m + s, v + s, vm, kb, k, a);
            sq((int)k, a->amsgrad ? vm : v + s, tmp, mode);
            if (avx) tl_apply_f32_avx2(p + s, m + s, tmp, k, a);
            else tl_apply_f32_scalar(p + s, m + s, tmp, k, a);
        }
    }
    static void tl_adam_loop_f64(double *p, const double *g, double *m, double *v, double *vmax,
                                 int64_t body, int64_t n, const tl_adam_args *a, tl_vml_f64 sq,
                                 long long mode, int avx) {
        double tmp[TL_BLK];
        for (int64_t s = 0; s < n; s += TL_BLK) {
            const int64_t k = (n - s) < TL_BLK ? (n - s) : TL_BLK;
            double *vm = a->amsgrad ? vmax + s : NULL;
            const int64_t kb = body - s < 0 ? 0 : (body - s > k ? k : body - s);
            if (avx) tl_mom_f64_avx2(p + s, g + s, m + s, v + s, vm, kb, k, a);
            else tl_mom_f64_scalar(p + s, g + s, m + s, v + s, vm, kb, k, a);
            sq((int)k, a->amsgrad ? vm : v + s, tmp, mode);
            if (avx) tl_apply_f64_avx2(p + s, m + s, tmp, k, a);
            else tl_apply_f64_scalar(p + s, m + s, tmp, k, a);
        }
    }
    """
    ctypedef struct tl_adam_args:
        double w, lerp_small, b2, c2, bc2s, eps, nss, wd, decay
        int amsgrad, maximize, l2, decoupled, tail_v_alt, body_v_alt
    ctypedef struct tl_sgd_args:
        double lr_neg, wd, momentum, damp1
        int has_momentum, first, nesterov, maximize, tail_alt
    int tl_cpu_has_avx2_fma() nogil
    void tl_adam_f32_scalar(float*, const float*, float*, float*, float*, int64_t, int64_t,
                            const tl_adam_args*) noexcept nogil
    void tl_adam_f64_scalar(double*, const double*, double*, double*, double*, int64_t, int64_t,
                            const tl_adam_args*) noexcept nogil
    void tl_adam_f32_avx2(float*, const float*, float*, float*, float*, int64_t, int64_t,
                          const tl_adam_args*) noexcept nogil
    void tl_adam_f64_avx2(double*, const double*, double*, double*, double*, int64_t, int64_t,
                          const tl_adam_args*) noexcept nogil
    void tl_mom_f32_scalar(const float*, const float*, float*, float*, float*, int64_t, int64_t,
                           const tl_adam_args*) noexcept nogil
    void tl_mom_f64_scalar(const double*, const double*, double*, double*, double*, int64_t, int64_t,
                           const tl_adam_args*) noexcept nogil
    void tl_mom_f32_avx2(const float*, const float*, float*, float*, float*, int64_t, int64_t,
                         const tl_adam_args*) noexcept nogil
    void tl_mom_f64_avx2(const double*, const double*, double*, double*, double*, int64_t, int64_t,
                         const tl_adam_args*) noexcept nogil
    void tl_apply_f32_scalar(float*, const float*, const float*, int64_t, const tl_adam_args*) noexcept nogil
    void tl_apply_f64_scalar(double*, const double*, const double*, int64_t, const tl_adam_args*) noexcept nogil
    void tl_apply_f32_avx2(float*, const float*, const float*, int64_t, const tl_adam_args*) noexcept nogil
    void tl_apply_f64_avx2(double*, const double*, const double*, int64_t, const tl_adam_args*) noexcept nogil
    ctypedef void (*tl_vml_f32)(int, const float*, float*, long long) noexcept nogil
    ctypedef void (*tl_vml_f64)(int, const double*, double*, long long) noexcept nogil
    void tl_adam_loop_f32(float*, const float*, float*, float*, float*, int64_t, int64_t,
                          const tl_adam_args*, tl_vml_f32, long long, int) noexcept nogil
    void tl_adam_loop_f64(double*, const double*, double*, double*, double*, int64_t, int64_t,
                          const tl_adam_args*, tl_vml_f64, long long, int) noexcept nogil
    void tl_sgd_f32_scalar(float*, const float*, float*, int64_t, int64_t, const tl_sgd_args*) noexcept nogil
    void tl_sgd_f64_scalar(double*, const double*, double*, int64_t, int64_t, const tl_sgd_args*) noexcept nogil
    void tl_sgd_f32_avx2(float*, const float*, float*, int64_t, int64_t, const tl_sgd_args*) noexcept nogil
    void tl_sgd_f64_avx2(double*, const double*, double*, int64_t, int64_t, const tl_sgd_args*) noexcept nogil

import numpy as np

# Dtype codes used by the Python layer (plain C constants so that the nogil blocks can test them).
cdef enum:
    DEF_F32 = 0
    DEF_F64 = 1

DTYPE_F32 = DEF_F32
DTYPE_F64 = DEF_F64

# Chosen once at import: the CPU does not change under us. Tests flip it with set_isa() to check
# that the portable and the AVX2 versions produce the same bits.
cdef bint _use_avx2 = tl_cpu_has_avx2_fma() != 0


# torch's own vectorised square root (see tl_adam_loop_*); NULL until set_vml_sqrt().
cdef tl_vml_f32 _vml_s = NULL
cdef tl_vml_f64 _vml_d = NULL
cdef long long _vml_mode = 0


def set_vml_sqrt(intptr_t fs, intptr_t fd, long long mode) -> None:
    """Install the addresses of ``vmsSqrt``/``vmdSqrt`` (0, 0 to uninstall) and their mode.

    The caller has checked that they reproduce ``torch.sqrt`` bit for bit; they must stay loaded
    for the life of the process (they live in torch's own library, which is never unloaded).
    """
    global _vml_s, _vml_d, _vml_mode
    if (fs == 0) != (fd == 0):
        raise ValueError("set_vml_sqrt: give both function addresses or neither")
    _vml_s = <tl_vml_f32>fs
    _vml_d = <tl_vml_f64>fd
    _vml_mode = mode


def has_vml_sqrt() -> bool:
    """Whether :func:`adam_loop_step` can run (a square root was installed)."""
    return _vml_s != NULL


def vml_sqrt(int dtype, intptr_t src, intptr_t dst, int n) -> None:
    """Call the installed square root on ``n`` elements (used by the self-check)."""
    if _vml_s == NULL:
        raise ValueError("vml_sqrt: no square root installed; call set_vml_sqrt first")
    if src == 0 or dst == 0 or n < 0:
        raise ValueError("vml_sqrt: null pointer or negative count")
    if dtype not in (DEF_F32, DEF_F64):  # any other code ran the float64 root over a float32 buffer
        raise ValueError(f"vml_sqrt: unsupported dtype code {dtype}")
    with nogil:
        if dtype == DEF_F32:
            _vml_s(n, <const float*>src, <float*>dst, _vml_mode)
        else:
            _vml_d(n, <const double*>src, <double*>dst, _vml_mode)


cdef inline void _adam_loop_item(int dtype, bint avx, bint amsgrad, intptr_t p, intptr_t g, intptr_t m,
                                 intptr_t v, intptr_t vmax, int64_t s, int64_t body, int64_t n,
                                 const tl_adam_args* a, tl_vml_f32 fs, tl_vml_f64 fd,
                                 long long mode) noexcept nogil:
    """One plan item of adam_loop_step: n elements from element offset s, in its dtype; the first
    ``body`` of them are in torch.maximum's vector loop (AMSGrad's NaN bits)."""
    body = 0 if body < 0 else (n if body > n else body)
    if dtype == DEF_F32:
        tl_adam_loop_f32(<float*>p + s, <const float*>g + s, <float*>m + s, <float*>v + s,
                         (<float*>vmax + s) if amsgrad else NULL, body, n, a, fs, mode, avx)
    else:
        tl_adam_loop_f64(<double*>p + s, <const double*>g + s, <double*>m + s, <double*>v + s,
                         (<double*>vmax + s) if amsgrad else NULL, body, n, a, fd, mode, avx)


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_loop_step(int dtype, intptr_t p, intptr_t g, intptr_t m, intptr_t v, intptr_t vmax,
                   const int64_t[::1] i_start, const int64_t[::1] i_len, const int64_t[::1] i_body,
                   double w, double b2, double c2, double bc2s, double eps, double nss, double wd,
                   double decay, bint amsgrad, bint maximize, bint l2, bint decoupled, int nthreads):
    """torch's for-loop/foreach Adam/AdamW in one cache-blocked pass (needs set_vml_sqrt).

    ``i_body``: per item, how many leading elements torch.maximum (AMSGrad) computes in its vector
    loop; the rest are its scalar tail, which gives a NaN other bits (see tl_vmax_*, tl_smax_*).
    """
    cdef tl_adam_args a
    cdef Py_ssize_t k, nitems = i_start.shape[0]
    cdef bint avx = _use_avx2
    cdef tl_vml_f32 fs = _vml_s
    cdef tl_vml_f64 fd = _vml_d
    cdef long long mode = _vml_mode
    if fs == NULL or fd == NULL:
        raise ValueError("adam_loop_step: no square root installed; call set_vml_sqrt first")
    if i_len.shape[0] != nitems or i_body.shape[0] != nitems:
        raise ValueError("adam_loop_step: plan arrays differ in length")
    if dtype not in (DEF_F32, DEF_F64):
        raise ValueError(f"adam_loop_step: unsupported dtype code {dtype}")
    if p == 0 or g == 0 or m == 0 or v == 0 or (amsgrad and vmax == 0):
        raise ValueError("adam_loop_step: null buffer pointer")
    _fill_args(&a, dtype, w, b2, c2, bc2s, eps, nss, wd, decay, amsgrad, maximize, l2, decoupled)
    if nthreads < 1:
        nthreads = 1
    # GIL released: see adam_step. vmsSqrt/vmdSqrt are thread-safe and, on blocks this small,
    # run on the calling thread.
    with nogil:
        if nthreads == 1:
            # no OpenMP region at all: inside even a one-thread region, MKL's square root
            # (adam_loop_step) would open a nested team per call, costing milliseconds
            for k in range(nitems):
                _adam_loop_item(dtype, avx, amsgrad, p, g, m, v, vmax, i_start[k], i_body[k], i_len[k], &a,
                                fs, fd, mode)
        else:
            for k in prange(nitems, schedule="dynamic", num_threads=nthreads):
                _adam_loop_item(dtype, avx, amsgrad, p, g, m, v, vmax, i_start[k], i_body[k], i_len[k], &a,
                                fs, fd, mode)


def isa() -> str:
    """Name of the kernel flavour in use: ``"avx2"`` or ``"scalar"``."""
    return "avx2" if _use_avx2 else "scalar"


def cpu_has_avx2() -> bool:
    """Whether this CPU can run the AVX2+FMA kernels."""
    return tl_cpu_has_avx2_fma() != 0


def set_isa(name: str) -> None:
    """Select ``"avx2"`` (only when the CPU has it) or ``"scalar"`` kernels (tests, debugging)."""
    global _use_avx2
    if name == "scalar":
        _use_avx2 = False
    elif name == "avx2":
        if not tl_cpu_has_avx2_fma():
            raise ValueError("set_isa('avx2'): this CPU lacks AVX2/FMA; use 'scalar'")
        _use_avx2 = True
    else:
        raise ValueError(f"set_isa: unknown kernel flavour {name!r}; use 'avx2' or 'scalar'")


def openmp_enabled() -> bool:
    """Whether this module was compiled with OpenMP (otherwise kernels run on one thread)."""
    return TL_OPENMP_ENABLED != 0


@cython.boundscheck(False)
@cython.wraparound(False)
def make_plan(const int64_t[::1] starts, const int64_t[::1] lengths, const int64_t[::1] bodies,
              int64_t chunk):
    """Split segments into work items of at most ``chunk`` elements.

    Args:
        starts: element offset of each segment in the flat buffers.
        lengths: element count of each segment.
        bodies: per segment, how many leading elements use the body formula (the rest use the
            tail formula).
        chunk: maximum item size; a multiple of 64 keeps items cache-line aligned.

    Returns:
        ``(item_start, item_len, item_body)`` int64 numpy arrays.
    """
    cdef Py_ssize_t ns = starts.shape[0], s
    cdef int64_t total = 0, k, n, off, piece, b
    if lengths.shape[0] != ns or bodies.shape[0] != ns:
        raise ValueError("make_plan: starts, lengths and bodies must have the same length")
    if chunk <= 0:
        raise ValueError(f"make_plan: chunk must be positive, got {chunk}")
    for s in range(ns):
        if lengths[s] < 0 or starts[s] < 0 or bodies[s] < 0 or bodies[s] > lengths[s]:
            raise ValueError(f"make_plan: segment {s} is invalid (start={starts[s]}, "
                             f"length={lengths[s]}, body={bodies[s]})")
        total += (lengths[s] + chunk - 1) // chunk
    out_start = np.empty(total, dtype=np.int64)
    out_len = np.empty(total, dtype=np.int64)
    out_body = np.empty(total, dtype=np.int64)
    cdef int64_t[::1] i_start = out_start
    cdef int64_t[::1] i_len = out_len
    cdef int64_t[::1] i_body = out_body
    k = 0
    for s in range(ns):
        n = lengths[s]
        off = 0
        while off < n:
            piece = min(chunk, n - off)
            b = bodies[s] - off
            b = 0 if b < 0 else (piece if b > piece else b)
            i_start[k] = starts[s] + off
            i_len[k] = piece
            i_body[k] = b
            k += 1
            off += piece
    return out_start, out_len, out_body


cdef inline void _adam_item(int dtype, bint avx, bint amsgrad, intptr_t p, intptr_t g, intptr_t m,
                            intptr_t v, intptr_t vmax, int64_t s, int64_t body, int64_t n,
                            const tl_adam_args* a) noexcept nogil:
    # One work item of adam_step: pick the kernel for (dtype, CPU) and offset the flat buffers.
    if dtype == DEF_F32:
        if avx:
            tl_adam_f32_avx2(<float*>p + s, <const float*>g + s, <float*>m + s, <float*>v + s,
                             (<float*>vmax + s) if amsgrad else NULL, body, n, a)
        else:
            tl_adam_f32_scalar(<float*>p + s, <const float*>g + s, <float*>m + s, <float*>v + s,
                               (<float*>vmax + s) if amsgrad else NULL, body, n, a)
    elif avx:
        tl_adam_f64_avx2(<double*>p + s, <const double*>g + s, <double*>m + s, <double*>v + s,
                         (<double*>vmax + s) if amsgrad else NULL, body, n, a)
    else:
        tl_adam_f64_scalar(<double*>p + s, <const double*>g + s, <double*>m + s, <double*>v + s,
                           (<double*>vmax + s) if amsgrad else NULL, body, n, a)


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_step(int dtype, intptr_t p, intptr_t g, intptr_t m, intptr_t v, intptr_t vmax,
              const int64_t[::1] i_start, const int64_t[::1] i_len, const int64_t[::1] i_body,
              double w, double b2, double c2, double bc2s, double eps, double nss, double wd,
              double decay, bint amsgrad, bint maximize, bint l2, bint decoupled,
              int body_v_alt, int tail_v_alt, int nthreads):
    """One Adam/AdamW update over the work items of a plan (see :func:`make_plan`).

    ``p, g, m, v, vmax`` are ``data_ptr()`` values of flat buffers of the same dtype (``vmax`` is
    0 unless ``amsgrad``). The Python caller has checked device, dtype, sizes and that every
    item lies inside every buffer: nothing is checked here but the arguments' own consistency.
    """
    cdef tl_adam_args a
    cdef Py_ssize_t k, nitems = i_start.shape[0]
    cdef bint avx = _use_avx2
    if i_len.shape[0] != nitems or i_body.shape[0] != nitems:
        raise ValueError("adam_step: plan arrays differ in length")
    if dtype not in (DEF_F32, DEF_F64):
        raise ValueError(f"adam_step: unsupported dtype code {dtype}")
    if p == 0 or g == 0 or m == 0 or v == 0 or (amsgrad and vmax == 0):
        raise ValueError("adam_step: null buffer pointer")
    _fill_args(&a, dtype, w, b2, c2, bc2s, eps, nss, wd, decay, amsgrad, maximize, l2, decoupled)
    a.body_v_alt = body_v_alt
    a.tail_v_alt = tail_v_alt
    if nthreads < 1:
        nthreads = 1
    # The GIL is released for the whole update: the buffers are owned by tensors the caller keeps
    # alive for the duration of this call, and nothing below touches a Python object.
    with nogil:
        if nthreads == 1:
            # no OpenMP region at all: inside even a one-thread region, MKL's square root
            # (adam_loop_step) would open a nested team per call, costing milliseconds
            for k in range(nitems):
                _adam_item(dtype, avx, amsgrad, p, g, m, v, vmax, i_start[k], i_body[k], i_len[k], &a)
        else:
            for k in prange(nitems, schedule="dynamic", num_threads=nthreads):
                _adam_item(dtype, avx, amsgrad, p, g, m, v, vmax, i_start[k], i_body[k], i_len[k], &a)

cdef inline bint _lerp_small(int dtype, double w) noexcept nogil:
    """Which formula exp_avg.lerp_(grad, w) takes: ATen tests |w| < 0.5 on the weight in the kernel's
    type (at::native::is_lerp_weight_small on weight.to<scalar_t>(); fused=True: scalar_t(1 - beta1)).
    For float32, the double rounded to float: 1 - 0.50000001 is below 0.5 in double, 0.5 in float."""
    if dtype == DEF_F32:
        return fabsf(<float>w) < 0.5
    return fabs(w) < 0.5


cdef int _fill_args(tl_adam_args* a, int dtype, double w, double b2, double c2, double bc2s, double eps,
                    double nss, double wd, double decay, bint amsgrad, bint maximize, bint l2,
                    bint decoupled) except -1:
    a.w = w
    a.lerp_small = 1.0 if _lerp_small(dtype, w) else 0.0
    a.b2 = b2
    a.c2 = c2
    a.bc2s = bc2s
    a.eps = eps
    a.nss = nss
    a.wd = wd
    a.decay = decay
    a.amsgrad = amsgrad
    a.maximize = maximize
    a.l2 = l2
    a.decoupled = decoupled
    a.body_v_alt = 0
    a.tail_v_alt = 0
    return 0


cdef inline void _moments_item(int dtype, bint avx, bint amsgrad, intptr_t p, intptr_t g, intptr_t m,
                               intptr_t v, intptr_t vmax, int64_t s, int64_t body, int64_t n,
                               const tl_adam_args* a) noexcept nogil:
    """One plan item of adam_moments: n elements from element offset s, in its dtype and ISA; the
    first ``body`` of them are in torch.maximum's vector loop (AMSGrad's NaN bits)."""
    body = 0 if body < 0 else (n if body > n else body)
    if dtype == DEF_F32:
        if avx:
            tl_mom_f32_avx2(<const float*>p + s, <const float*>g + s, <float*>m + s, <float*>v + s,
                            (<float*>vmax + s) if amsgrad else NULL, body, n, a)
        else:
            tl_mom_f32_scalar(<const float*>p + s, <const float*>g + s, <float*>m + s, <float*>v + s,
                              (<float*>vmax + s) if amsgrad else NULL, body, n, a)
    else:
        if avx:
            tl_mom_f64_avx2(<const double*>p + s, <const double*>g + s, <double*>m + s, <double*>v + s,
                            (<double*>vmax + s) if amsgrad else NULL, body, n, a)
        else:
            tl_mom_f64_scalar(<const double*>p + s, <const double*>g + s, <double*>m + s, <double*>v + s,
                              (<double*>vmax + s) if amsgrad else NULL, body, n, a)


cdef inline void _apply_item(int dtype, bint avx, intptr_t p, intptr_t m, intptr_t sq, int64_t s, int64_t n,
                             const tl_adam_args* a) noexcept nogil:
    """One plan item of adam_apply: n elements from element offset s, in its dtype and ISA."""
    if dtype == DEF_F32:
        if avx:
            tl_apply_f32_avx2(<float*>p + s, <const float*>m + s, <const float*>sq + s, n, a)
        else:
            tl_apply_f32_scalar(<float*>p + s, <const float*>m + s, <const float*>sq + s, n, a)
    else:
        if avx:
            tl_apply_f64_avx2(<double*>p + s, <const double*>m + s, <const double*>sq + s, n, a)
        else:
            tl_apply_f64_scalar(<double*>p + s, <const double*>m + s, <const double*>sq + s, n, a)


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_moments(int dtype, intptr_t p, intptr_t g, intptr_t m, intptr_t v, intptr_t vmax,
                 const int64_t[::1] i_start, const int64_t[::1] i_len, const int64_t[::1] i_body,
                 double w, double b2, double c2, double wd, bint amsgrad, bint maximize, bint l2,
                 int nthreads):
    """First half of torch's for-loop/foreach Adam: exp_avg, exp_avg_sq (and max) in one pass.

    torch takes ``exp_avg_sq.sqrt()`` with its own vectorised math library (MKL's VML on x86
    builds), which is not correctly rounded and cannot be reproduced here; the caller runs
    ``torch.sqrt`` between :func:`adam_moments` and :func:`adam_apply`, so the result is
    bitwise equal to torch's while memory is walked three times instead of about ten.
    ``i_body`` as for :func:`adam_loop_step`.
    """
    cdef tl_adam_args a
    cdef Py_ssize_t k, nitems = i_start.shape[0]
    cdef bint avx = _use_avx2
    if i_len.shape[0] != nitems or i_body.shape[0] != nitems:
        raise ValueError("adam_moments: plan arrays differ in length")
    if dtype not in (DEF_F32, DEF_F64):
        raise ValueError(f"adam_moments: unsupported dtype code {dtype}")
    if p == 0 or g == 0 or m == 0 or v == 0 or (amsgrad and vmax == 0):
        raise ValueError("adam_moments: null buffer pointer")
    _fill_args(&a, dtype, w, b2, c2, 1.0, 0.0, 0.0, wd, 1.0, amsgrad, maximize, l2, False)
    if nthreads < 1:
        nthreads = 1
    # GIL released: see adam_step.
    with nogil:
        if nthreads == 1:
            # no OpenMP region at all: inside even a one-thread region, MKL's square root
            # (adam_loop_step) would open a nested team per call, costing milliseconds
            for k in range(nitems):
                _moments_item(dtype, avx, amsgrad, p, g, m, v, vmax, i_start[k], i_body[k], i_len[k], &a)
        else:
            for k in prange(nitems, schedule="dynamic", num_threads=nthreads):
                _moments_item(dtype, avx, amsgrad, p, g, m, v, vmax, i_start[k], i_body[k], i_len[k], &a)


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_apply(int dtype, intptr_t p, intptr_t m, intptr_t sq,
               const int64_t[::1] i_start, const int64_t[::1] i_len,
               double bc2s, double eps, double nss, double decay, bint decoupled, int nthreads):
    """Second half of torch's for-loop/foreach Adam: ``p = p*decay + (nss*m) / (sq/bc2s + eps)``.

    ``sq`` holds ``torch.sqrt`` of exp_avg_sq (or of max_exp_avg_sq with amsgrad).
    """
    cdef tl_adam_args a
    cdef Py_ssize_t k, nitems = i_start.shape[0]
    cdef bint avx = _use_avx2
    if i_len.shape[0] != nitems:
        raise ValueError("adam_apply: plan arrays differ in length")
    if dtype not in (DEF_F32, DEF_F64):
        raise ValueError(f"adam_apply: unsupported dtype code {dtype}")
    if p == 0 or m == 0 or sq == 0:
        raise ValueError("adam_apply: null buffer pointer")
    _fill_args(&a, dtype, 0.0, 0.0, 0.0, bc2s, eps, nss, 0.0, decay, False, False, False, decoupled)
    if nthreads < 1:
        nthreads = 1
    # GIL released: see adam_step.
    with nogil:
        if nthreads == 1:
            # no OpenMP region at all: inside even a one-thread region, MKL's square root
            # (adam_loop_step) would open a nested team per call, costing milliseconds
            for k in range(nitems):
                _apply_item(dtype, avx, p, m, sq, i_start[k], i_len[k], &a)
        else:
            for k in prange(nitems, schedule="dynamic", num_threads=nthreads):
                _apply_item(dtype, avx, p, m, sq, i_start[k], i_len[k], &a)


cdef inline void _sgd_item(int dtype, bint avx, intptr_t p, intptr_t g, intptr_t buf, int64_t s,
                           int64_t body, int64_t n, const tl_sgd_args* a) noexcept nogil:
    # One work item of sgd_step: pick the kernel for (dtype, CPU) and offset the flat buffers
    # (no momentum buffer without momentum).
    if dtype == DEF_F32:
        if avx:
            tl_sgd_f32_avx2(<float*>p + s, <const float*>g + s,
                            (<float*>buf + s) if a.has_momentum else NULL, body, n, a)
        else:
            tl_sgd_f32_scalar(<float*>p + s, <const float*>g + s,
                              (<float*>buf + s) if a.has_momentum else NULL, body, n, a)
    elif avx:
        tl_sgd_f64_avx2(<double*>p + s, <const double*>g + s,
                        (<double*>buf + s) if a.has_momentum else NULL, body, n, a)
    else:
        tl_sgd_f64_scalar(<double*>p + s, <const double*>g + s,
                          (<double*>buf + s) if a.has_momentum else NULL, body, n, a)


@cython.boundscheck(False)
@cython.wraparound(False)
def sgd_step(int dtype, intptr_t p, intptr_t g, intptr_t buf,
             const int64_t[::1] i_start, const int64_t[::1] i_len, const int64_t[::1] i_body,
             double lr, double wd, double momentum, double dampening, bint nesterov,
             bint maximize, bint first, int tail_alt, int nthreads):
    """One SGD update over the work items of a plan; ``buf`` is 0 when ``momentum == 0``.

    With ``first`` the momentum buffer is initialised to the (decayed) gradient, as torch does on
    a parameter's first step. ``tail_alt`` selects torch fused=True's rounding of the momentum
    update for the elements past each item's body (its per-tensor scalar tail).
    """
    cdef tl_sgd_args a
    cdef Py_ssize_t k, nitems = i_start.shape[0]
    cdef bint avx = _use_avx2
    if i_len.shape[0] != nitems or i_body.shape[0] != nitems:
        raise ValueError("sgd_step: plan arrays differ in length")
    if dtype not in (DEF_F32, DEF_F64):
        raise ValueError(f"sgd_step: unsupported dtype code {dtype}")
    if p == 0 or g == 0 or (momentum != 0.0 and buf == 0):
        raise ValueError("sgd_step: null buffer pointer")
    a.lr_neg = -lr
    a.wd = wd
    a.momentum = momentum
    a.damp1 = 1.0 - dampening
    a.has_momentum = momentum != 0.0
    a.first = first
    a.nesterov = nesterov
    a.maximize = maximize
    a.tail_alt = tail_alt
    if nthreads < 1:
        nthreads = 1
    # GIL released: see adam_step.
    with nogil:
        if nthreads == 1:
            # no OpenMP region at all: inside even a one-thread region, MKL's square root
            # (adam_loop_step) would open a nested team per call, costing milliseconds
            for k in range(nitems):
                _sgd_item(dtype, avx, p, g, buf, i_start[k], i_body[k], i_len[k], &a)
        else:
            for k in prange(nitems, schedule="dynamic", num_threads=nthreads):
                _sgd_item(dtype, avx, p, g, buf, i_start[k], i_body[k], i_len[k], &a)


@cython.boundscheck(False)
@cython.wraparound(False)
def bump_steps(const int64_t[::1] ptrs, double inc):
    """Add ``inc`` to each float32 0-d step tensor whose ``data_ptr()`` is in ``ptrs``.

    torch keeps one 0-d ``step`` tensor per parameter; fuse_step advances them all in one call
    instead of thousands of tiny tensor ops. The caller keeps the tensors alive.
    """
    cdef Py_ssize_t k, n = ptrs.shape[0]
    for k in range(n):
        if ptrs[k] == 0:
            raise ValueError(f"bump_steps: null pointer at index {k}")
    with nogil:
        for k in range(n):
            (<float*>ptrs[k])[0] = <float>((<float*>ptrs[k])[0] + <float>inc)


def steps_equal(const int64_t[::1] ptrs, double value):
    """Whether every float32 0-d step tensor at ``ptrs`` holds ``value`` (as float32): the fast
    path's check that no step counter was reset in place (``st["step"].zero_()``)."""
    cdef Py_ssize_t k, n = ptrs.shape[0]
    cdef float v = <float>value
    for k in range(n):
        if ptrs[k] == 0:
            raise ValueError(f"steps_equal: null pointer at index {k}")
    for k in range(n):
        if (<float*>ptrs[k])[0] != v:
            return False
    return True


@cython.boundscheck(False)
@cython.wraparound(False)
def same_state(object state, list dicts, const int64_t[::1] sizes, list values):
    """Whether ``state`` (an optimizer's state: parameter -> dict) holds the very dicts ``dicts``
    in that order, each with ``sizes[i]`` entries, and those entries hold the very objects
    ``values`` (all dicts' values, in order): what the fast path recorded. A state cleared,
    deleted, replaced or emptied by hand fails, and so does a state tensor replaced by hand
    (``st["exp_avg"] = t``). Walks the dicts' values without hashing a key (a tensor's hash is a
    Python call, ~0.15 us): a pointer compare per entry."""
    cdef Py_ssize_t pos = 0, i = 0, n = len(dicts), j = 0, nv = len(values), ipos
    cdef PyObject *key
    cdef PyObject *value
    cdef PyObject *ikey
    cdef PyObject *ivalue
    if sizes.shape[0] != n:
        raise ValueError("same_state: dicts and sizes differ in length")
    if not isinstance(state, dict):  # a dict subclass (torch's defaultdict) is fine
        raise TypeError(f"same_state: state must be a dict, got {type(state).__name__}")
    if len(<dict>state) != n:
        return False
    while PyDict_Next(state, &pos, &key, &value):
        if value != PyList_GET_ITEM(dicts, i):
            return False
        if not isinstance(<object>value, dict) or len(<dict>value) != sizes[i]:
            return False
        ipos = 0
        while PyDict_Next(<object>value, &ipos, &ikey, &ivalue):
            if j >= nv or ivalue != PyList_GET_ITEM(values, j):
                return False
            j += 1
        i += 1
    return j == nv


def same_objects(list a, list b):
    """Whether two lists hold the very same objects in the same order (identity, not ==)."""
    cdef Py_ssize_t i, n = len(a)
    if len(b) != n:
        return False
    for i in range(n):
        if a[i] is not b[i]:
            return False
    return True


@cython.boundscheck(False)
@cython.wraparound(False)
def scan(list params, list grad_views, const int64_t[::1] ptrs, const int64_t[::1] grad_ptrs,
         object state, tuple keys, list key_views, list step_objs, Py_ssize_t n_extra, uint8_t[::1] out,
         bint light=False):
    """Classify the parameters of one bucket before a fused step (runs with the GIL held).

    Per parameter ``out[i]`` is 0 when its gradient is its flat view (the same object, still at
    ``grad_ptrs[i]``: ``p.grad.data = t`` re-points the view object), its storage is still the
    flat buffer and its state is in the flat buffers: every tensor named in ``keys`` is its flat
    view, ``step`` is the cached tensor when ``step_objs`` is given, and the state has exactly
    ``n_extra`` other entries (-1: any number; an empty state is fine only when nothing is
    expected). 1 when the gradient is None; 2 when the gradient is some other tensor (the
    caller copies it into the flat buffer); 3 when the state is not (or no longer) flat; 4 when
    ``p.data`` was replaced. Returns how many statuses are not 0. One C loop instead of a
    Python loop keeps fuse_step's overhead small for models with thousands of tensors.

    With ``light`` only gradients and storage are checked (the caller checks the state with
    :func:`same_state`; step() and load_state_dict() invalidate its cache).
    """
    cdef Py_ssize_t i, k, n = len(params), nk = len(keys), nbad = 0
    cdef object p, g, st, v
    cdef uint8_t code
    if (len(grad_views) != n or ptrs.shape[0] != n or grad_ptrs.shape[0] != n or out.shape[0] != n
            or len(key_views) != nk):
        raise ValueError("scan: argument lengths differ")
    if step_objs is not None and len(step_objs) != n:
        raise ValueError("scan: step_objs length differs")
    for i in range(n):
        p = params[i]
        if <int64_t>p.data_ptr() != ptrs[i]:
            out[i] = 4
            nbad += 1
            continue
        g = p.grad
        if g is None:
            code = 1
        elif g is grad_views[i] and <int64_t>g.data_ptr() == grad_ptrs[i]:
            code = 0
        else:
            code = 2
        # A foreign gradient (2) is reported first: the caller copies it, then scans again.
        if code == 0 and not light:
            st = state.get(p)
            if st is None or len(<dict>st) == 0:
                if nk != 0 or n_extra > 0 or step_objs is not None:
                    code = 3
            else:
                if n_extra >= 0 and len(<dict>st) != nk + n_extra:
                    code = 3
                else:
                    for k in range(nk):
                        v = (<dict>st).get(keys[k])
                        if v is None or v is not (<list>key_views[k])[i]:
                            code = 3
                            break
                    if code != 3 and step_objs is not None:
                        if (<dict>st).get("step") is not step_objs[i]:
                            code = 3
        out[i] = code
        if code != 0:
            nbad += 1
    return nbad
