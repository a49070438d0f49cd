"""The command-line parser every trainjob command uses (the data cache's, the launchers', the trainer's export,
report and generate commands): argparse, with a bad argument said in one line, `<prog>: error:
<what> (see <prog> --help)`, and exit code 2, instead of the usage block before it. Imports nothing else, so
that the launchers and the trainer can use it without loading the data cache."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors (its subcommands' too) are one line on stderr, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
