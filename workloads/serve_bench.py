"""``python -m workloads.serve_bench --url ...``: any OpenAI-compatible server over HTTP.

The command as documented; the code is ``workloads.http_bench``.
"""

from workloads.http_bench.bench import main

if __name__ == "__main__":
    main()
