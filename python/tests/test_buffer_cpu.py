"""The Buffer's API and checks where no GPU (and maybe no torch) is present: DeepEP's signatures,
every DeepEP keyword accepted, our keywords checked before the device, the size hint, NoDevice,
and the argument checks (on stand-in tensors)."""

import inspect
import subprocess
import sys

import pytest

import ep_dispatch as ep
from ep_dispatch import _checks
from ep_dispatch.buffer import Buffer, EventOverlap, Handle


def has_gpu():
    try:
        ep._native.probe_devices(1)
        return True
    except ep.NoDeviceError:
        return False


# ---- DeepEP's API -----------------------------------------------------------------------------

# DeepEP's low-latency API (deep_ep/buffer.py): names, order and defaults a caller may rely on.
DEEPEP_INIT = [("group", inspect.Parameter.empty), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
               ("low_latency_mode", False), ("num_qps_per_rank", 24),
               ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
               ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False),
               ("comm", None)]
DEEPEP_DISPATCH = [("x", inspect.Parameter.empty), ("topk_idx", inspect.Parameter.empty),
                   ("num_max_dispatch_tokens_per_rank", inspect.Parameter.empty),
                   ("num_experts", inspect.Parameter.empty),
                   ("cumulative_local_expert_recv_stats", None),
                   ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                   ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                   ("return_recv_hook", False)]
DEEPEP_COMBINE = [("x", inspect.Parameter.empty), ("topk_idx", inspect.Parameter.empty),
                  ("topk_weights", inspect.Parameter.empty), ("handle", inspect.Parameter.empty),
                  ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
                  ("return_recv_hook", False), ("out", None),
                  ("combine_wait_recv_cost_stats", None)]
DEEPEP_HINT = ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"]


def positional(fn, skip_self=True):
    ps = list(inspect.signature(fn).parameters.values())
    if skip_self:
        ps = ps[1:]
    return [(p.name, p.default) for p in ps
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_signatures_are_deepeps():
    assert positional(Buffer.__init__) == DEEPEP_INIT
    assert positional(Buffer.low_latency_dispatch) == DEEPEP_DISPATCH
    assert positional(Buffer.low_latency_combine) == DEEPEP_COMBINE
    hint = [n for n, _ in positional(Buffer.get_low_latency_rdma_size_hint, skip_self=False)]
    assert hint == DEEPEP_HINT
    assert [n for n, _ in positional(Buffer.clean_low_latency_buffer)] == [
        "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"]
    # Our extras are keyword-only, so DeepEP's positional calls cannot reach them.
    extras = {n for n, p in inspect.signature(Buffer.__init__).parameters.items()
              if p.kind == p.KEYWORD_ONLY}
    assert extras == {"path", "transport", "timeout_s", "num_max_dispatch_tokens_per_rank",
                      "hidden", "num_experts", "num_topk", "check_routing",
                      "trap_on_error"}


class FakeGroup:
    def rank(self):
        return 0

    def size(self):
        return 1


@pytest.mark.skipif(has_gpu(), reason="a GPU is present: NoDeviceError cannot happen here")
def test_every_deepep_keyword_is_accepted_then_no_device_is_clear():
    g = FakeGroup()
    kwargs = dict(num_nvl_bytes=0, num_rdma_bytes=1 << 30, low_latency_mode=True,
                  num_qps_per_rank=32, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                  use_fabric=False, explicitly_destroy=True, enable_shrink=False, comm=None)
    with pytest.raises(ep.NoDeviceError) as e:
        Buffer(g, **kwargs)
    assert str(e.value).startswith("no usable GPU: ") and e.value.kind == "NoDevice"
    assert isinstance(e.value, ep.DeviceError) and isinstance(e.value, RuntimeError)
    # The same positionally, and with our extras (every transport gets as far as the device).
    for path, transport in (("per_expert", "auto"), ("batched", "nccl"),
                            ("batched", "two-tier")):
        with pytest.raises(ep.NoDeviceError):
            Buffer(g, 0, 1 << 30, True, 24, True, False, False, False, False, None,
                   path=path, transport=transport, timeout_s=3,
                   num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256,
                   num_topk=8)


def test_unknown_keywords_are_refused():
    with pytest.raises(TypeError):
        Buffer(FakeGroup(), num_sms=24)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(path="fast"), "path"),
    (dict(transport="ib"), "transport"),
    (dict(transport="two_tier"), "transport"),
    (dict(transport="NCCL"), "transport"),
    (dict(transport=None), "transport"),
    (dict(path=1), "path"),
    (dict(path="fast", transport="nccl"), "path"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(timeout_s="10"), "timeout_s"),
    (dict(num_topk=17), "num_topk"),
    (dict(hidden=0), "hidden"),
    (dict(num_rdma_bytes=-1), "num_rdma_bytes"),
    (dict(low_latency_mode=1), "low_latency_mode"),
])
def test_our_keywords_are_checked_before_the_device(kwargs, argument):
    with pytest.raises(ep.ArgumentError) as e:
        Buffer(FakeGroup(), **kwargs)
    assert e.value.argument == argument, str(e.value)
    assert str(e.value).startswith(f"argument `{argument}`: ")


