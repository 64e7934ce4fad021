"""``Buffer``: DeepEP's low-latency ``Buffer`` over ep-dispatch's GPU kernels.

Code written for ``deep_ep.Buffer``'s low-latency mode runs unchanged: the same constructor,
method names, positional order, defaults, shapes and dtypes. What differs is listed in the class
docstring.
"""

from . import _checks
from . import _ep_dispatch as _native
from . import _torch_ext
from .errors import ArgumentError, InputError, argument_error


class EventOverlap:
    """DeepEP's ``EventOverlap``: a CUDA event (or None) and the tensors to keep alive until it.

    ``current_stream_wait()`` makes the current stream wait for the event; as a context manager
    it does so on exit.
    """

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            if hasattr(self.event, "current_stream_wait"):  # an EventHandle, as DeepEP's
                self.event.current_stream_wait()
                return
            import torch

            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.current_stream_wait()


# What a call without async_finish returns as its event (immutable: shared by every call).
_NO_EVENT = EventOverlap(None)

# Groups of Buffers collected during a CUDA graph capture (Buffer.__del__), released by the next
# call made outside capture.
_DEFERRED = []


def _release_deferred(torch):
    if _DEFERRED and not torch.cuda.is_current_stream_capturing():
        _DEFERRED.clear()


class Handle(tuple):
    """What ``low_latency_combine`` needs from a dispatch.

    A 5-tuple as in DeepEP, ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``: ``src_info`` ``int32 [L, R*T]``, the token index on its source rank;
    ``layout_range`` ``int64 [L, R]``, DeepEP's ``(begin << 32) | count`` (computed from the
    kernels' ``(begin, count)`` pairs at each read, so a caller that never reads it pays
    nothing; never cached, since a replayed CUDA graph rewrites the pairs under the same
    handle). Attributes: the same five by name, ``layout_pairs()``, ``recv_count``,
    ``num_tokens``, ``top_k``, ``use_fp8``, ``path``.
    """

    def __new__(cls, src_info, layout_range, tokens, hidden, experts, layout_pairs=None,
                **extra):
        h = super().__new__(cls, (src_info, layout_range, tokens, hidden, experts))
        h.src_info, h._packed, h._pairs = src_info, layout_range, layout_pairs
        h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts = tokens, hidden, experts
        for k, v in extra.items():
            setattr(h, k, v)
        return h

    @classmethod
    def _of_dispatch(cls, src_info, pairs, tokens, hidden, experts, recv_count, num_tokens,
                     top_k, use_fp8, path, key, buffer, hid, seq):
        """The handle a dispatch returns (the hot path: its attributes set as one dict, which
        costs less than an attribute at a time)."""
        h = tuple.__new__(cls, (src_info, None, tokens, hidden, experts))
        h.__dict__ = {"src_info": src_info, "_packed": None, "_pairs": pairs,
                      "num_max_dispatch_tokens_per_rank": tokens, "hidden": hidden,
                      "num_experts": experts, "recv_count": recv_count, "num_tokens": num_tokens,
                      "top_k": top_k, "use_fp8": use_fp8, "path": path, "_key": key,
                      "_buffer": buffer, "_id": hid, "_seq": seq}
        return h

    @property
    def layout_range(self):
        if self._pairs is None:
            return self._packed
        import torch

        # Not cached: graph replays write new pairs into the same tensor.
        p = self._pairs.to(torch.int64)
        return (p[..., 0] << 32) | p[..., 1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        if i in (1, 1 - len(self)):
            return self.layout_range
        return super().__getitem__(i)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def layout_pairs(self):
        """``(begin, count)``: two ``int32 [L, R]`` tensors."""
        if self._pairs is not None:
            return self._pairs[..., 0], self._pairs[..., 1]
        import torch

        lr = self.layout_range
        return (lr >> 32).to(torch.int32), (lr & 0xFFFFFFFF).to(torch.int32)


class _Dtypes:
    def __init__(self, torch):
        self.bf16 = torch.bfloat16
        self.fp8 = torch.float8_e4m3fn
        self.f32 = torch.float32
        self.i32 = torch.int32
        self.i64 = torch.int64
        # What the native CallSpec compares tensors' dtypes with (by identity), in its order.
        self.native = (self.bf16, self.fp8, self.f32, self.i32, self.i64)


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Buffer:
    """Low-latency expert-parallel dispatch and combine, with DeepEP's API.

    Arguments (DeepEP's, same order and defaults):
        group: the ``torch.distributed`` process group of the EP ranks (one rank per process).
            The rendezvous (CUDA IPC handles, or the NCCL unique id) goes through it with
            ``all_gather_object``. ``comm`` (an ``mpi4py`` communicator) may stand in for it.
        num_nvl_bytes, num_rdma_bytes: accepted and ignored: our buffers are sized from the
            shape ``(T, H, E, K)`` when the first dispatch fixes it (see
            ``get_low_latency_rdma_size_hint`` for how much memory that is).
        low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
        use_fabric: accepted and ignored (this Buffer only has the low-latency mode; there are
            no RDMA queue pairs, no fabric memory).
        enable_shrink: DeepEP's shrink mode: a wait for a peer that runs out masks that peer on
            this rank instead of raising; later calls neither send to a masked rank nor wait
            for it, and the selections of its experts count as -1 (on every unmasked rank the
            outputs equal the same call with those slots set to -1 and the masked ranks sending
            nothing). The mask: ``low_latency_query_mask_buffer``, ``..._update_...``,
            ``..._clean_...``. CUDA IPC only (transport='auto'), at most 256 ranks.
        explicitly_destroy: accepted; ``destroy()`` works either way, and buffers are freed
            when the Buffer is garbage-collected.

    Our own keywords (all optional):
        path: 'batched' (default; one message per destination rank) or 'per_expert' (one per
            selection, as DeepEP sends). Outputs are bit-identical either way.
        transport: 'auto' (default: NVLink over CUDA IPC between the processes, one node),
            'nccl' (every peer, this rank included, through NCCL; one GPU per rank) or
            'two-tier' (CUDA IPC to the ranks of this rank's node, NCCL to the others; the node
            is ``EP_NODE_ID``, else torchrun's ``GROUP_RANK``, else the hostname). Where NCCL
            carries traffic it sends fixed capacities (no host round trip: stream-ordered and
            capturable); only the batched path does that, so ``path='per_expert'`` with 'nccl'
            or 'two-tier' raises ``UnsupportedError``. The NCCL unique id goes through
            ``group`` with the IPC handles.
        timeout_s: the bound of every wait in the kernels (default 10 s); a wait that runs out
            raises ``ep_dispatch.TimeoutError`` naming rank, peer, phase and call.
        num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk: the shape up front;
            later calls must agree. Otherwise the first dispatch fixes each.
        check_routing: copy ``topk_idx`` to the host on each dispatch and check it (expert range,
            duplicates) before launching. Synchronises the stream: for debugging, not for graphs.
        trap_on_error: trap in the kernel right after it records an error, ending the CUDA
            context as DeepEP's kernels do (default False: the kernel exits cleanly and the
            next call raises). The error is still named afterwards (``poll()``, ``check()``).

    The FP8 scales are DeepEP's, not a difference: ``[L, R*T, H/128]`` (UE8M0: ``int32
    [L, R*T, H/512]``), column-major in the last two dimensions (strides ``(R*T*G, 1, R*T)``, as
    DeepGEMM takes them), the values the contract's.

    Differences from DeepEP, on purpose:
        - Row order is canonical (by source rank, then token), so outputs are reproducible and
          equal the oracle bit for bit.
        - Kernels run on ``torch.cuda.current_stream()``; ``async_finish=True`` returns an event
          recorded there after them (no separate communication stream).
        - ``use_logfmt=True`` sends the combine's rows in our LogFMT-10 (docs/contract.md 4.1:
          per 128 channels two bf16 bounds and 10 bits a value on a logarithmic grid, or the
          bf16 values where a group does not suit it), not DeepEP's encoding: the result is the
          contract's weighted sum of the decoded rows, bit for bit
          ``ep_dispatch.oracle.combine(..., use_logfmt=True)``. It needs H a multiple of 128
          (else ``ConfigError`` ``HiddenNotMultiple``) and NVLink peers only (with
          ``transport='nccl'`` or ``'two-tier'`` it raises ``UnsupportedError``).
        - One group is formed per (shape, FP8 mode); the first call with a new one is collective
          and must not be inside CUDA graph capture (warm up eagerly first).
        - Two operations in flight, as DeepEP's double buffer: a dispatch whose predecessor of
          the same shape is still to be combined runs on a second buffer set (formed at its
          first use; twice the memory of ``get_low_latency_rdma_size_hint`` from then on), so
          dispatch A, dispatch B (hooks or not), then combine A and combine B, in any order of
          the hooks, works. Combine takes the handle of either; a third overlapping dispatch
          reuses the older set, and that set's earlier handle then raises ``InputError``
          (stale). Combine reduces with its dispatch's routing: its ``topk_idx`` is checked for
          shape, and may be a copy of the dispatched values at another address.
        - Errors the kernels find (a timed-out wait, bad routing in ``topk_idx``, bad peer
          data) stop the kernels without trapping (unless ``trap_on_error=True``) and are
          raised at the entry of the next dispatch or combine on this Buffer (read from host
          memory the kernels write: no synchronisation), as ``TimeoutError`` naming rank, peer,
          phase and call, ``InputError`` or ``PeerError``; ``poll()`` raises them without
          making a call, ``check()`` after synchronising. The failed call's outputs are
          defined, so none passes for a good one: a failed dispatch receives nothing
          (``recv_count`` and every ``layout_range`` entry 0), a failed combine's rows are NaN.
          After an error every call raises it again: form a new Buffer.
        - With ``transport='nccl'`` or ``'two-tier'``, NCCL messages have fixed sizes (dispatch:
          a header and all T rows per peer; combine: T * min(K, L) rows per peer), more bytes
          than the rows there are, because exact sizes would need the host to read the batch
          headers mid-call. The per-expert path needs exact sizes and is refused there
          (``UnsupportedError``). NCCL's receives are not bounded by ``timeout_s``: a peer that
          never sends leaves the stream waiting (bound your own wait on it, e.g. with
          ``async_finish=True`` and ``event.event.query()``). Before capturing a CUDA graph,
          make one eager call of the same shape (NCCL connects peers on first use).
    """

    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None, *,
                 path="batched", transport="auto", timeout_s=10.0,
                 num_max_dispatch_tokens_per_rank=None, hidden=None, num_experts=None,
                 num_topk=None, check_routing=False, trap_on_error=False):
        # Everything that needs no GPU is checked first, so a bad argument is reported as such
        # on any machine.
        _checks.integer("num_nvl_bytes", num_nvl_bytes, lo=0)
        _checks.integer("num_rdma_bytes", num_rdma_bytes, lo=0)
        _checks.integer("num_qps_per_rank", num_qps_per_rank, lo=0)
        for name, v in (("low_latency_mode", low_latency_mode),
                        ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
                        ("allow_mnnvl", allow_mnnvl), ("use_fabric", use_fabric),
                        ("explicitly_destroy", explicitly_destroy),
                        ("enable_shrink", enable_shrink), ("check_routing", check_routing),
                        ("trap_on_error", trap_on_error)):
            _checks.flag(name, v)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise argument_error("timeout_s", f"{timeout_s!r} is not a number of seconds")
        for name, v in (("path", path), ("transport", transport)):
            if not isinstance(v, str):
                raise argument_error(name, f"{v!r} is not a string")
        _native.check_keywords(path, transport, float(timeout_s))
        self._shape = _checks.Shape(num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                    num_topk)
        if group is None and comm is None:
            raise argument_error("group", "a torch.distributed process group is required "
                                          "(or an mpi4py communicator as comm=)")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.path, self.transport, self.timeout_s = path, transport, float(timeout_s)
        self.check_routing = check_routing
        self.trap_on_error = trap_on_error
        self.enable_shrink = enable_shrink
        self._ident = id(self)  # what this Buffer's handles carry (`Handle._buffer`)
        self._ranks = {}
        self._combine_buffers = {}
        self._due = {}  # per shape, per buffer set: the dispatch (sequence no.) still to combine
        self._seq = 0  # dispatches so far (orders the buffer sets' due dispatches)

        # Then the GPU: a clear NoDeviceError where there is none, NotBuiltError where this
        # build cannot run on it. torch is imported only now.
        _native.probe_devices(1)
        _native.probe_transport(transport)  # 'nccl' needs libnccl in this process
        if _native.DEVICE_API is None:  # a build without GPU execution
            from .errors import NotBuiltError

            raise NotBuiltError("not built: this build of ep_dispatch has no GPU device API")
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"ep_dispatch.Buffer needs torch, which cannot be imported: {e}") \
                from e

        self._torch = torch
        self._dt = _Dtypes(torch)
        if group is not None:
            self.group = group
            self.rank, self.group_size = group.rank(), group.size()
        else:
            self.group = comm
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
        self._comm = comm if group is None else None
        self._device = torch.cuda.current_device()
        raw = _torch_ext.raw_stream_fn(torch)
        self._raw_stream = raw if raw is not None else (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
        # Where every tensor of a call must be, and where outputs are allocated.
        self._dev = torch.device("cuda", self._device)
        self._dev_index = self._device  # what the native checks want of `get_device()`
        # Every call runs with torch functions disabled: its torch calls (allocations, the
        # native side's reads of tensor metadata) then skip torch's modes, e.g. the
        # default-device mode of `torch.set_default_device('cuda')` (a Python
        # `__torch_function__` per call), as DeepEP's C++ does. Our calls pass devices
        # explicitly, so no mode has anything to add.
        self._notf = getattr(torch._C, "DisableTorchFunction", _NoContext)
        # The C++ call path (ep_dispatch/_torch_ext.py: built at the first Buffer of a process,
        # EP_DISPATCH_TORCH_EXT chooses), or None for the Python one (`call_path`).
        self._ext = _torch_ext.load(torch)
        if self._shape.experts is not None and self._shape.experts % self.group_size:
            raise argument_error("num_experts", f"{self._shape.experts} is not a multiple of "
                                                f"the group's {self.group_size} ranks")

    @property
    def call_path(self):
        """How calls reach the native rank: ``'extension'``, through the C++ torch extension
        (outputs allocated and tensors read in C++, one native call per half), or ``'python'``,
        through the native module's methods (outputs allocated with ``torch.empty``, tensors
        read through their Python attributes). The same checks, errors and outputs either way;
        ``EP_DISPATCH_TORCH_EXT`` chooses (see the README)."""
        return "python" if self._ext is None else "extension"

    # ---- DeepEP's static helpers -------------------------------------------------------------

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts, *, num_topk=None, transport="auto"):
        """Bytes of GPU memory one rank's buffers take for this shape (our layout, computed by
        ep-kernels: BF16, the largest payload; ``num_topk`` None means the bound over every
        top-k up to 16). ``transport='nccl'`` and ``'two-tier'`` add the NCCL staging buffer
        (a two-tier rank allocates it before it knows whether any peer is on another node).
        NCCL's own memory (its communicator's buffers) is not counted. Needs no GPU."""
        _checks.integer("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        _checks.integer("hidden", hidden)
        _checks.integer("num_ranks", num_ranks)
        _checks.integer("num_experts", num_experts)
        if num_topk is not None:
            _checks.integer("num_topk", num_topk, 1, _checks.MAX_TOP_K)
        if not isinstance(transport, str):
            raise argument_error("transport", f"{transport!r} is not 'auto', 'nccl' or 'two-tier'")
        return _native.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                 num_experts, num_topk, transport)

    @staticmethod
    def set_num_sms(new_num_sms):
        """Accepted for DeepEP code; our low-latency kernels size their grids themselves."""
        _checks.integer("new_num_sms", new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An ``EventOverlap`` holding an event recorded on the current stream."""
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """A no-op: our signals carry the call's epoch, so no buffer ever needs cleaning. The
        arguments are checked all the same."""
        _checks.integer("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        _checks.integer("hidden", hidden)
        _checks.integer("num_experts", num_experts)

    # ---- shrink mode's mask (DeepEP's three calls) -------------------------------------------

    def _shrink_groups(self, what):
        if not self.enable_shrink:
            from .errors import UnsupportedError

            raise UnsupportedError(f"{what} needs Buffer(..., enable_shrink=True)")
        return list(self._ranks.values())

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (``mask=True``) or unmasks ``rank_to_mask`` on this rank, in stream order, as
        DeepEP's. Unmasking a rank that missed calls needs ``low_latency_clean_mask_buffer`` on
        every rank instead (the ranks' call counts differ by the calls it missed)."""
        _checks.integer("rank_to_mask", rank_to_mask, 0, self.group_size - 1)
        _checks.flag("mask", mask)
        for g in self._shrink_groups("low_latency_update_mask_buffer"):
            g.update_mask(self._stream(), rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes this rank's mask into ``mask_status`` (``int32 [R]`` on this device; 1:
        masked), in stream order, as DeepEP's. With groups of several shapes, a rank masked in
        any of them is reported masked."""
        torch = self._torch
        _checks.tensor("mask_status", mask_status, self._dt.i32, (self.group_size,), self._dev)
        groups = self._shrink_groups("low_latency_query_mask_buffer")
        mask_status.zero_()
        part = torch.empty_like(mask_status) if len(groups) > 1 else mask_status
        for g in groups:
            g.query_mask(self._stream(), part)  # checked natively too
            if part is not mask_status:
                mask_status.bitwise_or_(part)

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank on this rank and resets its protocol state, in stream order.
        Unlike DeepEP's, it brings a rank that missed calls back: call it on every rank of the
        group with no call in flight, and let no rank call again before all have cleaned
        (e.g. ``torch.cuda.synchronize(); torch.distributed.barrier()`` after it)."""
        for g in self._shrink_groups("low_latency_clean_mask_buffer"):
            g.clean_mask(self._stream())

    def poll(self):
        """Raises what the kernels recorded so far (as ``check()`` does), without waiting for
        them: it reads host memory the kernels write, synchronises nothing, and may be called
        while kernels run (e.g. to bound a wait on an event). Every dispatch and combine makes
        the same check at its entry. (DeepEP has no counterpart.)"""
        for g in self._ranks.values():
            g.poll()

    def check(self):
        """Raises what the kernels recorded on the device since the last check: a timed-out
        wait (``TimeoutError`` naming rank, peer, phase, call), bad routing (``InputError``
        naming rank, token, slot) or bad peer data (``PeerError``). Afterwards the group refuses
        further calls. Synchronises with the GPU; not inside CUDA graph capture. (DeepEP has no
        counterpart: its kernels trap instead.)"""
        for g in self._ranks.values():
            g.check()

    def destroy(self):
        """Releases the GPU buffers (the next call forms the groups again). Waits for the
        device first: kernels still queued may use them."""
        if self._ranks and getattr(self, "_dev", None) is not None and self._dev.type == "cuda":
            self._torch.cuda.synchronize(self._dev)
        self._ranks.clear()
        self._combine_buffers.clear()
        self._due.clear()

    def __del__(self):
        # A Buffer caught in a reference cycle is freed by Python's cyclic collector, which may
        # run in the middle of another Buffer's CUDA graph capture; releasing the groups then
        # (their drop synchronises the context and frees device memory) would invalidate that
        # capture. They wait in _DEFERRED until a call outside capture (or the process's end).
        ranks = getattr(self, "_ranks", None)
        torch = getattr(self, "_torch", None)
        if not ranks or torch is None:
            return
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except Exception:  # interpreter shutdown: nothing is captured any more
            capturing = False
        if capturing:
            _DEFERRED.extend(ranks.values())
            ranks.clear()

    # ---- the group ------------------------------------------------------------------------

    def _all_gather(self, blob):
        if self._comm is not None:
            return [bytes(b) for b in self._comm.allgather(blob)]
        objs = [None] * self.group_size
        self._torch.distributed.all_gather_object(objs, blob, group=self.group)
        return [bytes(b) for b in objs]

    def _pick_set(self, shape):
        """The key of the group (buffer set) the next dispatch of `shape` uses (see
        `_rank_group`)."""
        due = self._due.setdefault(shape, [None, None])  # per set: the dispatch to combine
        if due[0] is None or (shape, 0) not in self._ranks:
            i = 0
        elif due[1] is None:
            i = 1
        else:
            i = 0 if due[0] < due[1] else 1
        return (shape, i)

    def _rank_group(self, T, H, E, K, use_fp8, round_scale, use_ue8m0):
        """The group (buffer set) the next dispatch of this shape uses, and its key.

        A group keeps the state of its latest dispatch (the handle combine needs), so two
        dispatches whose combines are both still due need two groups, as DeepEP's double
        buffer: a dispatch takes set 0 unless set 0's latest dispatch is still to be combined,
        then set 1 (formed at its first use, collectively: every rank makes the same calls);
        with both still due, the older one's handle becomes stale (combining it raises). A
        Buffer that never overlaps two dispatches keeps one set."""
        shape = (T, H, E, K, use_fp8, use_fp8 and round_scale, use_fp8 and use_ue8m0)
        key = self._pick_set(shape)
        if _DEFERRED:
            _release_deferred(self._torch)
        g = self._ranks.get(key)
        self._poll_others(g)  # before a group forms, too
        if g is None:
            # The shape is validated once, here (raises ConfigError naming the bad value);
            # the spec checks every tensor of the group's calls.
            spec = _native.CallSpec(self.group_size, E, T, H, K, use_fp8, round_scale, use_ue8m0,
                                    self._dev_index, self._dt.native)
            g = _native.GpuRank(spec, self.rank, self.path, self.transport, self.timeout_s,
                                self._all_gather, self.trap_on_error, self.enable_shrink)
            self._ranks[key] = g
            s = self._shape
            s.tokens, s.hidden, s.experts, s.top_k = T, H, E, K
        return key, g

    def _poll_others(self, g):
        """Raises an error any group of this Buffer but `g` recorded (g's native call checks its
        own at entry): each group's call reads only its own error words, so without this a call
        on another group (the other buffer set, another mode) could pass for a good one after an
        error. A host read per group, no sync."""
        for o in self._ranks.values():
            if o is not g:
                o.poll()

    def _stream(self):
        # torch's current stream of the Buffer's device as the raw CUstream (what
        # `current_stream(dev).cuda_stream` returns, without building a Stream object).
        return self._raw_stream(self._device)

    def _event(self, tensors):
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self._device))
        return EventOverlap(ev, tensors)

    # ---- dispatch and combine -------------------------------------------------------------

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False):
        """Sends each token to the ranks of its experts; returns
        ``(recv_x, recv_count, handle, event, hook)`` as DeepEP does.

        ``recv_x``: ``(float8_e4m3fn [L, R*T, H], float32 [L, R*T, H/128])`` with FP8 (UE8M0:
        ``int32 [L, R*T, H/512]`` scales), else ``bfloat16 [L, R*T, H]``. The scales are
        column-major in the last two dimensions, as DeepEP's: strides ``(R*T*G, 1, R*T)``.
        ``recv_count``: ``int32 [L]``. Rows at or past ``recv_count[l]`` carry no meaning. With
        ``return_recv_hook=True`` only the send half is enqueued, and calling ``hook()``
        enqueues the receive half (on the then-current stream). ``cumulative_local_expert_recv_stats``
        (``int32 [L]``) is incremented by ``recv_count`` on the device, by the receive kernel of a
        call that succeeded; ``dispatch_wait_recv_cost_stats`` (``int64 [R]``) gets the SM clock
        cycles (``clock64``, as DeepEP counts them) the receive waited for each source's tokens:
        once per source on the batched path, once per local expert and source on the per-expert
        path (as DeepEP's kernel); a source reached through NCCL adds nothing (its tokens arrive
        before the kernel starts).
        """
        if not (use_fp8.__class__ is bool and round_scale.__class__ is bool
                and use_ue8m0.__class__ is bool and async_finish.__class__ is bool
                and return_recv_hook.__class__ is bool):  # one test on the hot path
            for name, v in (("use_fp8", use_fp8), ("round_scale", round_scale),
                            ("use_ue8m0", use_ue8m0), ("async_finish", async_finish),
                            ("return_recv_hook", return_recv_hook)):
                _checks.flag(name, v)
        if self._ext is not None:
            return self._dispatch_ext(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                      cumulative_local_expert_recv_stats,
                                      dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                                      use_ue8m0, async_finish, return_recv_hook)
        with self._notf():
            return self._dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                  cumulative_local_expert_recv_stats,
                                  dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0,
                                  async_finish, return_recv_hook)

    def _dispatch_ext(self, x, topk_idx, T, E, stats, wait_stats, use_fp8, round_scale,
                      use_ue8m0, async_finish, return_recv_hook):
        """`_dispatch` through the C++ extension: one call allocates the outputs, describes every
        tensor and enqueues (the native entry checks each tensor as the native methods do)."""
        R, s = self.group_size, self._shape
        # A shape this Buffer dispatched before, whose group exists: no tensor is read here (the
        # Buffer's shape is fixed by then: H and K are its). Otherwise, the Python path's checks
        # first, which name what disagrees with this Buffer's shape before a group forms.
        shape = (T, s.hidden, E, s.top_k, use_fp8, use_fp8 and round_scale,
                 use_fp8 and use_ue8m0)
        g = None
        if (T.__class__ is int and E.__class__ is int and not self.check_routing
                and shape in self._due):
            key = self._pick_set(shape)
            g = self._ranks.get(key)
        fast = g is not None
        if fast:
            if _DEFERRED:
                _release_deferred(self._torch)
            if len(self._ranks) > 1:
                self._poll_others(g)
            H, K = s.hidden, s.top_k
        else:
            with self._notf():
                _, H, K = _checks.dispatch_args(x, topk_idx, T, E, self._shape, R, self._dev,
                                                self._dt)
                if self.check_routing:
                    host = topk_idx.detach().to("cpu").contiguous().numpy().tobytes()
                    _native.check_routing(self.rank, R, E, T, H, K, host)
                key, g = self._rank_group(T, H, E, K, use_fp8, round_scale, use_ue8m0)
        mode = (2 if use_ue8m0 else 1) if use_fp8 else 0
        # On torch's current stream of the Buffer's device, fetched in C++. A send half's
        # tensors are held natively until its receive half is enqueued: by the hook (a native
        # RecvHook, which enqueues it once, on the then-current stream), or first thing in the
        # next dispatch of this set, as in `_dispatch`.
        try:
            out, recv_count, src_info, pairs, hid, n, hook = self._ext.dispatch(
                g, self._dev_index, x, topk_idx, stats, wait_stats, E // R, R, T, H, mode,
                return_recv_hook)
        except ArgumentError:
            if fast:
                self._name_dispatch_fault(x, topk_idx, T, E, use_fp8, round_scale, use_ue8m0)
            raise
        self._seq += 1
        self._due[key[0]][key[1]] = self._seq
        handle = Handle._of_dispatch(src_info, pairs, T, H, E, recv_count, n, K, use_fp8,
                                     self.path, key, self._ident, hid, self._seq)
        if async_finish:
            recv_x, scales = out if use_fp8 else (out, None)
            with self._notf():
                event = self._event((x, topk_idx, recv_x, scales, recv_count, src_info, pairs,
                                     stats, wait_stats))
        else:
            event = _NO_EVENT
        return out, recv_count, handle, event, hook

    def _name_dispatch_fault(self, x, topk_idx, T, E, use_fp8, round_scale, use_ue8m0):
        """After the native entry refused a dispatch that `_dispatch_ext` made without reading
        shapes: where `_dispatch` would have run the Python checks first (shapes that are not a
        dispatched shape of this Buffer), runs them, so the error is the one they raise."""
        with self._notf():
            try:
                _, H = x.shape
                K = topk_idx.shape[1]
                known = (T, H, E, K, use_fp8, use_fp8 and round_scale,
                         use_fp8 and use_ue8m0) in self._due
            except (AttributeError, IndexError, TypeError, ValueError):
                known = False
            if not known:
                _checks.dispatch_args(x, topk_idx, T, E, self._shape, self.group_size, self._dev,
                                      self._dt)

    def _dispatch(self, x, topk_idx, T, E, stats, wait_stats, use_fp8, round_scale, use_ue8m0,
                  async_finish, return_recv_hook):
        torch, dt = self._torch, self._dt
        R = self.group_size
        # The group is chosen by (T, H, E, K) and the mode: read from the tensors' shapes. The
        # native call checks every tensor against the group's spec (dtype, shape, strides,
        # device); only the first call of a shape, or arguments whose shapes cannot be read,
        # take the Python checks, which name what disagrees with this Buffer's shape.
        try:
            n, H = x.shape
            K = topk_idx.shape[1]
            known = (T.__class__ is int and E.__class__ is int
                     and (T, H, E, K, use_fp8, use_fp8 and round_scale,
                          use_fp8 and use_ue8m0) in self._due)
        except (AttributeError, IndexError, TypeError, ValueError):
            known = False
        if not known:
            n, H, K = _checks.dispatch_args(x, topk_idx, T, E, self._shape, R, self._dev, dt)
        L, RT = E // R, R * T
        if self.check_routing:
            host = topk_idx.detach().to("cpu").contiguous().numpy().tobytes()
            _native.check_routing(self.rank, R, E, T, H, K, host)
        key, g = self._rank_group(T, H, E, K, use_fp8, round_scale, use_ue8m0)

        dev = self._dev
        if use_fp8:
            recv_x = torch.empty((L, RT, H), dtype=dt.fp8, device=dev)
            # DeepEP's layout: column-major in the last two dims, strides (RT*G, 1, RT); the
            # kernels write it so (the group's scales_column_major option).
            G = H // 512 if use_ue8m0 else H // 128
            scales = torch.empty_strided((L, RT, G), (RT * G, 1, RT),
                                         dtype=dt.i32 if use_ue8m0 else dt.f32, device=dev)
        else:
            recv_x = torch.empty((L, RT, H), dtype=dt.bf16, device=dev)
            scales = None
        recv_count = torch.empty((L,), dtype=dt.i32, device=dev)
        src_info = torch.empty((L, RT), dtype=dt.i32, device=dev)
        # The kernels write (begin, count) int32 pairs; the handle packs DeepEP's int64
        # `layout_range` from them on demand.
        pairs = torch.empty((L, R, 2), dtype=dt.i32, device=dev)
        if return_recv_hook:
            # The native rank holds the send half's tensors until its receive half is
            # enqueued: by the hook, or by the next dispatch of this set (which enqueues it
            # first when the hook was not called, so a lost hook never leaves the Buffer stuck;
            # the hook is then a no-op).
            hid = g.dispatch_send(self._stream(), x, topk_idx, recv_x, scales, recv_count,
                                  src_info, pairs, stats, wait_stats)
            done = False

            def hook():
                nonlocal done
                if done:
                    return
                done = True
                with self._notf():
                    g.dispatch_recv(self._stream(), hid)
        else:
            hid = g.dispatch(self._stream(), x, topk_idx, recv_x, scales, recv_count, src_info,
                             pairs, stats, wait_stats)
            hook = None
        self._seq += 1
        self._due[key[0]][key[1]] = self._seq
        handle = Handle._of_dispatch(src_info, pairs, T, H, E, recv_count, n, K,
                                     use_fp8, self.path, key, self._ident, hid, self._seq)
        out = (recv_x, scales) if use_fp8 else recv_x
        event = self._event((x, topk_idx, recv_x, scales, recv_count, src_info, pairs, stats, wait_stats)) \
            if async_finish else _NO_EVENT
        return out, recv_count, handle, event, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Sends the expert outputs ``x`` (``bfloat16 [L, R*T, H]``, in the dispatch layout)
        back and reduces them with ``topk_weights``; returns ``(combined_x, event, hook)``,
        ``combined_x``: ``bfloat16 [n, H]`` (written into ``out`` when given).

        ``zero_copy=True`` combines the tensor ``get_next_low_latency_combine_buffer`` returned
        instead of ``x``; either way the batched path's kernels read the expert rows of ranks
        on this GPU in place (ep-kernels' ``zero_copy_local``, always on here), and ranks on
        other GPUs get them as a put, so ``zero_copy`` only chooses which tensor is read.
        ``use_logfmt=True``: the rows travel in LogFMT-10 (see the class docstring);
        ``combine_wait_recv_cost_stats`` (``int64 [R]``) gets the SM clock cycles the receive
        waited for each owner's rows, as dispatch's stats do (nothing where every rank is on this
        GPU: the batched kernels then read the rows in place and wait for nobody).
        """
        if self._ext is not None:
            return self._combine_ext(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                     return_recv_hook, out, combine_wait_recv_cost_stats,
                                     use_logfmt)
        with self._notf():
            return self._combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                 return_recv_hook, out, combine_wait_recv_cost_stats, use_logfmt)

    def _combine_of(self, x, handle, zero_copy, async_finish, return_recv_hook, use_logfmt):
        """A combine's checks before its tensors: the flags, the handle (this Buffer's, its group
        alive), the other groups' errors; returns the handle's key, its group and the expert
        outputs to combine (``x``, or the zero-copy buffer)."""
        if not (use_logfmt.__class__ is bool and zero_copy.__class__ is bool
                and async_finish.__class__ is bool and return_recv_hook.__class__ is bool):
            for name, v in (("use_logfmt", use_logfmt), ("zero_copy", zero_copy),
                            ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
                _checks.flag(name, v)
        if not isinstance(handle, Handle) or getattr(handle, "_buffer", None) != self._ident:
            raise InputError("argument `handle`: not a handle returned by this Buffer's "
                             "low_latency_dispatch")
        key = handle._key
        g = self._ranks.get(key)
        if g is None:
            raise InputError("argument `handle`: its group was destroyed")
        if len(self._ranks) > 1:
            self._poll_others(g)
        y = self._combine_buffers.get(key) if zero_copy else x
        if y is None:
            raise argument_error("zero_copy", "no get_next_low_latency_combine_buffer(handle) "
                                              "was filled for this shape")
        return key, g, y

    def _combine_ext(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                     return_recv_hook, out, wait_stats, use_logfmt):
        """`_combine` through the C++ extension (`out` allocated there where None; the stream
        and, for a send half, the native receive hook as in `_dispatch_ext`)."""
        key, g, y = self._combine_of(x, handle, zero_copy, async_finish, return_recv_hook,
                                     use_logfmt)
        flags = (1 if return_recv_hook else 0) | (2 if use_logfmt else 0)
        out, hook = self._ext.combine(g, self._dev_index, handle._id, y, topk_idx, topk_weights,
                                      out, wait_stats, handle.num_tokens, handle.hidden, flags,
                                      handle if return_recv_hook else None)
        due = self._due.get(key[0])
        if due is not None and due[key[1]] == handle._seq:
            due[key[1]] = None  # this set is free for the next dispatch
        if async_finish:
            with self._notf():
                event = self._event((y, topk_idx, topk_weights, handle.src_info, out))
        else:
            event = _NO_EVENT
        return out, event, hook

    def _combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                 return_recv_hook, out, wait_stats, use_logfmt):
        key, g, y = self._combine_of(x, handle, zero_copy, async_finish, return_recv_hook,
                                     use_logfmt)
        if out is None:
            out = self._torch.empty((handle.num_tokens, handle.hidden), dtype=self._dt.bf16,
                                    device=self._dev)
        # The native call checks y, topk_idx, topk_weights, out and the stats against the
        # dispatch's shape and token count.
        if return_recv_hook:
            cid = g.combine_send(self._stream(), handle._id, y, topk_idx, topk_weights, out,
                                 wait_stats, handle, use_logfmt)  # held natively, as in dispatch
            done = False

            def hook():
                nonlocal done
                if done:
                    return
                done = True
                with self._notf():
                    g.combine_recv(self._stream(), cid)
        else:
            g.combine(self._stream(), handle._id, y, topk_idx, topk_weights, out, wait_stats,
                      use_logfmt)
            hook = None
        due = self._due.get(key[0])
        if due is not None and due[key[1]] == handle._seq:
            due[key[1]] = None  # this set is free for the next dispatch
        event = self._event((y, topk_idx, topk_weights, handle.src_info, out)) \
            if async_finish else _NO_EVENT
        return out, event, hook

    def get_next_low_latency_combine_buffer(self, handle):
        """A ``bfloat16 [L, R*T, H]`` tensor to write the expert outputs into; a following
        ``low_latency_combine(..., zero_copy=True)`` combines it. DeepEP's zero-copy buffer:
        here the batched path's combine reads the caller's rows in place on the same GPU with
        or without it."""
        if not isinstance(handle, Handle) or getattr(handle, "_buffer", None) != self._ident:
            raise InputError("argument `handle`: not a handle returned by this Buffer's "
                             "low_latency_dispatch")
        buf = self._combine_buffers.get(handle._key)
        if buf is None:
            R, T, H, E = self.group_size, handle[2], handle[3], handle[4]
            buf = self._torch.empty((E // R, R * T, H), dtype=self._dt.bf16,
                                    device=self._dev)
            self._combine_buffers[handle._key] = buf
        return buf
