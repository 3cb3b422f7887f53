"""A small OpenAI-compatible HTTP server over an `HFGenerator` (stdlib only).

Endpoints: GET /v1/models, POST /v1/completions (prompt as a string, token ids, or a list of
either), POST /v1/chat/completions (messages rendered with the tokenizer's chat template).
Understood vLLM extensions: `stop_token_ids`, `ignore_eos`, `return_tokens_as_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`. Generation stops at EOS unless `ignore_eos`;
`max_tokens` defaults to 256. Not supported: streaming, `echo`, `best_of`, top-N logprobs (only
the sampled token's logprob is returned, `top_logprobs` is null), `tool_choice` (the model
decides).

Tools: a chat request with `tools` is rendered as envace's rollouts render it (`Transcript.prompt`:
native tool schemas where the template has them, else signatures in the system message), earlier
assistant `tool_calls` become the `<tool_call>{...}</tool_call>` blocks the policy writes, and the
reply's blocks come back as OpenAI `tool_calls` (`finish_reason` "tool_calls"). A reply whose
blocks do not parse is returned as plain content.

Requests are served one generation at a time (a lock around the generator); the prompts of one
request are generated as one batch. The model name in requests is not checked, so clients that
prefix names (litellm's "openai/...") work. Serves loopback by default: there is no auth.

    envace serve --model default --port 8000      (or: python -m envace.backends.server ...)
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envace.backends.base import Completion, SamplingParams
from envace.backends.hf import HFGenerator
from envace.config import ConfigError, field
from envace.parsing import ParseError, parse_act
from envace.transcript import Transcript, compact_json

DEFAULT_MAX_TOKENS = 256  # when a request sets neither max_tokens nor max_completion_tokens


class RequestError(ValueError):
    """A bad request: answered with HTTP 400."""


def _token_ids(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """Normalise an OpenAI `prompt` (str | list[int] | list[str] | list[list[int]]) to token-id lists."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return [p for item in prompt for p in _token_ids(item, tokenizer)]
    raise RequestError("prompt must be a non-empty string, list of token ids, or list of those")


def _text_content(content: Any) -> str:
    """Message content as plain text (OpenAI also allows a list of {"type": "text"} parts)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as envace renders it: text content, tool calls as the policy's blocks."""
    content = _text_content(message.get("content"))
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        arguments = fn.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as err:
                raise RequestError(f"tool call arguments are not JSON: {err}") from err
        content += f"<tool_call>{compact_json({'name': fn.get('name', ''), 'arguments': arguments})}</tool_call>"
    return {"role": message.get("role", "user"), "content": content}


def assistant_reply(text: str, with_tools: bool) -> tuple[dict[str, Any], str | None]:
    """(message, finish reason override): parsed `tool_calls` when tools were offered."""
    if not with_tools:
        return {"role": "assistant", "content": text}, None
    try:
        parsed = parse_act(text)
    except ParseError:
        return {"role": "assistant", "content": text}, None
    if parsed.is_answer:
        return {"role": "assistant", "content": text}, None
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
    return {"role": "assistant", "content": parsed.text.strip() or None, "tool_calls": calls}, "tool_calls"


def _strip_stop(text: str, completion: Completion, stops: tuple[str, ...]) -> str:
    if completion.finish_reason == "stop":
        for s in stops:
            if s and text.endswith(s):
                return text[: -len(s)]
    return text


