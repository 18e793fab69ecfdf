"""Chat with a trained checkpoint: an OpenAI-compatible HTTP server and a web chat page.

    python serve.py --checkpoint checkpoints/ppo                 # then open http://127.0.0.1:8000/
    python serve.py --checkpoint checkpoints/sft --reward checkpoints/rm --port 8080

The server speaks the subset of the OpenAI API that clients rely on, so the ``openai`` package, curl or any chat
front end can talk to the model (``base_url="http://127.0.0.1:8000/v1"``, any api key):

* ``GET /v1/models``: the one model served; its id is the checkpoint folder's name (``ppo``).
* ``POST /v1/chat/completions``: ``messages`` (system, then user/assistant turns, ending with a user turn) go
  through the chat template (``chinese_tokenizer.chat_messages_ids``); needs a chat checkpoint (SFT, PPO, DPO,
  GRPO). Fields: ``temperature``, ``top_p``, ``max_tokens`` (or ``max_completion_tokens``), ``stop``, ``n``,
  ``seed``, ``stream`` (server-sent events, ending with ``data: [DONE]``), ``stream_options.include_usage``, and
  ``top_k`` (an extension, as other servers have it). The reply carries ``usage`` token counts and each choice's
  ``finish_reason``: ``stop`` ([SEP] or a stop string) or ``length`` (``max_tokens`` reached).
* ``POST /v1/completions``: plain continuation of ``prompt`` (a string or a list of strings), for any checkpoint.
* ``GET /``: the chat page (``web/chat.html``: plain HTML and JavaScript, nothing fetched from elsewhere).

Defaults where a request says nothing: temperature 0.8 and top-k 50 (``generate.py``'s; greedy text from a small model
loops), ``max_tokens`` half the model's context (or what the prompt leaves of it). A prompt is never cut silently: when
it does not fit with ``max_tokens`` the request gets a 400 naming both counts and the context, as OpenAI's API answers;
a chat request may instead send ``truncate_history: true`` (an extension) to drop its oldest whole (user, assistant)
turns, never the system text and never part of a turn. With ``--reward DIR`` every choice carries the reward model's
score as ``"reward"`` (an extension field) and a non-streamed reply lists its ``n`` choices best first (best-of-n); in a
stream each choice's last chunk carries its score.

How requests are run: one generation thread owns the model. Requests queue for it; those that arrive together and sample
alike (same temperature, top-k, top-p, no seed) run as one left-padded batch of up to ``MAX_BATCH`` rows through
``gpt_fast.generate`` with the KV cache, each row ending at its own [SEP], stop string or ``max_tokens``. Tokens go to
each request's own queue, so a slow reader never holds up the thread or the others' streams; a client who disconnects
ends its rows at the next token (a streamed one when its stream closes, a non-streamed one when the waiting request sees
the disconnect, polled every ``DISCONNECT_POLL_S``). A request with a ``seed`` runs alone, right after seeding torch's
generator, so the same request gives the same answer.

Errors come back as OpenAI error objects, ``{"error": {"message", "type", "param", "code"}}``: 400 for a body that is
not JSON or a request the model cannot serve (empty ``messages``, a message without ``content``, a role out of order, a
prompt and ``max_tokens`` longer than the context), 404 for an unknown model or path, 422 for a field of the wrong type
or range (``temperature`` < 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from chinese_tokenizer import EOS_ID, IncrementalDecoder, chat_messages_ids, encode
from gpt_fast import generate, speed_up
from plumbing.batching import pad_left
from plumbing.cli import ArgumentParser, UserError, run
from plumbing.devices import pick_device
from plumbing.inference import (
    DTYPES,
    add_dtype_argument,
    add_model_arguments,
    check_reward_dir,
    find_latest_checkpoint,
    load_policy,
    load_reward,
    weight_dtype,
)
from plumbing.reward import score_texts

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web", "chat.html")
MAX_BATCH = 16  # rows generated together; also the largest n
MAX_STOP = 4  # stop strings per request, as in the OpenAI API
DEFAULT_TEMPERATURE = 0.8  # generate.py's defaults: greedy text from a small model loops
DEFAULT_TOP_K = 50
DISCONNECT_POLL_S = 0.05  # how often a non-streamed request checks that its client is still there


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- requests ----------------------------------------------------------------------------------------------------

class Message(BaseModel):
    role: str
    content: str | list[dict] | None = None  # a message without content is refused (message_text), not read as ""


class Sampling(BaseModel):
    """The fields chat and completion requests share (OpenAI's names; ``top_k`` is an extension)."""
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_BATCH)
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)  # what torch.manual_seed takes
    stream: bool = False
    stream_options: dict | None = None


