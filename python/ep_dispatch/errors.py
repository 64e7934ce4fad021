"""The exceptions of ep_dispatch.

Every error the Rust side returns is raised as one of these classes, with our typed error's message
and its fields as attributes (``kind`` is the Rust variant's name; a ``TimeoutError`` has
``rank``, ``peer``, ``phase``, ``call`` and ``waited_ms``). Each class also derives from the
built-in exception a caller would expect, so ``except ValueError`` or ``except TimeoutError``
(the built-in one) keep working.

    EpError
    ├── ConfigError        (ValueError)         a bad group shape: E % R, H % 128, K, UE8M0 ...
    ├── InputError         (ValueError)         bad inputs: routing, token count, handle ...
    │   └── ArgumentError                       an argument's type/dtype/shape/device, names it
    ├── PeerError          (RuntimeError)       a peer disagreed or failed (kind PeerFailed: its
    │                                           group recorded an error), or the exchange failed
    ├── TimeoutError       (builtins.TimeoutError)  a bounded wait ran out
    ├── OutOfMemoryError   (MemoryError)        the buffers do not fit; says how many bytes
    ├── DeviceError        (RuntimeError)       CUDA, NCCL or NVRTC failed
    │   └── NoDeviceError                       no usable GPU here, and why
    └── UnsupportedError   (NotImplementedError)  outside what the kernels support
        └── NotBuiltError                       this build has no GPU execution
"""

import builtins


class EpError(Exception):
    """Base class of every ep_dispatch error. ``kind``: the Rust error variant."""

    kind = None


class ConfigError(EpError, ValueError):
    """The group's shape breaks a rule of the contract."""


class InputError(EpError, ValueError):
    """An input breaks the contract (routing, token count, a foreign handle, ...)."""


class ArgumentError(InputError):
    """An argument cannot be used as given; ``argument`` names it."""

    def __init__(self, message, argument=None):
        super().__init__(message)
        self.argument = argument


class PeerError(EpError, RuntimeError):
    """A peer announced something else than expected, a peer failed (kind ``PeerFailed``: its
    group recorded an error and published it; ``rank``, ``peer``, ``phase``, ``call``), or the
    rendezvous failed."""


class TimeoutError(EpError, builtins.TimeoutError):  # noqa: A001 (mirrors the built-in)
    """A bounded wait ran out: ``rank`` waited for ``peer`` in ``phase`` of ``call``."""


class OutOfMemoryError(EpError, MemoryError):
    """The communication buffers need more memory than the device has (``needed`` bytes)."""


class DeviceError(EpError, RuntimeError):
    """A CUDA, NCCL or NVRTC call failed."""


class NoDeviceError(DeviceError):
    """No usable GPU (no driver, no NVRTC, too few devices)."""


class UnsupportedError(EpError, NotImplementedError):
    """Outside what the GPU kernels support (e.g. more than 256 ranks: kind ``TooManyRanks``)."""


class NotBuiltError(UnsupportedError):
    """This build of ep_dispatch cannot run the operation (see ``ep_dispatch.DEVICE_API``)."""


def argument_error(argument, reason):
    """An ``ArgumentError`` worded as the Rust side words it."""
    return ArgumentError(f"argument `{argument}`: {reason}", argument=argument)


__all__ = [
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
    "argument_error",
]
