/* Fused kernels for the 1-bit masks of headroom.nn (see _bitmask.py).
 *
 * pack_nonzero(src, n, dst, dtype): bit i % 8 of dst[i / 8] = (src[i] != 0), for n
 *     elements of a contiguous float32 or float64 buffer; NaN counts as non-zero, -0.0 as zero
 *     (exactly C's and PyTorch's `!= 0`). Bits past n in the last byte are zero.
 * unpack(bits, n, dst, dtype): dst[i] = 1.0 where bit i is set, else +0.0.
 *
 * dtype: 0 float32, 1 float64, 2 float16 (unpack only), 3 bfloat16 (unpack only). Pointers come from the caller
 * (torch tensors it has checked: contiguous, right dtype, right size), as plain integers.
 *
 * One pass each: the packing reads the floats once and writes n/8 bytes (NumPy would need a
 * compare into a byte array and packbits over it); the unpacking writes the floats once. x86-64
 * gets AVX-512 or AVX2 loops chosen at run time (the library is built for any x86-64); other
 * machines get the scalar loops, which the compiler may vectorize. One thread: they are
 * memory-bound, and splitting a buffer over two threads right after a PyTorch op (whose OpenMP
 * workers still spin) measured slower on the 2-core development machine, for 1 M to 16 M
 * elements (a one-off measurement, not a benchmark). The GIL is released for large buffers.
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

static inline int nonzero_at(const char *src, int dtype, int64_t i) {
    /* The hardware's comparison, like PyTorch's kernels: with denormals-are-zero set on this
     * thread (torch.set_flush_denormal(True)) a subnormal counts as zero, as it does for them. */
    if (dtype == F32) return ((const float *)src)[i] != 0.0f;
    return ((const double *)src)[i] != 0.0;
}

/* Packs elements [8 * b0, min(n, 8 * b1)) into bytes [b0, b1). */
static void pack_scalar(const char *src, int64_t n, uint8_t *dst, int dtype, int64_t b0,
                        int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        uint8_t byte = 0;
        int64_t i0 = 8 * b;
        int k = (n - i0) < 8 ? (int)(n - i0) : 8;
        for (int j = 0; j < k; j++) byte |= (uint8_t)(nonzero_at(src, dtype, i0 + j) << j);
        dst[b] = byte;
    }
}

static void unpack_scalar(const uint8_t *bits, int64_t n, char *dst, int dtype, int64_t b0,
                          int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        uint8_t byte = bits[b];
        int64_t i0 = 8 * b;
        int k = (n - i0) < 8 ? (int)(n - i0) : 8;
        switch (dtype) {
        case F32:
            for (int j = 0; j < k; j++) ((float *)dst)[i0 + j] = (byte >> j) & 1 ? 1.0f : 0.0f;
            break;
        case F64:
            for (int j = 0; j < k; j++) ((double *)dst)[i0 + j] = (byte >> j) & 1 ? 1.0 : 0.0;
            break;
        default: {
            uint16_t one = dtype == F16 ? 0x3c00u : 0x3f80u;
            for (int j = 0; j < k; j++)
                ((uint16_t *)dst)[i0 + j] = (byte >> j) & 1 ? one : 0;
        }
        }
    }
}

/* ---------------------------------------------------------------- x86-64 SIMD (float32) */

#ifdef HR_X86
__attribute__((target("avx2"))) static void pack_f32_avx2(const float *src, uint8_t *dst,
                                                          int64_t b0, int64_t b1) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        /* NEQ_UQ: true where not equal or unordered (NaN); -0.0 == 0.0 */
        __m256 m = _mm256_cmp_ps(_mm256_loadu_ps(src + 8 * b), zero, _CMP_NEQ_UQ);
        dst[b] = (uint8_t)_mm256_movemask_ps(m);
    }
}

__attribute__((target("avx2"))) static void unpack_f32_avx2(const uint8_t *bits, float *dst,
                                                            int64_t b0, int64_t b1) {
    const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t b = b0; b < b1; b++) {
        __m256i v = _mm256_and_si256(_mm256_set1_epi32(bits[b]), select);
        __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, select));
        _mm256_storeu_ps(dst + 8 * b, _mm256_and_ps(set, one));
    }
}

