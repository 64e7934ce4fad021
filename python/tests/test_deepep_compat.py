"""python/deepep_compat: `import deep_ep` resolved to ep_dispatch, and the runner that takes a
DeepEP checkout (here a stand-in checkout whose test prints what DeepEP's test prints)."""

import importlib
import re
import sys
from pathlib import Path

import pytest

import ep_dispatch

COMPAT = Path(__file__).resolve().parents[1] / "deepep_compat"
sys.path.insert(0, str(COMPAT))
run = importlib.import_module("run")


def test_deep_ep_resolves_to_ep_dispatch():
    import deep_ep

    assert Path(deep_ep.__file__).parent.parent == COMPAT
    assert deep_ep.Buffer is ep_dispatch.Buffer
    assert deep_ep.Config is ep_dispatch.Config and deep_ep.EventHandle is ep_dispatch.EventHandle
    torch = pytest.importorskip("torch")
    assert deep_ep.topk_idx_t is torch.int64
    with pytest.raises(AttributeError):
        deep_ep.no_such_name


FAKE_TEST = '''
import deep_ep, sys
assert deep_ep.Buffer.__module__.startswith("ep_dispatch"), deep_ep.Buffer.__module__
print("args", sys.argv[1:])
for r, s in ((0, 1.0), (1, 3.0)):
    print(f"[rank {r}] Dispatch + combine bandwidth: 1.00 GB/s, avg_t={20 * s:.2f} us, min_t=1 us, max_t=2 us")
    print(f"[rank {r}] Dispatch bandwidth: 9.00 GB/s, avg_t={10 * s:.2f} us | Combine bandwidth: 8.00 GB/s, avg_t={11 * s:.2f} us")
    print(f"[rank {r}] Dispatch send/recv time: {4 * s:.2f} + {5 * s:.2f} us | Combine send/recv time: {6 * s:.2f} + {7 * s:.2f} us")
'''


def test_runner_runs_the_checkouts_test_on_ours_and_reads_its_figures(tmp_path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_low_latency.py").write_text(FAKE_TEST)
    rc = run.main([str(tmp_path), "--impl", "ours", "--log-dir", str(tmp_path / "logs"), "--",
                   "--num-processes", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "args ['--num-processes', '1']" in out
    log = (tmp_path / "logs" / "test_low_latency-ours.log").read_text()
    figs = run.figures(log.splitlines())
    assert figs == {"dispatch+combine avg_t (events)": 40.0, "dispatch kernel (profiler)": 20.0,
                    "combine kernel (profiler)": 22.0, "dispatch send (hook)": 8.0,
                    "dispatch recv (hook)": 10.0, "combine send (hook)": 12.0,
                    "combine recv (hook)": 14.0}
    assert re.search(r"^dispatch kernel \(profiler\) +20\.00$", out, re.M), out


def test_runner_fails_when_the_test_fails_or_the_checkout_is_wrong(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_low_latency.py").write_text("raise SystemExit(3)\n")
    assert run.main([str(tmp_path)]) == 1
    with pytest.raises(SystemExit):
        run.main([str(tmp_path / "nowhere")])
