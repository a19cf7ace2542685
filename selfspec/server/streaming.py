"""Response bodies: the JSON of a finished request, the SSE stream of a running one, and the
access log (one line per request, with the request's one outcome)."""

from __future__ import annotations

import json
import logging
import time
import uuid

from fastapi.responses import StreamingResponse

from selfspec.server.errors import APIError
from selfspec.server.logprob_format import CompletionLogprobs, chat_logprobs, merged
from selfspec.server.metrics import CLIENT_GONE

log = logging.getLogger("selfspec.server")

_LOG_FIELDS = (("selfspec_prompt_tokens", "prompt"), ("selfspec_completion_tokens", "completion"),
               ("selfspec_finish", "finish"), ("selfspec_strategy", "strategy"), ("selfspec_acceptance", "acceptance"),
               ("selfspec_queue_s", "queue_s"), ("selfspec_ttft_s", "ttft_s"), ("selfspec_outcome", "outcome"))


class LogRequests:
    """One log line per request (pure ASGI: no buffering of streams). The status is the
    request's recorded outcome when there is one (a stream whose client left: 499, not the
    200 its headers said)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 0}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            status["code"] = status["code"] or 500
            raise
        finally:
            st = scope.get("state", {})
            extra = "".join(f" {label}={st[key]:.3f}" if isinstance(st[key], float) else f" {label}={st[key]}"
                            for key, label in _LOG_FIELDS if key in st)
            client = scope.get("client") or ("-", 0)
            code = st.get("selfspec_status", status["code"]) or "-"
            log.info('%s "%s %s" %s %.3fs%s', client[0], scope["method"], scope["path"], code, time.perf_counter() - t0, extra)


def usage(job, results) -> dict:
    """OpenAI's usage of a request: each prompt once, every choice's tokens."""
    prompt, n = job.prompt_tokens, sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def finish_reason(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def sse(obj) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def _generation_stats(result) -> dict:
    s = result.stats
    return {"drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length, "verify_steps": s.verify_steps,
            "per_position_accepted": s.per_position_accepted, "per_position_drafted": s.per_position_drafted,
            "new_tokens": s.new_tokens, "stop_reason": result.finish_reason, "time_to_first_token_s": s.time_to_first_token_s,
            "time_s": s.time_s, "tokens_per_second": s.tokens_per_second,
            "free_drafted": s.free_drafted, "free_accepted": s.free_accepted}  # tokens a grammar forced (engine.free_draft)


def stats(srv, job, results) -> dict:
    """The `selfspec` object of a response: the generation's speculative statistics (of the
    first choice; with n > 1 every choice's under "choices")."""
    d = {"strategy": job.params.draft.strategy, "draft": job.params.draft.to_dict(), **_generation_stats(results[0]),
         "queue_time_s": (job.t_start - job.t_arrival) if job.t_start else 0.0,
         "server_time_to_first_token_s": (job.t_first - job.t_arrival) if job.t_first else None}
    if len(results) > 1:
        d["choices"] = [_generation_stats(r) for r in results]
    if srv.settings.replica_id:
        d["replica"] = srv.settings.replica_id
    return d


def ending_ids(srv, params) -> frozenset[int]:
    """The token ids that end a choice: their logprob entries show no text."""
    return frozenset(srv.model.eos_token_ids) | frozenset(params.stop_token_ids)


def _choice_logprobs(srv, job, i: int, result, chat: bool):
    """Choice i's logprobs object, finished (None without logprobs)."""
    p = job.prompt_of(i)
    if p.logprobs is None:
        return None
    entries = result.logprobs or []
    if chat:
        return chat_logprobs(entries, srv.model.tokenizer, ending_ids(srv, p))
    lp = CompletionLogprobs(srv.model.tokenizer, p.logprobs, ending_ids(srv, p))
    if p.echo:
        return merged(lp.prompt(job.prompt_logprobs_of(i), p.prompt_ids, p.echo_text), lp.piece(entries))
    return lp.piece(entries)


def plain_body(srv, job, results, chat: bool) -> tuple[dict, str]:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    choices = []
    for i, result in enumerate(results):
        choice = {"index": i, "logprobs": _choice_logprobs(srv, job, i, result, chat), "finish_reason": finish_reason(result)}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = job.prompt_of(i).echo_text + result.text
        choices.append(choice)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": job.params.model, "system_fingerprint": srv.fingerprint_of(job.params.sampling.coupling), "choices": choices,
            "usage": usage(job, results), "selfspec": stats(srv, job, results)}
    return body, rid


