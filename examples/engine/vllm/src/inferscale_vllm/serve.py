"""A served memory: vLLM's own OpenAI-compatible server with the InferScale connector and memory
routes, that answers each user from their memory and learns while it serves.

    python -m inferscale_vllm.serve MODEL --memory DIR [--memory-k 5] [any `vllm serve` flag]

Built on vLLM's API server (``vllm.entrypoints.launchers``: its argument parser, engine client,
app, state and HTTP serving; nothing of it copied): the connector is switched on for DIR, and
these routes are added (under /v1, so ``--api-key`` guards them as it guards vLLM's own):

  POST   /v1/memory/{user}/facts        {"facts": [text, ...], "context": text?}  -> {"ids", ...}
  GET    /v1/memory/{user}/facts        -> {"user", "facts": [{"id", "text"}], "generation"}
  POST   /v1/memory/{user}/retrieve     {"query": text, "k": int?} -> the facts an answer uses
  DELETE /v1/memory/{user}/facts/{id}   -> {"erased": id, "generation"}
  DELETE /v1/memory/{user}              -> {"erased": n, "generation"}

A write encodes each fact through the running engine (one forward of the memory's prefix, the
optional context — the conversation turns the fact was said in — and the fact; the connector's
save path reads the K/V back from vLLM's paged cache in the engine step, and this process
de-rotates them and makes the keys exact, off the step: serve_capture.read_capture), embeds its
text, and commits a new generation with the facade's crash-safe save; writes are serialised (one
writer).

``/v1/chat/completions`` and ``/v1/completions`` with OpenAI's ``user`` field answer from that
user's memory: the query is embedded, the user's top k facts retrieved, and the prompt composed as
tokens — the memory's prefix, the facts (most relevant last), then the chat-templated messages
(or the completion prompt) — with the memory's keyed cache salt; the connector loads the facts'
K/V and vLLM prefills only the query. Streaming works as in vLLM. The response names the facts
(``memory`` in the JSON body; the ``x-inferscale-memory`` header when streaming). A request may
send ``"memory": {"k": int, "required": bool}``: k in 1 .. the user's facts (default
min(--memory-k, facts)); ``required`` (default true) refuses an unknown user or an unreadable
memory with a 4xx, false answers without memory instead. Requests without ``user`` are vLLM's,
unchanged; ``kv_transfer_params`` and ``inferscale-`` salts from clients are refused.
"""

# (no `from __future__ import annotations`: FastAPI resolves the routes' annotations at runtime)

import asyncio
import json
import logging
import os
import re
import sys
import time
import uuid

logger = logging.getLogger("vllm.inferscale.serve")

MARKER = "\x00inferscale-memory\x00"
DEFAULT_SYSTEM = ("You are a helpful assistant. Facts you remember about the user:")
MAX_FACT_CHARS = 4000
MAX_FACTS_PER_WRITE = 64
# A capture's forward computes at least this many tokens (its own, then its own again, whose K/V
# are dropped): vLLM's CPU linear layers may round a row by how many tokens the step computes
# (token_classes.py; on the AMX Xeon 5-32 and 37-575 tokens are two classes), so a prefix or a
# short fact encoded alone would hold other bytes than a prompt's cold prefill computes for the
# same tokens (bench/results/2026-12-07-vllm-amx-tail.md). 64 puts them in the class of short
# prompts there; a memory is exact only for prompts whose cold prefill shares its class.
CAPTURE_MIN_TOKENS = 64
_USER = re.compile(r"[A-Za-z0-9_.@:-]{1,128}")


