/* The buffer arguments of ckptzip's C extensions (codecs/_gdeflate.c, codecs/_ckzhuff.c,
 * kernels/_cpu.c), checked in one place: C-contiguous, whole items, writable where written. */
#ifndef CKPTZIP_PYBUFFERS_H
#define CKPTZIP_PYBUFFERS_H

#include <Python.h>
#include <stdint.h>

/* obj's buffer as whole items of itemsize bytes; 0, or -1 with an exception set. */
static inline int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what, view->len,
                     itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A coder's (rows, sizes) arguments: rows of four int64 (source address and length, destination
 * address and length), one writable uint64 size per row; the row count, or -1 with an exception
 * set (nothing held). */
static inline Py_ssize_t get_rows(PyObject *args, Py_buffer *rows, Py_buffer *sizes) {
    PyObject *rows_obj, *sizes_obj;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OO", &rows_obj, &sizes_obj)) return -1;
    if (get_buffer(rows_obj, rows, 0, 4 * sizeof(int64_t), "rows") < 0) return -1;
    if (get_buffer(sizes_obj, sizes, 1, sizeof(uint64_t), "sizes") < 0) {
        PyBuffer_Release(rows);
        return -1;
    }
    n = rows->len / (Py_ssize_t)(4 * sizeof(int64_t));
    if (sizes->len / (Py_ssize_t)sizeof(uint64_t) != n) {
        PyErr_Format(PyExc_ValueError, "%zd rows but %zd sizes", n, sizes->len / (Py_ssize_t)sizeof(uint64_t));
        PyBuffer_Release(rows);
        PyBuffer_Release(sizes);
        return -1;
    }
    return n;
}

#endif