class ChatRequest(Sampling):
    messages: list[Message]
    truncate_history: bool = False  # an extension: drop the oldest whole turns that do not fit (conversation_ids)


class CompletionRequest(Sampling):
    prompt: str | list[str]


class ApiError(Exception):
    """A request the server refuses: becomes an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, status: int, param=None, code=None) -> dict:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def field_path(loc) -> str | None:
    """pydantic's error location as the request's own field path, e.g. ``messages[0].content`` (pydantic also
    names the member of a union it tried, ``str`` or ``list[...]``, which is no field of the request)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            path += ("." if path else "") + part
    return path or None


def message_text(message: Message, i: int) -> str:
    """A message's text: a string, or the ``text`` parts of a content list. Raises ``ApiError`` (400) for a
    message without ``content`` (null or missing) and for parts that are not text."""
    if message.content is None:
        raise ApiError(400, f"messages[{i}].content is missing: every message needs its text", f"messages[{i}].content")
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported, got {part.get('type')!r}",
                           f"messages[{i}].content")
        texts.append(part["text"])
    return "".join(texts)


# --- generation --------------------------------------------------------------------------------------------------

@dataclass
class Job:
    """One request's work for the generation thread: ``n`` continuations of one prompt (a completion request with
    several prompts is several jobs). Events go to ``events`` on the request's event loop:
    ``("text", choice, str)``, ``("end", choice, finish_reason, completion_tokens)``, ``("error", message)``."""
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)

    def batch_key(self):
        """Jobs with equal keys can share one ``generate`` call; a seeded job shares with none."""
        return (self.temperature, self.top_k, self.top_p) if self.seed is None else id(self)

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Row:
    """One continuation being written: its decoder, what has been sent, and why it ended."""

    def __init__(self, job: Job, choice: int, tokenizer):
        self.job, self.choice = job, choice
        self.decoder, self.sent, self.tokens, self.finish = IncrementalDecoder(tokenizer), 0, 0, None

    def push(self, token: int) -> bool:
        """Take the row's next token; returns True when the row has ended (and sends its events)."""
        if self.finish is not None:
            return True
        if self.job.cancelled.is_set():  # the client left: nobody reads this row any more
            self.finish = "cancelled"
            return True
        self.tokens += 1
        if token == EOS_ID:
            return self.end("stop")
        self.decoder.push(token)
        text, safe = self.decoder.text, len(self.decoder.text)
        for s in self.job.stop:
            at = text.find(s)
            if at >= 0:
                safe = min(safe, at)
        if safe < len(text):  # a stop string was written: the text ends just before it
            return self.end("stop", text[:safe])
        # hold back an end of the text that may be the start of a stop string
        for s in self.job.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        self.send_text(text[:safe])
        if self.tokens >= self.job.max_tokens:
            return self.end("length")
        return False

    def send_text(self, text: str) -> None:
        if len(text) > self.sent:
            self.job.send("text", self.choice, text[self.sent:])
            self.sent = len(text)

    def end(self, reason: str, text: str | None = None) -> bool:
        self.send_text(self.decoder.text if text is None else text)
        self.finish = reason
        self.job.send("end", self.choice, reason, self.tokens)
        return True


