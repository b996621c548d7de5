"""``python -m workloads.simulate``: the cache-only simulators, one engine or, with
``--replicas N --router NAME``, N replicas behind a router.

The command as documented; the code is ``workloads.simulators``.
"""

from workloads.simulators.cli import main

if __name__ == "__main__":
    main()
