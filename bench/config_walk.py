"""The config's walk through the code of a real run: `python -m trainer <overrides>` (the default run unless
overrides say otherwise) traced from its start to the optimizer's first step, every call of a function of the
project that is handed the config or one of its sections (the composed DictConfig or a node of it, the typed
`Config` or a section's dataclass; not the constructor of one being built). It prints how many such calls
there were, in how many modules, how often the walk went back into a module it had already left, which
modules it went back into, and the walk itself (consecutive calls in one module as one stay).

    python bench/config_walk.py [override ...]          # e.g. strategy=fsdp2 runtime=null
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
PACKAGES = tuple(os.path.join(REPO, p) + os.sep for p in ("trainjob", "trainer", "launchers", "datacache", "ops"))


def _is_config(value) -> bool:
    from omegaconf import DictConfig

    if isinstance(value, DictConfig):
        try:
            return "train" in value._get_root()
        except Exception:  # a node being built
            return False
    kind = type(value)  # a section's schema: trainer.config's and the launchers' `...Config` dataclasses
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and kind.__name__.endswith("Config") and (
        kind.__module__.startswith(("trainer.config", "launchers")))


class Walk:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []  # (module, function)
        self.done = False

    def profile(self, frame, event, arg):
        if self.done or event != "call":
            return
        code = frame.f_code
        if code.co_name == "step" and "torch/optim" in code.co_filename.replace(os.sep, "/"):
            self.done = True
            return
        if not code.co_filename.startswith(PACKAGES):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if code.co_name in ("__init__", "__post_init__"):  # a section being built is not the config handed on
            names = names[1:]
        if any(_is_config(frame.f_locals.get(n)) for n in names):
            module = os.path.relpath(code.co_filename, REPO).removesuffix(".py").replace(os.sep, ".")
            self.calls.append((module.removesuffix(".__init__"), code.co_qualname))


def stays(calls: list[tuple[str, str]]) -> list[str]:
    walk: list[str] = []
    for module, _ in calls:
        if not walk or walk[-1] != module:
            walk.append(module)
    return walk


def main(overrides: list[str]) -> None:
    from trainer.__main__ import main as trainer_main

    walk = Walk()
    run_dir = tempfile.mkdtemp(prefix="config-walk-")
    sys.argv = ["trainer", "train.max_steps=1", "train.eval_every=1", "train.eval_batches=1", "train.progress=false",
                f"hydra.run.dir={run_dir}", *overrides]
    sys.setprofile(walk.profile)
    try:
        trainer_main()
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    route = stays(walk.calls)
    seen: set[str] = set()
    back = collections.Counter()
    for module in route:
        if module in seen:
            back[module] += 1
        seen.add(module)
    print("| overrides | calls handed the config | modules | stays | back into a module already left |")
    print("|---|---|---|---|---|")
    print(f"| {' '.join(overrides) or '(the default run)'} | {len(walk.calls)} | {len(seen)} | {len(route)} | "
          f"{sum(back.values())} |")
    print()
    print("back into:", ", ".join(f"{m} x{n}" for m, n in back.most_common()) or "none")
    print("walk:", " -> ".join(route))
    if "--calls" in os.environ.get("CONFIG_WALK", ""):
        for module, function in walk.calls:
            print(f"  {module}.{function}")
    if not walk.done:
        print("(the run ended before an optimizer step)")


if __name__ == "__main__":
    main(sys.argv[1:])
