"""Traces through the Engine (``python -m workloads.bench``): every session a closed loop, the
cache on vs off interleaved, transformers' ``generate`` as the baseline, the KV tiers under
pressure; through the ``engine`` package's public names only.
"""
