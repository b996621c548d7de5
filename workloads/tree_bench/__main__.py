"""``python -m workloads.tree_bench``: the radix tree micro-benchmark (``bench.main``)."""

from workloads.tree_bench.bench import main

if __name__ == "__main__":
    main()
