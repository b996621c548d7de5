"""``/v1/responses``: OpenAI's Responses API, its conversations stored on the server.

``POST`` runs one turn: the stored conversation of ``previous_response_id`` (its tenant's
only), or the items of ``conversation`` (``/v1/conversations``), then this request's
``instructions`` and ``input`` items, rendered as chat renders a conversation; the previous
turn's token ids are kept verbatim (``EngineClient.encode``'s ``continuing``; a
conversation's while no item was added or deleted since), so the turn finds the whole
conversation in the cache. A turn on a ``conversation`` appends its input and output items
to it. With ``store`` (the
default) the turn is kept in the ``ResponseStore`` and its tokens stay pinned in the KV pool of
the engine that ran it for ``ServerConfig.response_ttl`` seconds: the user's next turn, a
minute later, still hits though other traffic came between. ``GET`` and ``DELETE
/v1/responses/{id}`` read and remove a stored response; the tenant is the ``cache_salt``
(query parameter), as it is in the body of a ``POST``.

Streams are the Responses event stream: ``response.created``, ``response.in_progress``, an
output item's ``added``/``done`` around its text deltas or its call's argument deltas,
``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``); an error
after the first byte is an in-band ``error`` event followed by ``response.failed``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.api import EngineClient, RequestOutput, TokenLogprob, ToolCall
from server import protocol
from server.checks import check_auth
from server.conversations.endpoints import no_such as no_such_conversation
from server.conversations.store import ConversationStoreFull
from server.errors import APIError, as_api_error, invalid, log, not_found
from server.generation import TokenBudget, parse, submit
from server.listing import page_body, page_query
from server.openai import records
from server.openai.bodies import chat_logprobs, vllm_prompt_logprobs
from server.responses import shapes
from server.responses.shapes import ResponsesRequest, new_id
from server.responses.store import StoredResponse, StoreFullError, StoreUnavailable
from server.state import ServerState
from server.streaming import Choice, EventStreamResponse, sse, updates, wait


class Turn:
    """One ``POST /v1/responses`` on its way: what it continues, what it sends the engine."""

    def __init__(
        self,
        engine: EngineClient,
        req: ResponsesRequest,
        previous: StoredResponse | None,
        conversation: list[dict[str, Any]] | None = None,
    ) -> None:
        self.req = req
        self.tenant = req.cache_salt or ""
        self.previous = previous
        self.id = new_id("resp")
        self.created_at = int(time.time())
        given = shapes.input_messages(req.input)
        if previous is not None:
            earlier_history = previous.history
            earlier = [*previous.items, *previous.body.get("output", [])]
            shapes.check_pairing(req.input, shapes.stored_calls(previous.body))
        else:
            earlier = conversation or []
            earlier_history = shapes.input_messages(earlier, "conversation") if earlier else []
            shapes.check_pairing(req.input, shapes.open_calls(earlier), "conversation")
        self.history = [*earlier_history, *given]
        self.new_items = shapes.as_items(req.input)  # what a conversation gains, then output
        self.items = [*earlier, *self.new_items]
        # the field a prompt too long for the context is said to be: the one holding most
        self.field = shapes.longest_field(req, self.history)
        # The conversation the engine renders: instructions, then the history.
        messages = protocol.conversation(
            msgspec.convert(self.history, list[protocol.ChatMessage]), "input"
        )
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}, *messages]
        reply = shapes.text_format(req.text)
        if req.structured_outputs:
            if reply is not None:
                raise invalid("structured_outputs: give it or text.format, not both",
                              param="structured_outputs")
            reply = records.structured_outputs(req)  # checked as chat checks it
        try:
            self.tools, (self.messages, self.structure) = protocol.tool_prompt(
                engine, messages, shapes.chat_tools(req.tools),
                shapes.chat_tool_choice(req.tool_choice, req.tools), req.parallel_tool_calls,
                reply,
            )
        except APIError as exc:  # chat's field names in the Responses API's flat ones
            raise shapes.flat_tool_error(exc) from None
        self.calling = self.tools is not None and self.tools.calling
        self.ids: list[int] = []

    def renames(self) -> dict[str, str]:
        """The request's name for a grammar the engine refuses (``structured_outputs.<kind>``
        when it came from the tools or ``text.format``; as sent when the client sent it)."""
        if self.calling:
            return {f"structured_outputs.{k}": "tools" for k in ("json", "grammar")}
        if self.req.structured_outputs:
            return {}
        return {
            "structured_outputs.json": shapes.TEXT_FORMAT_SCHEMA,
            "structured_outputs.json_object": "text.format",
        }

    def logprobs(self, state: ServerState, output: RequestOutput) -> list[dict[str, Any]]:
        """The reply's log-probabilities as OpenAI has them ([] when not asked for)."""
        if shapes.wants_logprobs(self.req) is None:
            return []
        return chat_logprobs(output.logprobs or [], state.texts)["content"]

    def extras(self, state: ServerState, output: RequestOutput) -> dict[str, Any]:
        """vLLM's fields chat has too, when asked for: ``prompt_token_ids`` and ``token_ids``
        (``return_token_ids``), ``prompt_logprobs``. Returned, not stored."""
        extra: dict[str, Any] = {}
        if self.req.return_token_ids:
            extra["prompt_token_ids"] = list(self.ids)
            extra["token_ids"] = list(output.token_ids)
        if self.req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(
                output.prompt_logprobs or [], state.texts, self.req.prompt_logprobs
            )
        return extra

    def calls(self, output: RequestOutput) -> tuple[list[ToolCall], bool]:
        """The reply's calls and whether they are whole (none: a plain reply)."""
        if output.tool_calls:
            return list(output.tool_calls), True
        if self.tools is None or not self.tools.calling:
            return [], False
        return self.tools.calls(output.text)

    def record(self, output: RequestOutput, body: dict[str, Any]) -> StoredResponse:
        """The turn as stored: its reply's calls as the client got them (``body``'s
        output), so the outputs it sends back answer the stored calls' ids."""
        calls = [ToolCall(item["call_id"], item["name"], item["arguments"])
                 for item in body["output"] if item["type"] == "function_call"]
        return StoredResponse(
            id=self.id,
            tenant=self.tenant,
            created_at=self.created_at,
            history=[*self.history, shapes.reply_message(output, calls)],
            token_ids=[*self.ids, *output.token_ids],
            body=body,
            items=self.items,
        )


