"""The Buffer's C++ call path: ``csrc/torch_ext.cpp``, a torch extension built from source at the
first Buffer (``torch.utils.cpp_extension.load``, ``-O2``, only the headers torch ships; the
build is cached under ``TORCH_EXTENSIONS_DIR``, else torch's default ``~/.cache/torch_extensions``)
and bound to the native module's C ABI (``_ep_dispatch._c_api``).

``EP_DISPATCH_TORCH_EXT`` chooses: unset, build and use it, and where it cannot be built or
loaded (no compiler, no ninja, no torch headers) take the Python path with one warning; ``0``:
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
            ext.bind(_native._c_api)
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


def _build(torch):
    from torch.utils import cpp_extension

    src = SOURCE.read_bytes()
    # One build per source, torch and Python: a name of its own, so builds of other versions
    # in the same cache never replace each other.
    tag = hashlib.sha256(src + torch.__version__.encode() + sys.version.encode()).hexdigest()
    with _ninja_on_path():
        return cpp_extension.load(name=f"ep_dispatch_torch_ext_{tag[:16]}",
                                  sources=[str(SOURCE)], extra_cflags=["-O2"], with_cuda=False,
                                  verbose=False)


@contextlib.contextmanager
def _ninja_on_path():
    """torch's build runs ``ninja`` from PATH; a venv's ninja (the ``ninja`` package, or one beside
    this interpreter) is put on PATH for the build where PATH has none."""
    if shutil.which("ninja"):
        yield
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:  # no ninja package: the interpreter's folder only
        pass
    found = next((d for d in dirs if os.access(os.path.join(d, "ninja"), os.X_OK)), None)
    if found is None:
        yield
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = found + (os.pathsep + old if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old
