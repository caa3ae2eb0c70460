/* GIL-free batch reads and writes of the fs tier's block files (kvbridge.offload.fs_fast).
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
 * write_files(items) stores every item's block file with the GIL released, so a store's
 * Python work is per job part, not per system call. An item is (path: bytes, temp path:
 * bytes, direct: bool, fsync: bool, buffers: tuple of buffers, header first): the final
 * path is looked at with lstat (a regular file there: EXISTED, nothing written; anything
 * else there: NOT_A_BLOCK_FILE, left to the caller, which removes it or names it); the
 * temp file is made O_CREAT | O_EXCL | O_NOFOLLOW (| O_DIRECT as for reads), written
 * with pwritev until every byte is in (no progress: EIO), fsynced when asked, closed (a
 * close error is a failure: the data may be lost) and renamed over the final path, so a
 * reader sees no file or a complete one. On any error the temp file (only one this call
 * made) is unlinked. The result is one int per item: 0 (written), EXISTED, a positive
 * errno, or NOT_A_BLOCK_FILE; the caller stores every item that is not 0 or EXISTED
 * again the plain way, which names the fault and applies the policy.
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
/* a write's final path already holds a regular file (a stored block: success) */
#define EXISTED (-2)
#define DIRECT_ALIGN 4096

/* what every item of a batch has first: its buffers and its outcome */
typedef struct {
    int num_buffers;      /* held: released even when the item failed to parse */
    Py_ssize_t total;
    Py_buffer buffers[MAX_BUFFERS];
    int status;
} head_t;

typedef struct {
    head_t h;             /* first: a batch sees every item as a head_t */
    char path[PATH_MAX];
    int direct;
} item_t;

typedef struct {
    head_t h;
    char path[PATH_MAX];
    char temp[PATH_MAX];
    int direct;
    int fsync;
} witem_t;

/* O_DIRECT needs page-aligned buffer addresses and lengths: checked here, so the caller
 * asks for it per tier and a buffer that does not allow it is read or written buffered */
static int direct_allowed(const Py_buffer *buffers, int num_buffers) {
    for (int i = 0; i < num_buffers; i++)
        if (((uintptr_t)buffers[i].buf | (uintptr_t)buffers[i].len) % DIRECT_ALIGN)
            return 0;
    return 1;
}

static void to_iovec(const Py_buffer *buffers, int num_buffers, struct iovec *iov) {
    for (int i = 0; i < num_buffers; i++) {
        iov[i].iov_base = buffers[i].buf;
        iov[i].iov_len = (size_t)buffers[i].len;
    }
}

/* past n bytes moved: drop the iovecs done, trim the first one left */
static void advance_iovec(struct iovec **rest, int *rest_count, size_t n) {
    while (*rest_count > 0 && n >= (*rest)->iov_len) {
        n -= (*rest)->iov_len;
        (*rest)++;
        (*rest_count)--;
    }
    if (*rest_count > 0 && n > 0) {
        (*rest)->iov_base = (char *)(*rest)->iov_base + n;
        (*rest)->iov_len -= n;
    }
}

typedef enum { MOVE_READ, MOVE_WRITE } move_t;

/* all of h's buffers from (MOVE_READ) or to (MOVE_WRITE) fd at offset 0, by preadv or
 * pwritev until h->total bytes moved, EINTR retried: 0, an errno, or `stalled` when a
 * call moved nothing (what that means is the caller's: a short file, a full disk) */
static int move_all(int fd, const head_t *h, move_t how, int stalled) {
    struct iovec iov[MAX_BUFFERS];
    to_iovec(h->buffers, h->num_buffers, iov);
    struct iovec *rest = iov;
    int rest_count = h->num_buffers;
    off_t done = 0;
    while (done < (off_t)h->total) {
        ssize_t n = how == MOVE_READ ? preadv(fd, rest, rest_count, done)
                                     : pwritev(fd, rest, rest_count, done);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return stalled;
        done += n;
        advance_iovec(&rest, &rest_count, (size_t)n);
    }
    return 0;
}

static int read_one(item_t *item) {
    int direct = item->direct && direct_allowed(item->h.buffers, item->h.num_buffers);
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
    if (!S_ISREG(st.st_mode) || st.st_size != (off_t)item->h.total) {
        close(fd);
        return NOT_A_BLOCK_FILE;
    }
    /* no progress: shorter than fstat said, which the plain read proves and handles */
    int status = move_all(fd, &item->h, MOVE_READ, NOT_A_BLOCK_FILE);
    if (close(fd) != 0 && status == 0)
        status = errno;   /* a close error: the plain read decides what it means */
    return status;
}

