"""The C++ torch extension on the CPU: it builds and loads, describes torch's tensors as they are
(address, dtype, shape, strides, device, element size), allocates the Buffer's outputs with the
shapes, dtypes and strides the Python path makes, raises the native checks' errors, and is left
for the Python path when EP_DISPATCH_TORCH_EXT says so or the build fails. Needs torch (CPU is
enough) and, for the extension itself, a C++ compiler and ninja."""

import os
import shutil
import warnings

import pytest

import ep_dispatch as ep
from ep_dispatch import _ep_dispatch as native
from ep_dispatch import _torch_ext

torch = pytest.importorskip("torch", reason="torch is not installed (the extension needs it)")
if not hasattr(native, "_StandInRank"):
    pytest.skip("the native module was built without its `testing` feature",
                allow_module_level=True)

R, E, T, H, K = 2, 8, 6, 512, 3
L, RT = E // R, R * T


def dtypes():
    return (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64)


def compiler():
    return shutil.which(os.environ.get("CXX", "c++")) is not None


@pytest.fixture
def ext(monkeypatch):
    """The extension; its absence fails the test where a compiler is there (it must build)."""
    monkeypatch.delenv(_torch_ext.ENV, raising=False)
    if not compiler():
        pytest.skip("no C++ compiler here (the extension is built at first use)")
    e = _torch_ext.load(torch)
    assert e is not None, _torch_ext._loaded.get(str(_torch_ext.SOURCE))
    return e


def test_the_extension_builds_and_loads_here(ext):
    assert ext._descriptor_size() == 56  # the Rust side's TensorDesc (its table says the same)
    assert _torch_ext.load(torch) is ext  # one build per process


def test_descriptors_of_cpu_tensors_carry_what_the_tensor_says(ext):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    views = [x, x.t(), x[1:, 2:], x[::2], torch.zeros((), dtype=torch.int64),
             torch.zeros(3, 0, dtype=torch.int32), torch.zeros(5, dtype=torch.float16),
             torch.zeros(2, 3, dtype=torch.float8_e4m3fn)]
    got = ext._echo(*views, None)
    assert got[-1] is None
    for t, g in zip(views, got):
        assert g == (t.data_ptr(), str(t.dtype), list(t.shape), list(t.stride()),
                     t.get_device(), t.element_size()), t


def test_a_non_tensor_is_named_as_the_native_methods_name_it(ext):
    with pytest.raises(ep.ArgumentError) as e:
        ext._echo(torch.zeros(2), [1, 2])
    assert e.value.argument == "tensors[1]"
    assert str(e.value) == "argument `tensors[1]`: expected a torch.Tensor, got list"


def stand_in(use_fp8=True, round_scale=False, use_ue8m0=False):
    spec = native.CallSpec(R, E, T, H, K, use_fp8, round_scale, use_ue8m0, -1, dtypes())
    return native._StandInRank(spec, object())  # enqueues nothing, counts ids


def inputs(n=5):
    x = torch.randn(n, H).to(torch.bfloat16)
    topk = torch.rand(n, E).argsort(dim=1)[:, :K].contiguous()
    return x, topk


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["bf16", "fp8", "ue8m0"])
def test_the_extension_allocates_the_outputs_the_python_path_makes(ext, mode):
    rank = stand_in(use_fp8=mode > 0, round_scale=mode == 2, use_ue8m0=mode == 2)
    x, topk = inputs()
    out, count, src, pairs, hid, n, hook = ext.dispatch(rank, -1, x, topk, None, None, L, R, T,
                                                        H, mode, False)
    assert (hid, n, hook) == (1, 5, None)
    if mode:
        recv_x, scales = out
        G = H // (512 if mode == 2 else 128)
        assert recv_x.dtype == torch.float8_e4m3fn and recv_x.shape == (L, RT, H)
        assert recv_x.stride() == (RT * H, H, 1)
        assert scales.dtype == (torch.int32 if mode == 2 else torch.float32)
        assert scales.shape == (L, RT, G) and scales.stride() == (RT * G, 1, RT)
    else:
        assert out.dtype == torch.bfloat16 and out.shape == (L, RT, H) and out.is_contiguous()
    for t, shape in ((count, (L,)), (src, (L, RT)), (pairs, (L, R, 2))):
        assert t.dtype == torch.int32 and t.shape == shape and t.is_contiguous()
        assert t.device.type == "cpu"
    # The send half holds its tensors: x, topk_idx, recv_x, (scales,) count, src_info, pairs.
    ext.dispatch(rank, -1, x, topk, None, None, L, R, T, H, mode, True)
    assert rank.held_counts() == (7 if mode else 6, 0)
    # combine: out allocated (bfloat16 [n, H]) where None, else the caller's.
    y = torch.zeros(L, RT, H, dtype=torch.bfloat16)
    w = torch.rand(5, K)
    got, hook = ext.combine(rank, -1, 2, y, topk, w, None, None, 5, H, 0, None)
    assert got.dtype == torch.bfloat16 and got.shape == (5, H) and hook is None
    mine = torch.empty(5, H, dtype=torch.bfloat16)
    handle = object()
    got, hook = ext.combine(rank, -1, 2, y, topk, w, mine, None, 5, H, 1, handle)
    assert got is mine and type(hook) is ext.RecvHook
    assert rank.held_counts()[1] == 5  # x, topk_idx, topk_weights, out and the handle


