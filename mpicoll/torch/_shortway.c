/* mpicoll.torch._shortway: the short way of a small blocking dist.all_reduce over the "mpicoll" backend, in C.
 *
 * What ProcessGroupMpicoll._short_way_in_python and Worker.reduce_now do together (mpicoll/torch/backend.py,
 * mpicoll/collectives/nonblocking.py), without their frames and bytecode: read torch's options and the tensor,
 * find MPI's op and datatype for (op, dtype), take the group worker's turn without blocking where nothing is
 * queued before the call, start MPI's Iallreduce on the tensor's memory and test it once, else wait for it on
 * the worker's channel with its deadline (Context.waitall).  Every other call, and every call that finds
 * something before it, answers False and takes the Python path unchanged.  An error fails the worker as
 * Worker._run_here does (unless every rank met it before any data moved: ``settled``) and a timeout is put in
 * torch's words.  The Python twin stays as the fallback where no compiler built this (MPICOLL_FAST_PATH=python
 * chooses it); both are tested.  The calls' price it takes off: docs/torch.md, "the price of a call".
 *
 * It links no MPI: MPI is reached through mpi4py's own methods, so the user's MPI works unchanged.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#ifndef Py_TPFLAGS_HAVE_VECTORCALL
#define Py_TPFLAGS_HAVE_VECTORCALL _Py_TPFLAGS_HAVE_VECTORCALL
#endif

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *straight;       /* dict: (op number, torch dtype) -> (MPI op, MPI datatype), or None where MPI's
                                 own allreduce does not answer as torch (filled by the Python path) */
    PyObject *worker;         /* the group's Worker: its ``failed`` read and set */
    PyObject *queued;         /* the worker's queue (a deque): empty, or the call takes the Python path */
    PyObject *acquire, *release;  /* the worker's turn (a lock): bound acquire and release */
    PyObject *comm_state;     /* the worker's Communicator's __dict__, where its channel ("_context") is kept */
    PyObject *comm, *others;  /* that Communicator, and the ranks a wait on it names (all but this one) */
    PyObject *address;        /* MPI.buffer.fromaddress */
    PyObject *iallreduce;     /* MPI.Intracomm.Iallreduce */
    PyObject *in_place;       /* MPI.IN_PLACE */
    PyObject *mpi_error;      /* MPI.Exception */
    PyObject *timeout_error;  /* mpicoll's CollectiveTimeout */
    PyObject *on_test_error;  /* on_test_error(context, error, request): raises what MPI's error means */
    PyObject *worded;         /* worded(timeout) -> the timeout in torch's words */
    PyObject *collective;     /* "Allreduce": what the channel's errors name */
    Py_ssize_t limit;         /* bytes: from this size the call takes the Python path (0: not known yet) */
    PyObject *weakrefs;
} ShortWay;

/* names, interned once */
static PyObject *s_reduceOp, *s_asyncOp, *s_dtype, *s_is_contiguous, *s_is_cpu, *s_nbytes, *s_data_ptr,
                *s_failed, *s_context, *s_napping, *s_broken, *s_collective, *s_Test, *s_waitall, *s_settled;

/* The raised error, taken (with its traceback), and raised again: what Python 3.12's PyErr_GetRaisedException
   and PyErr_SetRaisedException do, for 3.10 and 3.11 too */
static PyObject *take_error(void) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    if (trace != NULL && value != NULL)
        PyException_SetTraceback(value, trace);
    Py_XDECREF(type);
    Py_XDECREF(trace);
    return value;
}

static void raise_again(PyObject *error) {           /* steals the reference */
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(error)), error, PyException_GetTraceback(error));
}

