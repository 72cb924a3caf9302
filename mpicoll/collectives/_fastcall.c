/* mpicoll.collectives._fastcall: the small-call fast path of ``auto`` in C.
 *
 * What communicator.py's ``_straight_to_mpi`` closures do, without a Python frame: a callable that sends a
 * numpy call under ``limit`` bytes straight to mpi4py's own method, holding the communicator's turn (a list
 * of one token, shared with the checked path) and numbering the call in flight for the watchdog to time
 * (``in_flight``: a number costs nothing, a clock read ~20 ns), and hands
 * every other call (other types, keywords, overlapping or viewed buffers it cannot clear, larger ones) to the
 * checked path unchanged, and so does a call from a thread other than the one that made the communicator's first
 * call (``caller``: the checked path compares the calling thread across ranks from then on).  MPI.MIN and MPI.MAX on floating-point arrays become their NaN-keeping ops
 * (mpicoll.base.ops.keeping_nan), as on every other path.  The Python closures stay as the fallback where no compiler built this; both are
 * tested.  Measured at 2 ranks: the closure costs ~150 ns over mpi4py's own call, most of it the Python
 * frame and attribute lookups; this nothing measurable back to back, and less than it did when the caches
 * are cold, reading arrays through numpy's C API (docs/failures.md, docs/benchmarks.md).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
/* numpy's C API for an array's size and base: two field reads, where getting the attributes ran numpy's
   getters and made an int (measured with the rest of these reads: ~0.1 us of a 3.3 us call at 2 ranks) */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#ifndef Py_TPFLAGS_HAVE_VECTORCALL
#define Py_TPFLAGS_HAVE_VECTORCALL _Py_TPFLAGS_HAVE_VECTORCALL
#endif

/* What a collective's arguments look like (the module's ROOTED, GATHER and REDUCE; kind= of FastCall):
   (buf[, root]), (sendbuf, recvbuf), (sendbuf, recvbuf[, op]). */
enum { ROOTED = 0, GATHER = 1, REDUCE = 2 };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *owner;        /* the Communicator (what the watchdog's roll call asks for its context) */
    PyObject *collective;   /* "Allreduce", ... */
    PyObject *mpi_call;     /* mpi4py's unbound method: called with the owner first */
    PyObject *checked_call; /* the full path, for every call this one does not take */
    PyObject *on_mpi_error; /* called with an MPI.Exception: raises RanksLost if a peer died, else returns */
    PyObject *refuse;       /* called when another thread holds the turn: raises ConcurrentCall */
    PyObject *apart;        /* apart(sendbuf, recvbuf) -> bool, for pairs not both owning their memory */
    PyObject *takes;        /* takes(sendbuf, recvbuf, op) -> bool, or None: whether mpi_call carries a reduction
                               (the on-node allreduce's node, mpicoll.collectives._shm, carries some types and ops) */
    PyObject *turn;         /* list of one token; empty while a call holds it */
    PyObject *ndarray, *in_place, *mpi_error, *default_op, *zero;
    PyObject *min_op, *max_op, *nan_min, *nan_max;   /* MPI.MIN and MPI.MAX, and what replaces them on floats */
    Py_ssize_t limit;       /* bytes: calls from this size go the checked path */
    unsigned long caller;   /* the thread this one serves; another thread's call goes the checked path */
    int kind;
    unsigned long long calls;      /* calls taken so far */
    unsigned long long in_flight;  /* the number of the call in flight, 0 when idle: the watchdog times it */
    PyObject *weakrefs;
} FastCall;

/* failure.hold_if_ending, once the job is ending (hold_calls): a call that completes then does not return */
static PyObject *hold = NULL;

static PyObject *hold_calls(PyObject *module, PyObject *callable) {
    Py_XINCREF(callable);
    Py_XSETREF(hold, callable);
    Py_RETURN_NONE;
}

/* 1: a numpy array under the limit; 0: not */
static int small_array(FastCall *self, PyObject *obj) {
    return Py_TYPE(obj) == (PyTypeObject *)self->ndarray && PyArray_NBYTES((PyArrayObject *)obj) < self->limit;
}

/* 1: the send buffer may go with the receive buffer; 0: not (the checked path refuses or takes it); -1 */
static int send_apart(FastCall *self, PyObject *sendbuf, PyObject *recvbuf) {
    if (sendbuf == self->in_place)
        return 1;
    if (Py_TYPE(sendbuf) != (PyTypeObject *)self->ndarray)
        return 0;
    if (PyArray_BASE((PyArrayObject *)sendbuf) == NULL && PyArray_BASE((PyArrayObject *)recvbuf) == NULL)
        return sendbuf != recvbuf;   /* two arrays that own their memory are apart unless they are one */
    PyObject *answer = PyObject_CallFunctionObjArgs(self->apart, sendbuf, recvbuf, NULL);
    if (answer == NULL)
        return -1;
    int apart = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return apart;
}

