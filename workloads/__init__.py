"""Everything that measures radixkv, by purpose; none of it is the library.

- ``traces``: what requests look like (text traces on the real tokenizer, token-level
  synthetic traces, trace files, the ideal hit rate)
- ``engine_bench``: traces through the Engine (``python -m workloads.bench``)
- ``http_bench``: any OpenAI-compatible server over HTTP (``python -m workloads.serve_bench``,
  ``serve_compare``, ``replica_bench``)
- ``simulators``: cache-only, one engine or N replicas behind a router
  (``python -m workloads.simulate``)
- ``tree_bench``: the radix tree alone (``python -m workloads.tree_bench``)
- ``model_bench``: the model's forward and kernels against their floors
  (``python -m workloads.model_bench``, ``python -m workloads.model_bench.gpu``)
- ``checkpoints``: models for other machines and peers (random weights, a plain HF dir)
- ``reports``: figures shared by the benches, Markdown tables, plots

The modules at this level are the documented commands, each a thin entry into its
sub-package. Apart from ``model_bench``, nothing here reaches the engine except through the
``engine`` package's top-level names (``tests/test_layering.py``).
"""
