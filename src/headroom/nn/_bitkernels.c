/* Fused kernels for the 1-bit masks of headroom.nn (see _bitmask.py).
 *
 * pack_nonzero(src, n, dst, dtype): bit i % 8 of dst[i / 8] = (src[i] != 0), for n
 *     elements of a contiguous float32 or float64 buffer; NaN counts as non-zero, -0.0 as zero
 *     (exactly C's and PyTorch's `!= 0`). Bits past n in the last byte are zero.
 * pack_cmp(src, n, dst, dtype, op, lo, hi) -> bool: the same with another test per element:
 *     op 0 `x != 0` (pack_nonzero), op 1 `x > lo`, op 2 `lo < x < hi`; ops 1 and 2 are ordered
 *     comparisons (NaN gives 0). Returns whether a NaN was seen (op 2 only; else False).
 * unpack(bits, n, dst, dtype[, zero, one]): dst[i] = 1.0 where bit i is set, else +0.0; or the
 *     values whose bit patterns (as unsigned integers of dtype's width) are `one` and `zero`.
 * grad(bits, grad, n, dst, dtype, scale, slope): an activation's backward from its mask, in one
 *     pass: dst[i] = grad[i] where bit i is set, else +0.0 (scale 0: ReLU, Hardtanh) or
 *     grad[i] * slope (scale 1: LeakyReLU), computed in dtype (float32 or float64) as PyTorch's
 *     threshold_backward, hardtanh_backward and leaky_relu_backward kernels compute them.
 *
 * dtype: 0 float32, 1 float64, 2 float16 (unpack only), 3 bfloat16 (unpack only). Pointers come from the caller
 * (torch tensors it has checked: contiguous, right dtype, right size), as plain integers.
 *
 * One pass each: the packing reads the floats once and writes n/8 bytes (NumPy would need a
 * compare into a byte array and packbits over it); the unpacking writes the floats once. x86-64
 * gets AVX-512 or AVX2 loops chosen at run time (the library is built for any x86-64); other
 * machines get the scalar loops, which the compiler may vectorize. One thread: they are
 * memory-bound, and splitting a buffer over two threads right after a PyTorch op competes with
 * its OpenMP workers, which still spin. The GIL is released for large buffers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HR_X86 1
#endif

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 };

/* ---------------------------------------------------------------- scalar (any machine) */

/* What a packing tests per element. The comparisons are the hardware's, like PyTorch's kernels:
 * with denormals-are-zero set on this thread (torch.set_flush_denormal(True)) a subnormal
 * counts as zero, as it does for them. */
typedef struct {
    int op; /* 0: x != 0, 1: x > lo, 2: lo < x < hi */
    double lo, hi;
    int nan_seen; /* op 2: set when a NaN was met */
} test_t;

static inline int test_at(const char *src, int dtype, int64_t i, test_t *t) {
    /* float32 compares in float32 against the bounds rounded to float32, as PyTorch does */
    if (dtype == F32) {
        float x = ((const float *)src)[i];
        switch (t->op) {
        case 0:
            return x != 0.0f;
        case 1:
            return x > (float)t->lo;
        default:
            if (x != x) t->nan_seen = 1;
            return x > (float)t->lo && x < (float)t->hi;
        }
    }
    double x = ((const double *)src)[i];
    switch (t->op) {
    case 0:
        return x != 0.0;
    case 1:
        return x > t->lo;
    default:
        if (x != x) t->nan_seen = 1;
        return x > t->lo && x < t->hi;
    }
}

/* Packs elements [8 * b0, min(n, 8 * b1)) into bytes [b0, b1). */
static void pack_scalar(const char *src, int64_t n, uint8_t *dst, int dtype, int64_t b0,
                        int64_t b1, test_t *t) {
    for (int64_t b = b0; b < b1; b++) {
        uint8_t byte = 0;
        int64_t i0 = 8 * b;
        int k = (n - i0) < 8 ? (int)(n - i0) : 8;
        for (int j = 0; j < k; j++) byte |= (uint8_t)(test_at(src, dtype, i0 + j, t) << j);
        dst[b] = byte;
    }
}

