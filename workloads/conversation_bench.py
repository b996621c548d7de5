"""``python -m workloads.conversation_bench``: conversations with think time between turns
through ``/v1/responses``, pins on and off, one engine or replicas.

The command as documented; the code is ``workloads.http_bench.conversations``.
"""

from workloads.http_bench.conversations import main

if __name__ == "__main__":
    main()
