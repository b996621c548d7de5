"""The radix tree micro-benchmark, ``python -m workloads.tree_bench``: hit rates and the cost
of match / insert / evict on token-level traces, against a per-page LRU and whole-leaf
eviction. It lives here, not in ``radix/``, so the library holds only what the engine runs.
"""