/* a path argument into dst (NUL-terminated); 0, or -1 with an exception set */
static int copy_path(PyObject *path, char *dst, const char *fn) {
    char *raw;
    Py_ssize_t raw_len;
    if (PyBytes_AsStringAndSize(path, &raw, &raw_len) != 0)
        return -1;
    if (raw_len <= 0 || raw_len >= PATH_MAX || memchr(raw, 0, (size_t)raw_len) != NULL) {
        PyErr_Format(PyExc_ValueError, "%s: a path is empty, too long or holds a NUL byte",
                     fn);
        return -1;
    }
    memcpy(dst, raw, (size_t)raw_len);
    dst[raw_len] = 0;
    return 0;
}

/* a tuple of 1 to MAX_BUFFERS buffers into out (out->num_buffers counts the ones held,
 * released by the batch even on failure); 0, or -1 with an exception set */
static int get_buffers(PyObject *buffers, int flags, head_t *out, const char *fn) {
    if (!PyTuple_Check(buffers) || PyTuple_GET_SIZE(buffers) < 1
            || PyTuple_GET_SIZE(buffers) > MAX_BUFFERS) {
        PyErr_Format(PyExc_ValueError, "%s: buffers are a tuple of 1 to %d", fn, MAX_BUFFERS);
        return -1;
    }
    for (Py_ssize_t b = 0; b < PyTuple_GET_SIZE(buffers); b++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(buffers, b), &out->buffers[b], flags) != 0)
            return -1;
        out->num_buffers++;
        if (out->buffers[b].len > PY_SSIZE_T_MAX - out->total) {
            PyErr_Format(PyExc_OverflowError, "%s: buffers too large", fn);
            return -1;
        }
        out->total += out->buffers[b].len;
    }
    return 0;
}

/* one kind of batch: its items' size, how an item tuple is parsed into one (0, or -1
 * with an exception set; the item's head_t counts what it holds) and how one is
 * done without the GIL (its status) */
typedef struct {
    const char *name;
    size_t item_size;
    int (*parse)(PyObject *tuple, void *item);
    int (*run)(void *item);
} batch_t;

static head_t *item_head(const batch_t *kind, char *items, Py_ssize_t i) {
    return (head_t *)(items + (size_t)i * kind->item_size);
}

static void release_items(const batch_t *kind, char *items, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        head_t *head = item_head(kind, items, i);
        for (int b = 0; b < head->num_buffers; b++)
            PyBuffer_Release(&head->buffers[b]);
    }
}

/* parse every item of arg (at most MAX_ITEMS, bounded before anything is allocated), do
 * them all with the GIL released, answer their statuses as a list of ints */
static PyObject *run_batch(const batch_t *kind, PyObject *arg) {
    if (!PyList_Check(arg) && !PyTuple_Check(arg))
        return PyErr_Format(PyExc_TypeError, "%s expects a list of items", kind->name);
    PyObject *seq = PySequence_Fast(arg, "expected a list of items");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_ITEMS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "%s: %zd items, at most %d", kind->name, count,
                            MAX_ITEMS);
    }
    char *items = PyMem_Calloc(count ? (size_t)count : 1, kind->item_size);
    if (items == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t filled = 0;
    for (; filled < count; filled++) {
        if (kind->parse(PySequence_Fast_GET_ITEM(seq, filled),
                        item_head(kind, items, filled)) != 0) {
            /* the item being filled holds buffers too */
            release_items(kind, items, filled + 1);
            PyMem_Free(items);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        head_t *item = item_head(kind, items, i);
        item->status = kind->run(item);
    }
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *status = PyLong_FromLong(item_head(kind, items, i)->status);
        if (status == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, status);
    }
    release_items(kind, items, count);
    PyMem_Free(items);
    return out;
}

static int parse_read(PyObject *tuple, void *out) {
    item_t *item = out;
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 3) {
        PyErr_SetString(PyExc_TypeError, "read_files: an item is (path, direct, buffers)");
        return -1;
    }
    if (copy_path(PyTuple_GET_ITEM(tuple, 0), item->path, "read_files") != 0)
        return -1;
    item->direct = PyObject_IsTrue(PyTuple_GET_ITEM(tuple, 1));
    if (item->direct < 0)
        return -1;
    return get_buffers(PyTuple_GET_ITEM(tuple, 2), PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                       &item->h, "read_files");
}

