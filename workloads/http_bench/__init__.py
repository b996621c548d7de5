"""Any OpenAI-compatible server over HTTP (``python -m workloads.serve_bench``): the streaming
client and its figures, reports side by side (``serve_compare``), and ``radixkv serve
--replicas`` behind each router (``replica_bench``).
"""
