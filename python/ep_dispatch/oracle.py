"""The contract's oracle (``ep_reference::oracle``) on host data, for checking a GPU ``Buffer``
bit for bit.

Every function takes one entry per rank (a list of length R). An entry is a numpy array, a torch
tensor (copied to the host) or a bytes-like object holding little-endian values:

- ``x``: bf16 ``[n_r, H]``: a torch ``bfloat16`` tensor, or the bits as numpy ``uint16``/``int16``,
  or bytes (then pass ``hidden=``);
- ``topk_idx``: int64 ``[n_r, K]`` (bytes: pass ``top_k=``);
- ``y``: bf16 ``[L, R*T, H]``, the expert outputs in the dispatch layout;
- ``topk_weights``: float32 ``[n_r, K]``.

Outputs are numpy arrays where numpy is installed (bf16 as ``uint16`` bits, e4m3 as ``uint8``),
otherwise bytes. Only rows below ``recv_count[l]`` carry meaning; :func:`diff` compares exactly
those.
"""

from . import _ep_dispatch as _native
from .errors import argument_error

try:  # numpy is optional: without it, outputs are bytes.
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only where numpy is missing
    _np = None


def _is_torch(a):
    return type(a).__module__.split(".")[0] == "torch"


# name -> (numpy dtypes accepted, torch dtype name, bytes per value)
_KINDS = {
    "bf16": (("uint16", "int16"), "bfloat16", 2),
    "int64": (("int64",), "int64", 8),
    "float32": (("float32",), "float32", 4),
}


def _host_bytes(name, a, kind):
    """(little-endian bytes, shape or None) of one entry, after a dtype check naming it."""
    np_names, torch_name, size = _KINDS[kind]
    if _is_torch(a):
        import torch

        if str(a.dtype) != f"torch.{torch_name}":
            raise argument_error(name, f"dtype {a.dtype}, expected torch.{torch_name}")
        t = a.detach().to("cpu").contiguous()
        if kind == "bf16":
            t = t.view(torch.int16)
        return t.numpy().tobytes(), tuple(t.shape)
    if _np is not None and isinstance(a, _np.ndarray):
        if a.dtype.name not in np_names:
            if kind == "int64" and a.dtype.kind in "iu":
                a = a.astype(_np.int64)  # exact for every integer dtype numpy has but uint64
                if a.dtype.name != "int64":  # pragma: no cover
                    raise argument_error(name, "integer values do not fit int64")
            else:
                want = " or ".join(np_names)
                raise argument_error(name, f"dtype {a.dtype}, expected {want} ({kind})")
        return _np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes(), a.shape
    try:
        b = bytes(memoryview(a))
    except TypeError:
        raise argument_error(
            name, f"a {type(a).__name__} is not an array, a tensor or a bytes-like object"
        ) from None
    if len(b) % size:
        raise argument_error(name, f"{len(b)} bytes is not a whole number of {kind} values")
    return b, None


def _per_rank(name, entries, kind):
    if isinstance(entries, (bytes, bytearray, memoryview, str)) or not hasattr(entries, "__len__"):
        raise argument_error(name, "expected a list with one entry per rank")
    return [_host_bytes(f"{name}[{r}]", e, kind) for r, e in enumerate(entries)]


def _last_dim(name, given, shapes, what):
    """The size of the last dimension: from the arrays' shapes, or `given` for bytes."""
    dims = {s[-1] for s in shapes if s is not None and len(s) >= 1}
    if len(dims) > 1:
        raise argument_error(name, f"entries disagree on {what}: {sorted(dims)}")
    if dims:
        (d,) = dims
        if given is not None and given != d:
            raise argument_error(what, f"{given} given, but {name} has {d}")
        return d
    if given is None:
        raise argument_error(what, f"needed when {name} is given as bytes")
    return given


def _check_2d(name, shapes):
    for r, s in enumerate(shapes):
        if s is not None and len(s) != 2:
            raise argument_error(f"{name}[{r}]", f"shape {tuple(s)}, expected 2 dimensions")


