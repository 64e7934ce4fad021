// ep_dispatch's torch extension: the Buffer's dispatch and combine calls in C++, as DeepEP makes
// them. Each function takes the caller's tensors (Python objects), allocates the call's outputs
// with torch's allocator (at::empty / at::empty_strided on the Buffer's device), describes every
// tensor in an EpTensorDesc (address, dtype, shape, strides, device, element size) and calls the
// native rank through the C ABI of ep_dispatch._ep_dispatch (python/src/py/c_abi.rs), whose
// table of function pointers `bind` takes once from the capsule `_ep_dispatch._c_api`: the two
// libraries never link against each other. The native entry checks every tensor (the checks of
// the native methods) and enqueues; an error it finds is already the Python exception
// (ep_dispatch.errors), so a failed entry returns NULL to Python.
//
// A send half returns its receive hook, a RecvHook made here: calling it enqueues the receive
// half through the C ABI's `recv` entry on the then-current stream, once (a later call does
// nothing, whatever the first did), with no Python frame on the way.
//
// The stream is torch's current stream of the Buffer's device, fetched here at each call through
// the function `bind` was given (torch._C._cuda_getCurrentRawStream: what
// at::cuda::getCurrentCUDAStream(device).stream() returns, called from C, so no Python frame and
// no torch mode sees it); the host (device -1, the CPU tests) has stream 0.
//
// Built by torch.utils.cpp_extension.load at the Buffer's first use (ep_dispatch/_torch_ext.py)
// with only the headers torch ships; no CUDA headers or libraries, so it builds and loads with
// any torch build.

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <cstdint>

namespace {

// The C ABI (python/src/py/c_abi.rs): keep both sides in step (ABI_VERSION).
constexpr uint32_t kAbiVersion = 2;
constexpr const char* kCapsuleName = "ep_dispatch._ep_dispatch._c_api";
constexpr uint32_t kAbsent = 0, kTensor = 1, kNotATensor = 2;

struct EpTensorDesc {
  PyObject* obj;  // borrowed for the call
  uint32_t kind;
  int32_t dtype;  // bf16, fp8 e4m3, f32, i32, i64 = 0..4; -1: none of ours
  uint32_t ndim;
  uint32_t element_size;
  uint64_t ptr;
  int64_t device;  // CUDA ordinal, -1 on the host
  const int64_t* shape;
  const int64_t* strides;
};

struct EpDispatchOut {
  uint64_t id;
  uint64_t num_tokens;
};

using DispatchFn = int (*)(PyObject*, uint64_t, uint32_t, const EpTensorDesc*, size_t,
                           EpDispatchOut*);
using CombineFn = int (*)(PyObject*, uint64_t, uint64_t, uint32_t, const EpTensorDesc*, size_t,
                          PyObject*, uint64_t*);
using RecvFn = int (*)(PyObject*, uint64_t, uint32_t, uint64_t, uint32_t*);
using EchoFn = int (*)(const EpTensorDesc*, size_t, PyObject**);

struct EpApi {
  uint32_t abi_version;
  uint32_t descriptor_size;
  DispatchFn dispatch;
  CombineFn combine;
  RecvFn recv;
  EchoFn echo;  // null without the native module's `testing` feature
};

// RecvFn's op.
constexpr uint32_t kOpDispatch = 0, kOpCombine = 1;

const EpApi* g_api = nullptr;
PyObject* g_capsule = nullptr;    // keeps the native module's table alive
PyObject* g_stream_fn = nullptr;  // device index -> raw current stream (int); None: no CUDA

// A strong reference, released at scope exit unless taken.
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref& operator=(Ref&& o) noexcept {
    if (this != &o) {
      Py_XDECREF(p);
      p = o.p;
      o.p = nullptr;
    }
    return *this;
  }
  ~Ref() { Py_XDECREF(p); }
  PyObject* take() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
};

int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return 0;
    case at::kFloat8_e4m3fn: return 1;
    case at::kFloat: return 2;
    case at::kInt: return 3;
    case at::kLong: return 4;
    default: return -1;
  }
}