__attribute__((target("avx512f"))) static void pack_f32_avx512(const float *src, uint8_t *dst,
                                                              int64_t b0, int64_t b1) {
    const __m512 zero = _mm512_setzero_ps();
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) {
        __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(src + 8 * b), zero, _CMP_NEQ_UQ);
        uint16_t w = (uint16_t)m;
        memcpy(dst + b, &w, 2);
    }
    for (; b < b1; b++) {
        __mmask16 m = _mm512_mask_cmp_ps_mask(0xff, _mm512_maskz_loadu_ps(0xff, src + 8 * b),
                                              zero, _CMP_NEQ_UQ);
        dst[b] = (uint8_t)m;
    }
}

__attribute__((target("avx512f"))) static void unpack_f32_avx512(const uint8_t *bits,
                                                                float *dst, int64_t b0,
                                                                int64_t b1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) {
        uint16_t w;
        memcpy(&w, bits + b, 2);
        _mm512_storeu_ps(dst + 8 * b, _mm512_maskz_mov_ps((__mmask16)w, one));
    }
    for (; b < b1; b++) _mm512_mask_storeu_ps(dst + 8 * b, 0xff, _mm512_maskz_mov_ps(bits[b], one));
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

static void run(const void *src, void *dst, int64_t n, int dtype, int unpack) {
    /* Whole bytes below `full` hold 8 elements; the last byte may hold fewer. */
    int64_t full = n / 8, bytes = (n + 7) / 8, b0 = 0;
#ifdef HR_X86
    if (dtype == F32 && full > 0) {
        int level = simd();
        if (level == 2) {
            if (unpack) unpack_f32_avx512(src, dst, 0, full);
            else pack_f32_avx512(src, dst, 0, full);
            b0 = full;
        } else if (level == 1) {
            if (unpack) unpack_f32_avx2(src, dst, 0, full);
            else pack_f32_avx2(src, dst, 0, full);
            b0 = full;
        }
    }
#endif
    /* The scalar loops take what SIMD did not, and the partial last byte. */
    if (unpack) unpack_scalar(src, n, dst, dtype, b0, bytes);
    else pack_scalar(src, n, dst, dtype, b0, bytes);
}

/* Above this many elements the GIL is released while the kernel runs. */
#define RELEASE_GIL_FROM ((int64_t)1 << 16)

/* ---------------------------------------------------------------- Python entry points */

static PyObject *call(PyObject *const *args, Py_ssize_t nargs, int unpack) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "expected (src, n, dst, dtype)");
        return NULL;
    }
    void *src = PyLong_AsVoidPtr(args[0]);
    long long n = PyLong_AsLongLong(args[1]);
    void *dst = PyLong_AsVoidPtr(args[2]);
    long dtype = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (dtype < 0 || dtype > (unpack ? BF16 : F64) || n < 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code or element count");
        return NULL;
    }
    if (n > 0 && (src == NULL || dst == NULL)) {
        PyErr_SetString(PyExc_ValueError, "null pointer");
        return NULL;
    }
    if (n >= RELEASE_GIL_FROM) {
        Py_BEGIN_ALLOW_THREADS
        run(src, dst, (int64_t)n, (int)dtype, unpack);
        Py_END_ALLOW_THREADS
    } else {
        run(src, dst, (int64_t)n, (int)dtype, unpack);
    }
    Py_RETURN_NONE;
}

static PyObject *py_pack_nonzero(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return call(args, nargs, 0);
}

static PyObject *py_unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return call(args, nargs, 1);
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
    {"unpack", (PyCFunction)(void (*)(void))py_unpack, METH_FASTCALL,
     "unpack(bits, n, dst, dtype): dst[i] = 1.0 where bit i is set, else 0.0."},
    {"simd", py_simd, METH_NOARGS, "The instruction set the float32 loops use here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bitkernels", "Fused 1-bit mask kernels for headroom.nn.", -1, methods,
};

PyMODINIT_FUNC PyInit__bitkernels(void) { return PyModule_Create(&module); }