def test_every_transport_keyword_parses():
    for path in ("batched", "per_expert", "per-expert"):
        ep._native.check_keywords(path, "auto", 10.0)
    for transport in ("auto", "nccl", "two-tier"):
        ep._native.check_keywords("batched", transport, 10.0)
    with pytest.raises(ep.ArgumentError) as e:
        ep._native.check_keywords("batched", "rdma", 10.0)
    assert e.value.argument == "transport"
    assert "expected 'auto', 'nccl' or 'two-tier'" in str(e.value)


@pytest.mark.parametrize("transport, reach", [
    ("nccl", "every peer is reached through NCCL"),
    ("two-tier", "the peers on other nodes are reached through NCCL"),
])
def test_per_expert_over_nccl_is_refused_before_the_device_and_says_why(transport, reach):
    # On any machine, GPU or not: the keywords are checked before the device is looked at.
    with pytest.raises(ep.UnsupportedError) as e:
        Buffer(FakeGroup(), path="per_expert", transport=transport)
    assert e.value.kind == "Unsupported"
    assert isinstance(e.value, NotImplementedError)
    msg = str(e.value)
    # The message names the path as every message does ('per-expert'; both spellings parse).
    for words in (f"path='per-expert' with transport='{transport}'", reach, "exact sizes",
                  "host round trip", "stream-ordered", "fixed capacities",
                  "Use path='batched'"):
        assert words in msg, f"{words!r} not in {msg!r}"
    # The same refusal from the native check the Buffer calls.
    with pytest.raises(ep.UnsupportedError):
        ep._native.check_keywords("per_expert", transport, 10.0)


def test_probe_transport_names_what_is_missing():
    # 'auto' and 'two-tier' need nothing beyond the GPU here; 'nccl' needs libnccl, which a
    # machine may or may not have: either it passes or it names NCCL.
    ep._native.probe_transport("auto")
    ep._native.probe_transport("two-tier")
    try:
        ep._native.probe_transport("nccl")
    except ep.NoDeviceError as e:
        assert "transport='nccl' needs NCCL" in str(e) and "LD_LIBRARY_PATH" in str(e), str(e)
    with pytest.raises(ep.ArgumentError):
        ep._native.probe_transport("ib")


def test_a_group_is_required():
    with pytest.raises(ep.ArgumentError) as e:
        Buffer(None)
    assert e.value.argument == "group"


