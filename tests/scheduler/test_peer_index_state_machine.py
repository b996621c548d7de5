"""The peer index (what running requests generated, for their namespace's drafts) under random
requests that start, grow token by token and end, in two namespaces.

After every rule: each entry points at a running request of its own namespace, at an n-gram
of its output that its tokens really hold there; while no request has ended, every such
n-gram of every running request has an entry; a lookup returns only a running peer's tokens
that follow the query's n-gram, never its own, never another namespace's.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from scheduler import Request, SamplingParams
from scheduler.speculation.drafter import PEER_NGRAM, ContextIndex, PeerIndex

token_st = st.integers(0, 3)  # a small alphabet: n-grams recur across requests


class PeerIndexMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.index = PeerIndex()
        self.live: dict[ContextIndex, Request] = {}
        self.ended_any = False

    def _sync(self, request: Request, context: ContextIndex) -> None:
        context.sync(request)
        self.index.add(request.namespace, context, len(request.prompt))

    @rule(target=requests, namespace=st.sampled_from(["a", "b"]),
          prompt=st.lists(token_st, min_size=1, max_size=8))
    def start(self, namespace: str, prompt: list[int]) -> tuple[Request, ContextIndex]:
        request = Request(len(self.live), prompt, SamplingParams(max_new_tokens=64), namespace)
        context = ContextIndex()
        self._sync(request, context)
        self.live[context] = request
        return request, context

    @rule(running=requests, tokens=st.lists(token_st, min_size=1, max_size=6))
    def grow(self, running: tuple[Request, ContextIndex], tokens: list[int]) -> None:
        request, context = running
        if context not in self.live:
            return
        for token in tokens:  # one token per step, as a request decodes
            request.output.append(token)
            self._sync(request, context)

    @rule(running=consumes(requests))
    def end(self, running: tuple[Request, ContextIndex]) -> None:
        _, context = running
        if self.live.pop(context, None) is not None:
            self.index.remove(context)
            self.ended_any = True

    @rule(running=requests, k=st.integers(1, 6))
    def lookup(self, running: tuple[Request, ContextIndex], k: int) -> None:
        request, context = running
        if context not in self.live:
            return
        draft = self.index.lookup(request.namespace, context, k)
        if not draft:
            return
        query = context.tokens[-PEER_NGRAM:]
        assert any(
            peer is not context and other.namespace == request.namespace
            and any(peer.tokens[c - PEER_NGRAM : c] == query
                    and peer.tokens[c : c + k] == draft
                    for c in range(max(PEER_NGRAM, len(other.prompt)), len(peer.tokens)))
            for peer, other in self.live.items()
        ), "a draft that no running peer of the namespace generated"

    @invariant()
    def entries_point_at_running_requests(self) -> None:
        for (namespace, key), (context, cont) in self.index._first.items():
            request = self.live.get(context)
            assert request is not None, "an ended request's entry"
            assert request.namespace == namespace
            assert cont >= len(request.prompt) and tuple(context.tokens[cont - PEER_NGRAM : cont]) == key

    @invariant()
    def every_output_ngram_is_entered_while_nothing_ended(self) -> None:
        if self.ended_any:
            return
        for context, request in self.live.items():
            for cont in range(max(PEER_NGRAM, len(request.prompt)), len(context.tokens)):
                key = (request.namespace, tuple(context.tokens[cont - PEER_NGRAM : cont]))
                assert key in self.index._first


PeerIndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
test_peer_index_state_machine = PeerIndexMachine.TestCase