static PyObject *fastcall_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    FastCall *self = (FastCall *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *call[4];          /* owner, then the call's arguments with their defaults */
    Py_ssize_t n;
    int take = 0;
    if (kwnames == NULL) {
        if (self->kind == ROOTED && (nargs == 1 || nargs == 2)) {
            call[1] = args[0];
            call[2] = nargs == 2 ? args[1] : self->zero;
            n = 3;
            take = small_array(self, args[0]);
        } else if (self->kind != ROOTED && (nargs == 2 || (self->kind == REDUCE && nargs == 3))) {
            call[1] = args[0];
            call[2] = args[1];
            n = 3;
            if (self->kind == REDUCE) {
                call[3] = nargs == 3 ? args[2] : self->default_op;
                n = 4;
            }
            take = small_array(self, args[1]);
            if (take == 1 && self->kind == REDUCE && (call[3] == self->min_op || call[3] == self->max_op)
                    && PyArray_DESCR((PyArrayObject *)args[1])->kind == 'f')
                call[3] = call[3] == self->min_op ? self->nan_min : self->nan_max;   /* a NaN kept, as numpy */
            if (take == 1)
                take = send_apart(self, args[0], args[1]);
            if (take == 1 && self->takes != Py_None) {
                PyObject *answer = PyObject_Vectorcall(self->takes, call + 1, 3, NULL);
                take = answer == NULL ? -1 : PyObject_IsTrue(answer);
                Py_XDECREF(answer);
            }
        }
    }
    if (take < 0)
        return NULL;
    if (!take || PyThread_get_thread_ident() != self->caller)
        return PyObject_Vectorcall(self->checked_call, args, nargsf, kwnames);
    /* Take the token as list.pop() would, keeping the list's storage (list.pop() and PyList_SetSlice free it
       when the list empties, and the next append allocates it again); the Python paths pop and append as usual */
    PyListObject *turn = (PyListObject *)self->turn;
    if (Py_SIZE(turn) != 1)
        return PyObject_CallNoArgs(self->refuse);        /* raises ConcurrentCall */
    PyObject *token = turn->ob_item[0];                  /* the list's reference, now this call's */
    Py_SET_SIZE(turn, 0);
    call[0] = self->owner;
    self->in_flight = ++self->calls;
    PyObject *result = PyObject_Vectorcall(self->mpi_call, call, n, NULL);
    self->in_flight = 0;
    if (hold != NULL) {                 /* the job is ending: this call does not return (hold never does) */
        PyObject *held = PyObject_CallNoArgs(hold);
        Py_XDECREF(held);
    }
    if (result == NULL && PyErr_ExceptionMatches(self->mpi_error)) {
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        PyErr_NormalizeException(&type, &value, &trace);
        PyObject *checked = PyObject_CallOneArg(self->on_mpi_error, value);
        if (checked == NULL) {              /* RanksLost, raised from the MPI error */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(trace);
        } else {
            Py_DECREF(checked);
            PyErr_Restore(type, value, trace);
        }
    }
    if (Py_SIZE(turn) == 0 && turn->allocated >= 1) {  /* as list.append would, into the storage kept */
        turn->ob_item[0] = token;
        Py_SET_SIZE(turn, 1);
    } else {
        int given = PyList_Append(self->turn, token);
        Py_DECREF(token);
        if (given < 0) {
            Py_XDECREF(result);
            return NULL;
        }
    }
    return result;
}

static int fastcall_init(FastCall *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"owner", "collective", "kind", "limit", "mpi_call", "checked_call", "on_mpi_error",
                            "refuse", "apart", "turn", "ndarray", "in_place", "mpi_error", "default_op", "min_op",
                            "max_op", "nan_min", "nan_max", "takes", NULL};
    PyObject *owner, *collective, *mpi_call, *checked_call, *on_mpi_error, *refuse, *apart, *turn, *ndarray,
             *in_place, *mpi_error, *default_op, *min_op, *max_op, *nan_min, *nan_max, *takes;
    int kind;
    Py_ssize_t limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OOinOOOOOO!OOOOOOOOO", names, &owner, &collective, &kind, &limit,
                                     &mpi_call, &checked_call, &on_mpi_error, &refuse, &apart, &PyList_Type,
                                     &turn, &ndarray, &in_place, &mpi_error, &default_op, &min_op, &max_op,
                                     &nan_min, &nan_max, &takes))
        return -1;
    if (!PyType_Check(ndarray) || kind < ROOTED || kind > REDUCE) {
        PyErr_SetString(PyExc_ValueError, "FastCall: ndarray must be a type and kind ROOTED, GATHER or REDUCE");
        return -1;
    }
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL)
        return -1;
