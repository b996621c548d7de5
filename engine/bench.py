"""``python -m engine.bench``: the model against its floors, under the name the team's docs give.

``--device cpu`` (the default without CUDA) runs ``workloads.model_bench`` (our kernels against
the measured memory bandwidth and matrix-product peak); ``--device cuda`` (the default with
CUDA) runs ``workloads.model_bench.gpu`` (FlashInfer's path against HBM bandwidth). Every other
argument goes to that bench; ``--help`` after the device shows its own. Benchmarks sit above
the library and import it, never the reverse, so this module reaches them only when run as a
command: importing ``engine.bench`` imports nothing but the standard library.
"""

import sys


def split_device(argv: list[str], cuda_available: bool) -> tuple[str, list[str]]:
    """The device a run asks for (``--device X`` or ``--device=X``, else CUDA where there is
    one) and the arguments left for that device's bench."""
    device = "cuda" if cuda_available else "cpu"
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--device":
            device = next(args, "")
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"engine.bench: --device must be cpu or cuda, got {device!r}")
    return device, rest


if __name__ == "__main__":
    import torch

    device, rest = split_device(sys.argv[1:], torch.cuda.is_available())
    if device == "cuda":
        from workloads.model_bench.gpu import main
    else:
        from workloads.model_bench.cpu import main
    main(rest)
