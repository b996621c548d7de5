"""``python -m workloads.spec_bench``: speculative decoding on and off on repeating traces.

The command as documented; the code is ``workloads.engine_bench.speculation``.
"""

from workloads.engine_bench.speculation import main

if __name__ == "__main__":
    main()