class MemoryError4xx(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _bad(message: str, status: int = 400):
    return MemoryError4xx(status, message)


def check_user(user) -> str:
    if not isinstance(user, str) or not _USER.fullmatch(user):
        raise _bad(f"user must be 1-128 characters of [A-Za-z0-9_.@:-], got {user!r}")
    return user


class MemoryService:
    """The server's memory: the writer (this process), the embedder, the tokenizer, the prompt
    layout, and the engine it encodes facts through."""

    def __init__(self, engine, args, vllm_config):
        self.engine = engine
        self.args = args
        self.directory = args.memory
        self.default_k = args.memory_k
        self.vllm_config = vllm_config
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.write_lock = asyncio.Lock()
        self.memory = None
        self.embedder = None
        self.queries = None
        self.tokenizer = None
        self.head = None  # the prefix's text: the chat template's head before the facts

    async def start(self):
        from .embed import MiniLMEmbedder, QueryBatcher
        from .memory import Memory, check_model, describe_model

        # one thread: the engine's OpenMP threads own the cores (an embedding forward of two
        # threads here stalls every parallel region of the engine's step on a small machine)
        self.embedder = MiniLMEmbedder(self.args.embedder, threads=1)
        # the requests' queries, embedded together (in bfloat16 where the CPU has it natively)
        self.queries = QueryBatcher(self.embedder, self.args.query_compute)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.vllm_config.model_config.tokenizer)
        self.head, _ = self._split([{"role": "user", "content": "x"}])
        running = describe_model(self.vllm_config.model_config)
        if os.path.exists(os.path.join(self.directory, "memory.ismem")):
            self.memory = Memory.open(self.directory, self.embedder, writer=True)
            reason = check_model(self.memory.model, running)
            if reason:
                raise ValueError(f"inferscale serve: the memory at {self.directory} cannot serve "
                                 f"this model: {reason}")
        else:
            self.memory = Memory.create(self.directory, model=running, embedder=self.embedder,
                                        num_pages=self.args.memory_pages,
                                        dtype=running["dtype"])
        if self.memory.prefix is None:
            ids = self._tokens(self.head)
            kv = await self._capture(ids)
            self.memory.set_prefix(self.head, ids, kv["k"], kv["v"])
            self.memory.commit()
        elif self.memory.text(self.memory.prefix) != self.head:
            prefix = self.memory.text(self.memory.prefix)
            raise ValueError(f"inferscale serve: the memory's prefix is {prefix!r}, "
                             f"this server's system prompt renders {self.head!r} (--memory-system)")
        logger.info("inferscale serve: memory %s, generation %d, %d users", self.directory,
                    self.memory.generation, len(self.memory.users()))

    # -- the prompt layout ------------------------------------------------------------------
    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _split(self, messages):
        """(head, tail) of the chat template rendered with the system prompt and `messages`: the
        facts go between them."""
        content = self.args.memory_system + "\n" + MARKER
        text = self.tokenizer.apply_chat_template([{"role": "system", "content": content}]
                                                  + messages, tokenize=False,
                                                  add_generation_prompt=True)
        if text.count(MARKER) != 1:
            raise ValueError("inferscale serve: the model's chat template does not render the "
                             "system message verbatim; the memory needs it to place the facts")
        head, tail = text.split(MARKER)
        return head, tail

    # -- encoding through the engine --------------------------------------------------------
    async def _capture(self, ids: list[int]) -> dict:
        """The engine's pre-RoPE K/V of `ids` run as one prompt from position 0, read back from
        its paged cache by the connector's save path; the de-rotation and ExactKeys run here, in
        a thread of this process (read_capture), not in the engine's step."""
        from vllm import SamplingParams

        from .serve_capture import read_capture

        cid = uuid.uuid4().hex
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={
            "kv_transfer_params": {"inferscale_capture": {"id": cid}}})
        n = len(ids)
        sent = list(ids) * max(1, -(-CAPTURE_MIN_TOKENS // n))  # causal: the rows of ids unchanged
        prompt = {"prompt_token_ids": sent, "cache_salt": "inferscale-capture-" + cid}
        async for _ in self.engine.generate(prompt, params, f"inferscale-capture-{cid}"):
            pass
        kv = await asyncio.to_thread(read_capture, self.directory, cid, self.tp)
        if [int(t) for t in kv["token_ids"]] != sent:
            raise ValueError(f"inferscale serve: capture {cid} holds other tokens than were sent")
        return dict(kv, token_ids=kv["token_ids"][:n], k=kv["k"][:, :n].copy(),
                    v=kv["v"][:, :n].copy())

    # -- routes ------------------------------------------------------------------------------
    async def write(self, user: str, body) -> dict:
        check_user(user)
        if not isinstance(body, dict):
            raise _bad("the body is a JSON object {\"facts\": [text, ...], \"context\": text?}")
        facts, context = body.get("facts"), body.get("context", "")
        if (not isinstance(facts, list) or not facts or len(facts) > MAX_FACTS_PER_WRITE
                or not all(isinstance(f, str) and f.strip() for f in facts)):
            raise _bad(f"facts must be a list of 1-{MAX_FACTS_PER_WRITE} non-empty strings")
        if not isinstance(context, str):
            raise _bad("context must be a string (the turns the facts were said in)")
        too_long = [i for i, f in enumerate(facts) if len(f) > MAX_FACT_CHARS]
        if too_long or len(context) > 4 * MAX_FACT_CHARS:
            raise _bad(f"a fact holds at most {MAX_FACT_CHARS} characters and the context "
                       f"{4 * MAX_FACT_CHARS} (facts {too_long} are longer); nothing is cut",
                       413)
        prefix = self.memory.store.token_ids(self.memory.prefix)
        ctx = self._tokens(context) if context else []
        limit = self.vllm_config.model_config.max_model_len
        encoded = []
        for text in facts:
            line = f"- {text.strip()}\n"
            ids = self._tokens(line)
            if len(prefix) + len(ctx) + len(ids) >= limit:
                raise _bad(f"the prefix, context and fact make {len(prefix) + len(ctx) + len(ids)}"
                           f" tokens, the model takes {limit}", 413)
            encoded.append((text.strip(), ids))
        vectors = await asyncio.to_thread(self.embedder.embed, [t for t, _ in encoded])
        async with self.write_lock:
            # the facts' forwards at once: the engine batches them
            kvs = await asyncio.gather(*(self._capture(prefix + ctx + ids) for _, ids in encoded))
            items = [dict(text=text, token_ids=ids, keys=kv["k"], values=kv["v"],
                          context=prefix + ctx, embedding=vector)
                     for (text, ids), vector, kv in zip(encoded, vectors, kvs)]
            ids, generation = await asyncio.to_thread(self._add_and_commit, user, items)
        return {"user": user, "ids": ids, "generation": generation}

    def _add_and_commit(self, user, items):
        # under the memory's mutex: an answer composed meanwhile sees the committed generation
        # (its facts, tokens and salt), never facts that are not committed yet
        with self.memory._mutex:
            ids = self.memory.add_facts(user, items)
            return ids, self.memory.commit()

    async def retrieve(self, user: str, body) -> dict:
        """The user's k facts for a query, most relevant first (what an answer would use)."""
        check_user(user)
        if not isinstance(body, dict) or not isinstance(body.get("query"), str) \
                or not body["query"].strip():
            raise _bad("the body is {\"query\": text, \"k\": int}")
        facts = self.memory.facts(user)
        if not facts:
            raise _bad(f"unknown user {user!r} (no facts)", 404)
        k = body.get("k", min(self.default_k, len(facts)))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(facts):
            raise _bad(f"k must be an int in 1 .. {len(facts)} ({user!r}'s facts), got {k!r}")
        vector = await self.queries.embed(body["query"])
        return await asyncio.to_thread(self._retrieve, user, vector, k)

    def _retrieve(self, user, vector, k):
        with self.memory._mutex:
            ids = self.memory.retrieve(user, vector, k)
            return {"user": user, "generation": self.memory.generation,
                    "facts": [{"id": f, "text": self.memory.text(f)} for f in ids]}

    def list(self, user: str) -> dict:
        check_user(user)
        facts = self.memory.facts(user)
        if not facts:
            raise _bad(f"unknown user {user!r} (no facts)", 404)
        return {"user": user, "generation": self.memory.generation,
                "facts": [{"id": f, "text": self.memory.text(f)} for f in facts]}

    async def erase(self, user: str, fact_id: int | None) -> dict:
        check_user(user)
        async with self.write_lock:
            return await asyncio.to_thread(self._erase_and_commit, user, fact_id)

    def _erase_and_commit(self, user, fact_id):
        with self.memory._mutex:
            if fact_id is None:
                if not self.memory.facts(user):
                    raise _bad(f"unknown user {user!r} (no facts)", 404)
                result = {"erased": self.memory.erase_user(user)}
            else:
                if self.memory.owner(fact_id) != user:
                    raise _bad(f"fact {fact_id} is not one of {user!r}'s facts", 404)
                self.memory.erase_fact(fact_id, user)
                result = {"erased": fact_id}
            result["generation"] = self.memory.commit()
            return result

    async def compose(self, body: dict, chat: bool) -> tuple[dict, dict | None]:
        """The request body rewritten to answer from the user's memory, and what it used (None:
        answered without memory, as the request allowed). The checks and the chat template run
        in a worker thread, the query waits for its embedding holding no thread (QueryBatcher:
        the queries of concurrent requests share one forward), and retrieval with the prompt's
        composition runs in a worker thread under the memory's mutex."""
        started = time.perf_counter()
        prepared = await asyncio.to_thread(self._prepare, body, chat)
        if prepared[1] is None:
            return prepared[0], None
        body, user, k, query, query_ids = prepared
        asked = time.perf_counter()
        batch = {}
        vector = await self.queries.embed(query, batch)
        embedded = time.perf_counter()
        body, used = await asyncio.to_thread(self._finish, body, chat, user, k, vector, query_ids)
        # where the server's time went (the answer's `memory`): the checks and chat template, the
        # query's embedding (waiting for its batch included), retrieval and composition
        done = time.perf_counter()
        used["compose_ms"] = round(1e3 * (done - started), 3)
        used["compose_parts_ms"] = {"prepare": round(1e3 * (asked - started), 3),
                                    "embed": round(1e3 * (embedded - asked), 3),
                                    "retrieve": round(1e3 * (done - embedded), 3),
                                    "embed_batch": batch.get("batch", 0),
                                    "embed_forward": batch.get("forward_ms", 0.0)}
        return body, used

    def _prepare(self, body: dict, chat: bool):
        """(body, user, k, query, the query's token ids), or (body, None) to answer without
        memory; a MemoryError4xx for what the request gets wrong."""
        screen(body)
        options = body.pop("memory", None) or {}
        if not isinstance(options, dict):
            raise _bad("memory must be an object {\"k\": int, \"required\": bool}")
        required = options.get("required", True)
        if not isinstance(required, bool):
            raise _bad("memory.required must be true or false")
        user = check_user(body.get("user"))
        facts = self.memory.facts(user)
        if not facts:
            if required:
                raise _bad(f"unknown user {user!r} (no facts in the memory); send "
                           "\"memory\": {\"required\": false} to be answered without it", 404)
            return body, None, None, None, None
        k = options.get("k", min(self.default_k, len(facts)))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(facts):
            raise _bad(f"memory.k must be an int in 1 .. {len(facts)} ({user!r}'s facts), got "
                       f"{k!r}")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise _bad("messages must be a non-empty list of {role, content: string}")
            if any(m.get("role") == "system" for m in messages):
                raise _bad("with memory, the system prompt is the server's (--memory-system): "
                           "send no system message")
            users = [m["content"] for m in messages if m.get("role") == "user"]
            if not users:
                raise _bad("messages hold no user message to retrieve for")
            query = users[-1]
            head, tail = self._split(messages)
            if head != self.head:
                raise _bad("the chat template renders another system head for these messages",
                           500)
            query_ids = self._tokens(tail)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise _bad("with memory, prompt is one non-empty string")
            query, query_ids = prompt, self._tokens(prompt)
        return body, user, k, query, query_ids

    def _finish(self, body, chat, user, k, vector, query_ids):
        """The body with the composed prompt, salt and the connector's parameters, and what it
        used; retrieval, tokens and salt of one generation."""
        with self.memory._mutex:  # one consistent generation for retrieval, tokens and salt
            retrieved = self.memory.retrieve(user, vector, k)
            r = self.memory.request(user, retrieved[::-1], query_ids)  # the most relevant last
            generation = self.memory.generation
        ids = r["prompt"]["prompt_token_ids"]
        body = dict(body, cache_salt=r["prompt"]["cache_salt"])
        params = dict(r["extra_args"]["kv_transfer_params"])
        if chat:
            params["prompt_token_ids"] = ids  # vLLM 0.32 takes these instead of rendering
        else:
            body["prompt"] = ids
        body["kv_transfer_params"] = params
        used = {"user": user, "facts": retrieved, "generation": generation,
                "memory_tokens": r["memory_tokens"]}
        return body, used


def screen(body: dict) -> None:
    """What no client may send: the connector's parameters and memory salts (the memory server
    sets them; a forged one could name another user's facts)."""
    if body.get("kv_transfer_params") is not None:
        raise _bad("kv_transfer_params is set by the memory server, not by clients")
    if str(body.get("cache_salt") or "").startswith("inferscale-"):
        raise _bad("cache_salt: the prefix 'inferscale-' is the memory server's")


def install(app, service: MemoryService) -> None:
    """The memory routes, and the two answer routes in front of vLLM's own."""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionRequest,
                                                                   ChatCompletionResponse)
    from vllm.entrypoints.openai.completion.protocol import (CompletionRequest,
                                                             CompletionResponse)
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    router = APIRouter()

    def error(status: int, message: str):
        return JSONResponse(status_code=status, content={"error": {
            "message": message, "type": "invalid_request_error" if status < 500 else
            "server_error", "code": status}})

    async def guarded(call):
        try:
            return await call()
        except MemoryError4xx as e:
            return error(e.status, e.message)
        except ValueError as e:  # the library's and the package's refusals
            return error(400, str(e))

    async def json_body(request):
        try:
            return await request.json()
        except json.JSONDecodeError as e:
            raise _bad(f"the body is not JSON: {e}") from None

    @router.post("/v1/memory/{user}/facts")
    async def write(user: str, request: Request):
        async def call():
            return JSONResponse(await service.write(user, await json_body(request)))
        return await guarded(call)

    @router.post("/v1/memory/{user}/retrieve")
    async def retrieve(user: str, request: Request):
        async def call():
            body = await json_body(request)
            return JSONResponse(await service.retrieve(user, body))
        return await guarded(call)

    @router.get("/v1/memory/{user}/facts")
    async def list_facts(user: str):
        async def call():
            return JSONResponse(service.list(user))
        return await guarded(call)

    @router.delete("/v1/memory/{user}/facts/{fact_id}")
    async def erase_fact(user: str, fact_id: int):
        async def call():
            return JSONResponse(await service.erase(user, fact_id))
        return await guarded(call)

    @router.delete("/v1/memory/{user}")
    async def erase_user(user: str):
        async def call():
            return JSONResponse(await service.erase(user, None))
        return await guarded(call)

    async def answer(request: Request, chat: bool):
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the body is a JSON object")
        used = None
        try:
            screen(body)
        except MemoryError4xx as e:
            return error(e.status, e.message)
        if body.get("user") is not None or body.get("memory") is not None:
            try:
                body, used = await service.compose(body, chat)  # used: its compose_ms
            except MemoryError4xx as e:
                return error(e.status, e.message)
            except ValueError as e:
                return error(400, str(e))
        try:
            req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError: the client's fault
            return error(400, f"invalid request: {e}")
        state = request.app.state
        handler = state.openai_serving_chat if chat else state.openai_serving_completion
        generator = await (handler.create_chat_completion(req, request) if chat
                           else handler.create_completion(req, request))
        if isinstance(generator, ErrorResponse):
            return JSONResponse(content=generator.model_dump(), status_code=generator.error.code)
        if isinstance(generator, (ChatCompletionResponse, CompletionResponse)):
            content = generator.model_dump()
            if used is not None:
                report = (content.get("kv_transfer_params") or {}).get("inferscale") or {}
                content["memory"] = dict(used, loaded_tokens=report.get("loaded_tokens", 0),
                                         cached_tokens=report.get("cached_tokens", 0))
                if report.get("refused"):
                    content["memory"]["refused"] = report["refused"]
            return JSONResponse(content=content)
        headers = {"x-inferscale-memory": json.dumps(used)} if used is not None else None
        return StreamingResponse(content=generator, media_type="text/event-stream",
                                 headers=headers)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, True)

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, False)

    app.include_router(router)
    # ours first: FastAPI takes the first route that matches
    ours = [r for r in app.router.routes if r in router.routes or getattr(r, "endpoint", None) in
            {x.endpoint for x in router.routes}]
    rest = [r for r in app.router.routes if r not in ours]
    app.router.routes[:] = ours + rest


