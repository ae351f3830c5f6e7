"""Builds the CPU kernels on the machine that runs them, once, into the user cache.

`library()` compiles `fewrow_matmul.cc` with the system C++ compiler (`$CXX`, else g++ or
clang++) for this CPU (`-march=native`) against the XLA FFI headers that ship with jaxlib,
into `$XDG_CACHE_HOME/medusa_jax/kernels/<key>/` (XDG_CACHE_HOME defaulting to ~/.cache;
`MEDUSA_JAX_KERNEL_CACHE` names another folder). The key covers the source, the compiler,
its flags, jaxlib's version and this CPU's instruction sets, so an upgrade or another CPU
builds afresh and a build is never used where it was not made for.

A new build is checked in a child process (`medusa_fewrow_selftest`: every code path
against a double-precision product) before it is kept, so a build that computes wrong
results, or executes instructions this CPU lacks, is never loaded here. Whatever goes
wrong (no compiler, a failed compile, an unwritable cache folder, a stale or corrupt
library, a CPU without the instructions the build assumed) ends in one line on stderr and
`None`: the callers then use XLA's own products. Nothing here raises.

Start-up never waits on the compiler silently: a step slower than `SLOW_NOTE_S` says what it
waits for, asking the compiler about itself gives up after `PROBE_TIMEOUT_S` and compiling
after `MEDUSA_JAX_KERNEL_TIMEOUT` seconds (default `DEFAULT_TIMEOUT_S`), with the compiler's
whole process group killed (a hung cc1plus would otherwise hold its output open).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("fewrow_matmul.cc")
LIBRARY = "libmedusa_fewrow.so"
CACHE_ENV = "MEDUSA_JAX_KERNEL_CACHE"
FLAGS_ENV = "MEDUSA_JAX_KERNEL_CXXFLAGS"  # replaces -march=native (a cross build, say)
CPU_FLAGS_ENV = "MEDUSA_JAX_CPU_FLAGS"  # what this CPU supports, when /proc says otherwise
TIMEOUT_ENV = "MEDUSA_JAX_KERNEL_TIMEOUT"  # seconds a compile may take
DEFAULT_TIMEOUT_S = 120.0  # the build takes seconds; a slow shared machine, a minute
PROBE_TIMEOUT_S = 30.0  # `--version` and the predefined macros: instant from a working compiler
SLOW_NOTE_S = 2.0
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-DNDEBUG", "-ffp-contract=fast",
              "-fno-math-errno"]

# Compiler macros that mean "this build executes these instructions": macro -> cpuinfo flag.
ISA_MACROS = {"__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX2__": "avx2",
              "__FMA__": "fma", "__AVX__": "avx", "__F16C__": "f16c"}


def note(message: str):
    print(f"note: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "medusa_jax" / "kernels"


def compiler() -> str | None:
    for name in ([os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]):
        found = shutil.which(name)
        if found:
            return found
    return None


def arch_flags() -> list[str]:
    return os.environ.get(FLAGS_ENV, "-march=native").split()


def cpu_flags() -> set[str]:
    """The instruction sets this CPU reports (x86 /proc/cpuinfo `flags`)."""
    if os.environ.get(CPU_FLAGS_ENV) is not None:
        return set(os.environ[CPU_FLAGS_ENV].split())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_timeout() -> float:
    """`MEDUSA_JAX_KERNEL_TIMEOUT` (seconds > 0), else DEFAULT_TIMEOUT_S; ValueError naming
    the variable when it is not a number of seconds."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds > 0")
    return seconds


def _run(cmd: list[str], timeout: float, what: str, slow_note: float = SLOW_NOTE_S
         ) -> subprocess.CompletedProcess:
    """`cmd`'s output; past `slow_note` seconds a note says it waits for `what`, and past
    `timeout` its whole process group is killed and TimeoutExpired raised."""
    slow = threading.Timer(slow_note, note, [
        f"waiting for {what} ({cmd[0]}; giving up after {timeout:g} s; "
        f"MEDUSA_JAX_CPU_KERNELS=0 skips the CPU kernels)"])
    slow.daemon = True
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        slow.start()
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.communicate()  # the pipes close once the group is gone
            raise
        finally:
            slow.cancel()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def required_isa(cxx: str, flags: list[str], timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """The instruction sets code compiled with `flags` may execute (from the macros the
    compiler defines for them)."""
    out = _run([cxx, *flags, "-dM", "-E", "-x", "c++", os.devnull], timeout,
               "the C++ compiler's predefined macros").stdout
    return sorted(flag for macro, flag in ISA_MACROS.items() if f"#define {macro} " in out)


def _first_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if "error" in ln] or text.strip().splitlines()
    return lines[0][:200] if lines else "no output"


