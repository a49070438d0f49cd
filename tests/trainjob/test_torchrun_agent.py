"""The node agent's rendezvous (`trainjob.runtimes.torch_distributed.torchrun`): after a node's first rendezvous,
its re-formations wait `runtime.reform_last_call_timeout`, not the first round's last call. A real c10d
rendezvous on a TCPStore on loopback; the whole recovery is tests/trainer/test_elastic.py's."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from trainjob.nodes import free_port
from trainjob.runtimes.torch_distributed import ELASTIC_RDZV_CONF, TorchDistributedConfig, torchrun


def test_the_reformation_last_call_is_read_from_the_runtimes_rdzv_conf():
    conf = ELASTIC_RDZV_CONF.format(**vars(TorchDistributedConfig())) + ",join_timeout=600"
    assert torchrun.reform_last_call(conf) == 1
    assert torchrun.reform_last_call("is_host=false,join_timeout=600") is None  # plain torchrun's conf


def test_a_node_re_forms_with_the_short_last_call_once_its_first_rendezvous_is_done(monkeypatch):
    # Restored after the test: shorten_reformations wraps the class's method, as the agent's process does.
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous", DynamicRendezvousHandler.next_rendezvous)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the store kept apart
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="agent-test", min_nodes=1,
                                  max_nodes=2, is_host="false", last_call_timeout="2", keep_alive_interval="1",
                                  keep_alive_max_attempt="3")
    torchrun.shorten_reformations(1)
    handler = get_rendezvous_handler(params)
    try:
        assert handler.settings.timeout.last_call == timedelta(seconds=2)
        info = handler.next_rendezvous()  # one node of at most two: it waits the first round's 2 s last call
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.settings.timeout.last_call == timedelta(seconds=1)
        assert handler.next_rendezvous().world_size == 1  # a re-formation, as after a lost node
        assert handler.settings.timeout.last_call == timedelta(seconds=1)
    finally:
        handler.shutdown()
        del store


def test_the_last_call_a_re_formation_waits_is_the_one_set(monkeypatch):
    import time

    seconds = 4  # longer than the first round's 2 s: the wait is the one set, not torch's
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous", DynamicRendezvousHandler.next_rendezvous)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="agent-wait", min_nodes=1,
                                  max_nodes=2, is_host="false", last_call_timeout="2")
    torchrun.shorten_reformations(seconds)
    handler = get_rendezvous_handler(params)
    try:
        handler.next_rendezvous()
        started = time.monotonic()
        handler.next_rendezvous()
        waited = time.monotonic() - started
        # the first round's 2 s would have ended it sooner (no upper bound: a loaded machine stretches torch's polls)
        assert waited >= seconds, waited
    finally:
        handler.shutdown()
        del store
