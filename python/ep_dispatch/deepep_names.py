"""DeepEP's names beside ``Buffer``: ``topk_idx_t``, ``Config`` and ``EventHandle``, so code
written for ``deep_ep`` finds them under ``ep_dispatch`` too.

- ``topk_idx_t``: the dtype of ``topk_idx`` (``torch.int64``, as DeepEP's default build). Read
  from the package (``ep_dispatch.topk_idx_t``), which imports torch only then.
- ``Config``: DeepEP's normal-mode chunking config, with DeepEP's checks. The low-latency mode
  (the only one here) does not use it; its buffer size hints are 0: our buffers are sized from
  the shape when the first dispatch fixes it (``Buffer.get_low_latency_rdma_size_hint``).
- ``EventHandle``: a CUDA event recorded on the current stream when made;
  ``current_stream_wait()`` makes the then-current stream wait for it (``EventOverlap`` takes
  one as DeepEP's does).
"""

from . import _checks
from .errors import argument_error


class Config:
    """DeepEP's ``Config(num_sms, num_max_nvl_chunked_send_tokens,
    num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens,
    num_max_rdma_chunked_recv_tokens)``, checked as DeepEP checks it (``ArgumentError`` naming
    the argument where DeepEP asserts)."""

    def __init__(self, num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                 num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens):
        _checks.integer("num_sms", num_sms, lo=0)
        for name, v in (("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                        ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                        ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                        ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            _checks.integer(name, v, lo=1)
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise argument_error("num_max_nvl_chunked_send_tokens",
                                 f"{num_max_nvl_chunked_send_tokens} must be below "
                                 f"num_max_nvl_chunked_recv_tokens = "
                                 f"{num_max_nvl_chunked_recv_tokens}")
        # DeepEP rounds the RDMA receive chunk up to a multiple of the send chunk.
        send, recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        recv = -(-recv // send) * send
        if send > recv // 2:
            raise argument_error("num_max_rdma_chunked_send_tokens",
                                 f"{send} must be at most half of num_max_rdma_chunked_recv_tokens "
                                 f"(rounded up to a multiple of it: {recv})")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = send
        self.num_max_rdma_chunked_recv_tokens = recv

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: no normal-mode NVLink buffer here (the Buffer ignores ``num_nvl_bytes``)."""
        _checks.integer("hidden_bytes", hidden_bytes)
        _checks.integer("num_ranks", num_ranks)
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: no normal-mode RDMA buffer here (low-latency sizes: the Buffer's own hint)."""
        _checks.integer("hidden_bytes", hidden_bytes)
        _checks.integer("num_ranks", num_ranks)
        return 0

    def __repr__(self):
        return (f"Config({self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens})")


class EventHandle:
    """A CUDA event recorded on the current stream when made (DeepEP's ``EventHandle``)."""

    def __init__(self):
        import torch

        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self):
        import torch

        torch.cuda.current_stream().wait_event(self.event)
