"""The CPU path: what brings the model up on this machine, measured and verified here.

- ``products`` (+ ``csrc/dense.cpp``): our batch-invariant matrix products;
- ``exact_attention`` (+ ``csrc/exact_attention.cpp``): our batch-invariant attention kernel,
  and ``exact_backend``, the attention backend over it;
- ``native_build``: kernels compiled per machine, self-tested at load;
- ``machine``: the machine key, CPU flags, memory;
- ``threads``, ``malloc_tuning``: thread counts and allocator settings per pass size;
- ``probe`` / ``probe_child``: the dtype chosen by measurement, invariance verified.

``engine.model.cuda`` is the GPU's counterpart of this package.
"""
