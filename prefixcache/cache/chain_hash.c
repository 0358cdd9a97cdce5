/* The chained xxh64 block hashes of prefixcache.cache.hashing.BlockHasher.extend, in one C call.
 *
 * The Python loop costs ~300 ns a block (a slice, a concatenation and a call per block); this computes
 * the same bytes, h_i = XXH64(h_{i-1} || tokens of block i as little-endian uint32 || key_i, seed 0),
 * as xxhash.xxh64_digest's canonical (big-endian) 8 bytes, with the keys of BlockHasher.extend:
 * extra_key on blocks from num_unkeyed_blocks on, then output_key on blocks from first_tagged on.
 *
 * XXH64 follows the algorithm as specified in xxHash's doc/xxhash_spec.md (Yann Collet, BSD-2);
 * tests/cache/test_hashing.py checks it against the xxhash package byte for byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t P1 = 0x9E3779B185EBCA87ULL;
static const uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t P3 = 0x165667B19E3779F9ULL;
static const uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t P5 = 0x27D4EB2F165667C5ULL;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const unsigned char *p) {  /* little-endian, any alignment */
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline uint32_t read32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t merge_round(uint64_t acc, uint64_t val) {
    acc ^= xxh_round(0, val);
    return acc * P1 + P4;
}

static uint64_t xxh64(const unsigned char *p, size_t len, uint64_t seed) {
    const unsigned char *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        const unsigned char *limit = end - 32;
        do {
            v1 = xxh_round(v1, read64(p));
            v2 = xxh_round(v2, read64(p + 8));
            v3 = xxh_round(v3, read64(p + 16));
            v4 = xxh_round(v4, read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = merge_round(h, v1);
        h = merge_round(h, v2);
        h = merge_round(h, v3);
        h = merge_round(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    for (; p + 8 <= end; p += 8) {
        h ^= xxh_round(0, read64(p));
        h = rotl64(h, 27) * P1 + P4;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    for (; p < end; p++) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* xxh64(data: bytes) -> bytes: 8 bytes, big-endian, as xxhash.xxh64_digest (what the tests compare). */
static PyObject *py_xxh64_digest(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    uint64_t h = xxh64((const unsigned char *)data.buf, (size_t)data.len, 0);
    PyBuffer_Release(&data);
    unsigned char out[8];
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(h >> (56 - 8 * i));
    return PyBytes_FromStringAndSize((const char *)out, 8);
}

/* chain(parent, token_ids, start_block, num_full, block_size, extra_key, num_unkeyed_blocks,
 *       output_key, first_tagged) -> (list of 8-byte hashes, packed tokens of the new blocks)
 *
 * token_ids: a list of ints (or objects with __index__) in [0, 2**32): OverflowError otherwise, TypeError
 * for a non-integer, as array("I") raises.
 * Blocks start_block .. num_full - 1 are hashed; block i's key is extra_key when
 * i >= num_unkeyed_blocks, followed by output_key when i >= first_tagged. */
static PyObject *py_chain(PyObject *self, PyObject *args) {
    Py_buffer parent, extra, output;
    PyObject *tokens;
    Py_ssize_t start, num_full, bs, num_unkeyed, first_tagged;
    if (!PyArg_ParseTuple(args, "y*O!nnny*ny*n", &parent, &PyList_Type, &tokens, &start, &num_full, &bs,
                          &extra, &num_unkeyed, &output, &first_tagged))
        return NULL;
    PyObject *hashes = NULL, *packed = NULL, *result = NULL, *snapshot = NULL;
    unsigned char *scratch = NULL;
    /* Sizes checked by division: no product below can overflow. */
    if (bs < 1 || bs > PY_SSIZE_T_MAX / 4 || start < 0 || num_full < start ||
        num_full > PyList_GET_SIZE(tokens) / bs) {
        PyErr_SetString(PyExc_ValueError, "chain: block range outside token_ids");
        goto done;
    }
    Py_ssize_t width = 4 * bs, n_new = num_full - start;
    /* The new blocks' tokens copied first (owned references): an item's __index__ may run Python
     * code that changes the list, as the Python loop's slice is immune to. */
    snapshot = PyList_GetSlice(tokens, start * bs, num_full * bs);
    if (snapshot == NULL) goto done;
    packed = PyBytes_FromStringAndSize(NULL, n_new * width);
    if (packed == NULL) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(packed);
    for (Py_ssize_t t = 0, k = 0; t < n_new * bs; t++, k += 4) {
        PyObject *item = PyList_GET_ITEM(snapshot, t);
        unsigned long v;
        if (PyLong_CheckExact(item)) {
            v = PyLong_AsUnsignedLong(item);
        } else {  /* numpy / torch integers, bool: their __index__, as array("I") takes them */
            PyObject *index = PyNumber_Index(item);
            if (index == NULL) goto done;
            v = PyLong_AsUnsignedLong(index);
            Py_DECREF(index);
        }
        if (v == (unsigned long)-1 && PyErr_Occurred()) goto done;
        if (v > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
            goto done;
        }
        dst[k] = (unsigned char)v;
        dst[k + 1] = (unsigned char)(v >> 8);
        dst[k + 2] = (unsigned char)(v >> 16);
        dst[k + 3] = (unsigned char)(v >> 24);
    }
    hashes = PyList_New(n_new);
    if (hashes == NULL) goto done;
    Py_ssize_t head = parent.len > 8 ? parent.len : 8;
    scratch = PyMem_Malloc(head + width + extra.len + output.len);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *prev = parent.buf;
    Py_ssize_t prev_len = parent.len;
    for (Py_ssize_t i = start, k = 0; i < num_full; i++, k++) {
        unsigned char *p = scratch;
        memcpy(p, prev, prev_len);
        p += prev_len;
        memcpy(p, dst + k * width, width);
        p += width;
        if (i >= num_unkeyed && extra.len) {
            memcpy(p, extra.buf, extra.len);
            p += extra.len;
        }
        if (i >= first_tagged && output.len) {
            memcpy(p, output.buf, output.len);
            p += output.len;
        }
        uint64_t h = xxh64(scratch, (size_t)(p - scratch), 0);
        PyObject *digest = PyBytes_FromStringAndSize(NULL, 8);
        if (digest == NULL) goto done;
        unsigned char *out = (unsigned char *)PyBytes_AS_STRING(digest);
        for (int b = 0; b < 8; b++) out[b] = (unsigned char)(h >> (56 - 8 * b));
        PyList_SET_ITEM(hashes, k, digest);
        prev = out;
        prev_len = 8;
    }
    result = PyTuple_Pack(2, hashes, packed);
done:
    PyMem_Free(scratch);
    Py_XDECREF(snapshot);
    Py_XDECREF(hashes);
    Py_XDECREF(packed);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&extra);
    PyBuffer_Release(&output);
    return result;
}

static PyMethodDef methods[] = {
    {"xxh64_digest", py_xxh64_digest, METH_VARARGS, "XXH64 (seed 0) of a bytes-like, as 8 big-endian bytes."},
    {"chain", py_chain, METH_VARARGS, "Chained xxh64 block hashes and packed tokens (see chain_hash.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain_hash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain_hash(void) { return PyModule_Create(&module); }