def test_the_extension_raises_the_native_checks_errors(ext):
    rank = stand_in()
    x, topk = inputs()
    spec = native.CallSpec(R, E, T, H, K, True, False, False, -1, dtypes())
    outs = (torch.empty(L, RT, H, dtype=torch.float8_e4m3fn),
            torch.empty_strided((L, RT, 4), (RT * 4, 1, RT), dtype=torch.float32),
            torch.empty(L, dtype=torch.int32), torch.empty(L, RT, dtype=torch.int32),
            torch.empty(L, R, 2, dtype=torch.int32))
    for bad_x in (x.float(), x.t(), x.to(torch.float16), [1], x[:, :256]):
        with pytest.raises(ep.ArgumentError) as c_err:
            ext.dispatch(rank, -1, bad_x, topk, None, None, L, R, T, H, 1, False)
        with pytest.raises(ep.ArgumentError) as py_err:
            spec.check_dispatch(bad_x, topk, *outs)
        assert str(c_err.value) == str(py_err.value)
    stats = torch.zeros(L, dtype=torch.int64)  # int32 wanted
    with pytest.raises(ep.ArgumentError) as e:
        ext.dispatch(rank, -1, x, topk, stats, None, L, R, T, H, 1, False)
    assert e.value.argument == "cumulative_local_expert_recv_stats"
    y = torch.zeros(L, RT, H, dtype=torch.bfloat16)
    ext.dispatch(rank, -1, x, topk, None, None, L, R, T, H, 1, False)
    with pytest.raises(ep.ArgumentError) as e:  # 4 rows for a dispatch of 5
        ext.combine(rank, -1, 1, y, topk[:4], torch.rand(4, K), None, None, 4, H, 0, None)
    assert str(e.value) == "argument `topk_idx`: shape [4, 3], expected [5, 3]"
    with pytest.raises(ep.InputError):  # a handle this rank never gave
        ext.combine(rank, -1, 99, y, topk, torch.rand(5, K), None, None, 5, H, 0, None)


def test_a_send_halfs_hook_enqueues_its_receive_half_once(ext):
    """The hook a send half returns is the extension's RecvHook: its first call enqueues the
    receive half (one `recv`, which lets the send half's tensors go), a second does nothing; it
    takes no arguments; a whole call returns no hook."""
    rank = stand_in()  # counts ids itself, and the receive halves it enqueued
    x, topk = inputs()
    *_, hid, n, hook = ext.dispatch(rank, -1, x, topk, None, None, L, R, T, H, 1, True)
    assert type(hook) is ext.RecvHook and rank.held_counts() == (7, 0)
    assert repr(hook) == f"<ep_dispatch receive hook of dispatch {hid}, due>"
    with pytest.raises(TypeError, match="no arguments"):
        hook(0)
    assert rank.recv_counts() == (0, 0)
    assert hook() is None
    assert rank.recv_counts() == (1, 0) and rank.held_counts() == (0, 0)
    hook()
    assert rank.recv_counts() == (1, 0) and repr(hook).endswith("called>")
    y, w = torch.zeros(L, RT, H, dtype=torch.bfloat16), torch.rand(5, K)
    _, chook = ext.combine(rank, -1, hid, y, topk, w, None, None, 5, H, 1, None)
    assert rank.held_counts() == (0, 4)
    chook()
    chook()
    assert rank.recv_counts() == (1, 1) and rank.held_counts() == (0, 0)
    # A hook called after a later call enqueued its receive half: nothing more goes out.
    *_, late = ext.dispatch(rank, -1, x, topk, None, None, L, R, T, H, 1, True)
    ext.dispatch(rank, -1, x, topk, None, None, L, R, T, H, 1, False)
    late()
    assert rank.recv_counts() == (1, 1)


