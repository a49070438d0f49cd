"""`python -m launchers.packages VENV PACKAGE... [-- COMMAND...]`: a function job's `packages_to_install`.
Make VENV (once), a virtual environment that inherits this one (`python -m venv --system-site-packages`, plus
this environment's own site-packages, which a venv made from a venv would not see), pip-install the packages
into it, then run COMMAND where one is given (whose ranks run VENV's python). When pip fails the job ends here:
one line with pip's reason, exit 1.

Locally VENV is the job's own (`<run_dir>/venv`); on Docker each node container makes its own in its HOME, as the
image's environment may be root's: every container runs this before its ranks, or, where mpirun starts them over
SSH, mpirun runs it once on each host first (`command`).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig


def make_venv(venv: str) -> str:
    """VENV's python, making VENV first where it is not there yet."""
    python = venv_python(venv)
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], check=True)
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        parents = [p for p in (*site.getsitepackages(), sysconfig.get_paths()["purelib"]) if os.path.isdir(p)]
        with open(os.path.join(purelib, "_trainjob_parent.pth"), "w") as f:  # this env's packages, .pth files too
            f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in dict.fromkeys(parents)) + "\n")
    return python


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def command(python: str, venv: str, packages: list[str] | tuple[str, ...], then: list[str] | None = None) -> list[str]:
    """The command that fills `venv` with `packages` using `python` (the environment it inherits), then runs `then`
    (which runs `venv_python(venv)`)."""
    return [python, "-m", "launchers.packages", venv, *packages, *(["--", *then] if then else [])]


def reason(stderr: str) -> str:
    """pip's one-line reason: its first ERROR line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return errors[0] if errors else (lines[-1] if lines else "no output")


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    if cut < 2 or cut == len(argv) - 1:
        print("usage: python -m launchers.packages VENV PACKAGE... [-- COMMAND...]", file=sys.stderr)
        return 2
    venv, packages, then = argv[0], argv[1:cut], argv[cut + 1:]
    python = make_venv(venv)
    pip = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        print(f"error: pip could not install {' '.join(packages)}: {reason(pip.stderr)}", file=sys.stderr, flush=True)
        return 1
    print(f"installed {' '.join(packages)} into {venv}", flush=True)
    if not then:
        return 0
    os.execvp(then[0], then)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
