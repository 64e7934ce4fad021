"""The native module's C ABI (what the C++ torch extension calls), called here through ctypes
with hand-made descriptors and a native `_StandInRank`: its table, a good call, and every way
a descriptor can be bad, each refused with a typed error. Needs neither torch nor a GPU."""

import ctypes
import sys
from ctypes import (POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint32,
                    c_uint64, c_void_p, py_object)

import pytest

import ep_dispatch as ep
from ep_dispatch import _ep_dispatch as native

if not hasattr(native, "_StandInRank"):
    pytest.skip("the native module was built without its `testing` feature",
                allow_module_level=True)


class Desc(Structure):
    _fields_ = [("obj", c_void_p), ("kind", c_uint32), ("dtype", c_int32), ("ndim", c_uint32),
                ("element_size", c_uint32), ("ptr", c_uint64), ("device", c_int64),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64))]


class Out(Structure):
    _fields_ = [("id", c_uint64), ("num_tokens", c_uint64)]


class Api(Structure):
    _fields_ = [("abi_version", c_uint32), ("descriptor_size", c_uint32),
                ("dispatch", c_void_p), ("combine", c_void_p), ("recv", c_void_p),
                ("echo", c_void_p)]


# PYFUNCTYPE: called with the GIL held (as the extension calls them), an exception the entry
# set is raised.
DISPATCH = ctypes.PYFUNCTYPE(c_int, c_void_p, c_uint64, c_uint32, POINTER(Desc), c_size_t,
                             POINTER(Out))
COMBINE = ctypes.PYFUNCTYPE(c_int, c_void_p, c_uint64, c_uint64, c_uint32, POINTER(Desc),
                            c_size_t, c_void_p, POINTER(c_uint64))
RECV = ctypes.PYFUNCTYPE(c_int, c_void_p, c_uint64, c_uint32, c_uint64, POINTER(c_uint32))
ECHO = ctypes.PYFUNCTYPE(c_int, POINTER(Desc), c_size_t, POINTER(c_void_p))


def api():
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = c_void_p, [py_object, c_char_p]
    return Api.from_address(get(native._c_api, b"ep_dispatch._ep_dispatch._c_api"))


BF16, FP8, F32, I32, I64 = range(5)
SIZE = [2, 1, 4, 4, 8]

# R = 2, E = 8 (L = 4), T = 6, H = 512, K = 3; R*T = 12.
R, E, T, H, K = 2, 8, 6, 512, 3
L, RT = E // R, R * T


class Obj:
    """The Python object a descriptor names (what a send half holds)."""


class Tensor:
    """A tensor as the extension describes one."""

    next_ptr = 0x10000

    def __init__(self, code, shape, strides=None, device=0):
        self.code, self.shape, self.device = code, list(shape), device
        if strides is None:
            strides, acc = [], 1
            for d in reversed(shape):
                strides.insert(0, acc)
                acc *= d
        self.strides = list(strides)
        self.ptr, Tensor.next_ptr = Tensor.next_ptr, Tensor.next_ptr + 0x10000
        self.obj = Obj()
        n = max(len(shape), 1)
        self._shape = (c_int64 * n)(*self.shape)
        self._strides = (c_int64 * n)(*self.strides)

    def desc(self):
        return Desc(id(self.obj), 1, self.code, len(self.shape), SIZE[self.code], self.ptr,
                    self.device, self._shape, self._strides)


def descs(tensors):
    """The descriptors of `tensors`, which they point into (kept alive with the array)."""
    arr = (Desc * len(tensors))()
    for i, t in enumerate(tensors):
        arr[i] = Desc(None, 0, 0, 0, 0, 0, 0, None, None) if t is None else t.desc()
    arr.keep = list(tensors)
    return arr


def dispatch_tensors(n=5):
    G = H // 128
    return [Tensor(BF16, (n, H)), Tensor(I64, (n, K)), Tensor(FP8, (L, RT, H)),
            Tensor(F32, (L, RT, G), (RT * G, 1, RT)), Tensor(I32, (L,)), Tensor(I32, (L, RT)),
            Tensor(I32, (L, R, 2)), None, None]


def spec():
    return native.CallSpec(R, E, T, H, K, True, False, False, 0, tuple(object() for _ in range(5)))


def call_dispatch(rank, arr, send_only=0, count=None):
    out = Out()
    DISPATCH(api().dispatch)(id(rank), 0, send_only, arr, len(arr) if count is None else count,
                             ctypes.byref(out))
    return out


