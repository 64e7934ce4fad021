"""bench.py's reading of the profiler: kernels picked by name, in launch order, the hook split
into its send and receive halves. Needs torch (for torch.autograd.DeviceType), not a GPU."""

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (bench.py needs it)")


def load_bench():
    path = pathlib.Path(__file__).resolve().parent.parent / "bench.py"
    spec = importlib.util.spec_from_file_location("ep_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Range:
    def __init__(self, start, us):
        self.start, self._us = start, us

    def elapsed_us(self):
        return self._us


class Event:
    def __init__(self, name, start, us, cuda=True):
        from torch.autograd import DeviceType

        self.name, self.time_range = name, Range(start, us)
        self.device_type = DeviceType.CUDA if cuda else DeviceType.CPU


class Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_kernel_times_average_by_name_and_split_the_hook_halves():
    bench = load_bench()
    # Launch order (by start): dispatch send 10, dispatch recv 4, combine send 20, recv 6, twice;
    # listed out of order, with a CPU event and an unrelated kernel mixed in.
    ev = [Event("ep_batched::dispatch(KParams, IoTable)", 50, 12), Event("ep_batched::dispatch(KParams, IoTable)", 0, 10),
          Event("ep_batched::dispatch(KParams, IoTable)", 1, 4), Event("ep_batched::combine(KParams, IoTable)", 2, 20),
          Event("ep_batched::combine(KParams, IoTable)", 3, 6), Event("ep_batched::dispatch(KParams, IoTable)", 51, 6),
          Event("ep_batched::combine(KParams, IoTable)", 52, 22), Event("ep_batched::combine(KParams, IoTable)", 53, 8),
          Event("dispatch (cpu op)", 4, 999, cuda=False), Event("elementwise_kernel", 5, 77)]
    (ds, dr), (cs, cr) = bench.kernel_times(Prof(ev), ("dispatch", "combine"), 2)
    assert (ds, dr, cs, cr) == pytest.approx((11e-6, 5e-6, 21e-6, 7e-6))
    (d,), (c,) = bench.kernel_times(Prof(ev), ("dispatch", "combine"), 1)
    assert (d, c) == pytest.approx((8e-6, 14e-6))


def test_kernel_times_say_what_they_saw_when_the_count_is_wrong():
    bench = load_bench()
    with pytest.raises(RuntimeError, match="saw 1 'dispatch' kernels, expected a multiple of 2"):
        bench.kernel_times(Prof([Event("ep_batched::dispatch(KParams, IoTable)", 0, 1),
                                 Event("ep_batched::combine(KParams, IoTable)", 1, 1),
                                 Event("ep_batched::combine(KParams, IoTable)", 2, 1)]), ("dispatch", "combine"), 2)
