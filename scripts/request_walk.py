"""The files of ours one request crosses, for a refactor's before/after: a streamed chat
completion through the HTTP app and one ``Engine.generate``, each after a warm-up, with the
real model. A file counts when a function of it runs while the request is in flight; the
engine loop's thread is counted apart from the caller's side (the server's event loop and
its tokenizing thread, or the caller of ``generate``).

    python scripts/request_walk.py [--list]
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LIBRARY = tuple(str(ROOT / name) + "/" for name in ("radix", "scheduler", "engine", "server",
                                                     "cluster"))
LOOP_THREAD = "radixkv-engine-loop"


class Walk:
    """Records, per side (the loop thread or the caller's), which of our files ran."""

    def __init__(self) -> None:
        self.on = False
        self.files: dict[str, set[str]] = defaultdict(set)

    def profile(self, frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(LIBRARY):
            side = "loop" if threading.current_thread().name == LOOP_THREAD else "caller"
            self.files[side].add(str(Path(path).relative_to(ROOT)))

    def start(self) -> None:
        self.files.clear()
        self.on = True

    def stop(self) -> dict[str, set[str]]:
        self.on = False
        return {side: set(files) for side, files in self.files.items()}


def report(name: str, found: dict[str, set[str]], listing: bool) -> None:
    caller, loop = found.get("caller", set()), found.get("loop", set())
    print(f"{name}: {len(caller)} files on the caller's side, {len(loop)} on the loop "
          f"thread, {len(caller | loop)} in all")
    if listing:
        for side, files in (("caller", caller), ("loop", loop)):
            for path in sorted(files):
                print(f"  {side:6} {path}")


def main() -> None:
    listing = "--list" in sys.argv
    walk = Walk()
    threading.setprofile(walk.profile)  # threads started from now on (the loop, the tokenizer)
    sys.setprofile(walk.profile)
    import httpx

    from engine import Engine, SamplingParams
    from server.app import ServerConfig, create_app

    engine = Engine(dtype="float32")
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    messages = [{"role": "user", "content": "Name three colours."}]
    engine.generate([messages], params)  # warm-up
    walk.start()
    engine.generate([messages], params)
    report("Engine.generate (one conversation)", walk.stop(), listing)

    app = create_app(engine, ServerConfig(model_name="smollm2", response_store=":memory:",
                                          log_requests=False))
    body = {"model": "smollm2", "messages": messages, "max_tokens": 8, "temperature": 0,
            "stream": True}

    async def post() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await client.post("/v1/chat/completions", json=body)  # warm-up
            walk.start()
            reply = await client.post("/v1/chat/completions", json=body)
            found = walk.stop()
            assert reply.status_code == 200 and "[DONE]" in reply.text, reply.text[:200]
            report("streamed chat completion over HTTP", found, listing)

    asyncio.run(post())
    engine.close()


if __name__ == "__main__":
    main()