class Generator:
    """The thread that owns the model and runs queued jobs in batches (see the module docstring)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.thread = threading.Thread(target=self.loop, name="generator", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def take_batch(self) -> list[Job]:
        """The first queued job and the queued jobs that can share its batch (the others keep their order)."""
        batch = [self.jobs.get()]
        rows, waiting = batch[0].n, []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job.batch_key() == batch[0].batch_key() and rows + job.n <= MAX_BATCH:
                batch.append(job)
                rows += job.n
            else:
                waiting.append(job)
        for job in waiting:
            self.jobs.put(job)
        return batch

    def loop(self) -> None:
        while True:
            batch = self.take_batch()
            batch = [job for job in batch if not job.cancelled.is_set()]
            if not batch:
                continue
            try:
                self.run(batch)
            except Exception as e:  # a failed batch fails its requests, never the server
                traceback.print_exc()
                for job in batch:
                    job.send("error", f"generation failed: {type(e).__name__}: {e}")

    def run(self, batch: list[Job]) -> None:
        """Generate every row of ``batch`` in one left-padded ``generate`` call."""
        rows = [Row(job, c, self.tokenizer) for job in batch for c in range(job.n)]
        batch_ids = pad_left([row.job.prompt_ids for row in rows])
        input_ids = batch_ids["input_ids"].to(self.device)  # (B, T), every row ending at the last column
        attention_mask = batch_ids["attention_mask"].to(self.device)  # (B, T)
        first = batch[0]
        if first.seed is not None:
            torch.manual_seed(first.seed)

        def stream(next_ids):  # (B,)
            return [row.push(token) for row, token in zip(rows, next_ids.tolist())]

        generate(self.model, input_ids, max(job.max_tokens for job in batch), self.model.cfg.context_length,
                 temperature=first.temperature, top_k=first.top_k, top_p=first.top_p, eos_id=EOS_ID,
                 attention_mask=attention_mask, stream=stream)
        for row in rows:  # a row still open when generate returned has used its max_tokens
            if row.finish is None:
                row.end("length")
        left = [(row.tokens, row.job.max_tokens) for row in rows if row.finish == "cancelled"]
        if left:
            tokens, limit = max(left)
            log(f"stopped {len(left)} row(s) whose client left, after {tokens} of {limit} tokens")


# --- what differs between the two endpoints ----------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    """The shape of one endpoint's replies: ``chat.completion`` choices carry a ``message`` and stream ``delta``s
    (the first one giving the role), ``text_completion`` choices carry ``text`` in replies and chunks alike."""
    object: str
    chunk_object: str
    id_prefix: str
    chat: bool

    def choice(self, index: int, text: str, finish: str) -> dict:
        """One choice of a non-streamed reply."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": index, "finish_reason": finish, "logprobs": None, **body}

    def chunk_choice(self, index: int, text: str | None, finish: str | None, first: bool = False) -> dict:
        """One choice of a streamed chunk: a piece of text, the role (``first``, chat only) or the end."""
        if not self.chat:
            return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}


CHAT = Endpoint("chat.completion", "chat.completion.chunk", "chatcmpl-", chat=True)
COMPLETION = Endpoint("text_completion", "text_completion", "cmpl-", chat=False)


# --- errors ------------------------------------------------------------------------------------------------------

async def api_error(request: Request, e: ApiError):
    return JSONResponse(error_body(e.message, e.status, e.param, e.code), status_code=e.status)


async def invalid_request(request: Request, e: RequestValidationError):
    """pydantic's complaint about a body as one OpenAI error: 400 for a body that is no JSON object, 422 for a field
    of the wrong type or range."""
    first = e.errors()[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ())[1:2]
        reason = (first.get("ctx") or {}).get("error", first.get("msg"))
        at = f" at character {where[0]}" if where else ""
        return JSONResponse(error_body(f"the request body is not valid JSON ({reason}{at})", 400), 400)
    if tuple(first.get("loc", ())) == ("body",):
        return JSONResponse(error_body("the request body must be a JSON object, sent with Content-Type: "
                                       "application/json", 400), 400)
    param = field_path(first.get("loc", ())[1:])
    return JSONResponse(error_body(f"{param or 'body'}: {first.get('msg')}", 422, param), 422)


async def http_error(request: Request, e: StarletteHTTPException):
    allowed = (e.headers or {}).get("Allow", "another method")
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}: use {allowed}"}.get(e.status_code,
                                                                                             str(e.detail))
    return JSONResponse(error_body(message, e.status_code, code="not_found" if e.status_code == 404 else None),
                        e.status_code)


async def crashed(request: Request, e: Exception):
    traceback.print_exc()
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", 500), 500)


ERROR_HANDLERS = {ApiError: api_error, RequestValidationError: invalid_request, StarletteHTTPException: http_error,
                  Exception: crashed}


# --- a request's prompt and budget -------------------------------------------------------------------------------

def stop_strings(req: Sampling) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop has {len(stop)} strings; give at most {MAX_STOP}", "stop")
    return [s for s in stop if s]


