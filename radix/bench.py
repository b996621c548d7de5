"""``python -m radix.bench``: the radix tree micro-benchmark, under the name the team's docs give.

The code is ``workloads.tree_bench`` (benchmarks sit above the library and import it, never the
reverse), so this module reaches it only when run as a command: importing ``radix.bench``
imports nothing of ours.
"""

if __name__ == "__main__":
    from workloads.tree_bench.bench import main

    main()
