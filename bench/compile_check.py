"""Every Triton kernel specialisation of `ops/` compiled for sm_90 and sm_80 on a machine without a GPU, with
a running count: the whole check that tests/ops/test_ops.py's last test makes, as a script that reports as it
goes and picks up where it stopped (Triton's cache keeps each compiled kernel, so a second run compiles only
what is new).

1. The op tests run under Triton's interpreter, recording each kernel specialisation they launch
   (tests/ops/launches.py: argument types, 16-byte alignment, constexprs, warps); `--record FILE` reuses a
   recording instead.
2. The launches at Llama-3-8B's shapes are recorded without running them (the block sizes, warps and tiles
   a GPU uses there).
3. Each distinct specialisation is compiled with `triton.compile` for each architecture down to a cubin, its
   shared memory checked against the architecture's; one line per failure, a progress line every 50.

    python bench/compile_check.py [--record FILE] [--archs 90,80] [--jobs N]

Exit status 1 when any specialisation fails to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

from tests.ops.conftest import COMPILE_TEST, OP_TESTS  # noqa: E402
from tests.ops.launches import RECORD_ENV, compile_spec, distinct  # noqa: E402


def _env(**changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(changes)
    return env


def record(path: str) -> None:
    """The op tests' launches and the model shapes' into `path`."""
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                            "-n", "0", OP_TESTS, "--deselect", COMPILE_TEST], cwd=REPO,
                           env=_env(TRITON_INTERPRET="1", **{RECORD_ENV: path}), capture_output=True, text=True)
    if tests.returncode != 0:
        sys.exit(f"the op tests failed, so their launches are incomplete:\n{tests.stdout[-3000:]}")
    print(tests.stdout.strip().splitlines()[-1], flush=True)
    shapes = subprocess.run([sys.executable, "-m", "tests.ops.launches", "record-model-shapes", path], cwd=REPO,
                            env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True)
    if shapes.returncode != 0:
        sys.exit(f"recording the model shapes failed:\n{shapes.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", help="a recording of launches (JSON lines) to compile instead of making one")
    parser.add_argument("--archs", default="90,80", help="compute capabilities to compile for")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile with TRITON_INTERPRET unset: the interpreter replaces @triton.jit", file=sys.stderr)
        return 2
    archs = [int(a) for a in args.archs.split(",")]
    path = args.record
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="compile_check_"), "launches.jsonl")
        record(path)
    with open(path) as f:
        specs = distinct([json.loads(line) for line in f if line.strip()])
    kernels = sorted({s["kernel"]["name"] for s in specs})
    print(f"{len(specs)} distinct specialisations of {len(kernels)} kernels, for sm_{', sm_'.join(map(str, archs))}",
          flush=True)
    failures, done, start = [], 0, time.monotonic()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for future in as_completed([pool.submit(compile_spec, spec, archs) for spec in specs]):
            lines = future.result()
            failures += lines
            for line in lines:
                print("FAILED", line, flush=True)
            done += 1
            if done % 50 == 0 or done == len(specs):
                print(f"  {done}/{len(specs)} compiled, {len(failures)} failed, {time.monotonic() - start:.0f} s",
                      flush=True)
    print(f"{len(specs)} specialisations x {len(archs)} architectures: {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