def max_tokens_for(req: Sampling, prompt_tokens: int, context: int, hint: str = "") -> int:
    """The request's ``max_tokens`` (or ``max_completion_tokens``), checked before anything is generated: the prompt
    and the answer must fit in the context together, as OpenAI's API and vLLM check it. Without one, up to half the
    context, and no more than what the prompt leaves.

    Raises:
        ApiError: 400 (code ``context_length_exceeded``) naming the prompt's token count, ``max_tokens`` and the
            context when they do not fit; ``hint`` ends the message (another way out, if there is one).
    """
    name = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    wanted, room = req.max_completion_tokens or req.max_tokens, context - prompt_tokens
    if wanted is None and room >= 1:
        return min(context // 2, room)
    if wanted is None or wanted > room:
        asked = f"{name} {wanted}" if wanted else "at least 1 token"
        raise ApiError(400, f"this model's context is {context} tokens, but the prompt has {prompt_tokens} and the "
                            f"answer asks for {asked}; shorten the prompt or lower {name}{hint}",
                       name if wanted else "messages", "context_length_exceeded")
    return wanted


def conversation_ids(turns, tokenizer, context: int, req: ChatRequest) -> list[int]:
    """The chat template of ``turns`` whole, or, with the request's ``truncate_history``, without as many of its
    oldest (user, assistant) pairs as the context needs: never the system text, never part of a turn, never the
    last user turn. A conversation that does not fit is refused later (``max_tokens_for``), not cut.

    Raises:
        ApiError: 400 for a conversation out of order (the message says which turn).
    """
    try:
        ids = chat_messages_ids(turns, tokenizer)
        if req.truncate_history:
            budget = req.max_completion_tokens or req.max_tokens or 1
            system = [t for t in turns if t[0] == "system"]
            rest = turns[len(system):]
            while len(ids) + budget > context and len(rest) > 1:
                rest = rest[2:]  # the oldest user turn and the assistant's answer to it
                ids = chat_messages_ids(system + rest, tokenizer)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from e
    return ids


# --- the app -----------------------------------------------------------------------------------------------------

class Service:
    """One served model: its generation thread (``Generator``) and what turns a request into jobs and a reply.

    ``chat``: whether the model answers through the chat template (``/v1/chat/completions``);
    ``reward_model``: an optional RM that scores every choice (``"reward"``, best first when not streamed)."""

    def __init__(self, model, tokenizer, chat: bool, model_id: str, reward_model=None):
        self.model, self.tokenizer, self.chat, self.model_id = model, tokenizer, chat, model_id
        self.reward_model, self.context = reward_model, model.cfg.context_length
        self.generator = Generator(model, tokenizer)
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "local",
                "context_length": self.context, "chat": self.chat}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise ApiError(404, f"model {name!r} is not served here; this server has {self.model_id!r}", "model",
                           "model_not_found")

    def job(self, req: Sampling, prompt_ids: list[int], hint: str = "") -> Job:
        """The work of one prompt: its ``n`` continuations with the request's sampling (generate.py's defaults
        where it says nothing); the prompt must fit with its answer (``max_tokens_for``, ``hint`` for its error)."""
        temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
        top_k = DEFAULT_TOP_K if req.top_k is None else req.top_k
        top_p = req.top_p if req.top_p is not None and req.top_p < 1.0 else None
        return Job(prompt_ids, req.n, max_tokens_for(req, len(prompt_ids), self.context, hint), temperature,
                   top_k or None, top_p, req.seed, stop_strings(req), asyncio.get_running_loop(), asyncio.Queue())

    def chat_jobs(self, req: ChatRequest) -> tuple[list[Job], list[str]]:
        """The one job of a chat request and its prompt (the last user turn, for the RM's scores)."""
        self.check_model(req.model)
        if not self.chat:
            raise ApiError(400, f"{self.model_id} is a plain language model (not trained on the chat template); use "
                                f"/v1/completions, or serve an SFT, PPO, DPO or GRPO checkpoint", "messages")
        if not req.messages:
            raise ApiError(400, "messages is empty: give at least one user message", "messages")
        turns = [(m.role, message_text(m, i)) for i, m in enumerate(req.messages)]
        ids = conversation_ids(turns, self.tokenizer, self.context, req)
        several = sum(role == "user" for role, _ in turns) > 1
        hint = " (or send truncate_history: true to drop the oldest whole turns)" if several and not \
            req.truncate_history else ""
        return [self.job(req, ids, hint)], [turns[-1][1]]

    def completion_jobs(self, req: CompletionRequest) -> tuple[list[Job], list[str]]:
        """One job per prompt of a completion request, and the prompts."""
        self.check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if not prompts or any(not p for p in prompts):
            raise ApiError(400, "prompt is empty: give some text to continue", "prompt")
        if len(prompts) * req.n > MAX_BATCH:
            raise ApiError(400, f"{len(prompts)} prompts x n={req.n} is more than {MAX_BATCH} completions", "n")
        start = [] if self.model.cfg.bos_id is None else [self.model.cfg.bos_id]  # as the model's documents began
        return [self.job(req, start + encode(p, self.tokenizer)) for p in prompts], prompts

    def reward_of(self, prompt: str, text: str, finish: str) -> float:
        """The RM's score of one choice; one cut off at max_tokens (finish "length") without the closing [SEP]
        it never wrote, as generate.py and the alignment stages score such an answer."""
        return round(float(score_texts(self.reward_model, self.tokenizer, [prompt], [text],
                                       ended=[finish != "length"])[0]), 4)

    async def respond(self, request: Request, req: Sampling, jobs: list[Job], prompts: list[str],
                      endpoint: Endpoint):
        """Queue the jobs, then the reply: streamed (``stream_events``) or whole (``reply``)."""
        for job in jobs:
            self.generator.submit(job)
        rid = endpoint.id_prefix + uuid.uuid4().hex[:24]
        usage = {"prompt_tokens": sum(len(j.prompt_ids) for j in jobs), "completion_tokens": 0}
        started = time.perf_counter()
        if req.stream:
            return StreamingResponse(stream_events(self, rid, req, jobs, prompts, endpoint, usage, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            choices = await collect(jobs, req.n, request)
        finally:  # the reply is complete, or the client left (disconnected, or cancelled): no row runs on
            for job in jobs:
                job.cancelled.set()
        if choices is None:
            log_request(endpoint.object + " (client left)", usage, ["cancelled"], started)
            return Response(status_code=499)  # nobody reads it; the status only shows in logs
        return self.reply(rid, choices, prompts, endpoint, usage, started)

    def reply(self, rid: str, choices: dict, prompts: list[str], endpoint: Endpoint, usage: dict,
              started: float) -> dict:
        """A whole reply: the choices in order, or per prompt best first by the RM's reward, with the usage."""
        for (j, _), ch in choices.items():
            usage["completion_tokens"] += ch["tokens"]
            if self.reward_model is not None:
                ch["reward"] = self.reward_of(prompts[j], ch["text"], ch["finish"])
        order = sorted(choices) if self.reward_model is None else \
            sorted(choices, key=lambda k: (k[0], -choices[k]["reward"]))  # per prompt, best first
        out = []
        for index, key in enumerate(order):
            ch = choices[key]
            out.append({**endpoint.choice(index, ch["text"], ch["finish"]),
                        **({"reward": ch["reward"]} if "reward" in ch else {})})
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        log_request(endpoint.object, usage, [ch["finish"] for ch in choices.values()], started)
        return {"id": rid, "object": endpoint.object, "created": int(time.time()), "model": self.model_id,
                "choices": out, "usage": usage}


async def collect(jobs: list[Job], n: int, request: Request | None = None) -> dict | None:
    """Wait for every choice of ``jobs``: {(job, choice): {"text", "finish", "tokens"}}; None as soon as the
    client of ``request`` has disconnected (checked every ``DISCONNECT_POLL_S``, whether tokens arrive or not)."""
    choices, checked = {}, time.monotonic()
    for j, job in enumerate(jobs):
        texts, open_ = [""] * n, n
        while open_:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if request is not None and time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return None
            if event is None:
                continue
            if event[0] == "error":
                raise ApiError(500, event[1])
            if event[0] == "text":
                texts[event[1]] += event[2]
            else:
                choices[(j, event[1])] = {"text": texts[event[1]], "finish": event[2], "tokens": event[3]}
                open_ -= 1
    return choices


def sse(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def merged_events(jobs: list[Job]):
    """Every job's events as one stream of (job index, event), in the order they arrive; ends after an error."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(j, job):
        while True:
            event = await job.events.get()
            await merged.put((j, event))
            if event[0] == "error":
                return

    tasks = [asyncio.create_task(forward(j, job)) for j, job in enumerate(jobs)]
    try:
        while True:
            yield await merged.get()
    finally:
        for task in tasks:
            task.cancel()


async def stream_events(service: Service, rid, req, jobs, prompts, endpoint: Endpoint, usage, started):
    """Server-sent events: the role of each choice (chat), one chunk per piece of text, a last chunk per choice
    (with its reward under an RM), the usage if asked, then [DONE]. A client who goes away ends its rows at their
    next token."""
    created = int(time.time())
    with_usage = bool(req.stream_options and req.stream_options.get("include_usage"))

    def chunk(choice: dict) -> str:
        body = {"id": rid, "object": endpoint.chunk_object, "created": created, "model": service.model_id,
                "choices": [choice]}
        return sse({**body, "usage": None} if with_usage else body)

    finishes, texts, open_ = [], {}, len(jobs) * req.n
    try:
        if endpoint.chat:
            for c in range(req.n):
                yield chunk(endpoint.chunk_choice(c, None, None, first=True))
        events = merged_events(jobs)
        async for j, event in events:
            if event[0] == "error":
                yield sse(error_body(event[1], 500))
                finishes.append("error")
                break
            index = j * req.n + event[1]
            if event[0] == "text":
                texts[index] = texts.get(index, "") + event[2]
                yield chunk(endpoint.chunk_choice(index, event[2], None))
                continue
            open_ -= 1
            finishes.append(event[2])
            usage["completion_tokens"] += event[3]
            reward = {"reward": service.reward_of(prompts[j], texts.get(index, ""), event[2])} \
                if service.reward_model is not None else {}
            yield chunk({**endpoint.chunk_choice(index, None, event[2]), **reward})
            if not open_:
                break
        await events.aclose()
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if with_usage:
            yield sse({"id": rid, "object": endpoint.chunk_object, "created": created, "model": service.model_id,
                       "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away: its rows end at their next token
        for job in jobs:
            job.cancelled.set()
        if len(finishes) < len(jobs) * req.n:
            finishes.append("cancelled")
        log_request(endpoint.object + " (stream)", usage, finishes, started)


def create_app(model, tokenizer, chat: bool, model_id: str, reward_model=None) -> FastAPI:
    """The FastAPI app serving ``model`` (see the module docstring): the routes of a ``Service``, which starts its
    generation thread, and the error handlers."""
    service = Service(model, tokenizer, chat, model_id, reward_model)
    app = FastAPI(title="手搓 GPT-2", docs_url=None, redoc_url=None, exception_handlers=ERROR_HANDLERS)

    @app.get("/")
    async def page():
        return FileResponse(PAGE, media_type="text/html; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{name}")
    async def one_model(name: str):
        service.check_model(name)
        return service.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        jobs, prompts = service.chat_jobs(req)
        return await service.respond(request, req, jobs, prompts, CHAT)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        jobs, prompts = service.completion_jobs(req)
        return await service.respond(request, req, jobs, prompts, COMPLETION)

    return app


def log_request(kind: str, usage: dict, finishes: list[str], started: float) -> None:
    log(f"{kind}: {usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} completion tokens, "
        f"finish {','.join(sorted(set(finishes)))}, {time.perf_counter() - started:.2f} s")


# --- the command line --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = ArgumentParser(description="Serve a checkpoint over an OpenAI-compatible HTTP API, with a web chat page at /.")
    add_model_arguments(p)
    p.add_argument("--reward", help="reward model checkpoint (from 2-RM.py): score every choice, best first")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    add_dtype_argument(p)
    args = p.parse_args(argv)
    args.raw = False
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a TCP port; give 0..65535")
    return args


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, or a ``UserError`` naming the flag when the address cannot be used."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); choose another --host "
                        f"or --port, or stop what uses it") from e
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(argv=None):
    import uvicorn

    args = parse_args(argv)
    if args.reward:
        check_reward_dir(args.reward)
    sock = listen(args.host, args.port)
    device = pick_device(args.device)
    if args.checkpoint is None and args.from_hf is None:
        args.checkpoint = find_latest_checkpoint()
    model, tokenizer, chat = load_policy(args)
    speed_up(model)  # the same model, its decoding paths fast (gpt_fast.py)
    model.to(device=device, dtype=DTYPES[args.dtype])
    reward_model = speed_up(load_reward(args.reward, model.cfg.vocab_size).to(device)) if args.reward else None
    model_id = os.path.basename(os.path.abspath(args.checkpoint or args.from_hf))
    app = create_app(model, tokenizer, chat, model_id, reward_model)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    kind = "chat" if chat else "plain continuation"
    log(f"serving {model_id!r} ({kind}) on {device}, {weight_dtype(model)} weights: "
        f"chat page http://{shown}:{port}/ , API http://{shown}:{port}/v1 ; Ctrl-C stops")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    run(main)
