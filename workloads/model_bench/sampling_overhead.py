"""What structured outputs and penalties cost a decode step: decode tokens/s at batch 1, 8
and 32 with every request plain, constrained by a JSON schema, or penalised; and the compile
time of a typical tool schema. Configurations interleave (A B C A B C ...), medians are quoted.

    python -m workloads.model_bench.sampling_overhead [--repeats 5] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from engine import Engine, SamplingParams, StructuredOutputsParams
from engine.model.structured import Grammars

# An array of at least 60 short strings: long enough that every step of the run is constrained.
LONG_JSON = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "details": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "json schema": {"structured_outputs": StructuredOutputsParams(json=LONG_JSON)},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1},
}


def compile_ms(engine: Engine, repeats: int = 5) -> float:
    """Median time to compile and validate a new tool schema (the tokenizer already built)."""

    grammars = Grammars(engine.tokenizer)
    _ = grammars.tokenizer  # built once per engine (~0.3 s); not what a request pays
    times = []
    for i in range(repeats):
        spec = StructuredOutputsParams(json={**TOOL_SCHEMA, "title": f"tool{i}"})  # uncached
        started = time.perf_counter()
        grammars.check(spec)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def decode_rate(engine: Engine, prompts: list[Any], params: SamplingParams) -> float:
    """Decode tokens/s of the batch: each request's tokens after its first, over its time after
    its first token (median over requests), times the batch."""
    outs = engine.generate(prompts, params)
    per_request = [(len(o.token_ids) - 1) / (o.latency_s - (o.ttft_s or 0.0)) for o in outs]
    return statistics.median(per_request) * len(prompts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workloads.model_bench.sampling_overhead")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args(argv)
    prompts = [
        [{"role": "user", "content": f"List many words about topic {i}, as a JSON array."}]
        for i in range(max(args.batches))
    ]
    with Engine(num_pages=2048) as engine:
        print(f"compile a tool schema: {compile_ms(engine):.2f} ms (median of 5, uncached)")
        warm = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        engine.generate(prompts[:8], warm)
        print(f"| batch | {' | '.join(CASES)} | json / plain | penalties / plain |")
        print(f"| ---: | {' | '.join('---:' for _ in CASES)} | ---: | ---: |")
        for batch in args.batches:
            rates: dict[str, list[float]] = {name: [] for name in CASES}
            for _ in range(args.repeats):
                for name, knobs in CASES.items():
                    params = SamplingParams(
                        max_new_tokens=args.tokens, temperature=0, ignore_eos=True, **knobs
                    )
                    rates[name].append(decode_rate(engine, prompts[:batch], params))
            med = {name: statistics.median(v) for name, v in rates.items()}
            cells = " | ".join(f"{med[name]:.1f}" for name in CASES)
            print(
                f"| {batch} | {cells} | {med['json schema'] / med['plain']:.3f} | "
                f"{med['penalties'] / med['plain']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