def test_import_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
            "import ep_dispatch as ep\n"
            "assert ep.Buffer.get_low_latency_rdma_size_hint(8, 128, 1, 1) > 0\n"
            "try:\n"
            "    ep.Buffer(object())\n"
            "except (ep.NoDeviceError, ep.NotBuiltError, ImportError) as e:\n"
            "    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if has_gpu():  # the Buffer gets as far as torch, and says it is missing
        assert out.stdout.startswith("ImportError ep_dispatch.Buffer needs torch"), out.stdout
    else:
        assert out.stdout.startswith("NoDeviceError no usable GPU: "), out.stdout


def test_device_api_is_declared():
    # Either the name of the device API this build enqueues through, or None (then no Buffer).
    assert ep.DEVICE_API is None or isinstance(ep.DEVICE_API, str)


# ---- the size hint ----------------------------------------------------------------------------

def test_size_hint_is_ours_and_needs_no_gpu():
    hint = Buffer.get_low_latency_rdma_size_hint
    k8 = hint(128, 7168, 8, 256, num_topk=8)
    bound = hint(128, 7168, 8, 256)
    assert isinstance(k8, int) and 0 < k8 < bound
    # Same as the native call (ep-kernels' layout), and growing with every dimension.
    assert k8 == ep._native.size_hint(128, 7168, 8, 256, 8, "auto")
    assert hint(256, 7168, 8, 256, num_topk=8) > k8
    # More experts grow only the per-expert count tables of a batched-only group, less than one
    # of the allocation's 2 MiB pages.
    assert hint(128, 7168, 8, 288, num_topk=8) >= k8
    assert hint(128, 4096, 8, 256, num_topk=8) < k8
    assert hint(128, 7168, 8, 256, num_topk=8, transport="auto") == k8
    # NCCL staging: on 'nccl' and on 'two-tier' (allocated before the node plan is known).
    nccl = hint(128, 7168, 8, 256, num_topk=8, transport="nccl")
    assert nccl > k8
    assert hint(128, 7168, 8, 256, num_topk=8, transport="two-tier") == nccl
    assert nccl == ep._native.size_hint(128, 7168, 8, 256, 8, "nccl")
    assert ep._native.size_hint(128, 7168, 8, 256, 8) == k8  # the default is 'auto'
    # The staging holds at least the batched dispatch's R*T entries of H bf16 each.
    assert nccl - k8 >= 8 * 128 * 7168 * 2
    # The Buffer's groups hold no tensors of their own (the caller's outputs are torch's): the
    # batched dispatch's receive area (R*T entries of at least H bf16) and the combine's (T*K
    # rows of H bf16) of both buffer sets are a floor.
    assert k8 > 2 * (8 * 128 + 128 * 8) * 7168 * 2


def test_size_hint_follows_the_ranks_up_to_256_and_refuses_past():
    hint = Buffer.get_low_latency_rdma_size_hint
    # E = R * L with L = 2: per-rank memory grows with R (recv_x and y hold L x R*T rows).
    sizes = [hint(128, 7168, r, 2 * r, num_topk=8) for r in (8, 16, 32, 64, 128, 256)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), sizes
    assert sizes[3] == ep._native.size_hint(128, 7168, 64, 128, 8, "auto")
    with pytest.raises(ep.UnsupportedError) as e:
        hint(128, 7168, 257, 257)
    assert e.value.kind == "TooManyRanks" and e.value.ranks == 257 and e.value.max == 256


def test_size_hint_refuses_bad_shapes():
    hint = Buffer.get_low_latency_rdma_size_hint
    with pytest.raises(ep.ConfigError, match="num_experts = 256 is not a multiple of"):
        hint(128, 7168, 3, 256)
    with pytest.raises(ep.ArgumentError) as e:
        hint(128, 0, 8, 256)
    assert e.value.argument == "hidden"
    # The config's own bounds refuse it, naming the field, the value and the limit.
    with pytest.raises(ep.ConfigError, match="max_tokens_per_rank = 1099511627776 exceeds the limit 65536") as e:
        hint(1 << 40, 7168, 8, 256)
    assert e.value.kind == "LimitExceeded"
    for bad in ("rdma", "two_tier", None, True):
        with pytest.raises(ep.ArgumentError) as e:
            hint(128, 7168, 8, 256, transport=bad)
        assert e.value.argument == "transport"


