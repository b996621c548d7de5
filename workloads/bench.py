"""``python -m workloads.bench``: the workloads through the Engine, cache on vs off.

The command as documented; the code is ``workloads.engine_bench``.
"""

from workloads.engine_bench.bench import main

if __name__ == "__main__":
    main()
