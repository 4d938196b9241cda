"""Building and loading the small C kernels of the CPU path (`asyncengine_kernels.cpu_gemm`,
`asyncengine_kernels.cpu_decode_attention`).

A kernel's C source is compiled on first use with the system C compiler (`$CC`, else gcc or
cc) at `-O3 -march=native` with OpenMP, into the engine's cache directory
(`asyncengine_kernels.envs.cache_dir()`), under a name keyed by the source, the compiler and the
CPU: later start-ups load it without compiling, and a cache shared with another CPU builds
its own. OpenMP is the runtime torch itself loaded (same soname), so the kernels share its
threads. Without a compiler, or where the build or the load fails, `native_library` returns
None after one log line, and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from asyncengine_kernels.envs import c_compiler, cache_dir

__all__ = ["VECTOR_EXP_C", "native_library"]

logger = logging.getLogger(__name__)

# C for the kernels that need exp: `vf` (VW floats: AVX-512 or AVX2 width) and a vectorized
# exp(x), 2^n * p(r) with r = x - n ln2 and Cephes' minimax polynomial (about 1 ulp, as the
# vectorized exp torch's own CPU kernels use); 0 below -87.3, inf above 88.7.
VECTOR_EXP_C = r"""
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VW * 4), aligned(4)));

static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.3f, hi = (vf){0} + 88.7f;
    const vi under = x < lo;
    x = (vf)(((vi)x & ~under) | ((vi)lo & under));
    const vi over = x > hi;
    x = (vf)(((vi)x & ~over) | ((vi)hi & over));
    vf t = x * 1.44269504088896341f;
    /* round half away from zero: truncate t + copysign(0.5, t) */
    vf half = (vf)(((vi)t & (vi){0} + (int)0x80000000) | (vi)((vf){0} + 0.5f));
    vi n = __builtin_convertvector(t + half, vi);
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n in two factors, so n = 128 (x near hi) gives inf rather than a wrapped exponent */
    vi n1 = n >> 1;
    vf s1 = (vf)((n1 + 127) << 23), s2 = (vf)((n - n1 + 127) << 23);
    return (vf)((vi)(p * s1 * s2) & ~under);
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    cc = c_compiler()
    return cc if cc and shutil.which(cc) else (shutil.which("gcc") or shutil.which("cc"))


def _build(cc: str, name: str, source: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        lib = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, str(src), "-o", str(lib), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
        os.replace(lib, out)  # atomic: another process may be building the same file


@functools.cache
def native_library(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled `source` (cached on disk under `name`), or None where it cannot be built
    or loaded."""
    cc = _compiler()
    if cc is None:
        logger.info("%s: no C compiler found; the torch path stays in use", name)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout  # fmt: skip
        key = hashlib.sha256(
            "\0".join((source, cc, version, " ".join(FLAGS), _cpu_fingerprint())).encode()
        ).hexdigest()[:16]
        path = cache_dir() / "native" / f"{name}_{key}.so"
        if not path.exists():
            logger.info("%s: compiling with %s", name, cc)
            start = time.perf_counter()
            _build(cc, name, source, path)
            logger.info("%s: compiled in %.1f s (%s)", name, time.perf_counter() - start, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("%s: build or load failed; the torch path stays in use: %s", name,
                       str(detail).strip()[:500])  # fmt: skip
        return None
