"""The op tests by op family, each module a family's tests and its helpers; `tests/ops/test_ops.py` collects
them all, so that they run in one process and the compile test after them sees every launch they made."""
