"""A test double of the `docker` CLI: no Docker engine runs on these machines, so this stands in for one.

It keeps its containers and networks in a JSON file ($FAKE_DOCKER_STATE), logs every call with the
secrets it could read from its environment ($FAKE_DOCKER_LOG, one JSON line per call), and answers the
few commands the launcher runs (network create/rm, run, ps with a label filter and a --format of names,
states and labels, inspect, exec, logs, rm) as the real CLI would. A
container named in the state's `fail` list fails to start; `exit_code` sets how started containers end.
"""

from __future__ import annotations

import json
import os
import re
import sys

# The storage credentials a test gives the driver (launchers/docker/credentials.py), logged as this CLI sees them.
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN")


def main(argv: list[str]) -> int:
    path = os.environ["FAKE_DOCKER_STATE"]
    with open(path) as f:
        state = json.load(f)
    with open(os.environ["FAKE_DOCKER_LOG"], "a") as f:
        f.write(json.dumps({"argv": argv, "token": os.environ.get("TRAINJOB_CACHE_TOKEN"),
                            "credentials": {k: v for k, v in os.environ.items() if k in CREDENTIALS}}) + "\n")
    code, out, err = 0, "", ""
    if argv[:2] == ["network", "create"]:
        state["networks"].append(argv[-1])
    elif argv[:2] == ["network", "rm"]:
        if argv[2] in state["networks"]:
            state["networks"].remove(argv[2])
        else:
            code, err = 1, f"Error response from daemon: network {argv[2]} not found"
    elif argv[0] == "run":
        name = argv[argv.index("--name") + 1]
        labels = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--label")
        if name in state.get("fail", []):
            code, err = 125, "docker: Error response from daemon: could not select device driver"
        else:
            state["containers"][name] = {"state": "running", "labels": labels}
            out = f"{abs(hash(name)):x}\n"
    elif argv[0] == "ps":
        key, _, value = argv[argv.index("--filter") + 1].removeprefix("label=").partition("=")
        template = argv[argv.index("--format") + 1]
        for n, c in state["containers"].items():
            if key in c["labels"] and (not value or c["labels"][key] == value):
                line = template.replace("{{.Names}}", n).replace("{{.State}}", c["state"])
                out += re.sub(r'\{\{\.Label "([^"]+)"\}\}', lambda m, c=c: c["labels"].get(m.group(1), ""), line) + "\n"
    elif argv[0] == "inspect":
        name = argv[-1]
        if name in state["containers"]:
            state["containers"][name]["state"] = "exited"  # the job ran to its end
            out = f"exited {state.get('exit_code', 0)}\n"
        else:
            code, err = 1, f"Error: No such object: {name}"
    elif argv[0] == "exec":  # only `python -m datacache ready ...` is run inside: a running node answers
        if state["containers"].get(argv[1], {}).get("state") != "running":
            code, err = 1, f"Error response from daemon: container {argv[1]} is not running"
    elif argv[0] == "logs":
        pass
    elif argv[0] == "rm":
        for name in argv[2:]:
            state["containers"].pop(name, None)
    else:
        code, err = 1, f"fake docker: unknown command {argv}"
    with open(path, "w") as f:
        json.dump(state, f)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
