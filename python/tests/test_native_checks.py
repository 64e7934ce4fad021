"""The native side's checks of every tensor whose address it takes (``CallSpec``, the checks
``GpuRank``'s calls make before anything is enqueued), with stand-ins for torch's tensors and
dtypes: needs neither torch nor a GPU. A bad tensor passed straight to the native method gets an
``ArgumentError`` naming it."""

import pytest

import ep_dispatch as ep
from ep_dispatch import _ep_dispatch as native


class Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name


BF16, FP8, F32, I32, I64 = (Dtype(f"torch.{n}") for n in
                            ("bfloat16", "float8_e4m3fn", "float32", "int32", "int64"))
DTYPES = (BF16, FP8, F32, I32, I64)


def contiguous(shape):
    st, acc = [], 1
    for d in reversed(shape):
        st.insert(0, acc)
        acc *= d
    return tuple(st)


class Tensor:
    """What the native side reads of a torch tensor: dtype, shape, stride(), get_device(),
    data_ptr()."""

    next_ptr = 0x10000

    def __init__(self, dtype, shape, strides=None, device=0):
        self.dtype, self.shape, self.device = dtype, tuple(shape), device
        self.strides = tuple(strides) if strides is not None else contiguous(shape)
        self.ptr, Tensor.next_ptr = Tensor.next_ptr, Tensor.next_ptr + 0x10000

    def stride(self):
        return self.strides

    def get_device(self):
        return self.device

    def data_ptr(self):
        return self.ptr


# R = 2, E = 8 (L = 4), T = 6, H = 512, K = 3; R*T = 12.
R, E, T, H, K = 2, 8, 6, 512, 3
L, RT = E // R, R * T


def spec(use_fp8=True, round_scale=False, use_ue8m0=False, device=0):
    return native.CallSpec(R, E, T, H, K, use_fp8, round_scale, use_ue8m0, device, DTYPES)