class Recorder:
    """A stand-in's target that takes the checked calls and records what reaches it."""

    def __init__(self, fail=None):
        self.calls, self.fail, self.next = [], fail, 0

    def dispatch_checked(self, stream, send_only, addrs):
        self.next += 1
        self.calls.append(("dispatch", stream, send_only))
        return self.next

    def dispatched_tokens(self, handle):
        return 5

    def combine_checked(self, stream, handle, send_only, addrs, use_logfmt):
        self.next += 1
        self.calls.append(("combine", stream, send_only))
        return self.next

    def dispatch_recv(self, stream, hid):
        self.calls.append(("dispatch_recv", stream, hid))
        if self.fail is not None:
            raise self.fail
        return True

    def combine_recv(self, stream, cid):
        self.calls.append(("combine_recv", stream, cid))
        return True


def test_a_failed_receive_half_raises_its_typed_error_once(ext):
    """A hook whose receive half fails (the group recorded an error: the GPU rank raises it
    typed) raises that error; a second call does nothing, as the Python path's hook."""
    target = Recorder(fail=ep.TimeoutError("rank 0 waited for peer 1 (dispatch recv, call 1)"))
    rank = native._StandInRank(native.CallSpec(R, E, T, H, K, True, False, False, -1, dtypes()),
                               target)
    x, topk = inputs()
    *_, hid, _, hook = ext.dispatch(rank, -1, x, topk, None, None, L, R, T, H, 1, True)
    with pytest.raises(ep.TimeoutError, match="waited for peer 1"):
        hook()
    hook()
    assert [c for c in target.calls if c[0] == "dispatch_recv"] == [("dispatch_recv", 0, hid)]


def test_the_stream_is_the_current_one_at_each_call_and_hook(ext):
    """On a CUDA device the extension asks the bound stream function for the current stream at
    the call and again when the hook runs (DeepEP's hooks run on the then-current stream); the
    host (device -1) has stream 0. (Checked here with a stand-in stream function: a combine into
    a given `out` allocates nothing on the device.)"""
    current = {"stream": 1234}
    asked = []

    def stream_of(device):
        asked.append(device)
        return current["stream"] + device

    target = Recorder()
    rank = native._StandInRank(native.CallSpec(R, E, T, H, K, True, False, False, -1, dtypes()),
                               target)
    x, topk = inputs()
    y, w, out = (torch.zeros(L, RT, H, dtype=torch.bfloat16), torch.rand(5, K),
                 torch.empty(5, H, dtype=torch.bfloat16))
    ext.bind(native._c_api, stream_of)
    try:
        ext.dispatch(rank, -1, x, topk, None, None, L, R, T, H, 1, False)
        assert asked == [] and target.calls[-1] == ("dispatch", 0, False)
        _, hook = ext.combine(rank, 3, 1, y, topk, w, out, None, 5, H, 1, None)
        assert asked == [3] and target.calls[-1] == ("combine", 1237, True)
        current["stream"] = 5000
        hook()
        assert asked == [3, 3] and target.calls[-1] == ("combine_recv", 5003, 2)
        current["stream"] = None  # a stream function that fails: its error, nothing enqueued
        with pytest.raises(TypeError):
            ext.combine(rank, 3, 1, y, topk, w, out, None, 5, H, 0, None)
        assert target.calls[-1] == ("combine_recv", 5003, 2)
    finally:
        ext.bind(native._c_api, _torch_ext.raw_stream_fn(torch))
    with pytest.raises(TypeError, match="callable"):
        ext.bind(native._c_api, 5)


def test_a_foreign_rank_is_refused(ext):
    x, topk = inputs()
    with pytest.raises(ep.ArgumentError) as e:
        ext.dispatch(object(), -1, x, topk, None, None, L, R, T, H, 1, False)
    assert e.value.argument == "rank"


class Group:
    def rank(self):
        return 0

    def size(self):
        return R