// What `t` (the tensor of Python object `obj`) says about itself. A tensor whose metadata
// cannot be read (no storage, no strides) is described as no tensor, as the native methods'
// attribute reads name it.
void describe_tensor(EpTensorDesc& d, PyObject* obj, const at::Tensor& t) {
  d = EpTensorDesc{};
  d.obj = obj;
  try {
    d.dtype = dtype_code(t.scalar_type());
    d.ndim = static_cast<uint32_t>(t.dim());
    d.element_size = static_cast<uint32_t>(t.element_size());
    d.shape = t.sizes().data();
    d.strides = t.strides().data();
    d.device = t.get_device();
    d.ptr = reinterpret_cast<uint64_t>(t.data_ptr());
    d.kind = kTensor;
  } catch (const c10::Error&) {
    d = EpTensorDesc{};
    d.obj = obj;
    d.kind = kNotATensor;
  }
}

// A caller's argument: None (absent), a tensor, or something else.
void describe(EpTensorDesc& d, PyObject* obj) {
  if (obj == Py_None) {
    d = EpTensorDesc{};
    d.obj = obj;
    d.kind = kAbsent;
  } else if (THPVariable_Check(obj)) {
    describe_tensor(d, obj, THPVariable_Unpack(obj));
  } else {
    d = EpTensorDesc{};
    d.obj = obj;
    d.kind = kNotATensor;
  }
}

bool bound() {
  if (g_api == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "ep_dispatch torch extension: bind(_ep_dispatch._c_api) was not called");
    return false;
  }
  return true;
}

bool nargs_are(const char* fn, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", fn, want,
                 nargs);
    return false;
  }
  return true;
}

bool u64_of(PyObject* o, uint64_t* v) {
  *v = PyLong_AsUnsignedLongLong(o);
  return !(*v == static_cast<uint64_t>(-1) && PyErr_Occurred());
}

bool i64_of(PyObject* o, int64_t* v) {
  *v = PyLong_AsLongLong(o);
  return !(*v == -1 && PyErr_Occurred());
}

// A size the Buffer passes: in [1, 2^31) (each fits the kernels' `int`).
bool size_arg(PyObject* o, const char* what, int64_t* v) {
  if (!i64_of(o, v)) return false;
  if (*v < 1 || *v > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "%s = %lld is outside [1, 2^31)", what,
                 static_cast<long long>(*v));
    return false;
  }
  return true;
}

// The Buffer's device: a CUDA ordinal, or -1 for the host (the CPU stand-in tests); `*index` its
// number.
bool device_of(PyObject* o, at::Device* dev, int64_t* index) {
  int64_t d;
  if (!i64_of(o, &d)) return false;
  if (d < -1 || d > 127) {
    PyErr_Format(PyExc_ValueError, "device %lld is neither -1 nor a CUDA ordinal",
                 static_cast<long long>(d));
    return false;
  }
  *dev = d < 0 ? at::Device(at::kCPU)
               : at::Device(at::kCUDA, static_cast<at::DeviceIndex>(d));
  *index = d;
  return true;
}

// torch's current stream of CUDA device `device` as a raw handle, from the function `bind` was
// given (`device_obj`: the same index as a Python int); 0 for the host (device -1).
bool current_stream(int64_t device, PyObject* device_obj, uint64_t* stream) {
  if (device < 0) {
    *stream = 0;
    return true;
  }
  if (g_stream_fn == nullptr || g_stream_fn == Py_None) {
    PyErr_SetString(PyExc_RuntimeError,
                    "ep_dispatch torch extension: this torch has no CUDA current stream");
    return false;
  }
  Ref s(PyObject_CallOneArg(g_stream_fn, device_obj));
  return s.p != nullptr && u64_of(s.p, stream);
}

// ---- RecvHook: a send half's receive hook ----------------------------------------------------

struct RecvHook {
  PyObject_HEAD
  PyObject* rank;  // strong; null once called (the hook then does nothing)
  int64_t device;  // the Buffer's device (-1: the host)
  uint64_t id;     // the send half's id
  uint32_t op;     // kOpDispatch or kOpCombine
};

PyTypeObject kRecvHookType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// What a call returns as its hook: for a send half (`send`) a new hook of send half `id` of `op`
// on `rank`, else None; a new reference, or null with the exception set.
PyObject* hook_of(bool send, PyObject* rank, int64_t device, uint64_t id, uint32_t op) {
  if (!send) Py_RETURN_NONE;
  RecvHook* h = PyObject_New(RecvHook, &kRecvHookType);
  if (h == nullptr) return nullptr;
  Py_INCREF(rank);
  h->rank = rank;
  h->device = device;
  h->id = id;
  h->op = op;
  return reinterpret_cast<PyObject*>(h);
}

