"""The engine seam: Engine and RemoteEngine are both EngineClients, and ids that encode
returned are not encoded or checked again by submit."""

from __future__ import annotations

from engine_helpers import greedy

from cluster.remote import RemoteEngine
from engine import load_front
from engine.api import EngineClient, PromptIds
from engine.serving import inputs


def test_the_engine_and_the_replicas_front_are_engine_clients(engine) -> None:
    assert isinstance(engine, EngineClient)
    front = RemoteEngine(load_front(None), lambda call: None, lambda: None)
    assert isinstance(front, EngineClient)


def test_encoded_ids_are_checked_once(engine, monkeypatch) -> None:
    checks = []
    real = inputs.check_token_ids

    def counting(ids, vocab_size, field):
        checks.append(field)
        return real(ids, vocab_size, field)

    monkeypatch.setattr(inputs, "check_token_ids", counting)
    ids = engine.encode([{"role": "user", "content": "Hello there"}], field="messages")
    assert isinstance(ids, PromptIds) and checks == ["messages"]
    out = engine.submit(ids, greedy(4)).result()
    assert checks == ["messages"], "submit checked the encoded ids again"
    assert out.prompt_tokens == len(ids)
    # plain ids are still checked at submit
    engine.submit(list(ids), greedy(4)).result()
    assert checks == ["messages", "prompt"]