#define KEEP(field, value) do { PyObject *old = self->field; Py_INCREF(value); self->field = value; Py_XDECREF(old); } while (0)
    KEEP(owner, owner); KEEP(collective, collective); KEEP(mpi_call, mpi_call); KEEP(checked_call, checked_call);
    KEEP(on_mpi_error, on_mpi_error); KEEP(refuse, refuse); KEEP(apart, apart); KEEP(turn, turn);
    KEEP(ndarray, ndarray); KEEP(in_place, in_place); KEEP(mpi_error, mpi_error); KEEP(default_op, default_op);
    KEEP(zero, zero); KEEP(min_op, min_op); KEEP(max_op, max_op); KEEP(nan_min, nan_min); KEEP(nan_max, nan_max);
    KEEP(takes, takes);
#undef KEEP
    Py_DECREF(zero);
    self->kind = kind;
    self->limit = limit;
    self->caller = PyThread_get_thread_ident();     /* made in the call that made it: the first call's thread */
    self->in_flight = 0;
    self->vectorcall = fastcall_vectorcall;
    return 0;
}

static int fastcall_traverse(FastCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->owner); Py_VISIT(self->collective); Py_VISIT(self->mpi_call); Py_VISIT(self->checked_call);
    Py_VISIT(self->on_mpi_error); Py_VISIT(self->refuse); Py_VISIT(self->apart); Py_VISIT(self->turn);
    Py_VISIT(self->ndarray); Py_VISIT(self->in_place); Py_VISIT(self->mpi_error); Py_VISIT(self->default_op);
    Py_VISIT(self->zero); Py_VISIT(self->min_op); Py_VISIT(self->max_op); Py_VISIT(self->nan_min);
    Py_VISIT(self->nan_max); Py_VISIT(self->takes);
    return 0;
}

static int fastcall_clear(FastCall *self) {
    Py_CLEAR(self->owner); Py_CLEAR(self->collective); Py_CLEAR(self->mpi_call); Py_CLEAR(self->checked_call);
    Py_CLEAR(self->on_mpi_error); Py_CLEAR(self->refuse); Py_CLEAR(self->apart); Py_CLEAR(self->turn);
    Py_CLEAR(self->ndarray); Py_CLEAR(self->in_place); Py_CLEAR(self->mpi_error); Py_CLEAR(self->default_op);
    Py_CLEAR(self->zero); Py_CLEAR(self->min_op); Py_CLEAR(self->max_op); Py_CLEAR(self->nan_min);
    Py_CLEAR(self->nan_max); Py_CLEAR(self->takes);
    return 0;
}

static void fastcall_dealloc(FastCall *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    fastcall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef fastcall_members[] = {
    {"owner", T_OBJECT, offsetof(FastCall, owner), READONLY, "the communicator"},
    {"collective", T_OBJECT, offsetof(FastCall, collective), READONLY, "the collective's method name"},
    {"in_flight", T_ULONGLONG, offsetof(FastCall, in_flight), READONLY, "the number of the call in flight, 0 idle"},
    {NULL},
};

static PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpicoll.collectives._fastcall.FastCall",
    .tp_doc = "A small collective call straight to MPI, under the communicator's turn and timed by the watchdog.",
    .tp_basicsize = sizeof(FastCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fastcall_init,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastCall, vectorcall),
    .tp_weaklistoffset = offsetof(FastCall, weakrefs),
    .tp_traverse = (traverseproc)fastcall_traverse,
    .tp_clear = (inquiry)fastcall_clear,
    .tp_dealloc = (destructor)fastcall_dealloc,
    .tp_members = fastcall_members,
};

static PyMethodDef functions[] = {
    {"hold_calls", (PyCFunction)hold_calls, METH_O,
     "hold_calls(hold): from now on every call calls hold() once MPI's call is done (the job is ending)."},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcall", "auto's small-call fast path, in C.", -1,
                                    functions};

PyMODINIT_FUNC PyInit__fastcall(void) {
    import_array();
    if (PyType_Ready(&FastCallType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FastCallType);
    if (PyModule_AddObject(m, "FastCall", (PyObject *)&FastCallType) < 0) {
        Py_DECREF(&FastCallType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ROOTED", ROOTED) < 0 || PyModule_AddIntConstant(m, "GATHER", GATHER) < 0 ||
            PyModule_AddIntConstant(m, "REDUCE", REDUCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
