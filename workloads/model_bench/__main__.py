"""``python -m workloads.model_bench``: the CPU model bench (``cpu.main``)."""

from workloads.model_bench.cpu import main

if __name__ == "__main__":
    main()