async def create_response(state: ServerState, request: Request) -> Response:
    req = await parse(state, request, ResponsesRequest)
    shapes.check_request(req)
    store = state.responses
    previous = None
    if req.previous_response_id is not None:
        previous = await asyncio.to_thread(
            store.get, req.previous_response_id, req.cache_salt or ""
        )
        if previous is None:
            raise not_found(
                f"previous_response_id: no stored response {req.previous_response_id!r} "
                "(never stored, deleted, or another tenant's)",
                code="previous_response_not_found",
                param="previous_response_id",
            )
    conversation_id = shapes.conversation_id(req)
    conversation = None
    continuing = previous.token_ids if previous is not None else None
    if conversation_id is not None:
        tenant = req.cache_salt or ""
        conversation = await asyncio.to_thread(
            state.conversations.items, conversation_id, tenant
        )
        if conversation is None:
            raise no_such_conversation(conversation_id, param="conversation")
        continuing = await asyncio.to_thread(
            state.conversations.continuation, conversation_id, tenant
        )
    turn = Turn(state.engine, req, previous, conversation)
    texts = [m["content"] for m in turn.messages]
    turn.ids = await state.encode(
        turn.messages, turn.field, texts, req.truncate_prompt_tokens, continuing=continuing
    )
    budget = TokenBudget("max_output_tokens", req.max_output_tokens)
    params = protocol.choice_params(
        req,
        budget.tokens(len(turn.ids), state.engine.max_context),
        shapes.wants_logprobs(req),
        renames={"max_new_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
        structure=turn.structure,
        prompt_logprobs=req.prompt_logprobs,
    )
    kept = req.store or conversation_id is not None  # a next turn will continue it
    ttl = state.config.response_ttl if kept and state.config.response_ttl > 0 else None
    [choice] = submit(
        state, [turn.ids], [turn.field], params, budget, req.cache_salt, req.stream,
        renames=turn.renames(), pin_ttl=ttl,
    )
    if req.stream:
        return EventStreamResponse(_stream(state, turn, choice))
    outputs = await wait(state, request, [choice])
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    [output] = outputs
    calls, whole = turn.calls(output)
    items = shapes.output_items(output, calls, whole, turn.logprobs(state, output))
    body = shapes.response_object(
        req, turn.id, turn.created_at, state.config.model_name, output, items
    )
    await _conclude(state, turn, output, body)
    return JSONResponse({**body, **turn.extras(state, output)})


async def get_response(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    response_id = request.path_params["response_id"]
    stored = await asyncio.to_thread(state.responses.get, response_id, _tenant(request))
    if stored is None:
        raise _no_such(response_id)
    return JSONResponse(stored.body)


async def list_input_items(state: ServerState, request: Request) -> Response:
    """The items a stored response was made from (OpenAI's cursor page: ``order`` desc by
    default, ``limit`` 1-100 (20), ``after`` an item id)."""
    check_auth(request, state.config.api_key)
    response_id = request.path_params["response_id"]
    stored = await asyncio.to_thread(state.responses.get, response_id, _tenant(request))
    if stored is None:
        raise _no_such(response_id)
    asked = page_query(request)
    items = stored.items if asked.order == "asc" else stored.items[::-1]
    after = asked.after
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise invalid(f"after: no item {after!r} in this response's input", param="after")
        items = items[at + 1 :]
    return JSONResponse(page_body(items[: asked.limit], len(items) > asked.limit))


async def delete_response(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    response_id, tenant = request.path_params["response_id"], _tenant(request)
    stored = await asyncio.to_thread(state.responses.get, response_id, tenant)
    if stored is None or not await asyncio.to_thread(state.responses.delete, response_id, tenant):
        raise _no_such(response_id)
    # its tokens need not stay warm for a next turn any more (a follow-up stored since holds
    # its own pin, deeper on the same path, which stays)
    state.engine.unpin_prefix(stored.token_ids, tenant or None)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _tenant(request: Request) -> str:
    return request.query_params.get("cache_salt") or ""


def _no_such(response_id: str) -> APIError:
    return not_found(
        f"response {response_id!r}: no stored response with that id (never stored, deleted, "
        "or another tenant's: give its cache_salt as a query parameter)",
        code="response_not_found",
    )


async def _conclude(
    state: ServerState, turn: Turn, output: RequestOutput, body: dict[str, Any]
) -> None:
    """Keep a finished turn (a cut-off one is not kept): in the response store with
    ``store``, and its input and output appended to its ``conversation``."""
    if output.finish_reason == "abort":
        return
    req = turn.req
    if req.store:
        if not await _keep(state, turn.record(output, body)):
            body["store"] = False  # answered, not kept: as OpenAI shows such a response
    conversation_id = shapes.conversation_id(req)
    if conversation_id is None:
        return
    # The answer is generated: a conversation that cannot take it (deleted while the turn
    # ran, its tenant's bound reached, its file failing) does not cost the client the answer.
    # It gets it without ``conversation`` (as a response kept nowhere), and the log says why.
    why = None
    try:
        found = await asyncio.to_thread(
            state.conversations.finish_turn, conversation_id, turn.tenant,
            [*turn.new_items, *shapes.as_items(body["output"])], [*turn.ids, *output.token_ids],
        )
        why = None if found else "the conversation was deleted while the turn ran"
    except (ConversationStoreFull, StoreUnavailable) as exc:
        why = str(exc)
    if why is not None:
        log.warning("response %s answered but not added to conversation %s: %s",
                    turn.id, conversation_id, why)
        body["conversation"] = None


async def _keep(state: ServerState, record: StoredResponse) -> bool:
    """Store ``record``; the store makes room from the oldest responses (its module
    docstring), so only a response larger than a tenant's whole share is refused. False
    when the store cannot write (damaged, gone, a full disk): that does not cost the client
    its answer, generated already, and the log says why."""
    try:
        await asyncio.to_thread(state.responses.put, record)
    except StoreFullError as exc:
        raise invalid(f"store: {exc}; send store=false", param="store",
                      code="response_store_full") from None
    except StoreUnavailable as exc:
        log.warning("response %s answered but not stored: %s", record.id, exc)
        return False
    return True


async def _stream(state: ServerState, turn: Turn, choice: Choice) -> AsyncIterator[bytes]:
    """The Responses event stream of one turn (see the module docstring)."""
    req, model = turn.req, state.config.model_name
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return b"event: " + kind.encode() + b"\n" + sse(data)

    started = shapes.response_object(req, turn.id, turn.created_at, model, None, [])
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    reader = turn.tools.stream() if turn.calling and turn.tools is not None else None
    text = _TextItem(event, state if shapes.wants_logprobs(req) is not None else None)
    calls: list[dict[str, Any]] = []  # the function_call items opened, in order
    try:
        async for u in updates(state, [choice]):
            text.logprobs(u.logprobs)
            if reader is not None and reader.reading(u.text):
                for delta in reader.deltas():
                    for piece in delta["tool_calls"]:
                        if "id" in piece:
                            item = shapes.call_item(
                                new_id("fc"),
                                ToolCall(piece["id"], piece["function"]["name"], ""),
                                status="in_progress",
                            )
                            calls.append(item)
                            yield event("response.output_item.added",
                                        output_index=len(calls) - 1, item=dict(item))
                            continue
                        k, fragment = piece["index"], piece["function"]["arguments"]
                        calls[k]["arguments"] += fragment
                        yield event("response.function_call_arguments.delta",
                                    item_id=calls[k]["id"], output_index=k, delta=fragment)
                if u.output is None:
                    continue
                if not calls and reader.held:  # cut before it could tell: plain text
                    for chunk in text.delta(reader.take_held()):
                        yield chunk
            elif reader is not None and reader.held:  # a plain reply: the text held so far
                for chunk in text.delta(reader.take_held()):
                    yield chunk
            elif u.text:
                for chunk in text.delta(u.text):
                    yield chunk
            if u.output is None:
                continue
            output = reader.finish(u.output) if reader is not None else u.output
            whole = bool(output.tool_calls)
            for k, item in enumerate(calls):
                if whole:
                    item["arguments"] = output.tool_calls[k].arguments
                item["status"] = shapes.call_status(item["arguments"], whole)
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=k, name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
            items = calls
            if not calls:
                text.cut = output.finish_reason == "length"
                for chunk in text.done(turn.logprobs(state, output)):
                    yield chunk
                items = [text.item]
            body = shapes.response_object(
                req, turn.id, turn.created_at, model, output, items
            )
            await _conclude(state, turn, output, body)
            kind = "response.incomplete" if body["status"] == "incomplete" else (
                "response.completed"
            )
            yield event(kind, response={**body, **turn.extras(state, output)})
    except Exception as exc:
        error = as_api_error(exc)
        details = error.body()["error"]
        yield event("error", code=details["code"], message=details["message"],
                    param=details["param"])
        failed = {**started, "status": "failed",
                  "error": {"code": details["code"] or "server_error",
                            "message": details["message"]}}
        yield event("response.failed", response=failed)


class _TextItem:
    """The message item of a plain reply while it streams: opened on its first text. With
    log-probabilities asked for (``state`` given), each delta carries those of the tokens
    generated since the last delta (text held back by a tool reader keeps its tokens')."""

    def __init__(self, event: Any, state: ServerState | None) -> None:
        self._event = event
        self._state = state
        self._pending: list[TokenLogprob] = []
        self.item = shapes.message_item(new_id("msg"), "", status="in_progress")
        self.text = ""
        self.cut = False  # ended by max_output_tokens
        self._open = False

    def logprobs(self, entries: list[TokenLogprob]) -> None:
        """The log-probabilities of an update's tokens, sent with the next delta."""
        if self._state is not None:
            self._pending.extend(entries)

    def delta(self, text: str) -> list[bytes]:
        out = self._opening()
        if text:
            self.text += text
            shown = []
            if self._state is not None:
                shown = chat_logprobs(self._pending, self._state.texts)["content"]
                self._pending = []
            out.append(self._event("response.output_text.delta", item_id=self.item["id"],
                                   output_index=0, content_index=0, delta=text, logprobs=shown))
        return out

    def done(self, logprobs: list[dict[str, Any]]) -> list[bytes]:
        out = self._opening()
        part = shapes.text_part(self.text, logprobs)
        item_id = self.item["id"]
        out.append(self._event("response.output_text.done", item_id=item_id, output_index=0,
                               content_index=0, text=self.text, logprobs=logprobs))
        out.append(self._event("response.content_part.done", item_id=item_id, output_index=0,
                               content_index=0, part=part))
        status = "incomplete" if self.cut else "completed"
        self.item = {**self.item, "status": status, "content": [part]}
        out.append(self._event("response.output_item.done", output_index=0, item=self.item))
        return out

    def _opening(self) -> list[bytes]:
        if self._open:
            return []
        self._open = True
        return [
            self._event("response.output_item.added", output_index=0, item=dict(self.item)),
            self._event("response.content_part.added", item_id=self.item["id"],
                        output_index=0, content_index=0,
                        part=shapes.text_part("")),
        ]

