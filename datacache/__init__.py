"""trainjob's Arrow data cache: datasets that give every rank its exact share of a global sample order.

Usable on its own: it never imports `trainer` or `launchers`. Its names load on first use, so that a cache
node (`python -m datacache`, `datacache.server`) never imports torch.
"""

from trainjob import lazy

_HOMES = {"BatchPlan": "datacache.order", "CacheServer": "datacache.server", "DataCacheError": "datacache.server",
          "LocalDataset": "datacache.local", "StreamingDataset": "datacache.dataset"}

__all__ = sorted(_HOMES)

__getattr__ = lazy.names(__name__, _HOMES)
