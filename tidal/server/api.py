"""The OpenAI-compatible HTTP API: `build_app` (FastAPI) and `run_server` (`tidal serve`).

Every request is validated, tokenized (on a worker thread, so that a long prompt does not
hold up the event loop) and turned into engine requests in its handler, before anything
is queued, so a bad field is a 400 and never reaches the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import re
import secrets
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from tidal.config import EngineConfig, SamplingParams
from tidal.demo import DEMO_NAME
from tidal.engine import frozen_heap
from tidal.engine_args import engine_kwargs
from tidal.processing import check_text
from tidal.request import CompletionOutput, RequestOutput
from tidal.request import Request as EngineRequest
from tidal.server.async_engine import AsyncEngine, EngineError
from tidal.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                   CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                   DeltaMessage, ErrorInfo, ErrorResponse, ModelCard, ModelList, SamplingFields,
                                   TokenLogprob, TopLogprob, Usage)

logger = logging.getLogger(__name__)

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_request_body_bytes: int = 8 * 2**20) -> RequestGuard:
    """The server's app around an engine whose core process is running; the threads that
    talk to it start and stop with the app's lifespan."""
    serving = OpenAIServing(engine, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # A full collection would walk the libraries' objects too (a third of a million),
        # and while it runs nothing drains the core's pipe: the core blocks in its send and
        # the device idles (docs/design.md).
        with frozen_heap():
            yield
        await engine.stop()

    app = FastAPI(title="tidal", lifespan=lifespan)
    add_error_handlers(app)
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", serving.models, methods=["GET"])

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise APIError(503, "the engine is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return RequestGuard(app, api_key, max_request_body_bytes)


class RequestGuard:
    """Checked before a request reaches routing or body parsing: the API key on /v1 paths
    (so a malformed body or an unknown path tells nothing to a client without it), then
    the body's size, read here in full up to the limit (a larger one is 413 at once)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected and scope["path"].startswith("/v1") and \
                not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await self.refuse(send, APIError(
                401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                code="invalid_api_key"))
        too_large = APIError(413, f"request body larger than {self.max_body_bytes} bytes "
                                  "(the server's --max-request-body-mb)", code="request_too_large")
        if int(headers.get(b"content-length", b"0") or 0) > self.max_body_bytes:
            return await self.refuse(send, too_large)
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.max_body_bytes:
                return await self.refuse(send, too_large)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(body), "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def refuse(send, error: APIError) -> None:
        body = ErrorResponse(error=error.info).model_dump_json().encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn, which on SIGTERM (or Ctrl-C) stops taking connections and lets running
    requests finish for up to `drain_s` seconds, then ends those left with an OpenAI-style
    error (a stream gets an error event and [DONE]); and which exits when the engine dies."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_s: float):
        super().__init__(config)
        self.engine = engine
        self.drain_s = drain_s
        self.draining = False
        engine.on_death = self.engine_died

    def handle_exit(self, sig, frame) -> None:
        if not self.draining and self.engine.is_running:
            self.draining = True
            error = EngineError(f"the server is shutting down: the request did not finish within the "
                                f"{self.drain_s:g} s drain window", 503)
            self.engine._loop.call_later(self.drain_s, self.engine.fail_all, error)
        super().handle_exit(sig, frame)

    def engine_died(self) -> None:
        self.should_exit = True


def run_server(args: argparse.Namespace) -> int:
    """`tidal serve`: start the engine core's process, then serve until SIGTERM / Ctrl-C
    (drained, see DrainingServer). Returns 1 if the engine died, so that a supervisor
    restarts the server."""
    if args.drain_s < 0 or args.max_request_body_mb <= 0:
        raise ValueError("--drain-s must be >= 0 and --max-request-body-mb > 0")
    engine = AsyncEngine(EngineConfig(**engine_kwargs(args)))
    logger.info("engine core ready: %s", engine.description)
    name = args.served_model_name or args.model or DEMO_NAME
    app = build_app(engine, name, args.api_key, int(args.max_request_body_mb * 2**20))
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           timeout_graceful_shutdown=int(args.drain_s) + 5), engine, args.drain_s)
    server.run()
    return 1 if engine.dead else 0


# -- errors ------------------------------------------------------------------------------

def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's `{"error": {message, type, param, code}}`."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        problems = [describe_validation_error(err) for err in e.errors()]
        return APIError(400, "; ".join(message for _, message in problems), param=problems[0][0]).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, e: EngineError):
        return APIError(e.status, str(e), type="server_error").response()


def describe_validation_error(err: dict) -> tuple[str | None, str]:
    """(the field, a message naming it) for one pydantic error in the request body."""
    if err["type"] == "json_invalid":
        return None, f"malformed JSON body at character {err['loc'][-1]}: {err['ctx']['error']}"
    path = [str(part) for part in err["loc"][1:]]  # loc[0] is "body"; a union adds its member's name
    return (path[0] if path else None), f"{'.'.join(path) or 'request body'}: {err['msg']}"


# -- the endpoints ------------------------------------------------------------------------

class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_name = model_name
        self.created = int(time.time())

    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)])

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = self._completion_prompts(body.prompt)

        def make():
            return self._make_requests(response_id, prompts, body, body.max_tokens, body.logprobs, "prompt")

        # Token ids need no tokenizer: building them here spares a worker thread's round trip,
        # which at load waits on the event loop's turns. Text is tokenized off the loop.
        requests = make() if all(not isinstance(p, str) for p in prompts) else await asyncio.to_thread(make)
        if body.stream:
            outputs = await self._started(requests)
            return event_stream(self._stream_completion(response_id, len(requests), outputs, body))
        finals = await self._collect(requests, request)
        choices = [CompletionChoice(index=i, text=out.outputs[0].text, finish_reason=out.outputs[0].finish_reason,
                                    logprobs=None if body.logprobs is None
                                    else self._completion_logprobs(out.outputs[0], 0, 0)[0])
                   for i, out in enumerate(finals)]
        return CompletionResponse(id=response_id, created=int(time.time()), model=self.model_name,
                                  choices=choices, usage=usage(finals, body.n))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        requests = await asyncio.to_thread(lambda: self._make_requests(
            response_id, [self._chat_prompt(body.messages)], body, max_tokens, top_n, "messages"))
        if body.stream:
            outputs = await self._started(requests)
            return event_stream(self._stream_chat(response_id, len(requests), outputs, body, top_n))
        finals = await self._collect(requests, request)
        choices = [ChatChoice(index=i, message=AssistantMessage(content=out.outputs[0].text),
                              finish_reason=out.outputs[0].finish_reason,
                              logprobs=None if top_n is None else self._chat_logprobs(out.outputs[0], 0, top_n))
                   for i, out in enumerate(finals)]
        return ChatCompletionResponse(id=response_id, created=int(time.time()), model=self.model_name,
                                      choices=choices, usage=usage(finals, body.n))

    # -- building engine requests (on a worker thread when they tokenize text) ----------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def _completion_prompts(self, prompt: str | list) -> list[str | list[int]]:
        """OpenAI's prompt forms (a text, token ids, or a list of either) as a list of prompts."""
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts or any(p == "" for p in prompts):
            raise APIError(400, "prompt: empty prompt", param="prompt")
        return prompts

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        conversation = []
        for m in messages:
            content = m.content or ""
            if not isinstance(content, str):
                if any(part.type != "text" for part in content):
                    raise APIError(400, "messages: only text content is supported", param="messages")
                content = "".join(part.text or "" for part in content)
            conversation.append({"role": m.role, "content": content})
        try:
            for turn in conversation:
                check_text(turn["content"], "messages")
            return self.tokenizer.apply_chat_template(conversation)
        except (ValueError, TemplateError) as e:
            raise APIError(400, str(e) if str(e).startswith("messages:") else f"messages: {e}",
                           param="messages") from e

    def _make_requests(self, response_id: str, prompts: list[str | list[int]], body: SamplingFields,
                       max_tokens: int | None, logprobs: int | None, prompt_field: str) -> list[EngineRequest]:
        """`n` engine requests per prompt (seeds seed, seed+1, ...), all validated before
        any runs. Without max_tokens a request may fill the model's context. An error about
        the prompt names the field that carried it (`prompt_field`)."""
        requests = []
        try:
            for stop in [body.stop] if isinstance(body.stop, str) else body.stop or []:
                check_text(stop, "stop")
            for prompt in prompts:
                ids = self.engine.inputs.encode(prompt) if isinstance(prompt, str) else prompt
                for i in range(body.n):
                    params = SamplingParams(
                        max_tokens=max_tokens if max_tokens is not None else max(1, self.max_model_len - len(ids)),
                        seed=None if body.seed is None else body.seed + i, logprobs=logprobs, **body.sampling_kwargs())
                    requests.append(self.engine.make_request(
                        ids, params, f"{response_id}-{len(requests)}", stream=bool(body.stream),
                        simulate_acceptance=body.simulate_acceptance))
        except ValueError as e:
            field = re.match(r"\w+", str(e))
            field = prompt_field if field and field[0] == "prompt" else field[0] if field else None
            raise APIError(400, str(e), param=field if field in type(body).model_fields else None)
        return requests

    # -- results -------------------------------------------------------------------------

    async def _collect(self, requests: list[EngineRequest], http: Request) -> list[RequestOutput]:
        """The requests' final outputs; if the client goes away first, they are aborted."""
        finals: list[RequestOutput] = [None] * len(requests)

        async def run():
            async with aclosing(self.engine.generate(requests)) as outputs:
                async for i, out in outputs:
                    if out.finished:
                        finals[i] = out

        async def disconnected():
            while (await http.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.create_task(run()), asyncio.create_task(disconnected())
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not work.done():  # the client left: cancelling closes the generator, which aborts the requests
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise APIError(499, "the client closed the connection")
        work.result()
        return finals

    async def _started(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The requests' outputs, once the first has come: a stream's requests reach the core
        from the handler, not a few of the event loop's turns later when the response's body
        starts; and an engine that fails before the first token answers with an error status."""
        outputs = self.engine.generate(requests)
        try:
            first = await anext(outputs)
        except BaseException:
            await outputs.aclose()
            raise

        async def from_first():
            async with aclosing(outputs):
                yield first
                async for item in outputs:
                    yield item

        return from_first()

    async def _stream_completion(self, response_id: str, n: int, outputs: AsyncIterator[tuple[int, RequestOutput]],
                                 body: CompletionRequest) -> AsyncIterator[CompletionResponse]:
        created = int(time.time())
        finals: list[RequestOutput] = [None] * n
        tokens_sent = [0] * n
        text_offsets = [0] * n
        async with aclosing(outputs):
            async for i, out in outputs:
                completion = out.outputs[0]
                logprobs = None
                if body.logprobs is not None:
                    logprobs, text_offsets[i] = self._completion_logprobs(completion, tokens_sent[i], text_offsets[i])
                tokens_sent[i] = len(completion.token_ids)
                finals[i] = out
                yield CompletionResponse(id=response_id, created=created, model=self.model_name, choices=[
                    CompletionChoice(index=i, text=completion.delta, logprobs=logprobs,
                                     finish_reason=completion.finish_reason)])
        if body.include_usage:
            yield CompletionResponse(id=response_id, created=created, model=self.model_name, choices=[],
                                     usage=usage(finals, body.n))

    async def _stream_chat(self, response_id: str, n: int, outputs: AsyncIterator[tuple[int, RequestOutput]],
                           body: ChatCompletionRequest, top_n: int | None) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=response_id, created=created, model=self.model_name, choices=choices,
                                       usage=usage)

        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(n)])
        finals: list[RequestOutput] = [None] * n
        tokens_sent = [0] * n
        async with aclosing(outputs):
            async for i, out in outputs:
                completion = out.outputs[0]
                logprobs = None if top_n is None else self._chat_logprobs(completion, tokens_sent[i], top_n)
                tokens_sent[i] = len(completion.token_ids)
                finals[i] = out
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=completion.delta), logprobs=logprobs,
                                             finish_reason=completion.finish_reason)])
        if body.include_usage:
            yield chunk([], usage(finals, body.n))

    # -- logprobs: the engine gives, per output token, {token id: logprob}, sampled token first

    def _token_text(self, token_id: int) -> str:
        """The token's text; for a token that is only part of a UTF-8 character (it decodes
        to U+FFFD), its vocabulary entry instead, which unlike U+FFFD tells tokens apart."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.tokenizer.hf.convert_ids_to_tokens(token_id) if "\ufffd" in text else text

    def _new_logprobs(self, completion: CompletionOutput, start: int) -> list[tuple[int, dict[int, float]]]:
        """(token, its logprob entry) for output tokens from `start` on. The entry list may
        already be longer than this output's tokens (the engine thread keeps appending)."""
        end = len(completion.token_ids)
        return list(zip(completion.token_ids[start:end], completion.logprobs[start:end]))

    def _completion_logprobs(self, completion: CompletionOutput, start: int,
                             text_offset: int) -> tuple[CompletionLogprobs, int]:
        """Completions' format (the sampled token plus the top n in `top_logprobs`), and the
        text offset after these tokens."""
        entries = self._new_logprobs(completion, start)
        tokens = [self._token_text(token) for token, _ in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=text_offset))
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[entry[token] for token, entry in entries],
            # Reversed so that the sampled token (first) wins when two ids decode to the same text.
            top_logprobs=[{self._token_text(t): lp for t, lp in reversed(entry.items())} for _, entry in entries],
            text_offset=offsets[:-1]), offsets[-1]

    def _chat_logprobs(self, completion: CompletionOutput, start: int, top_n: int) -> ChatLogprobs:
        content = []
        for token, entry in self._new_logprobs(completion, start):
            top = sorted(entry.items(), key=lambda item: -item[1])[:top_n]
            content.append(TokenLogprob(**self._top_logprob(token, entry[token]).model_dump(),
                                        top_logprobs=[self._top_logprob(t, lp) for t, lp in top]))
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self._token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def usage(finals: list[RequestOutput], n: int) -> Usage:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
    prompt_tokens = sum(out.metrics["num_prompt_tokens"] for out in finals[::n])
    completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def event_stream(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events, OpenAI style: `data: {json}` per chunk, then `data: [DONE]`.
    An engine failure mid-stream becomes an error event (the status line is already sent).
    A client that disconnects cancels this generator, whose cleanup aborts its requests."""

    async def body():
        try:
            async for event in events:
                yield f"data: {event.model_dump_json()}\n\n"
        except EngineError as e:
            error = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error"))
            yield f"data: {error.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