void hook_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<RecvHook*>(self)->rank);
  Py_TYPE(self)->tp_free(self);
}

// hook(): enqueues the receive half on the then-current stream, the first time; None. The hook
// forgets its rank before the call (the reference goes at return), so a second call, or one
// after a first that raised, does nothing.
PyObject* hook_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "a receive hook takes no arguments");
    return nullptr;
  }
  auto* h = reinterpret_cast<RecvHook*>(self);
  if (h->rank == nullptr) Py_RETURN_NONE;
  Ref rank(h->rank);  // the hook's reference, released at return
  h->rank = nullptr;
  uint64_t stream = 0;
  if (h->device >= 0) {
    Ref dev(PyLong_FromLongLong(h->device));
    if (!dev.p || !current_stream(h->device, dev.p, &stream)) return nullptr;
  }
  uint32_t enqueued = 0;
  if (g_api->recv(rank.p, stream, h->op, h->id, &enqueued) != 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* hook_repr(PyObject* self) {
  auto* h = reinterpret_cast<RecvHook*>(self);
  return PyUnicode_FromFormat("<ep_dispatch receive hook of %s %llu, %s>",
                              h->op == kOpCombine ? "combine" : "dispatch",
                              static_cast<unsigned long long>(h->id),
                              h->rank != nullptr ? "due" : "called");
}

PyObject* ep_bind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_are("bind", nargs, 2)) return nullptr;
  if (args[1] != Py_None && !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "bind: the stream function is neither callable nor None");
    return nullptr;
  }
  void* p = PyCapsule_GetPointer(args[0], kCapsuleName);
  if (p == nullptr) return nullptr;
  auto* api = static_cast<const EpApi*>(p);
  if (api->abi_version != kAbiVersion || api->descriptor_size != sizeof(EpTensorDesc)) {
    PyErr_Format(PyExc_RuntimeError,
                 "ep_dispatch torch extension: the native module's C ABI is version %u with "
                 "%u-byte descriptors, this extension's version %u with %zu-byte ones",
                 api->abi_version, api->descriptor_size, kAbiVersion, sizeof(EpTensorDesc));
    return nullptr;
  }
  Py_INCREF(args[0]);
  Py_XDECREF(g_capsule);
  g_capsule = args[0];
  Py_INCREF(args[1]);
  Py_XDECREF(g_stream_fn);
  g_stream_fn = args[1];
  g_api = api;
  Py_RETURN_NONE;
}