# ---- argument checks on stand-in tensors --------------------------------------------------------

class Dev:
    def __init__(self, type_, index):
        self.type, self.index = type_, index

    def __eq__(self, other):
        return (self.type, self.index) == (other.type, other.index)

    def __str__(self):
        return f"{self.type}:{self.index}" if self.index is not None else self.type


class T:
    """Just what the checks read of a torch tensor."""

    def __init__(self, shape, dtype, device=Dev("cuda", 0), contiguous=True):
        self.shape, self.dtype, self.device, self._c = tuple(shape), dtype, device, contiguous

    def is_contiguous(self):
        return self._c

    def data_ptr(self):
        return 0x1000


class DT:
    bf16, fp8, f32, i32, i64 = "bfloat16", "float8_e4m3fn", "float32", "int32", "int64"


def dispatch(x, t, T_=8, E=4, R=2, shape=None):
    return _checks.dispatch_args(x, t, T_, E, shape or _checks.Shape(), R, Dev("cuda", 0), DT)


def test_dispatch_checks_accept_good_arguments():
    assert dispatch(T((5, 128), "bfloat16"), T((5, 2), "int64")) == (5, 128, 2)


@pytest.mark.parametrize("x, t, kw, argument, words", [
    (T((5, 128), "float32"), T((5, 2), "int64"), {}, "x", "dtype float32, expected bfloat16"),
    (T((5, 128), "bfloat16", Dev("cpu", None)), T((5, 2), "int64"), {}, "x", "on cpu"),
    (T((5, 128), "bfloat16", Dev("cuda", 1)), T((5, 2), "int64"), {}, "x", "expected cuda:0"),
    (T((5, 128), "bfloat16", contiguous=False), T((5, 2), "int64"), {}, "x", "not contiguous"),
    (T((5, 1, 128), "bfloat16"), T((5, 2), "int64"), {}, "x", "expected [*, *]"),
    (T((5, 128), "bfloat16"), T((5, 2), "int32"), {}, "topk_idx", "dtype int32"),
    (T((5, 128), "bfloat16"), T((4, 2), "int64"), {}, "topk_idx", "expected [5, *]"),
    (T((5, 128), "bfloat16"), T((5, 17), "int64"), {}, "topk_idx", "17 experts per token"),
    (T((9, 128), "bfloat16"), T((9, 2), "int64"), {}, "x", "9 tokens exceed"),
    (T((5, 128), "bfloat16"), T((5, 2), "int64"), dict(E=3), "num_experts", "not a multiple"),
    (T((5, 128), "bfloat16"), T((5, 2), "int64"), dict(T_=0), "num_max_dispatch_tokens_per_rank",
     "outside"),
    (T((5, 128), "bfloat16"), T((5, 2), "int64"), dict(shape=_checks.Shape(hidden=256)),
     "hidden", "differs from the 256"),
    ("not a tensor", T((5, 2), "int64"), {}, "x", "expected a torch.Tensor, got str"),
])
def test_dispatch_checks_name_the_argument(x, t, kw, argument, words):
    with pytest.raises(ep.ArgumentError) as e:
        dispatch(x, t, **kw)
    assert e.value.argument == argument
    assert words in str(e.value), str(e.value)


def test_combine_checks_name_the_argument():
    def combine(x=None, t=None, w=None, out=None):
        _checks.combine_args(x or T((2, 16, 128), "bfloat16"), t or T((5, 2), "int64"),
                             w or T((5, 2), "float32"), out, 2, 16, 128, 5, 2, Dev("cuda", 0), DT)

    combine()
    combine(out=T((5, 128), "bfloat16"))
    for kw, argument in [(dict(x=T((2, 8, 128), "bfloat16")), "x"),
                         (dict(t=T((5, 3), "int64")), "topk_idx"),
                         (dict(w=T((5, 2), "bfloat16")), "topk_weights"),
                         (dict(out=T((4, 128), "bfloat16")), "out")]:
        with pytest.raises(ep.ArgumentError) as e:
            combine(**kw)
        assert e.value.argument == argument


