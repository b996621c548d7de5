"""``python -m workloads.replica_bench``: ``radixkv serve --replicas`` behind each router, end
to end.

The command as documented; the code is ``workloads.http_bench``.
"""

from workloads.http_bench.replicas import main

if __name__ == "__main__":
    main()