/* 1 true, 0 false, -1 error: an attribute's truth, the reference dropped */
static int truth_of(PyObject *value) {
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* (MPI op, MPI datatype) for the call, borrowed; NULL with no error: not this way; NULL with an error */
static PyObject *straight_for(ShortWay *self, PyObject *tensor, PyObject *opts) {
    PyObject *reduce_op = PyObject_GetAttr(opts, s_reduceOp);
    if (reduce_op == NULL)
        return NULL;
    Py_hash_t number = PyObject_Hash(reduce_op);       /* torch's ReduceOp hashes to its op's number */
    Py_DECREF(reduce_op);
    if (number == -1 && PyErr_Occurred())
        return NULL;
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype);
    if (dtype == NULL)
        return NULL;
    PyObject *op_number = PyLong_FromSsize_t(number);
    PyObject *key = op_number == NULL ? NULL : PyTuple_Pack(2, op_number, dtype);
    Py_XDECREF(op_number);
    Py_DECREF(dtype);
    if (key == NULL)
        return NULL;
    PyObject *straight = PyDict_GetItemWithError(self->straight, key);
    Py_DECREF(key);
    if (straight == NULL || straight == Py_None)
        return NULL;
    if (!PyTuple_Check(straight) || PyTuple_GET_SIZE(straight) != 2) {
        PyErr_SetString(PyExc_TypeError, "ShortWay: straight's values must be (MPI op, MPI datatype)");
        return NULL;
    }
    return straight;
}

/* 1: the tensor is contiguous, on the host and under the limit, and the call blocking; 0: not; -1 */
static int small_and_blocking(ShortWay *self, PyObject *tensor, PyObject *opts, Py_ssize_t *nbytes) {
    int ok = truth_of(PyObject_CallMethodNoArgs(tensor, s_is_contiguous));   /* (a sparse tensor is not) */
    if (ok != 1)
        return ok;
    if ((ok = truth_of(PyObject_GetAttr(tensor, s_is_cpu))) != 1)
        return ok;
    PyObject *size = PyObject_GetAttr(tensor, s_nbytes);
    if (size == NULL)
        return -1;
    *nbytes = PyLong_AsSsize_t(size);
    Py_DECREF(size);
    if (*nbytes == -1 && PyErr_Occurred())
        return -1;
    if (*nbytes >= self->limit)
        return 0;
    int started = truth_of(PyObject_GetAttr(opts, s_asyncOp));
    return started < 0 ? -1 : !started;
}

/* The call, under the turn: NULL with an error, else Py_True (ran) or Py_False (the Python path runs it). */
static PyObject *run_under_turn(ShortWay *self, PyObject *tensor, PyObject *straight, Py_ssize_t nbytes) {
    PyObject *context = PyDict_GetItemWithError(self->comm_state, s_context);      /* borrowed */
    if (context == NULL)            /* a fresh channel: its first call is checked, on the Python path */
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    int napping = truth_of(PyObject_GetAttr(context, s_napping));
    if (napping != 0)               /* the worker's thread ran the last call: run_now sets the channel to spin */
        return napping < 0 ? NULL : Py_NewRef(Py_False);
    int broken = truth_of(PyObject_GetAttr(context, s_broken));
    if (broken != 0)                /* a channel a lost peer broke: the Python path refuses the call */
        return broken < 0 ? NULL : Py_NewRef(Py_False);
    Py_ssize_t queued = PyObject_Size(self->queued);
    if (queued != 0)
        return queued < 0 ? NULL : Py_NewRef(Py_False);
    if (PyObject_SetAttr(context, s_collective, self->collective) < 0)
        return NULL;
    PyObject *pointer = PyObject_CallMethodNoArgs(tensor, s_data_ptr);
    if (pointer == NULL)
        return NULL;
    PyObject *size = PyLong_FromSsize_t(nbytes);
    PyObject *memory = size == NULL ? NULL : PyObject_CallFunctionObjArgs(self->address, pointer, size, NULL);
    Py_DECREF(pointer);
    Py_XDECREF(size);
    if (memory == NULL)
        return NULL;
    PyObject *message = PyTuple_Pack(2, memory, PyTuple_GET_ITEM(straight, 1));
    Py_DECREF(memory);
    if (message == NULL)
        return NULL;
    PyObject *call[4] = {self->comm, self->in_place, message, PyTuple_GET_ITEM(straight, 0)};
    PyObject *request = PyObject_Vectorcall(self->iallreduce, call, 4, NULL);
    Py_DECREF(message);
    if (request == NULL)
        return NULL;
    PyObject *done = PyObject_CallMethodNoArgs(request, s_Test);   /* the last rank to come: done at once */
    PyObject *result = NULL;
    if (done == NULL) {
        if (PyErr_ExceptionMatches(self->mpi_error)) {
            PyObject *error = take_error();
            PyObject *raised = PyObject_CallFunctionObjArgs(self->on_test_error, context, error, request, NULL);
            Py_XDECREF(raised);                 /* (it raises) */
            Py_DECREF(error);
        }
    } else {
        int completed = truth_of(done);
        if (completed == 1) {
            result = Py_NewRef(Py_True);
        } else if (completed == 0) {
            PyObject *requests = PyList_New(1);
            if (requests != NULL) {
                PyList_SET_ITEM(requests, 0, Py_NewRef(request));
                PyObject *waited = PyObject_CallMethodObjArgs(context, s_waitall, requests, self->others, NULL);
                Py_DECREF(requests);
                if (waited != NULL) {
                    Py_DECREF(waited);
                    result = Py_NewRef(Py_True);
                }
            }
        }
    }
    Py_DECREF(request);
    return result;
}

