/* GIL-free batch reads of the fs tier's block files (kvbridge.offload.fs_fast).
 *
 * read_files(items) reads every item's file into its buffers with the GIL released,
 * so a load's Python work is per job part, not per block. An item is
 * (path: bytes, direct: bool, buffers: tuple of writable buffers): the file is opened
 * O_RDONLY | O_NOFOLLOW | O_NONBLOCK (| O_DIRECT when asked and every buffer's address
 * and length are page aligned), checked with fstat to be a regular
 * file of exactly the buffers' total size, read with preadv from offset 0 until full,
 * and closed. The result is one int per item: 0 when the file was read in full, else
 * a positive errno, or -1 when the file is not a regular file of the expected size (the
 * caller reads that one the plain way, which names what is wrong with it and applies
 * the deletion policy). Nothing is ever deleted here.
 *
 * Every count is bounded before anything is allocated: items (MAX_ITEMS), buffers per
 * item (MAX_BUFFERS), path bytes (PATH_MAX).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0
#endif
#ifndef O_NOFOLLOW
#define O_NOFOLLOW 0
#endif

#define MAX_ITEMS 1024
#define MAX_BUFFERS 64
#define NOT_A_BLOCK_FILE (-1)
#define DIRECT_ALIGN 4096

typedef struct {
    char path[PATH_MAX];
    int direct;
    int num_buffers;
    Py_ssize_t total;
    Py_buffer buffers[MAX_BUFFERS];
    int status;
} item_t;

/* O_DIRECT needs page-aligned buffer addresses and lengths: checked here, so the caller
 * asks for it per tier and a buffer that does not allow it is read buffered */
static int direct_allowed(const item_t *item) {
    for (int i = 0; i < item->num_buffers; i++)
        if (((uintptr_t)item->buffers[i].buf | (uintptr_t)item->buffers[i].len) % DIRECT_ALIGN)
            return 0;
    return 1;
}

static int read_one(item_t *item) {
    int direct = item->direct && direct_allowed(item);
    int flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | (direct ? O_DIRECT : 0);
    int fd = open(item->path, flags);
    if (fd < 0)
        return errno;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return err;
    }
    if (!S_ISREG(st.st_mode) || st.st_size != (off_t)item->total) {
        close(fd);
        return NOT_A_BLOCK_FILE;
    }
    struct iovec iov[MAX_BUFFERS];
    for (int i = 0; i < item->num_buffers; i++) {
        iov[i].iov_base = item->buffers[i].buf;
        iov[i].iov_len = (size_t)item->buffers[i].len;
    }
    struct iovec *rest = iov;
    int rest_count = item->num_buffers;
    off_t done = 0;
    int status = 0;
    while (done < (off_t)item->total) {
        ssize_t n = preadv(fd, rest, rest_count, done);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            status = errno;
            break;
        }
        if (n == 0) {   /* shorter than fstat said: the plain read proves and handles it */
            status = NOT_A_BLOCK_FILE;
            break;
        }
        done += n;
        while (rest_count > 0 && (size_t)n >= rest->iov_len) {
            n -= (ssize_t)rest->iov_len;
            rest++;
            rest_count--;
        }
        if (rest_count > 0 && n > 0) {
            rest->iov_base = (char *)rest->iov_base + n;
            rest->iov_len -= (size_t)n;
        }
    }
    if (close(fd) != 0 && status == 0)
        status = errno;   /* a close error: the plain read decides what it means */
    return status;
}

static void release_items(item_t *items, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++)
        for (int b = 0; b < items[i].num_buffers; b++)
            PyBuffer_Release(&items[i].buffers[b]);
}

static PyObject *read_files(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "read_files expects a list of items");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_ITEMS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "read_files: %zd items, at most %d", count,
                            MAX_ITEMS);
    }
    item_t *items = PyMem_Calloc(count ? (size_t)count : 1, sizeof(item_t));
    if (items == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t filled = 0;
    for (; filled < count; filled++) {
        item_t *item = &items[filled];
        PyObject *tuple = PySequence_Fast_GET_ITEM(seq, filled);
        PyObject *path, *direct, *buffers;
        if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 3) {
            PyErr_SetString(PyExc_TypeError, "read_files: an item is (path, direct, buffers)");
            goto fail;
        }
        path = PyTuple_GET_ITEM(tuple, 0);
        direct = PyTuple_GET_ITEM(tuple, 1);
        buffers = PyTuple_GET_ITEM(tuple, 2);
        char *raw;
        Py_ssize_t raw_len;
        if (PyBytes_AsStringAndSize(path, &raw, &raw_len) != 0)
            goto fail;
        if (raw_len <= 0 || raw_len >= PATH_MAX || memchr(raw, 0, (size_t)raw_len) != NULL) {
            PyErr_SetString(PyExc_ValueError, "read_files: a path is empty, too long or "
                            "holds a NUL byte");
            goto fail;
        }
        memcpy(item->path, raw, (size_t)raw_len);
        item->path[raw_len] = 0;
        item->direct = PyObject_IsTrue(direct);
        if (item->direct < 0)
            goto fail;
        if (!PyTuple_Check(buffers) || PyTuple_GET_SIZE(buffers) < 1
                || PyTuple_GET_SIZE(buffers) > MAX_BUFFERS) {
            PyErr_Format(PyExc_ValueError, "read_files: buffers are a tuple of 1 to %d",
                         MAX_BUFFERS);
            goto fail;
        }
        for (Py_ssize_t b = 0; b < PyTuple_GET_SIZE(buffers); b++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(buffers, b), &item->buffers[b],
                                   PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
                goto fail;
            item->num_buffers++;
            if (item->buffers[b].len > PY_SSIZE_T_MAX - item->total) {
                PyErr_SetString(PyExc_OverflowError, "read_files: buffers too large");
                goto fail;
            }
            item->total += item->buffers[b].len;
        }
    }
    Py_DECREF(seq);
    seq = NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        items[i].status = read_one(&items[i]);
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(count);
    if (out != NULL) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *status = PyLong_FromLong(items[i].status);
            if (status == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, status);
        }
    }
    release_items(items, count);
    PyMem_Free(items);
    return out;
fail:
    /* the item being filled holds num_buffers buffers too */
    release_items(items, filled + 1);
    PyMem_Free(items);
    Py_XDECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_O,
     "read_files(items) -> list[int]: read each (path, direct, buffers) item's file "
     "(O_DIRECT when direct and the buffers are page aligned) "
     "into its buffers without the GIL; per item 0 (read in full), an errno, or -1 "
     "(not a regular file of exactly the buffers' size)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fsio", "GIL-free batch reads of the fs tier's block files.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fsio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MAX_ITEMS", MAX_ITEMS) != 0
            || PyModule_AddIntConstant(m, "MAX_BUFFERS", MAX_BUFFERS) != 0
            || PyModule_AddIntConstant(m, "NOT_A_BLOCK_FILE", NOT_A_BLOCK_FILE) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