/* Writes the value patterns `one`/`zero` (of the dtype's width) for set/clear bits. */
static void unpack_scalar(const uint8_t *bits, int64_t n, char *dst, int dtype, int64_t b0,
                          int64_t b1, uint64_t zero, uint64_t one) {
    for (int64_t b = b0; b < b1; b++) {
        uint8_t byte = bits[b];
        int64_t i0 = 8 * b;
        int k = (n - i0) < 8 ? (int)(n - i0) : 8;
        switch (dtype) {
        case F32:
            for (int j = 0; j < k; j++)
                ((uint32_t *)dst)[i0 + j] = (byte >> j) & 1 ? (uint32_t)one : (uint32_t)zero;
            break;
        case F64:
            for (int j = 0; j < k; j++) ((uint64_t *)dst)[i0 + j] = (byte >> j) & 1 ? one : zero;
            break;
        default:
            for (int j = 0; j < k; j++)
                ((uint16_t *)dst)[i0 + j] = (byte >> j) & 1 ? (uint16_t)one : (uint16_t)zero;
        }
    }
}

/* ---------------------------------------------------------------- x86-64 SIMD (float32) */

#ifdef HR_X86
/* The predicates are immediates, so each test gets its own loop. NEQ_UQ: not equal or
 * unordered (NaN), -0.0 == 0.0; GT_OQ/LT_OQ: ordered (false for NaN). */
__attribute__((target("avx2"), always_inline)) static inline __m256 test8(__m256 v, int op,
                                                                         __m256 lo, __m256 hi,
                                                                         __m256 *nan) {
    if (op == 0) return _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    if (op == 1) return _mm256_cmp_ps(v, lo, _CMP_GT_OQ);
    *nan = _mm256_or_ps(*nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GT_OQ), _mm256_cmp_ps(v, hi, _CMP_LT_OQ));
}

/* One loop per test (`op` a constant once inlined), four mask bytes per 32-bit store: the
 * stores through `dst` may alias anything, so a test read through `t` inside the loop would
 * be reloaded and branched on for every byte. */
__attribute__((target("avx2"), always_inline)) static inline void pack8_loop(
    const float *src, uint8_t *dst, int64_t b0, int64_t b1, int op, __m256 lo, __m256 hi,
    __m256 *nan) {
    int64_t b = b0;
    for (; b + 4 <= b1; b += 4) {
        const float *s = src + 8 * b;
        uint32_t w = (uint32_t)_mm256_movemask_ps(test8(_mm256_loadu_ps(s), op, lo, hi, nan)) |
                     (uint32_t)_mm256_movemask_ps(test8(_mm256_loadu_ps(s + 8), op, lo, hi, nan))
                         << 8 |
                     (uint32_t)_mm256_movemask_ps(test8(_mm256_loadu_ps(s + 16), op, lo, hi, nan))
                         << 16 |
                     (uint32_t)_mm256_movemask_ps(test8(_mm256_loadu_ps(s + 24), op, lo, hi, nan))
                         << 24;
        memcpy(dst + b, &w, 4); /* little-endian: byte b first */
    }
    for (; b < b1; b++)
        dst[b] = (uint8_t)_mm256_movemask_ps(test8(_mm256_loadu_ps(src + 8 * b), op, lo, hi, nan));
}

__attribute__((target("avx2"))) static void pack_f32_avx2(const float *src, uint8_t *dst,
                                                          int64_t b0, int64_t b1, test_t *t) {
    const __m256 lo = _mm256_set1_ps((float)t->lo), hi = _mm256_set1_ps((float)t->hi);
    __m256 nan = _mm256_setzero_ps();
    switch (t->op) {
    case 0:
        pack8_loop(src, dst, b0, b1, 0, lo, hi, &nan);
        break;
    case 1:
        pack8_loop(src, dst, b0, b1, 1, lo, hi, &nan);
        break;
    default:
        pack8_loop(src, dst, b0, b1, 2, lo, hi, &nan);
    }
    if (_mm256_movemask_ps(nan)) t->nan_seen = 1;
}

__attribute__((target("avx2"))) static void unpack_f32_avx2(const uint8_t *bits, float *dst,
                                                            int64_t b0, int64_t b1,
                                                            uint32_t zero, uint32_t one) {
    const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 vzero = _mm256_castsi256_ps(_mm256_set1_epi32((int)zero));
    const __m256 vone = _mm256_castsi256_ps(_mm256_set1_epi32((int)one));
    for (int64_t b = b0; b < b1; b++) {
        __m256i v = _mm256_and_si256(_mm256_set1_epi32(bits[b]), select);
        __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, select));
        _mm256_storeu_ps(dst + 8 * b, _mm256_blendv_ps(vzero, vone, set));
    }
}

