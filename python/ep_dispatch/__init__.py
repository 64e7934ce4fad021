"""ep_dispatch: MoE low-latency dispatch/combine with DeepEP's Python API.

- ``ep_dispatch.Buffer``: a drop-in for ``deep_ep.Buffer``'s low-latency mode
  (``low_latency_dispatch`` / ``low_latency_combine``) on torch tensors, one rank per process.
- ``ep_dispatch.oracle``: the contract's reference outputs on host data, to check a Buffer bit
  for bit.
- ``ep_dispatch.errors``: the exceptions (also exported here).
- DeepEP's other names: ``topk_idx_t`` (``torch.int64``), ``Config``, ``EventHandle``.

``import ep_dispatch`` needs neither torch nor a GPU; creating a ``Buffer`` needs both.
``DEVICE_API`` names the GPU device API this build runs on, or is None where it has none.
"""

from . import _ep_dispatch as _native
from . import oracle
from .buffer import Buffer, EventOverlap, Handle
from .deepep_names import Config, EventHandle
from .errors import (
    ArgumentError,
    ConfigError,
    DeviceError,
    EpError,
    InputError,
    NoDeviceError,
    NotBuiltError,
    OutOfMemoryError,
    PeerError,
    TimeoutError,
    UnsupportedError,
)

DEVICE_API = _native.DEVICE_API
validate_config = _native.validate_config


def __getattr__(name):
    # DeepEP's topk_idx_t is a torch dtype; torch is imported only when it is asked for.
    if name == "topk_idx_t":
        import torch

        return torch.int64
    raise AttributeError(f"module 'ep_dispatch' has no attribute {name!r}")


__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "EventOverlap",
    "topk_idx_t",
    "Handle",
    "oracle",
    "validate_config",
    "DEVICE_API",
    "EpError",
    "ConfigError",
    "InputError",
    "ArgumentError",
    "PeerError",
    "TimeoutError",
    "OutOfMemoryError",
    "DeviceError",
    "NoDeviceError",
    "UnsupportedError",
    "NotBuiltError",
]