// dispatch(rank, device, x, topk_idx, cumulative_stats, wait_stats, L, R, T, H, mode,
//          send_only) -> (recv_x or (recv_x, scales), recv_count, src_info, pairs, id, n, hook)
// on torch's current stream of `device`. mode: 0 BF16, 1 FP8 with float32 scales, 2 FP8 with
// packed UE8M0 scales. hook: the send half's RecvHook, None for a whole dispatch.
PyObject* ep_dispatch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!nargs_are("dispatch", nargs, 12) || !bound()) return nullptr;
  uint64_t stream;
  at::Device dev(at::kCPU);
  int64_t device, L, R, T, H, mode;
  if (!device_of(args[1], &dev, &device) || !size_arg(args[6], "L", &L) ||
      !size_arg(args[7], "R", &R) || !size_arg(args[8], "T", &T) ||
      !size_arg(args[9], "H", &H) || !i64_of(args[10], &mode))
    return nullptr;
  if (mode < 0 || mode > 2) {
    PyErr_Format(PyExc_ValueError, "mode %lld is not 0, 1 or 2", static_cast<long long>(mode));
    return nullptr;
  }
  const int send_only = PyObject_IsTrue(args[11]);
  if (send_only < 0 || !current_stream(device, args[1], &stream)) return nullptr;
  const int64_t RT = R * T;  // both < 2^31: no overflow
  const bool fp8 = mode != 0, ue8m0 = mode == 2;
  const auto opts = at::TensorOptions().device(dev);

  Ref recv_x(THPVariable_Wrap(
      at::empty({L, RT, H}, opts.dtype(fp8 ? at::kFloat8_e4m3fn : at::kBFloat16))));
  Ref scales;
  if (fp8) {
    // DeepEP's layout: column-major in the last two dimensions, strides (RT*G, 1, RT).
    const int64_t G = ue8m0 ? H / 512 : H / 128;
    scales = Ref(THPVariable_Wrap(at::empty_strided(
        {L, RT, G}, {RT * G, 1, RT}, opts.dtype(ue8m0 ? at::kInt : at::kFloat))));
  }
  Ref count(THPVariable_Wrap(at::empty({L}, opts.dtype(at::kInt))));
  Ref src_info(THPVariable_Wrap(at::empty({L, RT}, opts.dtype(at::kInt))));
  Ref pairs(THPVariable_Wrap(at::empty({L, R, 2}, opts.dtype(at::kInt))));
  if (!recv_x.p || (fp8 && !scales.p) || !count.p || !src_info.p || !pairs.p) return nullptr;

  EpTensorDesc d[9];
  describe(d[0], args[2]);  // x
  describe(d[1], args[3]);  // topk_idx
  describe_tensor(d[2], recv_x.p, THPVariable_Unpack(recv_x.p));
  if (fp8) {
    describe_tensor(d[3], scales.p, THPVariable_Unpack(scales.p));
  } else {
    describe(d[3], Py_None);
  }
  describe_tensor(d[4], count.p, THPVariable_Unpack(count.p));
  describe_tensor(d[5], src_info.p, THPVariable_Unpack(src_info.p));
  describe_tensor(d[6], pairs.p, THPVariable_Unpack(pairs.p));
  describe(d[7], args[4]);  // cumulative_local_expert_recv_stats
  describe(d[8], args[5]);  // dispatch_wait_recv_cost_stats

  EpDispatchOut res{};
  if (g_api->dispatch(args[0], stream, send_only ? 1u : 0u, d, 9, &res) != 0) return nullptr;

  Ref id(PyLong_FromUnsignedLongLong(res.id));
  Ref n(PyLong_FromUnsignedLongLong(res.num_tokens));
  if (!id.p || !n.p) return nullptr;
  Ref hook(hook_of(send_only != 0, args[0], device, res.id, kOpDispatch));
  if (!hook.p) return nullptr;
  Ref out;
  if (fp8) {
    out = Ref(PyTuple_New(2));
    if (!out.p) return nullptr;
    PyTuple_SET_ITEM(out.p, 0, recv_x.take());
    PyTuple_SET_ITEM(out.p, 1, scales.take());
  } else {
    out = Ref(recv_x.take());
  }
  PyObject* t = PyTuple_New(7);
  if (!t) return nullptr;
  PyTuple_SET_ITEM(t, 0, out.take());
  PyTuple_SET_ITEM(t, 1, count.take());
  PyTuple_SET_ITEM(t, 2, src_info.take());
  PyTuple_SET_ITEM(t, 3, pairs.take());
  PyTuple_SET_ITEM(t, 4, id.take());
  PyTuple_SET_ITEM(t, 5, n.take());
  PyTuple_SET_ITEM(t, 6, hook.take());
  return t;
  END_HANDLE_TH_ERRORS
}

// combine(rank, device, handle, x, topk_idx, topk_weights, out, wait_stats, n, H, flags, keep)
// -> (out, hook) on torch's current stream of `device`; `out` None: a new bfloat16 [n, H].
// flags: bit 0 the send half only, bit 1 LogFMT. `keep` (None or an object): held with a send
// half's tensors. hook: the send half's RecvHook, None for a whole combine.
PyObject* ep_combine(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!nargs_are("combine", nargs, 12) || !bound()) return nullptr;
  uint64_t stream, handle, flags;
  at::Device dev(at::kCPU);
  int64_t device, n, H;
  if (!device_of(args[1], &dev, &device) || !u64_of(args[2], &handle) ||
      !i64_of(args[8], &n) || !size_arg(args[9], "H", &H) || !u64_of(args[10], &flags))
    return nullptr;
  if (n < 0 || n > INT32_MAX || flags > UINT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "combine: n or flags out of range");
    return nullptr;
  }
  if (!current_stream(device, args[1], &stream)) return nullptr;
  Ref out;
  if (args[6] == Py_None) {
    out = Ref(THPVariable_Wrap(
        at::empty({n, H}, at::TensorOptions().device(dev).dtype(at::kBFloat16))));
    if (!out.p) return nullptr;
  } else {
    Py_INCREF(args[6]);
    out = Ref(args[6]);
  }
  EpTensorDesc d[5];
  describe(d[0], args[3]);  // x (the expert outputs)
  describe(d[1], args[4]);  // topk_idx
  describe(d[2], args[5]);  // topk_weights
  describe(d[3], out.p);
  describe(d[4], args[7]);  // combine_wait_recv_cost_stats
  PyObject* keep = args[11] == Py_None ? nullptr : args[11];
  uint64_t id = 0;
  if (g_api->combine(args[0], stream, handle, static_cast<uint32_t>(flags), d, 5, keep, &id) != 0)
    return nullptr;
  Ref hook(hook_of((flags & 1u) != 0, args[0], device, id, kOpCombine));
  if (!hook.p) return nullptr;
  PyObject* t = PyTuple_New(2);
  if (!t) return nullptr;
  PyTuple_SET_ITEM(t, 0, out.take());
  PyTuple_SET_ITEM(t, 1, hook.take());
  return t;
  END_HANDLE_TH_ERRORS
}