__attribute__((target("avx512f"))) static inline __mmask16 test16(__m512 v, const test_t *t,
                                                                  __m512 lo, __m512 hi,
                                                                  __mmask16 *nan) {
    if (t->op == 0) return _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (t->op == 1) return _mm512_cmp_ps_mask(v, lo, _CMP_GT_OQ);
    *nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_cmp_ps_mask(v, lo, _CMP_GT_OQ) & _mm512_cmp_ps_mask(v, hi, _CMP_LT_OQ);
}

__attribute__((target("avx512f"))) static void pack_f32_avx512(const float *src, uint8_t *dst,
                                                              int64_t b0, int64_t b1,
                                                              test_t *t) {
    const __m512 lo = _mm512_set1_ps((float)t->lo), hi = _mm512_set1_ps((float)t->hi);
    __mmask16 nan = 0;
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) {
        uint16_t w = (uint16_t)test16(_mm512_loadu_ps(src + 8 * b), t, lo, hi, &nan);
        memcpy(dst + b, &w, 2);
    }
    for (; b < b1; b++) {
        /* the upper 8 lanes load zeros; their bits are dropped */
        __mmask16 m = test16(_mm512_maskz_loadu_ps(0xff, src + 8 * b), t, lo, hi, &nan);
        dst[b] = (uint8_t)m;
    }
    if (nan) t->nan_seen = 1;
}

__attribute__((target("avx512f"))) static void unpack_f32_avx512(const uint8_t *bits,
                                                                float *dst, int64_t b0,
                                                                int64_t b1, uint32_t zero,
                                                                uint32_t one) {
    const __m512 vzero = _mm512_castsi512_ps(_mm512_set1_epi32((int)zero));
    const __m512 vone = _mm512_castsi512_ps(_mm512_set1_epi32((int)one));
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) {
        uint16_t w;
        memcpy(&w, bits + b, 2);
        _mm512_storeu_ps(dst + 8 * b, _mm512_mask_blend_ps((__mmask16)w, vzero, vone));
    }
    for (; b < b1; b++)
        _mm512_mask_storeu_ps(dst + 8 * b, 0xff, _mm512_mask_blend_ps(bits[b], vzero, vone));
}

__attribute__((target("avx512f"))) static void grad_f32_avx512(const uint8_t *bits,
                                                              const float *g, float *dst,
                                                              int64_t b0, int64_t b1,
                                                              int scale, float slope) {
    const __m512 vs = _mm512_set1_ps(slope);
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) {
        uint16_t w;
        memcpy(&w, bits + b, 2);
        __m512 v = _mm512_loadu_ps(g + 8 * b);
        __m512 other = scale ? _mm512_mul_ps(v, vs) : _mm512_setzero_ps();
        _mm512_storeu_ps(dst + 8 * b, _mm512_mask_blend_ps((__mmask16)w, other, v));
    }
    for (; b < b1; b++) {
        __m512 v = _mm512_maskz_loadu_ps(0xff, g + 8 * b);
        __m512 other = scale ? _mm512_mul_ps(v, vs) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(dst + 8 * b, 0xff, _mm512_mask_blend_ps(bits[b], other, v));
    }
}

__attribute__((target("avx2"))) static void grad_f32_avx2(const uint8_t *bits, const float *g,
                                                          float *dst, int64_t b0, int64_t b1,
                                                          int scale, float slope) {
    const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 vs = _mm256_set1_ps(slope);
    for (int64_t b = b0; b < b1; b++) {
        __m256i m = _mm256_and_si256(_mm256_set1_epi32(bits[b]), select);
        __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, select));
        __m256 v = _mm256_loadu_ps(g + 8 * b);
        __m256 other = scale ? _mm256_mul_ps(v, vs) : _mm256_setzero_ps();
        _mm256_storeu_ps(dst + 8 * b, _mm256_blendv_ps(other, v, set));
    }
}

static int simd_level = -1; /* 0 none, 1 avx2, 2 avx512f */