def buffer(monkeypatch):
    monkeypatch.setattr(native, "probe_devices", lambda n: 1)
    monkeypatch.setattr(native, "probe_transport", lambda t: None)
    monkeypatch.setattr(native, "GpuRank", lambda spec, *a, **k: native._StandInRank(spec, Null()))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    b = ep.Buffer(Group(), 0, 1 << 20, True, E // R)
    b._dev, b._dev_index, b._stream = torch.device("cpu"), -1, lambda: 0
    return b


class Null:
    """What a Buffer calls on its rank besides the C ABI's entries (and, on the Python path,
    the native methods' calls, which do nothing here)."""

    def poll(self):
        pass

    def dispatch(self, stream, *tensors):
        return 1

    dispatch_send = dispatch

    def combine(self, stream, handle, *tensors):
        return 1

    combine_send = combine

    def dispatch_recv(self, stream, hid):
        return True

    def combine_recv(self, stream, cid):
        return True


def test_hooks_through_the_buffer_are_native_and_enqueue_once(ext, monkeypatch):
    """The Buffer's hooks on the extension path are the extension's RecvHooks: per pair with
    hooks, each hook called twice, one receive half each of dispatch and combine goes out."""
    b = buffer(monkeypatch)
    assert b.call_path == "extension"
    x, topk = inputs()
    y, w = torch.zeros(L, RT, H, dtype=torch.bfloat16), torch.rand(5, K)
    for i in range(1, 4):
        _, _, handle, _, hook = b.low_latency_dispatch(x, topk, T, E, return_recv_hook=True)
        assert type(hook) is ext.RecvHook
        hook()
        hook()
        _, _, chook = b.low_latency_combine(y, topk, w, handle, return_recv_hook=True)
        assert type(chook) is ext.RecvHook
        chook()
        chook()
        rank = b._ranks[handle._key]
        assert rank.recv_counts() == (i, i) and rank.held_counts() == (0, 0)
    _, _, handle, _, hook = b.low_latency_dispatch(x, topk, T, E)
    assert hook is None
    assert b.low_latency_combine(y, topk, w, handle)[2] is None


def test_the_python_path_when_forced(monkeypatch):
    monkeypatch.setenv(_torch_ext.ENV, "0")
    assert _torch_ext.load(torch) is None
    assert buffer(monkeypatch).call_path == "python"
    monkeypatch.setenv(_torch_ext.ENV, "yes")
    with pytest.raises(ep.ArgumentError) as e:
        _torch_ext.load(torch)
    assert e.value.argument == _torch_ext.ENV


def test_the_build_without_ninja_makes_the_same_extension(ext, tmp_path):
    """The builder taken where no ninja is on PATH (one compiler call): a module with the same
    entries, bound to the native module, whose descriptors read as the ninja build's do."""
    name = "ep_dispatch_torch_ext_direct_test"
    m = _torch_ext._build_direct(torch, name, tmp_path / name)
    assert (tmp_path / name / f"{name}.so").exists()
    m.bind(native._c_api, None)
    assert m._descriptor_size() == ext._descriptor_size()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]
    assert m._echo(x, None) == ext._echo(x, None)
    assert m._echo(x)[0] == (x.data_ptr(), "torch.float32", [3, 3], [4, 1], -1, 4)


def test_the_build_without_ninja_goes_to_torch_extensions_dir_else_the_cache(monkeypatch,
                                                                             tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert _torch_ext._cache_dir() == tmp_path / "ext"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _torch_ext._cache_dir() == tmp_path / "xdg" / "torch_extensions"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _torch_ext._cache_dir() == tmp_path / "home" / ".cache" / "torch_extensions"


def test_a_build_failure_warns_once_and_takes_the_python_path_or_raises(monkeypatch, tmp_path):
    broken = tmp_path / "torch_ext.cpp"
    broken.write_text("#error this extension does not build\n")
    monkeypatch.setattr(_torch_ext, "SOURCE", broken)
    monkeypatch.setattr(_torch_ext, "_loaded", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    monkeypatch.setenv(_torch_ext.ENV, "1")
    with pytest.raises(ep.NotBuiltError, match="could not be built or loaded"):
        _torch_ext.load(torch)
    monkeypatch.setattr(_torch_ext, "_loaded", {})
    monkeypatch.delenv(_torch_ext.ENV)
    with pytest.warns(RuntimeWarning, match="takes its Python call path"):
        assert _torch_ext.load(torch) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert _torch_ext.load(torch) is None
        assert buffer(monkeypatch).call_path == "python"


def test_a_pair_on_the_extension_path_makes_no_python_level_torch_call(ext, monkeypatch):
    """What a TorchFunctionMode (e.g. torch.set_default_device's) sees of an eager pair, with
    the Buffer's disabling of torch functions turned off: nothing on the extension path (after
    the first call of a shape), some on the Python path."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    class Open:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    b = buffer(monkeypatch)
    b._notf = Open
    x, topk = inputs()
    y, w = torch.zeros(L, RT, H, dtype=torch.bfloat16), torch.rand(5, K)
    stats = torch.zeros(L, dtype=torch.int32)

    def pair(hooks):
        _, _, handle, _, hook = b.low_latency_dispatch(x, topk, T, E, stats,
                                                       return_recv_hook=hooks)
        if hooks:
            hook()
        _, _, chook = b.low_latency_combine(y, topk, w, handle, return_recv_hook=hooks)
        if hooks:
            chook()

    for path in ("extension", "python"):
        if path == "python":
            b._ext = None
        assert b.call_path == path
        for hooks in (False, True):
            pair(hooks)
            Count.n = 0
            with Count():
                pair(hooks)
            if path == "extension":
                assert Count.n == 0, hooks
            else:
                assert Count.n >= 6, hooks  # torch.empty of the outputs at least
