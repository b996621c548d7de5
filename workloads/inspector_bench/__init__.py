"""The cache inspector measured and seen (``python -m workloads.inspector_bench``): what a tree
snapshot costs the engine loop (``snapshot_cost``), and the page in headless Chromium under
the RAG and chat workloads, one engine and replicas (``screens``, driving ``chromium``)."""
