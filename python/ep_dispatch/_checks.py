"""Argument checks of the Buffer's calls, before anything touches a GPU.

They only read attributes a torch tensor has (``shape``, ``dtype``, ``device``,
``is_contiguous()``), and take the expected dtypes as arguments, so they run (and are tested)
without torch. Each failure is an ``ArgumentError`` naming the argument.
"""

from .errors import argument_error

MAX_TOP_K = 16


def integer(name, v, lo=1, hi=None):
    """A Python int (not a bool) in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise argument_error(name, f"{v!r} is not an int")
    if v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise argument_error(name, f"{v} is outside {bound}")
    return v


def flag(name, v):
    if not isinstance(v, bool):
        raise argument_error(name, f"{v!r} is not a bool")
    return v


def tensor(name, t, dtype, shape, device):
    """`t` is a tensor of `dtype`, `shape` (None entries match any size), on `device` (the
    Buffer's ``torch.device``), contiguous. Returns its shape."""
    # The hot path (every call, every tensor): one attribute read each, the shape compared as
    # a whole; anything off, or a shape with wildcards, goes to the naming path.
    try:
        got = t.shape
        if t.dtype == dtype and got == shape and t.device == device and t.is_contiguous():
            return got
    except AttributeError:
        pass
    return _tensor_error(name, t, dtype, shape, device)


def matrix(name, t, dtype, rows, device):
    """`t` is a 2-D contiguous tensor of `dtype` on `device` with `rows` rows (None: any) and
    any number of columns. Returns its shape."""
    try:
        got = t.shape
        if (t.dtype == dtype and len(got) == 2 and (rows is None or got[0] == rows)
                and t.device == device and t.is_contiguous()):
            return got
    except AttributeError:
        pass
    return _tensor_error(name, t, dtype, (rows, None), device)


def _tensor_error(name, t, dtype, shape, device):
    """Names what `tensor` found wrong (the slow path)."""
    for attr in ("shape", "dtype", "device", "is_contiguous", "data_ptr"):
        if not hasattr(t, attr):
            raise argument_error(name, f"expected a torch.Tensor, got {type(t).__name__}")
    got = tuple(t.shape)
    if t.dtype != dtype:
        raise argument_error(name, f"dtype {t.dtype}, expected {dtype}")
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise argument_error(name, f"shape {list(got)}, expected {want}")
    if t.device != device:
        raise argument_error(name, f"on {t.device}, expected {device} (the Buffer's device)")
    if not t.is_contiguous():
        raise argument_error(name, "is not contiguous (call .contiguous() first)")
    return got


class Shape:
    """The group shape a Buffer was given up front (any part may be None: fixed at first use)."""

    def __init__(self, num_max_dispatch_tokens_per_rank=None, hidden=None, num_experts=None,
                 num_topk=None):
        self.tokens = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.experts = num_experts
        self.top_k = num_topk
        if self.tokens is not None:
            integer("num_max_dispatch_tokens_per_rank", self.tokens)
        if self.hidden is not None:
            integer("hidden", self.hidden)
        if self.experts is not None:
            integer("num_experts", self.experts)
        if self.top_k is not None:
            integer("num_topk", self.top_k, 1, MAX_TOP_K)

    def agree(self, name, mine, given):
        if mine is not None and mine != given:
            raise argument_error(
                name, f"{given} differs from the {mine} this Buffer was created or first used with")


def dispatch_args(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, shape, num_ranks,
                  device, dt):
    """Checks low_latency_dispatch's arguments; returns (n, H, K).

    `dt` holds the expected dtypes (`bf16`, `i64`, `i32`); `shape` is the Buffer's `Shape`.
    """
    T = integer("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    E = integer("num_experts", num_experts)
    n, H = matrix("x", x, dt.bf16, None, device)
    if H < 1:
        raise argument_error("x", "hidden (its second dimension) is 0")
    _, K = matrix("topk_idx", topk_idx, dt.i64, n, device)
    if not 1 <= K <= MAX_TOP_K:
        raise argument_error("topk_idx", f"{K} experts per token, expected 1..={MAX_TOP_K}")
    if n > T:
        raise argument_error(
            "x", f"{n} tokens exceed num_max_dispatch_tokens_per_rank = {T}")
    if E % num_ranks:
        raise argument_error(
            "num_experts", f"{E} is not a multiple of the group's {num_ranks} ranks")
    shape.agree("num_max_dispatch_tokens_per_rank", shape.tokens, T)
    shape.agree("hidden", shape.hidden, H)
    shape.agree("num_experts", shape.experts, E)
    shape.agree("num_topk", shape.top_k, K)
    return n, H, K


def combine_args(x, topk_idx, topk_weights, out, num_local_experts, rows, hidden, n, top_k,
                 device, dt):
    """Checks low_latency_combine's tensors against the handle's shape."""
    tensor("x", x, dt.bf16, (num_local_experts, rows, hidden), device)
    tensor("topk_idx", topk_idx, dt.i64, (n, top_k), device)
    tensor("topk_weights", topk_weights, dt.f32, (n, top_k), device)
    if out is not None:
        tensor("out", out, dt.bf16, (n, hidden), device)


def stats(name, t, dtype, shape, device):
    """An optional statistics tensor."""
    if t is not None:
        tensor(name, t, dtype, shape, device)
