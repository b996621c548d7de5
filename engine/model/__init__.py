"""The model side of the engine: tensors in, tokens out.

Loading a checkpoint (``loader``, ``model_config``), the Llama-family forward over paged KV
(``llama``, ``forward_batch``, ``kv_pool``, ``attention``), sampling (``sampler``), one pass
per scheduler batch (``runner``), and what is measured per machine to run it fast and exact
(``probe`` and the ``probe_child`` it runs, ``invariance``, ``threads``; the machine's
identity, memory and cache root: ``machine``). It knows nothing of requests' lifetimes, text
or callers.
"""
