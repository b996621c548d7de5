"""The CUDA platform (``platform.CudaPlatform``): FlashInfer's paged attention over the radix
pages and what makes a step fast and exact on a GPU.

- ``flashinfer_backend`` (the attention backend; its ``flashinfer_plan`` per pass and
  ``flashinfer_reference``, the same calls in torch, which runs them on the CPU in CI);
- ``step_buffers``: a pass's integers in one pinned buffer, one copy to the device;
- ``graphs``: decode steps replayed from CUDA graphs, per batch-size bucket;
- ``cascade_rule``: when attending a shared prefix once pays on the device.

The runner (``engine.model.runner``) reaches these through the platform: it packs each pass
through ``StepBuffers`` and hands decode passes to ``DecodeGraphs``; the bring-up
(``engine.model.bringup``) decides what is on and checks the runner at start
(``device_check``). Everything here but the capture and FlashInfer's kernels runs on the CPU.
"""
