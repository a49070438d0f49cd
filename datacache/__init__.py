"""trainjob's Arrow data cache: datasets that give every rank its exact share of a global sample order.

Usable on its own: it never imports `trainer` or `launchers`.
"""

from datacache.dataset import StreamingDataset
from datacache.local import LocalDataset
from datacache.order import BatchPlan
from datacache.server import CacheServer, DataCacheError

__all__ = ["BatchPlan", "CacheServer", "DataCacheError", "LocalDataset", "StreamingDataset"]