def _int(name, v, lo=0):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise argument_error(name, f"{v!r} is not an integer >= {lo}")
    return v


def _array(b, dtype, shape):
    if _np is None:
        return b
    return _np.frombuffer(b, dtype=_np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)


class DispatchResult:
    """One rank's dispatch output in DeepEP's low-latency shapes.

    ``recv_x``: ``[L, R*T, H]`` e4m3 bytes (``uint8``) or bf16 bits (``uint16``);
    ``recv_x_scales``: ``float32 [L, R*T, H/128]``, packed UE8M0 ``int32 [L, R*T, H/512]``, or
    None in BF16 (a C-ordered array; the Buffer's scales tensor holds the same values
    column-major in the last two dimensions, as DeepEP's); ``recv_count``: ``int32 [L]``;
    ``layout_range``: ``int64 [L, R]``, DeepEP's
    ``(begin << 32) | count``; ``src_info``: ``int32 [L, R*T]``, the token index on its source.
    """

    def __init__(self, d, num_ranks, num_local_experts, rows, hidden):
        L, R, RT, H = num_local_experts, num_ranks, rows, hidden
        fp8 = d["scales_kind"] is not None
        self.use_fp8 = fp8
        self.recv_x = _array(d["recv_x"], "uint8" if fp8 else "uint16", (L, RT, H))
        if d["scales_kind"] == "float32":
            self.recv_x_scales = _array(d["recv_x_scales"], "float32", (L, RT, H // 128))
        elif d["scales_kind"] == "ue8m0":
            self.recv_x_scales = _array(d["recv_x_scales"], "int32", (L, RT, H // 512))
        else:
            self.recv_x_scales = None
        self.recv_count = _array(d["recv_count"], "int32", (L,))
        self.layout_range = _array(d["layout_range"], "int64", (L, R))
        self.src_info = _array(d["src_info"], "int32", (L, RT))

    def layout_pairs(self):
        """``layout_range`` as ``(begin, count)`` int arrays ``[L, R]`` each (numpy only)."""
        lr = self.layout_range
        return (lr >> 32).astype("int32"), (lr & 0xFFFFFFFF).astype("int32")


def _shape_args(x_shapes, topk_shapes, hidden, top_k):
    _check_2d("x", x_shapes)
    _check_2d("topk_idx", topk_shapes)
    h = _last_dim("x", hidden, x_shapes, "hidden")
    k = _last_dim("topk_idx", top_k, topk_shapes, "top_k")
    return h, k


def masked_routing(topk_idx, num_experts, masked):
    """Every rank's routing under a rank mask (docs/contract.md, "Masked ranks"): a rank in
    ``masked`` (rank indices) sends nothing (all its slots -1), and every slot naming an expert
    of a masked rank is -1. ``topk_idx``: one torch tensor or numpy array per rank; returns
    copies. The oracle on this routing is what shrink mode's unmasked ranks return."""
    num_ranks = len(topk_idx)
    L = _int("num_experts", num_experts, lo=1) // max(num_ranks, 1)
    out = []
    for r, t in enumerate(topk_idx):
        t = t.clone() if _is_torch(t) else t.copy()
        if r in masked:
            t[:] = -1
        for m in masked:
            t[(t >= 0) & (t // L == m)] = -1
        out.append(t)
    return out


def dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
             round_scale=False, use_ue8m0=False, *, hidden=None, top_k=None):
    """Every rank's dispatch output (a list of :class:`DispatchResult`), straight from the
    contract. Raises ``ConfigError`` / ``InputError`` for what the contract refuses."""
    T = _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    E = _int("num_experts", num_experts)
    xs = _per_rank("x", x, "bf16")
    ts = _per_rank("topk_idx", topk_idx, "int64")
    h, k = _shape_args([s for _, s in xs], [s for _, s in ts], hidden, top_k)
    outs = _native.oracle_dispatch([b for b, _ in xs], [b for b, _ in ts], T, E, h, k,
                                   bool(use_fp8), bool(round_scale), bool(use_ue8m0))
    R = len(xs)
    return [DispatchResult(d, R, E // R, R * T, h) for d in outs]


def combine(y, topk_idx, topk_weights, num_max_dispatch_tokens_per_rank, num_experts, *,
            hidden=None, top_k=None, use_logfmt=False):
    """Every rank's combine output, bf16 bits ``[n_r, H]`` (``uint16``). ``use_logfmt=True``:
    the rows as they reach the reduction after LogFMT-10 (docs/contract.md 4.1; H a multiple
    of 128), what ``Buffer.low_latency_combine(..., use_logfmt=True)`` returns."""
    if use_logfmt.__class__ is not bool:
        raise argument_error("use_logfmt", f"{use_logfmt!r} is not a bool")
    T = _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    E = _int("num_experts", num_experts)
    ys = _per_rank("y", y, "bf16")
    ts = _per_rank("topk_idx", topk_idx, "int64")
    ws = _per_rank("topk_weights", topk_weights, "float32")
    _check_2d("topk_idx", [s for _, s in ts])
    h = _last_dim("y", hidden, [s for _, s in ys], "hidden")
    k = _last_dim("topk_idx", top_k, [s for _, s in ts], "top_k")
    outs = _native.oracle_combine([b for b, _ in ys], [b for b, _ in ts], [b for b, _ in ws],
                                  T, E, h, k, use_logfmt)
    return [_array(b, "uint16", (len(b) // (2 * h), h)) for b in outs]


def cpu_roundtrip(path, x, topk_idx, y, topk_weights, num_max_dispatch_tokens_per_rank,
                  num_experts, use_fp8=True, round_scale=False, use_ue8m0=False, *,
                  hidden=None, top_k=None, timeout_s=10.0):
    """One dispatch and one combine on the CPU backend (``path``: 'per_expert' or 'batched'),
    one thread per rank: ``(list of DispatchResult, list of combine outputs)``."""
    T = _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    E = _int("num_experts", num_experts)
    xs = _per_rank("x", x, "bf16")
    ts = _per_rank("topk_idx", topk_idx, "int64")
    ys = _per_rank("y", y, "bf16")
    ws = _per_rank("topk_weights", topk_weights, "float32")
    h, k = _shape_args([s for _, s in xs], [s for _, s in ts], hidden, top_k)
    outs, comb = _native.cpu_roundtrip(
        path, [b for b, _ in xs], [b for b, _ in ts], [b for b, _ in ys], [b for b, _ in ws],
        T, E, h, k, bool(use_fp8), bool(round_scale), bool(use_ue8m0), float(timeout_s))
    R = len(xs)
    return ([DispatchResult(d, R, E // R, R * T, h) for d in outs],
            [_array(b, "uint16", (len(b) // (2 * h), h)) for b in comb])


def bf16_from_f32(a):
    """float32 values -> bf16 bits (``uint16``, same shape), rounded to nearest even as the
    contract rounds (NaN -> 0x7FFF). Bytes in, bytes out without numpy."""
    b, shape = _host_bytes("a", a, "float32")
    out = _native.bf16_from_f32(b)
    return out if shape is None or _np is None else _array(out, "uint16", shape)


def f32_from_bf16(a):
    """bf16 bits -> float32 (exact)."""
    b, shape = _host_bytes("a", a, "bf16")
    out = _native.f32_from_bf16(b)
    return out if shape is None or _np is None else _array(out, "float32", shape)


def diff(got, want):
    """The first difference between two dispatch outputs of one rank, or None.

    ``got`` and ``want`` have the attributes of :class:`DispatchResult` (numpy arrays, or torch
    tensors, which are copied to the host); rows at or past ``recv_count`` are not compared.
    """
    if _np is None:  # pragma: no cover
        raise ImportError("ep_dispatch.oracle.diff needs numpy")

    def host(a):
        if a is None:
            return None
        if _is_torch(a):
            import torch

            t = a.detach().to("cpu").contiguous()
            if t.dtype in (torch.bfloat16, torch.float8_e4m3fn):
                t = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.uint8)
            return t.numpy()
        return _np.asarray(a)

    gc, wc = host(got.recv_count), host(want.recv_count)
    if not _np.array_equal(gc, wc):
        return f"recv_count differs: {gc.tolist()} vs {wc.tolist()}"
    gl, wl = host(got.layout_range), host(want.layout_range)
    if not _np.array_equal(gl, wl):
        return f"layout_range differs: {gl.tolist()} vs {wl.tolist()}"
    gs, ws = host(got.src_info), host(want.src_info)
    gx, wx = host(got.recv_x), host(want.recv_x)
    gsc, wsc = host(got.recv_x_scales), host(want.recv_x_scales)
    if (gsc is None) != (wsc is None):
        return "one output has scales, the other not"
    gx, wx = gx.view(_np.uint8), wx.view(_np.uint8)
    for l, n in enumerate(wc.tolist()):
        if not _np.array_equal(gs[l, :n], ws[l, :n]):
            row = int(_np.nonzero(gs[l, :n] != ws[l, :n])[0][0])
            return f"src_info[{l}][{row}]: {gs[l, row]} vs {ws[l, row]}"
        if not _np.array_equal(gx[l, :n], wx[l, :n]):
            row = int(_np.nonzero((gx[l, :n] != wx[l, :n]).any(axis=1))[0][0])
            return f"recv_x differs at expert {l} row {row}"
        if gsc is not None:
            a, b = gsc[l, :n].view(_np.uint32), wsc[l, :n].view(_np.uint32)
            if not _np.array_equal(a, b):
                row = int(_np.nonzero((a != b).any(axis=1))[0][0])
                return f"recv_x_scales differ at expert {l} row {row}"
    return None


def combine_diff(got, want):
    """The first differing (token, channel) of two bf16 combine outputs, or None."""
    if _np is None:  # pragma: no cover
        raise ImportError("ep_dispatch.oracle.combine_diff needs numpy")

    def bits(a):
        if _is_torch(a):
            import torch

            return a.detach().to("cpu").contiguous().view(torch.int16).numpy().view(_np.uint16)
        return _np.asarray(a).view(_np.uint16)

    g, w = bits(got), bits(want)
    if g.shape != w.shape:
        return f"shapes differ: {g.shape} vs {w.shape}"
    bad = _np.argwhere(g != w)
    if len(bad) == 0:
        return None
    t, c = bad[0].tolist()
    return f"token {t} channel {c}: {g[t, c]:#06x} vs {w[t, c]:#06x}"


def outcome(got, want, out, want_c):
    """What one dispatch + combine pair of a rank returned (docs/contract.md, "A failure never
    spreads as data"): ``"good"`` when both outputs are bitwise the oracle's (``got``/``want``
    as for :func:`diff`, ``out``/``want_c`` as for :func:`combine_diff`); ``"failed"`` when each
    is the oracle's or the contract's failed output (a dispatch that received nothing: every
    ``recv_count`` and ``layout_range`` 0; a combine whose rows are all NaN) and one of them is;
    else ``"WRONG: ..."`` naming the differences: a finite wrong output."""
    d, c = diff(got, want), combine_diff(out, want_c)
    if d is None and c is None:
        return "good"

    def host(a):
        if _is_torch(a):
            return a.detach().to("cpu").contiguous().numpy()
        return _np.asarray(a)

    d_failed = not host(got.recv_count).any() and not host(got.layout_range).any()
    if _is_torch(out):
        import torch

        o = out.detach().to("cpu").contiguous().view(torch.int16).numpy().view(_np.uint16)
    else:
        o = _np.asarray(out).view(_np.uint16)
    c_failed = o.size > 0 and bool((((o & 0x7F80) == 0x7F80) & ((o & 0x7F) != 0)).all())
    if (d is None or d_failed) and (c is None or c_failed):
        return "failed"
    return f"WRONG: dispatch {d}; combine {c}"