static int simd(void) {
    if (simd_level < 0) {
        __builtin_cpu_init();
        simd_level = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return simd_level;
}
#endif

/* ---------------------------------------------------------------- the whole buffer */

static void run_pack(const void *src, void *dst, int64_t n, int dtype, test_t *t) {
    /* Whole bytes below `full` hold 8 elements; the last byte may hold fewer. */
    int64_t full = n / 8, bytes = (n + 7) / 8, b0 = 0;
#ifdef HR_X86
    if (dtype == F32 && full > 0) {
        int level = simd();
        if (level == 2) {
            pack_f32_avx512(src, dst, 0, full, t);
            b0 = full;
        } else if (level == 1) {
            pack_f32_avx2(src, dst, 0, full, t);
            b0 = full;
        }
    }
#endif
    /* The scalar loop takes what SIMD did not, and the partial last byte. */
    pack_scalar(src, n, dst, dtype, b0, bytes, t);
}

static void run_unpack(const void *src, void *dst, int64_t n, int dtype, uint64_t zero,
                       uint64_t one) {
    int64_t full = n / 8, bytes = (n + 7) / 8, b0 = 0;
#ifdef HR_X86
    if (dtype == F32 && full > 0) {
        int level = simd();
        if (level == 2) {
            unpack_f32_avx512(src, dst, 0, full, (uint32_t)zero, (uint32_t)one);
            b0 = full;
        } else if (level == 1) {
            unpack_f32_avx2(src, dst, 0, full, (uint32_t)zero, (uint32_t)one);
            b0 = full;
        }
    }
#endif
    unpack_scalar(src, n, dst, dtype, b0, bytes, zero, one);
}

static void grad_scalar(const uint8_t *bits, const char *g, char *dst, int64_t n, int dtype,
                        int64_t b0, int64_t b1, int scale, double slope) {
    for (int64_t b = b0; b < b1; b++) {
        uint8_t byte = bits[b];
        int64_t i0 = 8 * b;
        int k = (n - i0) < 8 ? (int)(n - i0) : 8;
        if (dtype == F32) {
            const float *gf = (const float *)g;
            float *df = (float *)dst, s = (float)slope;
            for (int j = 0; j < k; j++)
                df[i0 + j] = (byte >> j) & 1 ? gf[i0 + j] : (scale ? gf[i0 + j] * s : 0.0f);
        } else {
            const double *gd = (const double *)g;
            double *dd = (double *)dst;
            for (int j = 0; j < k; j++)
                dd[i0 + j] = (byte >> j) & 1 ? gd[i0 + j] : (scale ? gd[i0 + j] * slope : 0.0);
        }
    }
}

static void run_grad(const uint8_t *bits, const void *g, void *dst, int64_t n, int dtype,
                     int scale, double slope) {
    int64_t full = n / 8, bytes = (n + 7) / 8, b0 = 0;
#ifdef HR_X86
    if (dtype == F32 && full > 0) {
        int level = simd();
        if (level == 2) {
            grad_f32_avx512(bits, g, dst, 0, full, scale, (float)slope);
            b0 = full;
        } else if (level == 1) {
            grad_f32_avx2(bits, g, dst, 0, full, scale, (float)slope);
            b0 = full;
        }
    }
#endif
    grad_scalar(bits, g, dst, n, dtype, b0, bytes, scale, slope);
}

/* Run CALL, without the GIL from this many elements on. */
#define RELEASE_GIL_FROM ((int64_t)1 << 16)
#define RUN(n, CALL)                                                     \
    do {                                                                 \
        if ((n) >= RELEASE_GIL_FROM) {                                   \
            Py_BEGIN_ALLOW_THREADS CALL; Py_END_ALLOW_THREADS            \
        } else {                                                         \
            CALL;                                                        \
        }                                                                \
    } while (0)

/* A TypeError naming the arguments expected, unless COND holds. */
#define CHECK_NARGS(COND, EXPECTED)                                      \
    do {                                                                 \
        if (!(COND)) {                                                   \
            PyErr_SetString(PyExc_TypeError, "expected " EXPECTED);      \
            return NULL;                                                 \
        }                                                                \
    } while (0)

/* The bit patterns of 1.0 per dtype code. */
static const uint64_t ONE[4] = {0x3f800000u, 0x3ff0000000000000ull, 0x3c00u, 0x3f80u};

/* ---------------------------------------------------------------- Python entry points */

/* Parses (src, n, dst, dtype) into the pointers; -1 with an exception set on bad input. */
static int parse(PyObject *const *args, int max_dtype, void **src, long long *n, void **dst,
                 long *dtype) {
    *src = PyLong_AsVoidPtr(args[0]);
    *n = PyLong_AsLongLong(args[1]);
    *dst = PyLong_AsVoidPtr(args[2]);
    *dtype = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return -1;
    if (*dtype < 0 || *dtype > max_dtype || *n < 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code or element count");
        return -1;
    }
    if (*n > 0 && (*src == NULL || *dst == NULL)) {
        PyErr_SetString(PyExc_ValueError, "null pointer");
        return -1;
    }
    return 0;
}

static PyObject *do_pack(PyObject *const *args, test_t *t) {
    void *src, *dst;
    long long n;
    long dtype;
    if (parse(args, F64, &src, &n, &dst, &dtype) < 0) return NULL;
    RUN(n, run_pack(src, dst, (int64_t)n, (int)dtype, t));
    return PyBool_FromLong(t->nan_seen);
}

static PyObject *py_pack_nonzero(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    CHECK_NARGS(nargs == 4, "(src, n, dst, dtype)");
    test_t t = {0, 0.0, 0.0, 0};
    PyObject *r = do_pack(args, &t);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *py_pack_cmp(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    CHECK_NARGS(nargs == 7, "(src, n, dst, dtype, op, lo, hi)");
    test_t t = {(int)PyLong_AsLong(args[4]), PyFloat_AsDouble(args[5]),
                PyFloat_AsDouble(args[6]), 0};
    if (PyErr_Occurred()) return NULL;
    if (t.op < 0 || t.op > 2) {
        PyErr_SetString(PyExc_ValueError, "bad op code");
        return NULL;
    }
    return do_pack(args, &t);
}

static PyObject *py_unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    CHECK_NARGS(nargs == 4 || nargs == 6, "(bits, n, dst, dtype[, zero, one])");
    void *src, *dst;
    long long n;
    long dtype;
    if (parse(args, BF16, &src, &n, &dst, &dtype) < 0) return NULL;
    uint64_t zero = 0, one = ONE[dtype];
    if (nargs == 6) {
        zero = (uint64_t)PyLong_AsUnsignedLongLong(args[4]);
        one = (uint64_t)PyLong_AsUnsignedLongLong(args[5]);
        if (PyErr_Occurred()) return NULL;
    }
    RUN(n, run_unpack(src, dst, (int64_t)n, (int)dtype, zero, one));
    Py_RETURN_NONE;
}

static PyObject *py_grad(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    CHECK_NARGS(nargs == 7, "(bits, grad, n, dst, dtype, scale, slope)");
    const uint8_t *bits = PyLong_AsVoidPtr(args[0]);
    const void *g = PyLong_AsVoidPtr(args[1]);
    long long n = PyLong_AsLongLong(args[2]);
    void *dst = PyLong_AsVoidPtr(args[3]);
    long dtype = PyLong_AsLong(args[4]);
    int scale = PyObject_IsTrue(args[5]);
    double slope = PyFloat_AsDouble(args[6]);
    if (scale < 0 || PyErr_Occurred()) return NULL;
    if (dtype < 0 || dtype > F64 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code or element count");
        return NULL;
    }
    if (n > 0 && (bits == NULL || g == NULL || dst == NULL)) {
        PyErr_SetString(PyExc_ValueError, "null pointer");
        return NULL;
    }
    RUN(n, run_grad(bits, g, dst, (int64_t)n, (int)dtype, scale, slope));
    Py_RETURN_NONE;
}

static PyObject *py_simd(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef HR_X86
    static const char *names[3] = {"scalar", "avx2", "avx512f"};
    return PyUnicode_FromString(names[simd()]);
#else
    return PyUnicode_FromString("scalar");
#endif
}

static PyMethodDef methods[] = {
    {"pack_nonzero", (PyCFunction)(void (*)(void))py_pack_nonzero, METH_FASTCALL,
     "pack_nonzero(src, n, dst, dtype): bit i of dst = src[i] != 0."},
    {"pack_cmp", (PyCFunction)(void (*)(void))py_pack_cmp, METH_FASTCALL,
     "pack_cmp(src, n, dst, dtype, op, lo, hi) -> NaN seen: op 0 != 0, 1 > lo, 2 lo < x < hi."},
    {"unpack", (PyCFunction)(void (*)(void))py_unpack, METH_FASTCALL,
     "unpack(bits, n, dst, dtype[, zero, one]): dst[i] = one (1.0) where bit i is set, else "
     "zero (0.0); zero and one as bit patterns."},
    {"grad", (PyCFunction)(void (*)(void))py_grad, METH_FASTCALL,
     "grad(bits, grad, n, dst, dtype, scale, slope): dst = grad where bit i is set, else 0 "
     "(scale false) or grad * slope."},
    {"simd", py_simd, METH_NOARGS, "The instruction set the float32 loops use here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bitkernels", "Fused 1-bit mask kernels for headroom.nn.", -1, methods,
};

PyMODINIT_FUNC PyInit__bitkernels(void) { return PyModule_Create(&module); }