def _selftest(path: Path) -> str | None:
    """None when the library loads and computes right in a child process; else why not."""
    code = ("import ctypes, sys; "
            f"sys.exit(ctypes.CDLL({str(path)!r}).medusa_fewrow_selftest())")
    try:
        # a busy machine may take a few seconds to start Python: no note before 10 s
        r = _run([sys.executable, "-c", code], 120, "the CPU kernels' self-test", 10.0)
    except subprocess.TimeoutExpired:
        return "its self-test did not finish"
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        return f"its self-test died of signal {-r.returncode} (an instruction this CPU lacks?)"
    if r.returncode == 3:
        return "its self-test computed wrong products"
    return f"it does not load ({_first_line(r.stderr)})"


def _key(cxx: str, flags: list[str], include: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    import jaxlib

    version = _run([cxx, "--version"], timeout, "the C++ compiler's version").stdout
    version = version.splitlines()[:1]
    parts = [SOURCE.read_bytes().decode(), cxx, *version, *flags, jaxlib.__version__,
             platform.machine(), " ".join(sorted(cpu_flags())), include]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def library() -> tuple[Path | None, str]:
    """(path of a checked library, "") or (None, why there is none)."""
    import jax

    try:
        timeout = build_timeout()
    except ValueError as e:
        return None, str(e)
    cxx = compiler()
    if cxx is None:
        if os.environ.get("CXX"):
            return None, (f"CXX={os.environ['CXX']}: no such C++ compiler (not found, or not "
                          f"executable)")
        return None, "no C++ compiler found (install g++ or set CXX)"
    include = jax.ffi.include_dir()
    flags = arch_flags()
    probe = min(PROBE_TIMEOUT_S, timeout)
    try:
        isa = required_isa(cxx, flags, probe)
        key = _key(cxx, flags, include, probe)
    except subprocess.TimeoutExpired:
        return None, f"the compiler {cxx} did not answer within {probe:g} s"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the compiler {cxx} does not run ({e})"
    missing = sorted(set(isa) - cpu_flags()) if cpu_flags() else []
    if missing:
        return None, (f"a build with {' '.join(flags)} executes {', '.join(missing)}, which "
                      f"this CPU lacks")
    folder = cache_dir() / key
    lib = folder / LIBRARY
    if lib.is_file():
        problem = _selftest(lib)
        if problem is None:
            return lib, ""
        note(f"the CPU kernel build in {folder} is unusable ({problem}); building it again")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
        os.close(fd)
    except OSError as e:
        return None, f"the kernel cache {cache_dir()} is not writable ({e.strerror or e})"
    tmp = Path(tmp)
    try:
        cmd = [cxx, *BASE_FLAGS, *flags, "-I", include, str(SOURCE), "-o", str(tmp)]
        try:
            r = _run(cmd, timeout, "the C++ compiler to build the CPU kernels (once for this "
                                   "machine)")
        except subprocess.TimeoutExpired:
            return None, (f"compiling the CPU kernels with {cxx} took over {timeout:g} s "
                          f"({TIMEOUT_ENV} sets the limit)")
        except OSError as e:  # the compiler, not the cache folder
            return None, f"the compiler {cxx} does not run ({e.strerror or e})"
        if r.returncode != 0:
            return None, f"compiling the CPU kernels failed: {_first_line(r.stderr)}"
        problem = _selftest(tmp)
        if problem is not None:
            return None, f"the new CPU kernel build is unusable ({problem})"
        (folder / "build.json").write_text(json.dumps(
            {"compiler": cxx, "flags": BASE_FLAGS + flags, "isa": isa}, indent=1))
        os.replace(tmp, lib)  # atomic: a reader sees the old library or the whole new one
        return lib, ""
    except OSError as e:
        return None, f"the kernel cache {folder} is not writable ({e.strerror or e})"
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        note(f"the CPU kernels do not load ({e}); using XLA's products")
        return None
