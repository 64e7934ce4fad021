"""The Buffer's C++ call path: ``csrc/torch_ext.cpp``, a torch extension built from source at the
first Buffer (``torch.utils.cpp_extension.load``, ``-O2``, only the headers torch ships; without
ninja, one compiler call with torch's flags; the build is cached under ``TORCH_EXTENSIONS_DIR``,
else torch's default ``~/.cache/torch_extensions``)
and bound to the native module's C ABI (``_ep_dispatch._c_api``).

``EP_DISPATCH_TORCH_EXT`` chooses: unset, build and use it, and where it cannot be built or
loaded (no compiler, no torch headers) take the Python path with one warning; ``0``:
the Python path, nothing built; ``1``: the extension or ``NotBuiltError`` saying why not.
"""

import contextlib
import hashlib
import os
import pathlib
import shutil
import sys
import warnings

from . import _ep_dispatch as _native
from .errors import NotBuiltError, argument_error

ENV = "EP_DISPATCH_TORCH_EXT"
SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "torch_ext.cpp"

# Per source file: (the bound module, None) or (None, why it could not be had); one build (and
# at most one warning) per process.
_loaded = {}


def setting():
    """``EP_DISPATCH_TORCH_EXT``: '' (unset: the extension where it builds), '0' or '1'."""
    v = os.environ.get(ENV, "")
    if v not in ("", "0", "1"):
        raise argument_error(ENV, f"{v!r} is not '0' or '1' (or unset)")
    return v


def load(torch):
    """The extension module bound to the native module, or None for the Python path."""
    mode = setting()
    if mode == "0":
        return None
    key = str(SOURCE)
    if key not in _loaded:
        try:
            ext = _build(torch)
            ext.bind(_native._c_api, raw_stream_fn(torch))
            _loaded[key] = (ext, None)
        except Exception as e:  # a compiler's, ninja's or the loader's failure, whatever its type
            why = f"{type(e).__name__}: {e}".strip()
            if len(why) > 2000:
                why = why[:1000] + " ... " + why[-1000:]
            _loaded[key] = (None, why)
            if mode != "1":
                warnings.warn(f"ep_dispatch: the C++ torch extension ({SOURCE.name}) could not be "
                              f"built or loaded, so the Buffer takes its Python call path "
                              f"({ENV}=0 chooses it without trying): {why}", RuntimeWarning,
                              stacklevel=3)
    ext, why = _loaded[key]
    if ext is None and mode == "1":
        raise NotBuiltError(f"not built: {ENV}=1 and the C++ torch extension ({SOURCE}) could "
                            f"not be built or loaded: {why}")
    return ext


def raw_stream_fn(torch):
    """``device index -> torch's current stream of that CUDA device as an int`` (the raw
    ``CUstream``): ``torch._C._cuda_getCurrentRawStream``, a C function (no Python frame, no
    torch mode), else ``torch.cuda.current_stream(d).cuda_stream``; None for a torch without
    CUDA. The Python path calls it, and the extension calls it from C at every call and hook."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    if not hasattr(torch._C, "_cuda_getDevice"):
        return None
    return lambda d: torch.cuda.current_stream(d).cuda_stream


def _build(torch):
    from torch.utils import cpp_extension

    src = SOURCE.read_bytes()
    # One build per source, torch and Python: a name of its own, so builds of other versions
    # in the same cache never replace each other.
    tag = hashlib.sha256(src + torch.__version__.encode() + sys.version.encode()).hexdigest()
    name = f"ep_dispatch_torch_ext_{tag[:16]}"
    with _ninja_on_path() as ninja:
        if ninja:
            return cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"],
                                      with_cuda=False, verbose=False)
    return _build_direct(torch, name, _cache_dir() / name)


def _cache_dir():
    """Where the build without ninja goes: ``TORCH_EXTENSIONS_DIR`` (torch's builder's folder)
    where set, else ``$XDG_CACHE_HOME/torch_extensions`` (``~/.cache`` without it), the root of
    torch's default. The build's name carries the hash of the source, torch's version and
    Python's, so no subfolder per version is needed."""
    d = os.environ.get("TORCH_EXTENSIONS_DIR")
    if d:
        return pathlib.Path(d)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "torch_extensions"


def _build_direct(torch, name, folder):
    """Without ninja (torch's builder needs it): one compiler call, as torch's would make (its
    include and library folders, its C++ ABI, C++20 as torch builds its own, -O2), into
    `folder/name.so`, written under a temporary name and renamed (ranks of one host may build
    at once), then loaded."""
    import importlib.machinery
    import importlib.util
    import subprocess
    import sysconfig
    import tempfile

    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    so = folder / f"{name}.so"
    if not so.exists():
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if cxx is None:
            raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH, and no ninja")
        libs = cpp_extension.library_paths()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++20",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               *(f"-I{d}" for d in cpp_extension.include_paths()),
               f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", tmp,
               *(f"-L{d}" for d in libs), *(f"-Wl,-rpath,{d}" for d in libs),
               "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cxx} exited {r.returncode}: {r.stderr[-1500:]}")
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@contextlib.contextmanager
def _ninja_on_path():
    """torch's build runs ``ninja`` from PATH; a venv's ninja (the ``ninja`` package, or one beside
    this interpreter) is put on PATH for the build where PATH has none. Yields whether a ninja
    is on PATH (else the build goes without it: `_build_direct`)."""
    if shutil.which("ninja"):
        yield True
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:  # no ninja package: the interpreter's folder only
        pass
    found = next((d for d in dirs if os.access(os.path.join(d, "ninja"), os.X_OK)), None)
    if found is None:
        yield False
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = found + (os.pathsep + old if old else "")
    try:
        yield True
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old