# ---- small pieces -------------------------------------------------------------------------------

def test_handle_unpacks_as_deepeps_five_tuple():
    h = Handle("src", "layout", 128, 7168, 256, recv_count="rc", num_tokens=5)
    assert h[1] == "layout" and h[-4] == "layout" and h[1:3] == ("layout", 128)
    src_info, layout_range, tokens, hidden, experts = h
    assert (src_info, layout_range, tokens, hidden, experts) == ("src", "layout", 128, 7168, 256)
    assert h.num_max_dispatch_tokens_per_rank == 128 and h.recv_count == "rc" and len(h) == 5


def test_event_overlap_without_event_is_a_no_op():
    with EventOverlap(None) as ev:
        assert ev.event is None
    EventOverlap().current_stream_wait()


def test_exceptions_derive_from_the_builtins_a_caller_expects():
    import builtins

    assert issubclass(ep.TimeoutError, builtins.TimeoutError)
    assert issubclass(ep.OutOfMemoryError, MemoryError)
    assert issubclass(ep.NotBuiltError, NotImplementedError)
    assert issubclass(ep.ArgumentError, ep.InputError) and issubclass(ep.InputError, ValueError)
    for cls in (ep.ConfigError, ep.PeerError, ep.DeviceError, ep.UnsupportedError):
        assert issubclass(cls, ep.EpError)


def test_deepeps_other_names():
    """topk_idx_t, Config and EventHandle exist under DeepEP's names; Config
    checks what DeepEP's asserts."""
    import ep_dispatch as ep

    assert {"Config", "EventHandle", "topk_idx_t"} <= set(ep.__all__)
    c = ep.Config(20, 6, 256, 6, 128)
    assert (c.num_sms, c.num_max_rdma_chunked_recv_tokens) == (20, 132)  # 128 rounded up to 6s
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) == 0
    assert ep.Config(20, 6, 256, 6, 20).num_max_rdma_chunked_recv_tokens == 24  # rounded up
    with pytest.raises(ep.ArgumentError) as e:
        ep.Config(20, 256, 256, 6, 128)
    assert e.value.argument == "num_max_nvl_chunked_send_tokens"
    with pytest.raises(ep.ArgumentError) as e:
        ep.Config(20, 6, 256, 100, 50)  # 50 rounds up to 100: not twice the send chunk
    assert e.value.argument == "num_max_rdma_chunked_send_tokens"
    with pytest.raises(ep.ArgumentError):
        ep.Config(-1, 6, 256, 6, 128)
    try:
        import torch
    except ImportError:
        with pytest.raises(ImportError):
            ep.topk_idx_t
    else:
        assert ep.topk_idx_t is torch.int64


def test_native_stubs_match_the_module():
    """The wheel ships _ep_dispatch.pyi and py.typed; the stub names exactly
    what the native module and its GpuRank define."""
    import ast
    import pathlib

    here = pathlib.Path(ep.__file__).parent
    assert (here / "py.typed").exists()
    tree = ast.parse((here / "_ep_dispatch.pyi").read_text())
    top, methods = set(), {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            top.add(node.name)
        elif isinstance(node, ast.ClassDef):
            top.add(node.name)
            methods[node.name] = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            top |= {t.id for t in targets}
    top -= {"Ptr", "Dtypes"}
    native = {n for n in dir(ep._native) if not n.startswith("__")}
    assert top == native, (top ^ native)
    for cls, stub in methods.items():
        got = {n for n in dir(getattr(ep._native, cls)) if not n.startswith("__")}
        assert stub - {"__init__"} == got, (cls, (stub - {"__init__"}) ^ got)
