"""python/deepep_compat: `import deep_ep` resolved to ep_dispatch, and the runner that takes a
DeepEP checkout (here a stand-in checkout whose test prints what DeepEP's test prints)."""

import importlib
import os
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


FAKE_DEEP_EP = '''
class Buffer:
    def low_latency_dispatch(self, x, return_recv_hook=False):
        return (x, 2, 3, None, (lambda: "received") if return_recv_hook else None)

    def low_latency_combine(self, x, return_recv_hook=False):
        return (x, None, (lambda: "combined") if return_recv_hook else None)
'''

CALLER = '''
import deep_ep
b = deep_ep.Buffer()
for _ in range(3):
    assert b.low_latency_dispatch(7)[0] == 7
for _ in range(2):
    out = b.low_latency_dispatch(8, return_recv_hook=True)
    assert out[0] == 8 and out[-1]() == "received"
assert b.low_latency_combine(9, return_recv_hook=False)[0] == 9
print("caller done")
'''


def test_host_timing_wraps_the_buffers_calls_and_hooks(tmp_path):
    """run.py --host-timing's sitecustomize: DeepEP's Buffer (here a stand-in) timed per method,
    hooks flag and hook, the results returned unchanged, one line each at exit."""
    import subprocess

    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text(FAKE_DEEP_EP)
    # The environment's own sitecustomize, which the timing one shadows, still runs.
    (tmp_path / "sitecustomize.py").write_text('print("shadowed sitecustomize ran")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(COMPAT / "host_timing"), str(tmp_path)]))
    env.pop("RANK", None)
    env.pop("LOCAL_RANK", None)
    out = subprocess.run([sys.executable, "-c", CALLER], env=env, capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "caller done" in out.stdout and "shadowed sitecustomize ran" in out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("[host-timing]")]
    calls = {(m.group(1), m.group(2)): int(m.group(3)) for line in lines
             if (m := re.search(r"rank \S+ (.+?) hooks=(\w+): calls (\d+), median [\d.]+ us", line))}
    assert calls == {("low_latency_dispatch", "False"): 3, ("low_latency_dispatch", "True"): 2,
                     ("low_latency_dispatch hook", "True"): 2,
                     ("low_latency_combine", "False"): 1}, out.stdout
    # Without the timing folder first on the path nothing is wrapped and nothing is printed.
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", CALLER], env=env, capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0 and "[host-timing]" not in out.stdout, out.stdout


def test_runner_reads_the_host_timing_lines_and_puts_the_folder_first(tmp_path):
    env = run.env_for("ours", tmp_path, host_timing=True)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(COMPAT / "host_timing")
    assert str(COMPAT / "host_timing") not in run.env_for("ours", tmp_path)["PYTHONPATH"]
    lines = ["[host-timing] rank 0 low_latency_dispatch hooks=False: calls 9, median 20.00 us, min 1 us",
             "[host-timing] rank 1 low_latency_dispatch hooks=False: calls 9, median 30.00 us, min 1 us",
             "[host-timing] rank 0 low_latency_combine hooks=True: calls 9, median 8.00 us, min 1 us"]
    figs = run.figures(lines)
    assert figs["host: low_latency_dispatch"] == 25.0
    assert figs["host: low_latency_combine (hooks)"] == 8.0
    assert figs["dispatch kernel (profiler)"] is None