class CompletionService:
    """Turns OpenAI request bodies into HFGenerator calls."""

    def __init__(self, generator: HFGenerator, model_name: str):
        self.generator = generator
        self.tokenizer = generator.tokenizer
        self.model_name = model_name
        self.vocab_size = generator.model.get_input_embeddings().num_embeddings
        self.lock = threading.Lock()  # HFGenerator is not thread-safe

    @functools.cached_property
    def transcript(self) -> Transcript:
        return Transcript(self.tokenizer)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "envace"}]}

    def params(self, body: dict[str, Any]) -> SamplingParams:
        if body.get("stream"):
            raise RequestError("streaming is not supported by this server")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        stop = body.get("stop") or ()
        stop_ids = tuple(body.get("stop_token_ids") or ())
        if not body.get("ignore_eos", False) and self.tokenizer.eos_token_id is not None:
            stop_ids += (self.tokenizer.eos_token_id,)
        try:
            return SamplingParams(
                max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens),
                temperature=float(1.0 if body.get("temperature") is None else body["temperature"]),
                top_p=float(1.0 if body.get("top_p") is None else body["top_p"]),
                stop_token_ids=stop_ids,
                stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
            )
        except (TypeError, ValueError) as err:
            raise RequestError(f"bad sampling parameter: {err}") from err

    def choices_per_prompt(self, body: dict[str, Any]) -> int:
        n = body.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise RequestError("n must be a positive integer")
        return n

    def run(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Completion]:
        if any(not 0 <= t < self.vocab_size for p in prompts for t in p):
            raise RequestError(f"token ids must be in [0, {self.vocab_size})")
        if params.max_new_tokens < 1:
            raise RequestError("max_tokens must be >= 1")
        prompts = [p for p in prompts for _ in range(n)]
        with self.lock:
            ids = self.generator.open(len(prompts))
            try:
                return self.generator.generate(ids, prompts, params)
            finally:
                self.generator.close(ids)

    def _envelope(self, kind: str, choices: list[dict[str, Any]], prompts: list[list[int]],
                  completions: list[Completion], n: int) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prompts) * n
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
                "object": kind, "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        params, n = self.params(body), self.choices_per_prompt(body)
        prompts = _token_ids(body.get("prompt"), self.tokenizer)
        completions = self.run(prompts, params, n)
        skip_special = body.get("skip_special_tokens", True)
        choices = []
        for index, c in enumerate(completions):
            text = self.tokenizer.decode(c.token_ids, skip_special_tokens=skip_special)
            if not body.get("include_stop_str_in_output", False):
                text = _strip_stop(text, c, params.stop_strings)
            choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": c.finish_reason, "logprobs": None}
            if body.get("logprobs") is not None:
                as_ids = body.get("return_tokens_as_token_ids", False)
                tokens = [f"token_id:{t}" if as_ids else self.tokenizer.decode([t]) for t in c.token_ids]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None}
            choices.append(choice)
        return self._envelope("text_completion", choices, prompts, completions, n)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """Token ids of an OpenAI chat request: the chat template, and with tools as envace renders them."""
        messages = [_chat_message(m) for m in messages]
        if tools:
            return self.transcript.prompt(messages, "", tools).token_ids
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        params, n = self.params(body), self.choices_per_prompt(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        tools = body.get("tools") or []
        prompts = [self.chat_prompt(messages, tools)]
        completions = self.run(prompts, params, n)
        choices = []
        for index, c in enumerate(completions):
            content = _strip_stop(self.tokenizer.decode(c.token_ids, skip_special_tokens=True), c, params.stop_strings)
            message, finish = assistant_reply(content, bool(tools))
            choices.append({"index": index, "message": message, "finish_reason": finish or c.finish_reason, "logprobs": None})
        return self._envelope("chat.completion", choices, prompts, completions, n)


def make_server(service: CompletionService, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server for `service` (port 0 = any free port; see `server.server_address`)."""
    routes_get = {"/v1/models": lambda _: service.models(), "/health": lambda _: {}}
    routes_post = {"/v1/completions": service.completions, "/v1/chat/completions": service.chat}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive for pooled clients

        def do_GET(self) -> None:
            self._route(routes_get, None)

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError:
                self._reply(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}})
                return
            self._route(routes_post, body)

        def _route(self, routes: dict[str, Any], body: Any) -> None:
            handler = routes.get(self.path.split("?")[0].rstrip("/"))
            if handler is None:
                self._reply(404, {"error": {"message": f"no route {self.command} {self.path}", "type": "not_found"}})
                return
            try:
                self._reply(200, handler(body))
            except RequestError as err:
                self._reply(400, {"error": {"message": str(err), "type": "invalid_request_error"}})
            except Exception as err:  # answer, never drop the connection
                self._reply(500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error"}})

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(model_spec: str, host: str = "127.0.0.1", port: int = 8000, seed: int = 0,
          max_batch: int | None = None, served_name: str | None = None, device: str | None = None) -> None:
    """Load `model_spec` and serve it until interrupted."""
    from envace.backends.models import load_model

    model, tokenizer = load_model(model_spec, device=device)
    service = CompletionService(HFGenerator(model, tokenizer, seed=seed, max_batch=max_batch), served_name or model_spec)
    server = make_server(service, host, port)
    print(f"serving {service.model_name!r} at http://{host}:{server.server_address[1]}/v1", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


@dataclass
class ServeConfig:
    model: str = field("default", help="model: 'default' (bundled SmolLM2-135M-Instruct), 'qwen2.5-coder-0.5b' (make install-qwen), a local directory or a .gguf file")
    host: str = field("127.0.0.1", help="address to bind (loopback by default: the server has no auth)")
    port: int = field(8000, help="TCP port (0 = any free port)")
    seed: int = field(0, help="sampling seed")
    max_batch: int | None = field(None, help="most prompts generated as one batch")
    served_name: str | None = field(None, help="model name reported by /v1/models (None = the --model value)")
    device: str | None = field(None, help="cuda | cpu (None = cuda if available)")

    def validate(self) -> None:
        from envace.backends.models import check_model_spec

        check_model_spec(self.model)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")


def serve_command(cfg: ServeConfig) -> None:
    """`envace serve`."""
    serve(cfg.model, cfg.host, cfg.port, cfg.seed, cfg.max_batch, cfg.served_name, cfg.device)


if __name__ == "__main__":
    from envace.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
