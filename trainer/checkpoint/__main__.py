"""`python -m trainer.checkpoint verify RUN_DIR_OR_CHECKPOINT` (a path, or a `train.checkpoint_dir` URL or one of its
checkpoints'): one line per checkpoint, whole or damaged and why
(its files against its manifest, its DCP metadata and shards); exit 0 when every one is whole, 1 when one is
not, 2 when the path holds no checkpoint."""

from __future__ import annotations

import logging
import os
import sys

from trainer.checkpoint import fs, layout, manifest
from trainer.checkpoint.checks import damage


def _checkpoints(target: str) -> list[str]:
    """The checkpoints `verify` looks at: `target` itself, or the `step-<N>` folders of a run directory (or of
    its checkpoints/ folder)."""
    target = target.rstrip("/") if fs.remote(target) else target
    if layout.is_checkpoint(target) or manifest.has_manifest(target):
        return [target]
    for root in (os.path.join(target, "checkpoints"), target):
        found = [os.path.join(root, n) for n in fs.listdir(root) if layout.step_of(n) is not None]
        if found:
            return sorted(found, key=layout.step_of)
    return []


def _unfinished(path: str) -> str:
    """Why `path`, a `step-<N>` folder, is not a checkpoint."""
    if fs.remote(path) and fs.isfile(os.path.join(path, ".metadata")):
        return f"its {layout.MANIFEST} is missing: its writer did not finish"
    return "its .metadata is missing"


def verify(target: str) -> int:
    """One line per checkpoint of `target`; 0 when every one is whole."""
    found = _checkpoints(target)
    if not found:
        print(f"error: {target} is neither a checkpoint nor a run directory with checkpoints", file=sys.stderr)
        return 2
    damaged = 0
    for path in found:
        m = layout.STEP_DIR.match(os.path.basename(path))
        name = f"step {m.group(1)}" if m else path
        problem = damage(path) if layout.is_checkpoint(path) else _unfinished(path)
        if problem:
            damaged += 1
            print(f"{name}: damaged: {problem} ({path})")
        elif manifest.has_manifest(path):
            print(f"{name}: whole ({path})")
        else:
            print(f"{name}: whole as far as sizes tell (no manifest: written before checkpoints recorded their "
                  f"files' hashes) ({path})")
    return 1 if damaged else 0


def main(argv: list[str] | None = None) -> int:
    from trainjob.cli import OneLineParser

    parser = OneLineParser(prog="python -m trainer.checkpoint", description="Check checkpoints against their "
                           "manifests.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="say, for each checkpoint, whether its files are as written")
    check.add_argument("target", metavar="RUN_DIR_OR_CHECKPOINT")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the lines printed here say it all
    return verify(args.target)


if __name__ == "__main__":
    sys.exit(main())