static int run_read(void *item) {
    return read_one(item);
}

static const batch_t READ_BATCH = {"read_files", sizeof(item_t), parse_read, run_read};

static PyObject *read_files(PyObject *self, PyObject *arg) {
    (void)self;
    return run_batch(&READ_BATCH, arg);
}

/* the temp file of a failed write: unlink it, report err */
static int abandon(const witem_t *item, int err) {
    unlink(item->temp);
    return err;
}

static int write_one(witem_t *item) {
    struct stat st;
    if (lstat(item->path, &st) == 0)
        return S_ISREG(st.st_mode) ? EXISTED : NOT_A_BLOCK_FILE;
    if (errno != ENOENT)
        return errno;
    int direct = item->direct && direct_allowed(item->h.buffers, item->h.num_buffers);
    int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | (direct ? O_DIRECT : 0);
    int fd = open(item->temp, flags, 0644);
    if (fd < 0)
        return errno;   /* not made by this call (O_EXCL): never unlinked here */
    /* no progress: EIO, and the plain write names it */
    int status = move_all(fd, &item->h, MOVE_WRITE, EIO);
    if (status == 0 && item->fsync) {
        while (fsync(fd) != 0) {
            if (errno != EINTR) {
                status = errno;
                break;
            }
        }
    }
    /* a close error on a written file may mean lost data: a failed store */
    if (close(fd) != 0 && status == 0)
        status = errno;
    if (status != 0)
        return abandon(item, status);
    if (rename(item->temp, item->path) != 0)
        return abandon(item, errno);
    return 0;
}

static int parse_write(PyObject *tuple, void *out) {
    witem_t *item = out;
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 5) {
        PyErr_SetString(PyExc_TypeError, "write_files: an item is (path, temp path, "
                        "direct, fsync, buffers)");
        return -1;
    }
    if (copy_path(PyTuple_GET_ITEM(tuple, 0), item->path, "write_files") != 0
            || copy_path(PyTuple_GET_ITEM(tuple, 1), item->temp, "write_files") != 0)
        return -1;
    if (strcmp(item->path, item->temp) == 0) {
        /* a failed write unlinks its temp path: never the block's own */
        PyErr_SetString(PyExc_ValueError, "write_files: the temp path is the path");
        return -1;
    }
    item->direct = PyObject_IsTrue(PyTuple_GET_ITEM(tuple, 2));
    if (item->direct < 0)
        return -1;
    item->fsync = PyObject_IsTrue(PyTuple_GET_ITEM(tuple, 3));
    if (item->fsync < 0)
        return -1;
    return get_buffers(PyTuple_GET_ITEM(tuple, 4), PyBUF_C_CONTIGUOUS, &item->h,
                       "write_files");
}

static int run_write(void *item) {
    return write_one(item);
}

static const batch_t WRITE_BATCH = {"write_files", sizeof(witem_t), parse_write, run_write};

static PyObject *write_files(PyObject *self, PyObject *arg) {
    (void)self;
    return run_batch(&WRITE_BATCH, arg);
}

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_O,
     "read_files(items) -> list[int]: read each (path, direct, buffers) item's file "
     "(O_DIRECT when direct and the buffers are page aligned) "
     "into its buffers without the GIL; per item 0 (read in full), an errno, or -1 "
     "(not a regular file of exactly the buffers' size)."},
    {"write_files", write_files, METH_O,
     "write_files(items) -> list[int]: store each (path, temp path, direct, fsync, buffers) "
     "item's block file (temp file, then renamed over path; O_DIRECT when direct and the "
     "buffers are page aligned) without the GIL; per item 0 (written), EXISTED (a regular "
     "file is there: nothing written), an errno (temp file removed), or NOT_A_BLOCK_FILE "
     "(something else is there: nothing written)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fsio", "GIL-free batch reads and writes of the fs tier's block files.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fsio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MAX_ITEMS", MAX_ITEMS) != 0
            || PyModule_AddIntConstant(m, "MAX_BUFFERS", MAX_BUFFERS) != 0
            || PyModule_AddIntConstant(m, "NOT_A_BLOCK_FILE", NOT_A_BLOCK_FILE) != 0
            || PyModule_AddIntConstant(m, "EXISTED", EXISTED) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
