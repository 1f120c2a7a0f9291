/* One counter that moves whenever a watched dict changes: graphify's per-call check of the
 * Python state a graph reads (module __dict__s, their parameter and hook dicts, the globals
 * of the functions a call runs, class dicts) in one integer compare.
 *
 * Python 3.12 and newer: a dict watcher (PyDict_AddWatcher, the mechanism dynamo's guards
 * use) bumps `epoch` on every insertion, deletion, replacement or clear of a watched dict,
 * and a function watcher on every assignment to any function's __code__, __defaults__ or
 * __kwdefaults__. Every Python keeps a per-dict version tag up to 3.13 (PEP 509):
 * `versions()` reads them, so older Pythons compare tags instead (and functions' attributes
 * with `same_functions`), and newer ones find which dicts moved.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static unsigned long long epoch = 0;

#if PY_VERSION_HEX >= 0x030C0000
#define HAVE_WATCHERS 1
static int watcher_id = -1;

static int function_watcher_id = -1;

static int on_dict_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *new_value)
{
    (void)dict; (void)key; (void)new_value;
    if (event != PyDict_EVENT_DEALLOCATED)
        epoch++;
    return 0;
}

static int on_function_event(PyFunction_WatchEvent event, PyFunctionObject *func, PyObject *new_value)
{
    (void)func; (void)new_value;
    if (event == PyFunction_EVENT_MODIFY_CODE || event == PyFunction_EVENT_MODIFY_DEFAULTS
        || event == PyFunction_EVENT_MODIFY_KWDEFAULTS)
        epoch++;
    return 0;
}
#else
#define HAVE_WATCHERS 0
#endif

#if PY_VERSION_HEX < 0x030E0000
#define HAVE_VERSIONS 1
#define DICT_VERSION(d) (((PyDictObject *)(d))->ma_version_tag)
#else
#define HAVE_VERSIONS 0
#endif

static PyObject *watch(PyObject *self, PyObject *dicts)
{
    PyObject *seq = PySequence_Fast(dicts, "watch() takes a sequence of dicts");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyDict_Check(items[i])) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_TypeError, "watch() takes dicts, got %.100s", Py_TYPE(items[i])->tp_name);
            return NULL;
        }
#if HAVE_WATCHERS
        if (PyDict_Watch(watcher_id, items[i]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
#endif
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *get_epoch(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(epoch);
}

#if HAVE_VERSIONS
static PyObject *versions(PyObject *self, PyObject *dicts)
{
    PyObject *seq = PySequence_Fast(dicts, "versions() takes a sequence of dicts");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyDict_Check(items[i])) {
            Py_DECREF(seq);
            Py_DECREF(out);
            PyErr_Format(PyExc_TypeError, "versions() takes dicts, got %.100s", Py_TYPE(items[i])->tp_name);
            return NULL;
        }
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)DICT_VERSION(items[i]));
        if (v == NULL) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
}

/* packed_versions(dicts): every dict's version tag, packed as native uint64s in a bytes
 * object: what same_versions compares against without unboxing an int per dict */
static PyObject *packed_versions(PyObject *self, PyObject *dicts)
{
    if (!PyTuple_Check(dicts)) {
        PyErr_SetString(PyExc_TypeError, "packed_versions() takes a tuple of dicts");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(dicts);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL)
        return NULL;
    uint64_t *tags = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_TypeError, "packed_versions() takes dicts");
            return NULL;
        }
        tags[i] = (uint64_t)DICT_VERSION(d);
    }
    return out;
}

/* same_versions(dicts, packed): whether no dict's version moved since packed_versions (one
 * pass, no allocation) */
static PyObject *same_versions(PyObject *self, PyObject *args)
{
    PyObject *dicts, *packed;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &dicts, &PyBytes_Type, &packed))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(dicts);
    if (PyBytes_GET_SIZE(packed) != n * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "same_versions() takes the dicts packed_versions() packed");
        return NULL;
    }
    const uint64_t *tags = (const uint64_t *)PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) {
            PyErr_SetString(PyExc_TypeError, "same_versions() takes dicts");
            return NULL;
        }
        if ((uint64_t)DICT_VERSION(d) != tags[i])
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}
#endif