// _echo(*objects) -> what the native side parsed of their descriptors (feature `testing`).
PyObject* ep_echo(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!bound()) return nullptr;
  if (g_api->echo == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "_echo: the native module was built without its `testing` feature");
    return nullptr;
  }
  if (nargs > 64) {
    PyErr_SetString(PyExc_TypeError, "_echo() takes at most 64 arguments");
    return nullptr;
  }
  EpTensorDesc d[64];
  for (Py_ssize_t i = 0; i < nargs; i++) describe(d[i], args[i]);
  PyObject* out = nullptr;
  if (g_api->echo(d, static_cast<size_t>(nargs), &out) != 0) return nullptr;
  return out;
  END_HANDLE_TH_ERRORS
}

PyObject* ep_descriptor_size(PyObject*, PyObject*) {
  return PyLong_FromSize_t(sizeof(EpTensorDesc));
}

PyMethodDef kMethods[] = {
    {"bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ep_bind)),
     METH_FASTCALL,
     "bind(capsule, stream_fn): the native module's C ABI table, and the function giving the "
     "raw current stream of a CUDA device (None: no CUDA) (once)."},
    {"dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ep_dispatch)),
     METH_FASTCALL, "A dispatch or its send half: allocates the outputs, calls the native rank."},
    {"combine", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ep_combine)),
     METH_FASTCALL, "A combine or its send half: allocates out where None, calls the native rank."},
    {"_echo", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ep_echo)),
     METH_FASTCALL, "Test hook: what the native side parses of these objects' descriptors."},
    {"_descriptor_size", ep_descriptor_size, METH_NOARGS, "sizeof(EpTensorDesc)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

#define EP_CONCAT2(a, b) a##b
#define EP_CONCAT(a, b) EP_CONCAT2(a, b)
#define EP_STR2(a) #a
#define EP_STR(a) EP_STR2(a)

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT,
                              EP_STR(TORCH_EXTENSION_NAME),
                              "ep_dispatch's dispatch and combine calls in C++ (torch_ext.cpp)",
                              -1,
                              kMethods,
                              nullptr,
                              nullptr,
                              nullptr,
                              nullptr};

PyMODINIT_FUNC EP_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  kRecvHookType.tp_name = EP_STR(TORCH_EXTENSION_NAME) ".RecvHook";
  kRecvHookType.tp_basicsize = sizeof(RecvHook);
  // Not tracked by the collector: a hook holds only its rank, which holds no hook.
  kRecvHookType.tp_flags = Py_TPFLAGS_DEFAULT;
  kRecvHookType.tp_doc =
      "A send half's receive hook: hook() enqueues the receive half on the then-current stream, "
      "once; later calls do nothing.";
  kRecvHookType.tp_dealloc = hook_dealloc;
  kRecvHookType.tp_call = hook_call;
  kRecvHookType.tp_repr = hook_repr;
  if (PyType_Ready(&kRecvHookType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  Py_INCREF(&kRecvHookType);
  if (PyModule_AddObject(m, "RecvHook", reinterpret_cast<PyObject*>(&kRecvHookType)) < 0) {
    Py_DECREF(&kRecvHookType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
