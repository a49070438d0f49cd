"""`python -m trainjob.runtimes.torch_distributed.torchrun <torchrun options> -m <worker> CONFIG`: torchrun's
elastic agent, whose exit code is the code its failed rank exited with, where plain torchrun turns every failure
into 1. It imports torch: nothing imports it, every node runs it as `python -m`.

What the code says matters to whoever watches the node: 2 is a refused config or input (a Kubernetes
`podFailurePolicy` fails the job at once rather than restarting it), 143 a preemption whose checkpoint is
written (the run resumes when relaunched). An agent told to stop exits 128 + the signal (its ranks were told
too, and a SIGTERM lets them checkpoint first); a rendezvous that timed out waiting for the other nodes
exits 3; a rank killed by a signal, or an agent that failed, exits 1.

Once a node has formed, its later rendezvous rounds (re-formations after a node was lost or joined) wait
`runtime.reform_last_call_timeout` for more nodes, not the first round's `runtime.last_call_timeout`.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from trainjob.env import DRIVER_REPORTS_ENV, RDZV_TIMEOUT_EXIT
from trainjob.startup import mark_agent_ready


def exit_code(error: ChildFailedError) -> int:
    """The first failed rank's exit code, when it exited with one (a signal is a negative code: 1)."""
    _, failure = error.get_first_failure()
    return failure.exitcode if failure.exitcode > 0 else 1


def reform_last_call(rdzv_conf: str) -> int | None:
    """`reform_last_call_timeout` of torchrun's --rdzv-conf (`k=v,k=v`), where the runtime put it; None if absent."""
    for item in rdzv_conf.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "reform_last_call_timeout":
            return int(value)
    return None


def shorten_reformations(seconds: int) -> None:
    """Once this node's first rendezvous has completed, its later rounds wait `seconds` (not the first round's
    last call) for more nodes once MIN are there: those rounds re-form nodes already running, which arrive
    within a second of each other. torch reads one last-call timeout for every round from the handler's
    settings; this sets it on them after the first round."""
    first = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(self):
        info = first(self)
        # The handler's timeouts are shared with its rendezvous steps, which read them each round.
        self.settings.timeout._set_timeouts(last_call=timedelta(seconds=seconds))
        return info

    DynamicRendezvousHandler.next_rendezvous = next_rendezvous


def main(argv: list[str]) -> int:
    mark_agent_ready()  # its ranks report when, in their log (trainjob.startup)
    args = run.parse_args(argv)
    if (seconds := reform_last_call(args.rdzv_conf)) is not None:
        shorten_reformations(seconds)
    reported = bool(os.environ.get(DRIVER_REPORTS_ENV))  # the driver says what failed, once
    try:
        run.run(args)
    except ChildFailedError as e:
        if not reported:
            print(e.format_msg(), file=sys.stderr)
        return exit_code(e)
    except RendezvousTimeoutError:
        if not reported:
            print(f"error: the rendezvous at {args.rdzv_endpoint} timed out after waiting for {args.nnodes} nodes "
                  "(runtime.rdzv_timeout)", file=sys.stderr)
        return RDZV_TIMEOUT_EXIT
    except RendezvousError as e:  # the store went away (killed, its machine lost), or the run was closed there
        detail = " ".join(f"{type(e).__name__}: {e}".split()).rstrip(": ")
        print(f"error: the rendezvous at {args.rdzv_endpoint} failed ({detail}): restart the nodes with the same "
              "command to resume from the newest checkpoint", file=sys.stderr)
        return 1
    except SignalException as e:  # the agent was told to stop (SIGTERM: preempted); its ranks were stopped
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