/* same_cells(cells, values): whether every closure cell still holds the very object recorded */
static PyObject *same_cells(PyObject *self, PyObject *args)
{
    PyObject *cells, *values;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &cells, &PyTuple_Type, &values))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(cells);
    if (PyTuple_GET_SIZE(values) != n) {
        PyErr_SetString(PyExc_ValueError, "same_cells() takes tuples of one length");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cell = PyTuple_GET_ITEM(cells, i);
        if (!PyCell_Check(cell)) {
            PyErr_SetString(PyExc_TypeError, "same_cells() takes cells");
            return NULL;
        }
        if (PyCell_GET(cell) != PyTuple_GET_ITEM(values, i))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* same_lists(lists, contents): whether every list holds exactly the recorded items (a tuple
 * each), by identity and length */
static PyObject *same_lists(PyObject *self, PyObject *args)
{
    PyObject *lists, *contents;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &lists, &PyTuple_Type, &contents))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(lists);
    if (PyTuple_GET_SIZE(contents) != n) {
        PyErr_SetString(PyExc_ValueError, "same_lists() takes tuples of one length");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *list = PyTuple_GET_ITEM(lists, i), *want = PyTuple_GET_ITEM(contents, i);
        if (!PyList_Check(list) || !PyTuple_Check(want)) {
            PyErr_SetString(PyExc_TypeError, "same_lists() takes lists and tuples");
            return NULL;
        }
        Py_ssize_t m = PyList_GET_SIZE(list);
        if (m != PyTuple_GET_SIZE(want))
            Py_RETURN_FALSE;
        for (Py_ssize_t j = 0; j < m; j++)
            if (PyList_GET_ITEM(list, j) != PyTuple_GET_ITEM(want, j))
                Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* same_functions(funcs, states): whether every function keeps its recorded
 * (__code__, __defaults__, __kwdefaults__), by identity */
static PyObject *same_functions(PyObject *self, PyObject *args)
{
    PyObject *funcs, *states;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &funcs, &PyTuple_Type, &states))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(funcs);
    if (PyTuple_GET_SIZE(states) != n) {
        PyErr_SetString(PyExc_ValueError, "same_functions() takes tuples of one length");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(funcs, i), *want = PyTuple_GET_ITEM(states, i);
        if (!PyFunction_Check(f) || !PyTuple_Check(want) || PyTuple_GET_SIZE(want) != 3) {
            PyErr_SetString(PyExc_TypeError, "same_functions() takes functions and (code, defaults, kwdefaults)");
            return NULL;
        }
        PyObject *defaults = PyFunction_GET_DEFAULTS(f), *kwdefaults = PyFunction_GET_KW_DEFAULTS(f);
        if (PyFunction_GET_CODE(f) != PyTuple_GET_ITEM(want, 0)
            || (defaults ? defaults : Py_None) != PyTuple_GET_ITEM(want, 1)
            || (kwdefaults ? kwdefaults : Py_None) != PyTuple_GET_ITEM(want, 2))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"watch", watch, METH_O, "watch(dicts): every later change to these dicts moves epoch() (Python 3.12+)."},
    {"epoch", get_epoch, METH_NOARGS, "epoch(): how many changes watched dicts have seen."},
#if HAVE_VERSIONS
    {"versions", versions, METH_O, "versions(dicts): each dict's version tag (moves on every change)."},
    {"packed_versions", packed_versions, METH_O, "packed_versions(dicts): the tags, packed for same_versions."},
    {"same_versions", same_versions, METH_VARARGS, "same_versions(dicts, packed): no dict's tag moved."},
#endif
    {"same_cells", same_cells, METH_VARARGS, "same_cells(cells, values): each cell holds its value, by identity."},
    {"same_lists", same_lists, METH_VARARGS, "same_lists(lists, contents): each list holds its tuple's items."},
    {"same_functions", same_functions, METH_VARARGS,
     "same_functions(funcs, states): each function keeps its (__code__, __defaults__, __kwdefaults__)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dictwatch", "Dict watchers and version tags for graphify's per-call check.", -1, methods,
};

PyMODINIT_FUNC PyInit__dictwatch(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#if HAVE_WATCHERS
    if (watcher_id < 0) {
        watcher_id = PyDict_AddWatcher(on_dict_event);
        if (watcher_id < 0) {
            Py_DECREF(m);
            return NULL;
        }
        function_watcher_id = PyFunction_AddWatcher(on_function_event);
        if (function_watcher_id < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
#endif
    if (PyModule_AddIntConstant(m, "HAVE_WATCHERS", HAVE_WATCHERS) < 0
        || PyModule_AddIntConstant(m, "HAVE_VERSIONS", HAVE_VERSIONS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
