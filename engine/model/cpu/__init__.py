"""The CPU path: what brings the model up on this machine, measured and verified here.

- ``products`` (+ ``csrc/dense.cpp``): our batch-invariant matrix products;
- ``native_build``: kernels compiled per machine, self-tested at load;
- ``machine``: the cache root, the machine key, CPU flags, memory;
- ``threads``, ``malloc_tuning``: thread counts and allocator settings per pass size;
- ``probe`` / ``probe_child``: the dtype chosen by measurement, invariance verified.

The CPU attention kernel lives with the other backends (``engine.model.attention.native``);
``engine.model.cuda`` is the GPU's counterpart of this package.
"""
