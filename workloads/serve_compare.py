"""``python -m workloads.serve_compare A.json B.json ...``: ``serve_bench --json`` reports
side by side.

The command as documented; the code is ``workloads.http_bench``.
"""

from workloads.http_bench.compare import main

if __name__ == "__main__":
    main()