def dispatch_tensors(n=5, G=H // 128, scales_dtype=F32):
    return dict(x=Tensor(BF16, (n, H)), topk_idx=Tensor(I64, (n, K)),
                recv_x=Tensor(FP8, (L, RT, H)),
                recv_x_scales=Tensor(scales_dtype, (L, RT, G), (RT * G, 1, RT)),
                recv_count=Tensor(I32, (L,)), src_info=Tensor(I32, (L, RT)),
                layout_range=Tensor(I32, (L, R, 2)))


def test_a_good_dispatch_gives_the_addresses_and_lengths():
    t = dispatch_tensors()
    n, x, topk, rx, sc, count, src, layout, rs, ws = spec().check_dispatch(**t)
    assert rs is None and ws is None
    assert n == 5
    assert x == (t["x"].ptr, 5 * H) and topk == (t["topk_idx"].ptr, 5 * K)
    assert rx == (t["recv_x"].ptr, L * RT * H)  # bytes
    assert sc == (t["recv_x_scales"].ptr, L * RT * (H // 128) * 4)  # bytes
    assert count == (t["recv_count"].ptr, L) and src == (t["src_info"].ptr, L * RT)
    assert layout == (t["layout_range"].ptr, L * R)  # int64 entries
    assert spec().shape == (R, E, T, H, K, True, False, False, 0)


@pytest.mark.parametrize("name, bad, words", [
    ("x", Tensor(F32, (5, H)), "dtype torch.float32, expected torch.bfloat16"),
    ("x", Tensor(BF16, (5, H // 2)), "shape [5, 256], expected [5, 512]"),
    ("x", Tensor(BF16, (7, H)), "7 tokens exceed num_max_dispatch_tokens_per_rank = 6"),
    ("x", Tensor(BF16, (5, H), device=1), "on cuda:1, expected cuda:0"),
    ("x", Tensor(BF16, (5, H), strides=(1, 5)), "is not contiguous"),
    ("x", object(), "expected a torch.Tensor, got object"),
    ("topk_idx", Tensor(I64, (4, K)), "shape [4, 3], expected [5, 3]"),
    ("recv_x", Tensor(BF16, (L, RT, H)), "dtype torch.bfloat16, expected torch.float8_e4m3fn"),
    ("recv_x_scales", Tensor(F32, (L, RT, H // 128)), "expected [48, 1, 12]"),
    ("recv_x_scales", None, "needs its scales"),
    ("recv_count", Tensor(I32, (L + 1,)), "shape [5], expected [4]"),
    ("src_info", Tensor(I64, (L, RT)), "dtype torch.int64, expected torch.int32"),
    ("layout_range", Tensor(I64, (L, R)), "dtype torch.int64, expected torch.int32"),
])
def test_each_bad_dispatch_tensor_is_named(name, bad, words):
    t = dispatch_tensors()
    t[name] = bad
    with pytest.raises(ep.ArgumentError) as e:
        spec().check_dispatch(**t)
    assert e.value.argument == name and words in str(e.value), str(e.value)


def test_the_stats_are_checked_too():
    t = dispatch_tensors()
    with pytest.raises(ep.ArgumentError) as e:
        spec().check_dispatch(**t, recv_stats=Tensor(I64, (L,)))
    assert e.value.argument == "cumulative_local_expert_recv_stats"
    with pytest.raises(ep.ArgumentError) as e:
        spec().check_dispatch(**t, wait_stats=Tensor(I64, (R + 1,)))
    assert e.value.argument == "dispatch_wait_recv_cost_stats"
    rs, ws = Tensor(I32, (L,)), Tensor(I64, (R,))
    got = spec().check_dispatch(**t, recv_stats=rs, wait_stats=ws)
    assert got[8:] == ((rs.ptr, L), (ws.ptr, R))


def test_bf16_and_ue8m0_dispatches():
    t = dispatch_tensors()
    t["recv_x"] = Tensor(BF16, (L, RT, H))
    with pytest.raises(ep.ArgumentError) as e:
        spec(use_fp8=False).check_dispatch(**t)
    assert e.value.argument == "recv_x_scales"
    t["recv_x_scales"] = None
    assert spec(use_fp8=False).check_dispatch(**t)[3][1] == L * RT * H * 2
    u = dispatch_tensors(G=H // 512, scales_dtype=I32)
    assert spec(True, True, True).check_dispatch(**u)[4][1] == L * RT * (H // 512) * 4
    with pytest.raises(ep.ArgumentError) as e:
        spec(True, True, True).check_dispatch(**dispatch_tensors())
    assert e.value.argument == "recv_x_scales"


def test_combine_tensors_are_checked_against_the_dispatched_tokens():
    s = spec()
    t = dict(x=Tensor(BF16, (L, RT, H)), topk_idx=Tensor(I64, (5, K)),
             topk_weights=Tensor(F32, (5, K)), out=Tensor(BF16, (5, H)))
    y, topk, w, out, ws = s.check_combine(5, **t)
    assert y[1] == L * RT * H and out == (t["out"].ptr, 5 * H) and ws is None
    stats = Tensor(I64, (R,))
    assert s.check_combine(5, **t, wait_stats=stats)[4] == (stats.ptr, R)
    for name, bad in [("x", Tensor(BF16, (L, RT, H // 2))),
                      ("topk_weights", Tensor(I64, (5, K))),
                      ("out", Tensor(BF16, (4, H))),
                      ("topk_idx", Tensor(I64, (5, K), device=-1))]:
        with pytest.raises(ep.ArgumentError) as e:
            s.check_combine(5, **dict(t, **{name: bad}))
        assert e.value.argument == name, (name, str(e.value))
    with pytest.raises(ep.ArgumentError) as e:
        s.check_combine(5, **t, wait_stats=Tensor(I32, (R,)))
    assert e.value.argument == "combine_wait_recv_cost_stats"


def test_a_logfmt_combine_needs_h_a_multiple_of_128():
    t = dict(x=Tensor(BF16, (L, RT, H)), topk_idx=Tensor(I64, (5, K)),
             topk_weights=Tensor(F32, (5, K)), out=Tensor(BF16, (5, H)))
    assert spec().check_combine(5, **t, use_logfmt=True) == spec().check_combine(5, **t)
    h = 192  # a multiple of 64, not of 128: bf16 dispatch takes it, LogFMT does not
    s = native.CallSpec(R, E, T, h, K, False, False, False, 0, DTYPES)
    t = dict(x=Tensor(BF16, (L, RT, h)), topk_idx=Tensor(I64, (5, K)),
             topk_weights=Tensor(F32, (5, K)), out=Tensor(BF16, (5, h)))
    s.check_combine(5, **t)
    with pytest.raises(ep.ConfigError) as e:
        s.check_combine(5, **t, use_logfmt=True)
    assert e.value.kind == "HiddenNotMultiple"
    assert (e.value.hidden, e.value.multiple, e.value.mode) == (192, 128, "logfmt")


def test_a_spec_validates_its_shape_once_when_made():
    with pytest.raises(ep.ConfigError):
        native.CallSpec(3, E, T, H, K, True, False, False, 0, DTYPES)  # E % R
    with pytest.raises(ep.ConfigError):
        native.CallSpec(R, E, T, 100, K, True, False, False, 0, DTYPES)  # H % 128 in FP8
    with pytest.raises(ep.ArgumentError) as e:
        native.CallSpec(R, E, T, H, K, True, False, False, 0, DTYPES[:4])
    assert e.value.argument == "dtypes"
