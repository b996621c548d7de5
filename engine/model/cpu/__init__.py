"""The CPU platform (``platform.CpuPlatform``) and everything of the CPU path, measured and
verified per machine.

- ``products`` (+ ``csrc/dense.cpp``): our batch-invariant matrix products;
- ``exact_attention`` (+ ``csrc/exact_attention.cpp``): our batch-invariant attention kernel
  and the attention backend over it;
- ``native_build``: kernels compiled per machine, self-tested at load; ``kernels``: both
  kernels' version and whether they load;
- ``machine``: the machine key, CPU flags (and whether bf16 products run), memory;
- ``threads``, ``malloc_tuning``: thread counts and allocator settings per pass size.

The dtype is chosen by measurement in the bring-up (``engine.model.bringup.dtype_probe``: it
runs the whole model side); ``engine.model.cuda`` is the GPU's counterpart of this package.
"""
