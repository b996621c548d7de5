"""The cache-only simulators: token-level traces (``workloads.traces.synthetic``) through the
real Scheduler and radix tree with a scripted model, counted rather than timed.

One loop (``loop.run_closed_loop``) drives N schedulers; one engine is the case N = 1
(``one_engine.simulate``), N replicas behind a router fed by their KV events the general one
(``cluster.simulate_cluster``). ``python -m workloads.simulate`` runs either (``cli``).
"""
