"""The public object: a loaded model that generates, with or without self-speculation.

    m = selfspec.load("gemma-3-270m", dtype="float32")
    out = m.generate("def f(x):", max_new_tokens=64, strategy="early-exit", exit_layer=12)
    out.text, out.token_ids, out.stats
    out = m.run(selfspec.Request.build(m, "def f(x):", max_new_tokens=64))   # the same, as one request object
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict

import torch

from selfspec import chat_templates, ggml_weights, kernels
from selfspec.architectures import ModelSpec
from selfspec.batch import BatchEngine
from selfspec.batch.planner import kept_costs
from selfspec.config import DraftConfig, GenerationConfig, SamplingConfig
from selfspec.drafters import Drafter, build
from selfspec.drafters.factory import runs_here
from selfspec.engine import GenerationResult, generate
from selfspec.errors import SelfSpecError
from selfspec.grammar import grammar_matcher
from selfspec.greedy_head import screened_head
from selfspec.kernels.weights import release_freed
from selfspec.loading import ALIASES, load_source, resolve_tokenizer
from selfspec.logprobs import TokenLogprob, scored_prompt
from selfspec.predictor.costs import CostModel
from selfspec.processors import Processing
from selfspec.profiles import (Profile, best_options, builtin_profiles, checkpoint_repo, installed_profile, load_profile,
                               remember_repo)
from selfspec.request import Request, check_draft_options
from selfspec.resources import DraftResources
from selfspec.runtime import Runtime
from selfspec.predictor.options import calibrated_options

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_log = logging.getLogger("selfspec")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if kernels.available():  # our kernels widen bf16 exactly in registers on any AVX2 CPU: half the bytes of fp32
        return "bfloat16"
    try:
        return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    except Exception:
        return "float32"


def resolve_dtype(dtype, device: str) -> torch.dtype:
    if dtype in ggml_weights.AUTO:  # auto: a GGUF by size, its blocks or a dequantized copy (ggml_weights.fitting)
        dtype = default_dtype(device)
    if dtype == ggml_weights.NATIVE:  # a GGUF's blocks as stored: fp32 activations (ggml_weights.py)
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise SelfSpecError(f"unsupported dtype {dtype!r}; choose auto, native, float32 or bfloat16")
    return _DTYPES[dtype]


def resolve_device(device) -> str:
    device = device or default_device()
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise SelfSpecError("--device cuda requested but no CUDA GPU is available")
    if not (str(device) == "cpu" or str(device).startswith("cuda")):
        raise SelfSpecError(f"unsupported device {device!r}; choose cpu or cuda")
    return str(device)


def fingerprint(spec: ModelSpec, runtime: Runtime) -> str:
    """A short id of the weights and shape, the same for float32 and bfloat16 loads."""
    h = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True, default=str).encode())
    probes = [runtime.head_columns(torch.arange(min(64, spec.vocab_size), device=runtime.device)),
              ggml_weights.weight_columns(runtime, 0, "wqkv", 64),
              ggml_weights.weight_columns(runtime, spec.num_layers - 1, "w_down", 64)]
    for t in probes:
        h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def merge_profile_draft(draft: DraftConfig, strategy: str | None, given: dict) -> DraftConfig:
    """A profile's draft refined by explicitly given options (and a strategy, which may only be
    the profile's own or auto, which then gates the profile's draft)."""
    if strategy is None or strategy == draft.strategy:  # options refine the profile's draft
        return DraftConfig.from_dict({**draft.to_dict(), **given})
    if strategy == "auto":  # auto gates the profile's draft (refined by the options)
        return DraftConfig("auto", base=DraftConfig.from_dict({**draft.to_dict(), **given}))
    raise SelfSpecError(f"the profile drafts with {draft.strategy}; strategy {strategy} cannot use it (drop one of the two)")


class SelfSpecModel:
    """A loaded model: its runtime, tokenizer and chat template, and the resources its drafters
    share (resources.py: bounded however many draft configurations it serves). Each generation
    gets a drafter of its own. Thread-safe: concurrent `generate` calls run one at a time (the
    kernels already use every core), each exactly as it would alone."""

    def __init__(self, runtime: Runtime, tokenizer, name: str = "", chat_template: str | None = None,
                 repo_id: str | None = None):
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.name = name
        self.repo_id = repo_id  # the Hub repo it came from (a Hub id, or a path in the Hub cache): built-in profiles
        self.spec = runtime.spec
        self.fingerprint = fingerprint(self.spec, runtime)
        eos = set(self.spec.eos_token_ids)
        gen_eos = getattr(getattr(runtime, "generation_config", None), "eos_token_id", None)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        if gen_eos is not None:
            eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self._model_eos = tuple(sorted(eos))
        self.eos_token_ids = self._model_eos
        self.resources = DraftResources(runtime, self.fingerprint, tokenizer, repo_id)
        if repo_id and any(repo_id in p.model_ids for p in builtin_profiles()):
            remember_repo(self.fingerprint, repo_id)  # its local copies get the same profile
        self._lock = threading.RLock()  # one generation at a time
        self.chat_template: str | None = None  # the Jinja template chat prompts use (None: chat is unavailable)
        self.chat_template_source = "none"
        self._chat_template_arg: str | None = None  # what apply_chat_template gets (None: the tokenizer's own)
        self._chat_note: str | None = None  # said once, at the first chat prompt
        self.set_chat_template(chat_template)

    @contextmanager
    def computing(self) -> Iterator[None]:
        """The model to this thread for a generation, a batch or a step: its lock (one at a
        time: the kernels already use every core), and on the CPU kernels their compute scope
        (kernels/pool.py: torch's own threads kept off the kernels' cores)."""
        with self._lock, self.runtime.compute_scope():
            yield

    # ---- chat ---------------------------------------------------------------------------

    def set_chat_template(self, template: str | None = None) -> None:
        """The template chat prompts use: a Jinja file, a built-in name (chat_templates.BUILTIN:
        gemma, llama3, chatml, llama2, mistral), or a Jinja string. None: the tokenizer's own,
        else the built-in template of the model's family (when its tokenizer has that format's
        turn tokens). A built-in template's end-of-turn token also ends generation."""
        note = None
        if template is not None:
            text, builtin, source = chat_templates.resolve(template)
            arg = text
        else:
            own = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
            if isinstance(own, dict):  # named templates (e.g. "default", "tool_use"): transformers picks the default
                own = own.get("default") or next(iter(own.values()), None)
            text, arg, builtin, source = own, None, None, "the tokenizer's chat template"
            if not own:
                builtin = chat_templates.for_family(self.spec.model_type, self.tokenizer)
                text = arg = chat_templates.BUILTIN[builtin] if builtin else None
                source = f"the built-in {builtin} template" if builtin else "none"
                if builtin:
                    who = f"{self.name} is a base model" if self.name in ALIASES else f"{self.name or 'this model'} has no chat template of its own"
                    note = (f"selfspec: note: {who}; chat prompts use the built-in {builtin} turn format "
                            "(a base model continues text: it was not trained to follow instructions)")
        end = chat_templates.turn_end_id(builtin, self.tokenizer)
        eos = tuple(sorted(set(self._model_eos) | ({end} if end is not None else set())))
        with self._lock:
            self.chat_template, self.chat_template_source, self._chat_template_arg = text, source, arg
            self._chat_note = note
            self.eos_token_ids = eos

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ([{"role": ..., "content": ...}, ...]) under the chat
        template, ending with the prompt for the assistant's turn."""
        if self.tokenizer is None:
            raise SelfSpecError("this model has no tokenizer: chat needs one (load with tokenizer=...)")
        if not self.chat_template:
            raise SelfSpecError(f"this model has no chat template and none is built in for it ({self.spec.model_type}): "
                                f"give one with --chat-template FILE|NAME or chat_template=... "
                                f"(built in: {', '.join(chat_templates.names())})")
        if self._chat_note:
            _log.warning(self._chat_note)
            self._chat_note = None
        try:
            ids = self.tokenizer.apply_chat_template(messages, chat_template=self._chat_template_arg,
                                                     add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja raises for e.g. roles that do not alternate
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SelfSpecError(f"the chat template rejected the messages: {first}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    @property
    def context_length(self) -> int:
        return self.spec.max_position_embeddings

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt: text, token ids, or (chat=True) text as one user turn or a
        list of messages, under the chat template."""
        if chat and isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.chat_ids(list(prompt))
        elif isinstance(prompt, (list, tuple)):
            ids = [int(t) for t in prompt]
        else:
            if not isinstance(prompt, str):
                raise SelfSpecError("prompt must be a string or a list of token ids")
            if self.tokenizer is None:
                raise SelfSpecError("this model has no tokenizer: pass token ids, or load with tokenizer=...")
            if chat:
                ids = self.chat_ids([{"role": "user", "content": prompt}]) if prompt.strip() else []
            else:
                ids = self.tokenizer(prompt).input_ids if prompt else []
        if isinstance(prompt, str) and not prompt.strip():
            raise SelfSpecError("the prompt is empty")
        self.check_prompt(ids)
        return ids

    def check_prompt(self, ids: Sequence[int]) -> None:
        """Token ids this model can continue: some, each in its vocabulary, fewer than its context."""
        if not ids:
            raise SelfSpecError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise SelfSpecError(f"token id {bad[0]} is outside the vocabulary (size {self.spec.vocab_size})")
        if len(ids) >= self.context_length:
            raise SelfSpecError(f"the prompt has {len(ids)} tokens; this model's context is {self.context_length}")

    def draft_config(self, strategy: str | None = None, profile: str | Profile | None = None, **options) -> DraftConfig:
        check_draft_options(strategy, options)
        given = {k: v for k, v in options.items() if v is not None}
        if profile is None:
            if strategy is not None:  # named: its defaults for this model, refined by the options given
                given = {**self.strategy_defaults(strategy)[0], **given}
            return DraftConfig.from_dict({**({"strategy": strategy} if strategy else {}), **given})
        prof = profile if isinstance(profile, Profile) else load_profile(profile, self.fingerprint, self.repo_id)
        if not prof.fits(self.fingerprint, self.repo_id):
            raise SelfSpecError("the profile was made for another model")
        return merge_profile_draft(prof.draft, strategy, given)

    def strategy_defaults(self, strategy: str, calibrate: bool = True) -> tuple[dict, str]:
        """(options, source): what `strategy` starts from on this model, options given to a
        call overriding only themselves (config.DraftConfig's doc): the best options a profile
        measured for it ("profile: PATH"), else the predictor's choice for the bare strategy
        ("calibrated"; calibrate=False: not made here), else none ("static": the dataclass
        defaults). auto and autoregressive have no options of their own to fill in."""
        if strategy in ("auto", "autoregressive"):
            return {}, "static"
        found = best_options(self.fingerprint, strategy, self.repo_id)
        if found is not None:
            options, path = found
            if runs_here(DraftConfig.from_dict({**options, "strategy": strategy}), self.runtime):
                return options, f"profile: {path}"
        if calibrate:
            options = calibrated_options(self, strategy)
            if options is not None:
                return options, "calibrated"
        return {}, "static"

    def drafter(self, cfg: DraftConfig) -> Drafter:
        """A new drafter for one generation of cfg (checks cfg against this model)."""
        return build(cfg, self.resources, self.eos_token_ids)

    def prepare(self) -> None:
        """Make what the default strategy drafts with now, when the model has an installed
        profile (quantized copy, draft head, measured costs), so that the first generation does
        not pay for it (load does this), nor the first generate_batch: the batch planner's pass
        costs, measured once per machine and kept (batch/planner.kept_costs; about a second on the
        default model). Without a profile auto calibrates per prompt instead, and a batch measures the
        costs at its first call. The screened greedy head (greedy_head.py) is made here too."""
        screened_head(self.runtime)
        if installed_profile(self.fingerprint, repo_id=self.repo_id) is not None:
            self.drafter(self.draft_config())
            with self.computing():
                kept_costs(self.resources)

    def memory(self) -> dict[str, int]:
        """Bytes the model holds, by what: its weights as the runtime lays them out (64-column
        tiles, so a little padding; an untied embedding), the greedy head's int8 screen
        (greedy_head.py, made at load where it applies), and what drafters have made."""
        rt = self.runtime
        screen = screened_head(rt)
        embed = 0 if rt.embed_weight is None else kernels.nbytes(rt.embed_weight)
        return {"weights": rt.weight_bytes() + embed, "greedy_screen": screen.nbytes if screen is not None else 0,
                **self.resources.nbytes()}

    # the resources, as the model's own API (resources.py)

    def draft_vocabulary(self, n: int) -> torch.Tensor:
        """The n most frequent token ids (see draft_vocab.py), sorted by id."""
        return self.resources.draft_vocabulary(n)

    def set_token_frequencies(self, order: torch.Tensor) -> None:
        """Token ids, most frequent first: defines the restricted draft vocabularies."""
        self.resources.set_token_frequencies(order)

    def draft_head(self, n: int) -> tuple[torch.Tensor, object]:
        """(ids of the n most frequent tokens, those LM-head columns prepared for the runtime)."""
        return self.resources.draft_head(n)

    def cost_model(self, draft_vocabs: tuple[int, ...] = ()) -> CostModel:
        """Measured primitive costs of this model's runtime (predictor/costs.py)."""
        return self.resources.cost_model(heads=tuple((n, None) for n in draft_vocabs))

    def generate(self, prompt: str | list[int] | list[dict], **options) -> GenerationResult:
        """`prompt` (text, token ids, or with chat=True one user turn or a list of messages)
        continued: `self.run(Request.build(self, prompt, **options))`. options: request.configs'
        keywords, each defaulting to its config dataclass's (max_new_tokens, temperature, top_k,
        top_p, seed, coupling, stop, stop_token_ids, logprobs, chat; strategy and the draft
        options, profile, or draft=DraftConfig; the logits processors and json_schema=dict|str),
        and on_event(event) to stream. logprobs=N records every new token's log-probability and
        its N most likely alternatives (result.logprobs)."""
        return self.run(Request.build(self, prompt, **options))

    def run(self, request: Request) -> GenerationResult:
        """Generate one request (request.py), as fitted to this model (Request.fitted)."""
        r = request.fitted(self)
        ids = list(r.prompt_ids)
        with self.computing():  # one generation at a time (class doc)
            drafter = self.drafter(r.draft)
            return generate(self.runtime, drafter, ids, r.gen, r.sampling, self.tokenizer, self.eos_token_ids, r.on_event,
                            self.processing(r.sampling, r.gen, ids))

    def processing(self, sampling: SamplingConfig, gen: GenerationConfig, prompt_ids: list[int]) -> Processing | None:
        """A generation's logits processors and logprobs (processors.py), None when it has neither."""
        if not Processing.needed(sampling, gen):
            return None
        matcher = None if sampling.grammar is None else grammar_matcher(self, sampling.grammar)
        return Processing(sampling, gen, prompt_ids, self.spec.vocab_size, matcher)

    def prompt_logprobs(self, prompt: str | list[int], top: int = 0) -> list[TokenLogprob | None]:
        """Every prompt token's log-probability under the model given the tokens before it (the
        first: None) and its `top` most likely alternatives: one pass over the prompt
        (logprobs.scored_prompt)."""
        ids = self.encode(prompt)
        with self.computing():
            return scored_prompt(self.runtime, ids, top)

    def generate_batch(self, prompts: list, *, max_batch: int = 16, prefill_chunk: int | None = None,
                       **options) -> list[GenerationResult]:
        """generate() for many prompts at once, through one continuous batch (selfspec.batch):
        the same options, applied to every prompt (`seed` may be a list, one per prompt;
        `on_event(index, event)` streams): `self.run_batch(Request.batch(self, prompts, **options))`.
        result[i] has exactly the tokens generate(prompts[i], ...) would give, greedy or with the
        same seed."""
        return self.run_batch(Request.batch(self, prompts, **options), max_batch=max_batch, prefill_chunk=prefill_chunk)

    def run_batch(self, requests: list[Request], *, max_batch: int = 16, prefill_chunk: int | None = None) -> list[GenerationResult]:
        """Many requests through one continuous batch; result[i] has exactly the tokens
        run(requests[i]) gives. A request that fails raises here (the others went on)."""
        with self.computing():  # one batch (or generation) at a time
            engine = BatchEngine(self, max_batch=max_batch, prefill_chunk=prefill_chunk)
            handles = [engine.submit(r) for r in requests]
            engine.run()
        if failed := [h.error for h in handles if h.error is not None]:
            raise failed[0]  # one request's failure ended it alone in the batch (BatchEngine); raised here
        return [h.result for h in handles]


def load(
    source="gemma-3-270m",
    *,
    tokenizer=None,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    chat_template: str | None = None,
    allow_pickle: bool = False,
) -> SelfSpecModel:
    """Load from a built-in alias, a HF model directory, a .gguf file, a Hugging Face Hub id
    (`org/name`, `org/name@revision`, `org/name:file.gguf`; downloaded into the Hub cache, see
    hub.py), or a transformers model object (its weights are read, never modified).
    chat_template: a Jinja file, a built-in name or a Jinja string for chat prompts (default:
    the tokenizer's own, else the built-in template of the model's family; see
    SelfSpecModel.set_chat_template). allow_pickle: accept pickled .bin weights where a model
    has no safetensors (unpickling can run code). What cannot fit is refused before it is read."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if chat_template is not None:
        chat_templates.resolve(chat_template)  # a bad name or file fails before the weights load
    run = [dtype]  # what the weights run as: --dtype, or native where auto's dequantized copy cannot fit
    def fits(config) -> None:  # before any weight is read, or downloaded: refuse what cannot fit
        run[0] = ggml_weights.fitting(source, dtype, ModelSpec.from_hf_config(config), torch_dtype, device)
    sd, config, tok, name = load_source(source, tokenizer, allow_pickle=allow_pickle, fits=fits)
    spec = ModelSpec.from_hf_config(config)
    runtime = ggml_weights.runtime(spec, sd, config, run[0], torch_dtype, device)
    del sd
    # the tokenizer first: its parse frees more than it keeps (glibc would keep those pages), given
    # back before the warm-up pass touches every weight (a GGUF's mapped blocks), the load's peak
    tok = resolve_tokenizer(tok)
    release_freed()
    runtime.warm_up()
    model = SelfSpecModel(runtime, tok, name, chat_template,
                          repo_id=checkpoint_repo(name, spec) if isinstance(source, (str, os.PathLike)) else None)
    model.prepare()
    return model
