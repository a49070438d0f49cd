"""What the Client says of the runtimes (Kubeflow TrainerClient's `list_runtimes`, `get_runtime`,
`get_runtime_packages`): each runtime's name, framework label, nodes, device and the image it runs on a
launcher, and what its environment holds (Python's version, `pip list`, `nvidia-smi` where there is one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainjob import runtimes

UNKNOWN = "Unknown"  # Kubeflow SDK's word for what a runtime does not say
# The SDK's one-off container command for a runtime's packages (its Container backend).
PACKAGES_SCRIPT = ("python -c \"import sys; print(f'Python: {sys.version}')\" && (pip list || echo 'pip not found') "
                   "&& (nvidia-smi || echo 'nvidia-smi not found')")


@dataclass(frozen=True)
class RuntimeTrainer:
    """A runtime's trainer as Kubeflow's SDK describes it: `framework` (the `trainer.kubeflow.org/framework`
    label), the `image` it runs on this launcher ("local": this machine's Python), nodes, device and count."""

    framework: str
    image: str
    num_nodes: int = 1
    device: str = UNKNOWN
    device_count: str = UNKNOWN


@dataclass(frozen=True)
class Runtime:
    """A runtime (`name`, Kubeflow's ClusterTrainingRuntime of that name); `function_only`: it runs a user's
    function only (Client.train(func=...)), not `python -m trainer`."""

    name: str
    trainer: RuntimeTrainer
    kind: str = "ClusterTrainingRuntime"
    function_only: bool = False


def unit(name: str) -> runtimes.Runtime:
    """The runtime called `name`; ValueError listing the runtimes where there is none."""
    if name not in runtimes.NAMES:
        raise ValueError(f"runtime={name!r}: no such runtime; the runtimes are {', '.join(runtimes.NAMES)}")
    return runtimes.get(name)


def local_gpus() -> int:
    """GPUs on this machine, as `nvidia-smi -L` lists them (0 without it)."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def _device(launcher: str, options: Mapping[str, Any]) -> tuple[str, str]:
    if launcher == "local":
        gpus = local_gpus()
        return ("gpu", str(gpus)) if gpus else ("cpu", str(os.cpu_count() or 1))
    if launcher == "docker":
        gpus = int(options.get("gpus_per_node") or 0)
        return ("gpu", str(gpus)) if gpus else ("cpu", UNKNOWN)
    res = options.get("resources_per_node") or {}
    if res.get("gpu"):
        return "gpu", str(res["gpu"])
    return ("cpu", str(res["cpu"])) if res.get("cpu") else (UNKNOWN, UNKNOWN)


def describe(name: str, launcher: str, options: Mapping[str, Any]) -> Runtime:
    """Runtime `name` as it runs on `launcher` with the launcher's `options`."""
    u = unit(name)
    if launcher == "local":
        image = "local"
    elif launcher == "docker":
        image = options.get("image") or UNKNOWN
    else:  # a derived runtime runs the job's image; the shipped one's, its own where none is given
        image = options.get("image") or u.kubeflow_image
    device, count = _device(launcher, options)
    return Runtime(name, RuntimeTrainer(u.framework, image, 1, device, count), function_only=u.function_only)


def print_packages() -> None:
    """What a runtime's environment holds (the SDK's print_packages): run in it by `packages`."""
    import shutil
    import subprocess
    import sys

    print(f"Python: {sys.version}")
    if shutil.which("pip"):
        subprocess.run(["pip", "list"], check=False)
    else:
        subprocess.run([sys.executable, "-m", "pip", "list"], check=False)
    if shutil.which("nvidia-smi"):
        print("Available GPUs on the single training node")
        subprocess.run(["nvidia-smi"], check=False)


def local_packages(name: str) -> str:
    """This machine's environment, which local jobs of runtime `name` run in: Python, `pip list`, `nvidia-smi`,
    and what the runtime lacks here (with the pip extra that installs it)."""
    lacking = unit(name).missing()
    lines = [f"Python: {sys.version}"]
    pip = subprocess.run([sys.executable, "-m", "pip", "list", "--disable-pip-version-check"], capture_output=True,
                         text=True)
    lines.append(pip.stdout.rstrip() if pip.returncode == 0 else f"Unable to get installed packages: {pip.stderr}")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
        lines += ["Available GPUs on the single training node", smi.stdout.rstrip()]
    if lacking:
        lines.append(f"missing: {lacking}")
    return "\n".join(lines) + "\n"


def docker_packages(image: str) -> str:
    """What `image` holds, from a one-off container (the SDK Container backend's command)."""
    if not shutil.which("docker"):
        raise RuntimeError("launcher=docker: the docker CLI is not on PATH")
    proc = subprocess.run(["docker", "run", "--rm", "--entrypoint", "bash", image, "-lc", PACKAGES_SCRIPT],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"docker run {image} exited with code {proc.returncode}: "
                           f"{' | '.join(proc.stderr.strip().splitlines()[-3:])}")
    return proc.stdout
