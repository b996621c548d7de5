"""The model and its kernels against the machine's floors: ``python -m workloads.model_bench``
(the CPU forward: our products and attention, batch-invariant or not, beside transformers')
and ``python -m workloads.model_bench.gpu`` (the FlashInfer path on a CUDA machine).

This is the one place in ``workloads`` allowed to import engine internals
(``engine.model.*``: the runner, the KV pool, the products, the attention backends): it
measures them, below the public API. Everything else in ``workloads`` imports the ``engine``
package's top-level names only (``tests/test_layering.py`` holds it to that).
"""
