"""A scripted stand-in for the model, for scheduler tests (no torch).

``ScriptedModel`` plays the KV pool: every slot it writes holds a content address of the
token there and everything before it (a hash chain), and every page it reads must hold
exactly the address the request's own tokens give. A page table that points at a freed,
reused or wrong page therefore fails the test instead of silently reading garbage.
Sampled tokens come from a per-request script, so outputs can be checked token by token.
"""

from __future__ import annotations

from collections.abc import Callable

from radix import KVManager, PageAllocator, RadixCache
from scheduler import Batch, Request, Scheduler, SchedulerConfig

VOCAB = 50_000
STOP = 2


def script_token(request_id: object, index: int) -> int:
    """The ``index``-th token the model 'generates' for a request (never STOP)."""
    return 10 + (hash((request_id, index)) % (VOCAB - 10))


class ScriptedModel:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.kv: dict[int, int] = {}  # slot -> content address written there
        # Per request: index of its output at which it emits STOP (absent: never).
        self.stop_at: dict[int | str, int] = {}
        # Requests whose script follows their prompt, not their id: equal prompts then give
        # equal outputs (what speculation's tree drafts find again).
        self.by_prompt: set[int | str] = set()
        self.pages_read = 0
        # Per request: the prompt positions whose next token was scored, in the order scored.
        self.scored: dict[int | str, list[int]] = {}

    def script(self, request: Request, index: int) -> int:
        if self.stop_at.get(request.id) == index:
            return STOP
        key = tuple(request.prompt) if request.id in self.by_prompt else request.id
        return script_token(key, index)

    def step(self, batch: Batch) -> list[int | list[int]]:
        """One token per entry (-1 where it only prefills); for an entry with a draft, the
        draft tokens that match the script and the script's next token."""
        p = self.page_size
        out: list[int | list[int]] = []
        for entry in batch.entries:
            request = entry.request
            tokens = request.prompt + request.output + entry.draft
            assert entry.kv_len <= len(tokens), "entry runs past the request's tokens"
            assert entry.input_ids == tokens[entry.start_pos : entry.kv_len], "wrong input ids"
            assert len(entry.pages) == -(-entry.kv_len // p), "page table of the wrong size"
            for page in entry.pages:
                assert not self.allocator.is_free(page), f"entry uses free page {page}"
            address = 0
            for pos in range(entry.kv_len):
                address = hash((address, tokens[pos]))
                slot = entry.pages[pos // p] * p + pos % p
                if pos < entry.start_pos:
                    assert self.kv.get(slot) == address, (
                        f"request {request.id} reads position {pos} from slot {slot}, which holds "
                        "other K/V (a freed or wrong page)"
                    )
                    self.pages_read += 1
                else:
                    assert entry.slots[pos - entry.start_pos] == slot, "slot != page table"
                    self.kv[slot] = address
            if entry.scored:
                done = self.scored.setdefault(request.id, [])
                assert entry.scored.start == len(done), (
                    f"request {request.id} scores from position {entry.scored.start}, "
                    f"{len(done)} scored so far"
                )
                assert entry.scored.stop <= len(request.prompt) - 1, "scores past the prompt"
                done.extend(entry.scored)
            if entry.draft:
                accepted = []
                for j in range(len(entry.draft) + 1):
                    accepted.append(self.script(request, len(request.output) + j))
                    if j == len(entry.draft) or accepted[-1] != entry.draft[j]:
                        break
                out.append(accepted)
                continue
            out.append(self.script(request, len(request.output)) if entry.sample else -1)
        return out


def make_scheduler(
    num_pages: int, page_size: int = 4, **config: object
) -> tuple[Scheduler, ScriptedModel, RadixCache, PageAllocator]:
    kv = KVManager(num_pages, page_size, prefix_cache=bool(config.get("prefix_cache", True)))
    sched = Scheduler(kv, SchedulerConfig(page_size=page_size, **config))
    return sched, ScriptedModel(kv.allocator, page_size), kv.tree, kv.allocator


def run_to_idle(
    sched: Scheduler,
    model: ScriptedModel,
    max_steps: int = 100_000,
    on_batch: Callable[[Batch], None] | None = None,
    check: bool = True,
) -> int:
    """Step until nothing is left; returns the number of steps. Fails past ``max_steps``."""
    steps = 0
    while sched.has_work:
        batch = sched.schedule()
        assert batch is not None, "work left but nothing scheduled (deadlock)"
        if on_batch is not None:
            on_batch(batch)
        sched.commit(batch, model.step(batch))
        if check:
            sched.check_integrity()
        steps += 1
        assert steps <= max_steps, f"not idle after {max_steps} steps"
    return steps


def assert_output_follows_script(model: ScriptedModel, request: Request) -> None:
    expected = [model.script(request, i) for i in range(len(request.output))]
    assert request.output == expected, f"request {request.id}: outputs out of order"
