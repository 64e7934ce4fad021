"""``deep_ep`` resolved to ep_dispatch: DeepEP's low-latency names from ep_dispatch, so DeepEP's
own tests and engines written against ``deep_ep`` run on our Buffer unmodified. Put this folder
first on PYTHONPATH (python/deepep_compat/run.py does); nothing of DeepEP is in it."""

from ep_dispatch import Buffer, Config, EventHandle, EventOverlap  # noqa: F401
from ep_dispatch import __getattr__ as _getattr  # topk_idx_t, imported from torch when asked

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]


def __getattr__(name):
    return _getattr(name)