/* An error under the turn: the worker fails (the calls after it are refused) unless the error is ``settled``;
   a timeout is raised in torch's words. */
static void fail(ShortWay *self) {
    PyObject *error = take_error();
    PyObject *settled = PyObject_GetAttr(error, s_settled);
    int is_settled = settled == NULL ? (PyErr_Clear(), 0) : truth_of(settled);
    if (is_settled <= 0) {
        PyErr_Clear();
        if (PyObject_SetAttr(self->worker, s_failed, error) < 0)
            PyErr_Clear();
    }
    if (PyObject_IsInstance(error, self->timeout_error) == 1) {
        PyObject *worded = PyObject_CallOneArg(self->worded, error);
        if (worded != NULL) {
            Py_DECREF(error);
            error = worded;
        } else {
            PyErr_Clear();
        }
    }
    raise_again(error);
}

static PyObject *shortway_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    ShortWay *self = (ShortWay *)callable;
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != 2) {
        PyErr_SetString(PyExc_TypeError, "ShortWay takes (tensors, opts)");
        return NULL;
    }
    PyObject *tensors = args[0], *opts = args[1];
    if (self->limit <= 0 || opts == Py_None || !PyList_CheckExact(tensors) || PyList_GET_SIZE(tensors) != 1)
        return Py_NewRef(Py_False);
    PyObject *tensor = PyList_GET_ITEM(tensors, 0);
    PyObject *straight = straight_for(self, tensor, opts);
    if (straight == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    Py_INCREF(straight);
    Py_ssize_t nbytes = 0;
    int small = small_and_blocking(self, tensor, opts, &nbytes);
    if (small != 1) {
        Py_DECREF(straight);
        return small < 0 ? NULL : Py_NewRef(Py_False);
    }
    /* the worker: nothing queued, no failure, the turn free */
    Py_ssize_t queued = PyObject_Size(self->queued);
    PyObject *failed = queued == 0 ? PyObject_GetAttr(self->worker, s_failed) : NULL;
    int clear = failed == Py_None;
    Py_XDECREF(failed);
    if (!clear) {
        Py_DECREF(straight);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    }
    int taken = truth_of(PyObject_CallOneArg(self->acquire, Py_False));
    if (taken != 1) {
        Py_DECREF(straight);
        return taken < 0 ? NULL : Py_NewRef(Py_False);
    }
    PyObject *result = run_under_turn(self, tensor, straight, nbytes);
    Py_DECREF(straight);
    if (result == NULL)
        fail(self);
    PyObject *error = result == NULL ? take_error() : NULL;
    PyObject *released = PyObject_CallNoArgs(self->release);
    if (released == NULL) {             /* (a lock this thread holds releases) */
        Py_XDECREF(error);
        Py_XDECREF(result);
        return NULL;
    }
    Py_DECREF(released);
    if (error != NULL)
        raise_again(error);
    return result;
}