def parse_args(argv=None):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        description="vLLM's OpenAI-compatible server answering from InferScale memory")
    parser = make_arg_parser(parser)
    group = parser.add_argument_group("InferScale memory")
    group.add_argument("--memory", required=True,
                       help="the memory directory (created if absent)")
    group.add_argument("--memory-k", type=int, default=5,
                       help="facts retrieved per request by default")
    group.add_argument("--memory-system", default=DEFAULT_SYSTEM,
                       help="the system prompt the facts follow")
    group.add_argument("--memory-pages", type=int, default=8192,
                       help="pages of 16 tokens in a new memory's store")
    group.add_argument("--memory-load", default="exact", choices=("exact", "all", "blocks"),
                       help="how much of the memory the connector loads: exact (default: as many "
                            "tokens as leave vLLM a rest it computes as in its cold prefill, "
                            "measured on this CPU), all (every token: fastest; as close to a cold "
                            "prefill as vLLM's own prefix cache), blocks (whole blocks only)")
    group.add_argument("--query-compute", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="the queries' embedding arithmetic (facts: float32); auto: bfloat16 "
                            "where the CPU has it natively (AMX, AVX512_BF16)")
    group.add_argument("--embedder", default=None,
                       help="all-MiniLM-L6-v2's folder (default: $INFERSCALE_MINILM_HF)")
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.memory_k < 1:
        parser.error("--memory-k must be at least 1")
    if args.kv_transfer_config is not None:
        parser.error("--kv-transfer-config is set by inferscale_vllm.serve (the connector)")
    validate_parsed_serve_args(args)
    from .engine import kv_transfer_config

    args.kv_transfer_config = kv_transfer_config(os.path.abspath(args.memory), args.memory_load)
    return args


async def run(args) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as engine:
        supported = await engine.get_supported_tasks()
        app = build_app(args, supported, engine.model_config)
        await init_app_state(engine, app.state, args, supported)
        service = MemoryService(engine, args, engine.vllm_config)
        await service.start()
        install(app, service)
        app.state.inferscale_memory = service
        logger.info("inferscale serve: listening on %s", listen_address)
        shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port,
                                    log_level=args.uvicorn_log_level,
                                    access_log=not args.disable_uvicorn_access_log)
    try:
        await shutdown
    finally:
        sock.close()
        if service.memory is not None:
            service.memory.close()


def main(argv=None) -> int:
    from .engine import cpu_environment

    logging.basicConfig(level=logging.INFO)
    args = parse_args(argv)
    cpu_environment(args.tensor_parallel_size * args.pipeline_parallel_size)
    import uvloop

    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