class Recorder:
    """A target that takes the checked calls."""

    def __init__(self):
        self.calls = []

    def dispatch_checked(self, stream, send_only, addrs):
        self.calls.append(("dispatch", stream, send_only, addrs))
        return 40 + len(self.calls)

    def dispatched_tokens(self, handle):
        return 5

    def combine_checked(self, stream, handle, send_only, addrs, use_logfmt):
        self.calls.append(("combine", stream, handle, send_only, addrs, use_logfmt))
        return 90 + len(self.calls)


def test_the_capsule_holds_the_abi_table():
    a = api()
    assert a.abi_version == 2
    assert a.descriptor_size == ctypes.sizeof(Desc) == 56
    assert a.dispatch and a.combine and a.recv and a.echo  # echo: the `testing` build


def test_a_good_dispatch_and_combine_through_the_c_abi():
    """The entry's checked addresses are what CallSpec.check_dispatch gives the same tensors;
    ids and the token count come back."""
    target = Recorder()
    rank = native._StandInRank(spec(), target)
    ts = dispatch_tensors()
    out = call_dispatch(rank, descs(ts))
    assert (out.id, out.num_tokens) == (41, 5)
    _, stream, send_only, addrs = target.calls[0]
    x, topk, rx, sc, count, src, lr = ts[:7]
    assert (stream, send_only) == (0, False)
    assert addrs == (5, (x.ptr, 5 * H), (topk.ptr, 5 * K), (rx.ptr, L * RT * H),
                     (sc.ptr, L * RT * (H // 128) * 4), (count.ptr, L), (src.ptr, L * RT),
                     (lr.ptr, L * R), None, None)
    y, tk, w, o = (Tensor(BF16, (L, RT, H)), Tensor(I64, (5, K)), Tensor(F32, (5, K)),
                   Tensor(BF16, (5, H)))
    cid = c_uint64()
    COMBINE(api().combine)(id(rank), 7, 41, 3, descs([y, tk, w, o, None]), 5, None,
                           ctypes.byref(cid))
    assert cid.value == 92
    assert target.calls[1] == ("combine", 7, 41, True,
                               ((y.ptr, L * RT * H), (tk.ptr, 15), (w.ptr, 15), (o.ptr, 5 * H),
                                None), True)


def test_a_send_half_holds_its_tensors_until_the_next_call():
    rank = native._StandInRank(spec(), object())  # counts ids itself
    ts = dispatch_tensors()
    before = sys.getrefcount(ts[0].obj)
    call_dispatch(rank, descs(ts), send_only=1)
    held = sys.getrefcount(ts[0].obj)  # (read outside the asserts, which keep references)
    assert rank.held_counts() == (7, 0)
    assert held == before + 1
    call_dispatch(rank, descs(ts))
    after = sys.getrefcount(ts[0].obj)
    assert rank.held_counts() == (0, 0)
    assert after == before


def recv(rank, op, hid, stream=0):
    """The C ABI's receive half of send half `hid` (`op` 0 dispatch, 1 combine): 1 where it was
    enqueued, 0 where a later call had."""
    done = c_uint32(7)
    RECV(api().recv)(id(rank), stream, op, hid, ctypes.byref(done))
    return done.value


def combine_tensors(n=5):
    return [Tensor(BF16, (L, RT, H)), Tensor(I64, (n, K)), Tensor(F32, (n, K)),
            Tensor(BF16, (n, H)), None]


def test_a_receive_half_goes_out_once_and_frees_its_send_halfs_tensors():
    """`recv` of the pending send half enqueues it (1) and lets its tensors go; again, or after
    a later call enqueued it, it does nothing (0); an id never given, a bad op, a null result
    slot or a foreign rank are typed errors, as the GPU rank's `dispatch_recv` raises them."""
    rank = native._StandInRank(spec(), object())  # counts ids itself
    ts = dispatch_tensors()
    before = sys.getrefcount(ts[0].obj)
    hid = call_dispatch(rank, descs(ts), send_only=1).id
    assert rank.held_counts() == (7, 0)
    assert recv(rank, 0, hid) == 1
    after = sys.getrefcount(ts[0].obj)
    assert rank.held_counts() == (0, 0) and rank.recv_counts() == (1, 0)
    assert after == before
    assert recv(rank, 0, hid) == 0  # done already: nothing more
    # A send half whose hook was not called: the next call enqueued its receive half first.
    lost = call_dispatch(rank, descs(ts), send_only=1).id
    call_dispatch(rank, descs(ts))
    assert recv(rank, 0, lost) == 0 and rank.recv_counts() == (1, 0)
    # Combine's receive halves are counted apart from dispatch's.
    cid = c_uint64()
    COMBINE(api().combine)(id(rank), 0, lost, 1, descs(combine_tensors()), 5, None,
                           ctypes.byref(cid))
    assert rank.held_counts() == (0, 4)
    assert recv(rank, 0, cid.value) == 0  # a dispatch id that was completed long ago
    assert recv(rank, 1, cid.value) == 1
    assert rank.held_counts() == (0, 0) and rank.recv_counts() == (1, 1)
    with pytest.raises(ep.ArgumentError) as e:
        recv(rank, 1, 99)
    assert (e.value.argument, str(e.value)) == (
        "hook", "argument `hook`: combine 99 was never sent by this rank")
    with pytest.raises(ep.ArgumentError) as e:
        recv(rank, 2, 1)
    assert e.value.argument == "op"
    with pytest.raises(ep.ArgumentError) as e:
        RECV(api().recv)(id(rank), 0, 0, 1, None)
    assert e.value.argument == "enqueued"
    with pytest.raises(ep.ArgumentError) as e:
        recv(object(), 0, 1)
    assert e.value.argument == "rank"


def test_a_receive_half_asks_a_forwarding_target_and_raises_what_it_raises():
    """A target that takes the checked calls is asked for the receive half (its ids), and its
    error (the typed error a failed group raises) comes back as that exception."""
    class Failing(Recorder):
        def dispatch_recv(self, stream, hid):
            self.calls.append(("dispatch_recv", stream, hid))
            raise ep.TimeoutError("the group failed")

        def combine_recv(self, stream, cid):
            self.calls.append(("combine_recv", stream, cid))
            return False

    target = Failing()
    rank = native._StandInRank(spec(), target)
    hid = call_dispatch(rank, descs(dispatch_tensors()), send_only=1).id
    with pytest.raises(ep.TimeoutError, match="the group failed"):
        recv(rank, 0, hid, stream=9)
    assert target.calls[-1] == ("dispatch_recv", 9, hid)
    assert rank.held_counts() == (0, 0)  # taken before the receive half, as a GPU rank does
    assert recv(rank, 1, 5) == 0 and target.calls[-1] == ("combine_recv", 0, 5)


def bad(mutate, argument, fragment, send_only=0):
    ts = dispatch_tensors()
    arr = descs(ts)
    rank = native._StandInRank(spec(), object())
    args = dict(rank=id(rank), arr=arr, count=len(arr), out=Out(), send_only=send_only)
    mutate(args)
    out = args["out"]
    with pytest.raises(ep.ArgumentError) as e:
        DISPATCH(api().dispatch)(args["rank"], 0, args["send_only"], args["arr"], args["count"],
                                 None if out is None else ctypes.byref(out))
    assert e.value.argument == argument, e.value
    assert fragment in str(e.value), e.value
    return e.value


def set_field(i, **fields):
    def mutate(args):
        for k, v in fields.items():
            setattr(args["arr"][i], k, v)
    return mutate


@pytest.mark.parametrize("mutate,argument,fragment", [
    (lambda a: a.update(arr=None), "tensors", "null"),
    (lambda a: a.update(count=8), "tensors", "8 descriptors, expected 9"),
    (lambda a: a.update(out=None), "out", "null"),
    (lambda a: a.update(send_only=2), "send_only", "2, expected 0 or 1"),
    (lambda a: a.update(rank=None), "rank", "null"),
    (lambda a: a.update(rank=id(object())), "rank", "expected a native GpuRank"),
    (set_field(0, kind=7), "x", "descriptor kind 7"),
    (set_field(1, dtype=9), "topk_idx", "dtype code 9"),
    (set_field(1, dtype=-2), "topk_idx", "dtype code -2"),
    (set_field(2, element_size=2), "recv_x", "element size 2 for torch.float8_e4m3fn"),
    (set_field(4, ndim=65), "recv_count", "65 dimensions"),
    (set_field(5, shape=None), "src_info", "shape pointer is null"),
    (set_field(6, strides=None), "layout_range", "strides pointer is null"),
    (set_field(0, obj=None), "x", "no object"),
], ids=["null-array", "count", "null-out", "send-only", "null-rank", "not-a-rank", "kind",
        "dtype-code", "dtype-negative", "element-size", "ndim", "null-shape", "null-strides",
        "null-object"])
def test_bad_descriptors_are_refused_with_typed_errors(mutate, argument, fragment):
    bad(mutate, argument, fragment)


def test_a_bad_combine_flag_is_refused():
    rank = native._StandInRank(spec(), Recorder())
    ts = [Tensor(BF16, (L, RT, H)), Tensor(I64, (5, K)), Tensor(F32, (5, K)),
          Tensor(BF16, (5, H)), None]
    cid = c_uint64()
    with pytest.raises(ep.ArgumentError) as e:
        COMBINE(api().combine)(id(rank), 0, 1, 4, descs(ts), 5, None, ctypes.byref(cid))
    assert e.value.argument == "flags"


def test_a_bad_tensor_gets_the_native_methods_message():
    """The C ABI's checks are the native methods': the same ArgumentError for the same fault."""
    class Dtype:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name

    class PyTensor:  # what the native methods read
        def __init__(self, t, dtype):
            self.dtype, self.shape, self.t = dtype, tuple(t.shape), t

        def stride(self):
            return tuple(self.t.strides)

        def get_device(self):
            return self.t.device

        def data_ptr(self):
            return self.t.ptr

    dts = tuple(Dtype(f"torch.{n}") for n in
                ("bfloat16", "float8_e4m3fn", "float32", "int32", "int64"))
    s = native.CallSpec(R, E, T, H, K, True, False, False, 0, dts)
    f16 = Dtype("torch.float16")
    for fault, py_dtype in (("f32", dts[F32]), ("f16", f16), ("noncontig", dts[BF16]),
                            ("device", dts[BF16])):
        ts = dispatch_tensors()
        x = ts[0]
        if fault == "f32":
            x.code = F32
        elif fault == "f16":
            x.code = -1
            x.obj.dtype = f16  # the entry reads the name of a dtype none of ours from Python
        elif fault == "noncontig":
            x._strides[0], x._strides[1] = 1, 5
            x.strides = [1, 5]
        else:
            x.device = 1
        arr = descs(ts)
        if fault == "f16":
            arr[0].element_size = 2
        with pytest.raises(ep.ArgumentError) as c_err:
            call_dispatch(native._StandInRank(s, object()), arr)
        pys = [None if t is None else PyTensor(t, dts[t.code] if t.code >= 0 else py_dtype)
               for t in ts]
        with pytest.raises(ep.ArgumentError) as py_err:
            s.check_dispatch(*pys)
        assert str(c_err.value) == str(py_err.value), fault
        assert c_err.value.argument == "x"


def test_absent_and_foreign_objects_are_named_as_the_native_methods_name_them():
    ts = dispatch_tensors()
    arr = descs(ts)
    arr[1] = Desc(None, 0, 0, 0, 0, 0, 0, None, None)  # topk_idx None
    with pytest.raises(ep.ArgumentError, match=r"argument `topk_idx`: expected a torch.Tensor, "
                                               r"got NoneType"):
        call_dispatch(native._StandInRank(spec(), object()), arr)
    five = 5
    arr = descs(ts)
    arr[2] = Desc(id(five), 2, 0, 0, 0, 0, 0, None, None)  # not a tensor
    with pytest.raises(ep.ArgumentError, match=r"argument `recv_x`: expected a torch.Tensor, "
                                               r"got int"):
        call_dispatch(native._StandInRank(spec(), object()), arr)


def test_a_busy_rank_is_an_error_not_a_second_borrow():
    """A call into a rank whose call is still running (here: re-entered from the target) is
    refused as PyO3 refuses a busy native method."""
    class Reenter(Recorder):
        def dispatch_checked(self, stream, send_only, addrs):
            call_dispatch(self.rank, descs(dispatch_tensors()))
            return 1

    target = Reenter()
    rank = target.rank = native._StandInRank(spec(), target)
    with pytest.raises(RuntimeError, match="borrow"):
        call_dispatch(rank, descs(dispatch_tensors()))


def test_echo_returns_what_the_entries_parse():
    t = Tensor(F32, (3, 4), (1, 3), device=-1)
    arr = descs([t, None])
    out = c_void_p()
    ECHO(api().echo)(arr, 2, ctypes.byref(out))
    got = ctypes.cast(out, py_object).value
    assert got == [(t.ptr, "torch.float32", [3, 4], [1, 3], -1, 4), None]