#define FIELDS(X) X(straight) X(worker) X(queued) X(acquire) X(release) X(comm_state) X(comm) X(others) \
    X(address) X(iallreduce) X(in_place) X(mpi_error) X(timeout_error) X(on_test_error) X(worded) X(collective)

static int shortway_init(ShortWay *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"straight", "worker", "queued", "turn", "comm_state", "comm", "others", "address",
                            "iallreduce", "in_place", "mpi_error", "timeout_error", "on_test_error", "worded",
                            "collective", NULL};
    PyObject *straight, *worker, *queued, *turn, *comm_state, *comm, *others, *address, *iallreduce, *in_place,
             *mpi_error, *timeout_error, *on_test_error, *worded, *collective;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!OOOO!OO!OOOOOOOU", names, &PyDict_Type, &straight, &worker,
                                     &queued, &turn, &PyDict_Type, &comm_state, &comm, &PyList_Type, &others,
                                     &address, &iallreduce, &in_place, &mpi_error, &timeout_error, &on_test_error,
                                     &worded, &collective))
        return -1;
    PyObject *acquire = PyObject_GetAttrString(turn, "acquire");
    PyObject *release = acquire == NULL ? NULL : PyObject_GetAttrString(turn, "release");
    if (release == NULL) {
        Py_XDECREF(acquire);
        return -1;
    }
#define KEEP(field) do { PyObject *old = self->field; Py_INCREF(field); self->field = field; Py_XDECREF(old); } while (0);
    FIELDS(KEEP)
#undef KEEP
    Py_DECREF(acquire);
    Py_DECREF(release);
    self->limit = 0;
    self->vectorcall = shortway_vectorcall;
    return 0;
}

static int shortway_traverse(ShortWay *self, visitproc visit, void *arg) {
#define VISIT(field) Py_VISIT(self->field);
    FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int shortway_clear(ShortWay *self) {
#define CLEAR(field) Py_CLEAR(self->field);
    FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void shortway_dealloc(ShortWay *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    shortway_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef shortway_members[] = {
    {"limit", T_PYSSIZET, offsetof(ShortWay, limit), 0, "bytes: calls from this size take the Python path"},
    {NULL},
};

static PyTypeObject ShortWayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpicoll.torch._shortway.ShortWay",
    .tp_doc = "ShortWay(...)(tensors, opts) -> bool: a small blocking all_reduce run straight through MPI's "
              "Iallreduce under the group worker's turn, or False where the Python path runs it.",
    .tp_basicsize = sizeof(ShortWay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)shortway_init,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ShortWay, vectorcall),
    .tp_weaklistoffset = offsetof(ShortWay, weakrefs),
    .tp_traverse = (traverseproc)shortway_traverse,
    .tp_clear = (inquiry)shortway_clear,
    .tp_dealloc = (destructor)shortway_dealloc,
    .tp_members = shortway_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shortway",
                                    "The short way of a small blocking dist.all_reduce, in C.", -1, NULL};

PyMODINIT_FUNC PyInit__shortway(void) {
#define INTERN(name, text) if ((name = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_reduceOp, "reduceOp") INTERN(s_asyncOp, "asyncOp") INTERN(s_dtype, "dtype")
    INTERN(s_is_contiguous, "is_contiguous") INTERN(s_is_cpu, "is_cpu") INTERN(s_nbytes, "nbytes")
    INTERN(s_data_ptr, "data_ptr") INTERN(s_failed, "failed") INTERN(s_context, "_context")
    INTERN(s_napping, "napping") INTERN(s_broken, "broken") INTERN(s_collective, "collective") INTERN(s_Test, "Test")
    INTERN(s_waitall, "waitall") INTERN(s_settled, "settled")
#undef INTERN
    if (PyType_Ready(&ShortWayType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ShortWayType);
    if (PyModule_AddObject(m, "ShortWay", (PyObject *)&ShortWayType) < 0) {
        Py_DECREF(&ShortWayType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