class _Chunks:
    """The SSE chunks of one streamed response."""

    def __init__(self, srv, job, chat: bool):
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.chat = chat
        self.include_usage = job.params.include_usage
        self.base = {"id": self.rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": job.params.model,
                     "system_fingerprint": srv.fingerprint_of(job.params.sampling.coupling)}
        p = job.params
        self.ending = ending_ids(srv, p)
        self.logprobs = None if p.logprobs is None or chat else [CompletionLogprobs(srv.model.tokenizer, p.logprobs, self.ending)
                                                                 for _ in range(job.size)]
        self.tok = srv.model.tokenizer

    def chunk(self, index: int, delta_text: str | None, finish: str | None = None, role: bool = False,
              entries: list | None = None, prompt=None) -> str:
        """prompt: the Params whose prompt `entries` score (echo), else entries are generated tokens'."""
        lp = None
        if entries is not None and self.chat:
            lp = chat_logprobs(entries, self.tok, self.ending)
        elif entries is not None:
            lp = self.logprobs[index]
            lp = lp.prompt(entries, prompt.prompt_ids, prompt.echo_text) if prompt is not None else lp.piece(entries)
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            elif delta_text is not None:
                delta["content"] = delta_text
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
        c = {**self.base, "choices": [choice]}
        if self.include_usage:
            c["usage"] = None
        return sse(c)


def _coalesce(job, item) -> tuple[dict, object]:
    """The ("tok", i, text, logprob) events waiting from item on -> ({i: (text, [logprobs])}, the next other event or None)."""
    out: dict[int, tuple[str, list]] = {}
    while item is not None and item[0] == "tok":
        _, i, text, lp = item
        t, lps = out.get(i, ("", []))
        out[i] = (t + text, lps + ([lp] if lp is not None else []))
        item = job.events.get_nowait() if not job.events.empty() else None
    return out, item


async def _events(srv, job, first, ch: _Chunks, state: dict):
    # The engine's deltas are already safe to send: it holds back text that could still
    # become a stop string or an incomplete character (engine._Output).
    n, p = job.size, job.params
    sent, item = [""] * n, first
    if ch.chat:
        for i in range(n):
            yield ch.chunk(i, None, role=True)
    elif p.echo:
        for i in range(n):
            q = job.prompt_of(i)
            yield ch.chunk(i, q.echo_text, entries=job.prompt_logprobs_of(i) if p.logprobs is not None else None, prompt=q)
    while item[0] == "tok":
        out, item = _coalesce(job, item)
        for i, (text, lps) in sorted(out.items()):
            if text or lps:
                sent[i] += text
                yield ch.chunk(i, text, entries=lps if p.logprobs is not None else None)
        if item is None:
            item = await job.events.get()
    if item[0] == "done":
        results = state["result"] = item[1]
        for i, result in enumerate(results):
            if result.text.startswith(sent[i]):
                rest = result.text[len(sent[i]):]
            else:  # cannot happen with a prefix-stable detokenizer; never resend
                log.warning("streamed text diverged from the final text (request %s)", ch.rid)
                rest = ""
            if rest:
                yield ch.chunk(i, rest)
            yield ch.chunk(i, None if ch.chat else "", finish=finish_reason(result))
        if ch.include_usage:
            yield sse({**ch.base, "choices": [], "usage": usage(job, results), "selfspec": stats(srv, job, results)})
        yield "data: [DONE]\n\n"
    elif item[0] == "error":
        e = item[1]
        log.error("generation failed mid-stream: %s: %s", type(e).__name__, e, exc_info=e)
        state["status"] = 500
        yield sse(APIError(500, f"Generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error").body())
    else:  # "cancelled" / "skipped": only after our own cancel
        state["status"] = CLIENT_GONE


def stream_response(srv, job, first, chat: bool, endpoint: str, info: dict) -> StreamingResponse:
    """The SSE response of a job whose first event is `first`; when it ends, however it ends,
    the job is cancelled if still running, the outcome recorded once and the slot freed."""
    ch = _Chunks(srv, job, chat)
    state = {"status": 200, "result": None, "closed": False}

    def on_close():
        if state["closed"]:
            return
        state["closed"] = True
        if state["result"] is None:
            job.cancel()
            if state["status"] == 200:  # the client left before the end
                state["status"] = CLIENT_GONE
        srv.metrics.record(endpoint, state["status"], job, state["result"], info=info)
        srv.admission.release()

    return _JobStream(_events(srv, job, first, ch, state), on_close, media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": ch.rid, **srv.headers})


class _JobStream(StreamingResponse):
    """A StreamingResponse that always runs `on_close` (client gone or not, started or not)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close
        self._gen = content

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            try:
                await self._gen.aclose()
            except Exception:  # already finished or failed: nothing left to clean up
                pass
