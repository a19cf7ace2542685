"""The public object: a loaded model that generates, with or without self-speculation.

    m = selfspec.load("gemma-3-270m", dtype="float32")
    out = m.generate("def f(x):", max_new_tokens=64, strategy="early-exit", exit_layer=12)
    out.text, out.token_ids, out.stats
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, fields

import torch

from selfspec import kernels
from selfspec.architectures import ModelSpec
from selfspec import chat_templates
from selfspec.config import STRATEGIES, DraftConfig, GenerationConfig, SamplingConfig
from selfspec.drafters import Drafter, make_drafter
from selfspec.engine import GenerationResult, StreamEvent, generate
from selfspec.errors import SelfSpecError, unknown_choice
from selfspec.predictor.calibrate import AUTO_DRAFT_VOCAB, calibrate, calibration_exits
from selfspec.predictor.costs import CostModel, load_costs, save_costs
from selfspec.profiles import Profile, load_profile
from selfspec.runtime import Runtime

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_DRAFT_FIELDS = {f.name for f in fields(DraftConfig)}
MAX_DRAFTERS = 32  # draft configurations kept ready per model (least recently used dropped first)
MAX_DRAFT_HEADS = 8  # restricted draft heads (one per vocabulary size) kept per model
_log = logging.getLogger("selfspec")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    try:
        return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    except Exception:
        return "float32"


def resolve_dtype(dtype, device: str) -> torch.dtype:
    if dtype is None:
        dtype = default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise SelfSpecError(f"unsupported dtype {dtype!r}; choose float32 or bfloat16")
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
    probes = [runtime.head_columns(torch.arange(min(64, spec.vocab_size), device=runtime.device)), runtime.weight(0, "wqkv")[:, :64], runtime.weight(spec.num_layers - 1, "w_down")[:, :64]]
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


def _lru_get(cache: OrderedDict, key, make, limit: int):
    """cache[key], made on a miss; the least recently used entries beyond `limit` are dropped."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    while len(cache) > limit:
        cache.popitem(last=False)
    return value


class SelfSpecModel:
    """A loaded model. Its memory is bounded however many draft configurations it serves
    (MAX_DRAFTERS drafters, MAX_DRAFT_HEADS restricted heads shared by the drafters). It is
    thread-safe: concurrent `generate` calls run one at a time, each exactly as it would alone
    (for concurrent throughput, batch requests: `selfspec serve`)."""

    def __init__(self, runtime: Runtime, tokenizer, name: str = "", chat_template: str | None = None):
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.name = name
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
        self._drafters: OrderedDict[DraftConfig, Drafter] = OrderedDict()
        self._draft_heads: OrderedDict[int, tuple[torch.Tensor, object]] = OrderedDict()
        self._draft_models: dict[str, Runtime] = {}
        self._token_order: torch.Tensor | None = None
        self._costs: dict = {}
        self._lock = threading.RLock()  # drafters keep per-generation state: one generation at a time
        self.chat_template: str | None = None  # the Jinja template chat prompts use (None: chat is unavailable)
        self.chat_template_source = "none"
        self._chat_template_arg: str | None = None  # what apply_chat_template gets (None: the tokenizer's own)
        self._chat_note: str | None = None  # said once, at the first chat prompt
        self.set_chat_template(chat_template)

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
                    from selfspec.loading import ALIASES

                    who = f"{self.name} is a base model" if self.name in ALIASES else f"{self.name or 'this model'} has no chat template of its own"
                    note = (f"selfspec: note: {who}; chat prompts use the built-in {builtin} turn format "
                            "(a base model continues text: it was not trained to follow instructions)")
        end = chat_templates.turn_end_id(builtin, self.tokenizer)
        eos = tuple(sorted(set(self._model_eos) | ({end} if end is not None else set())))
        with self._lock:
            self.chat_template, self.chat_template_source, self._chat_template_arg = text, source, arg
            self._chat_note = note
            if eos != self.eos_token_ids:
                self.eos_token_ids = eos
                self._drafters.clear()  # drafters stop drafting at the end-of-sequence tokens they were made with

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
        if not ids or (isinstance(prompt, str) and not prompt.strip()):
            raise SelfSpecError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise SelfSpecError(f"token id {bad[0]} is outside the vocabulary (size {self.spec.vocab_size})")
        if len(ids) >= self.context_length:
            raise SelfSpecError(f"the prompt has {len(ids)} tokens; this model's context is {self.context_length}")
        return ids

    def draft_config(self, strategy: str | None = None, profile: str | Profile | None = None, **options) -> DraftConfig:
        unknown = set(options) - _DRAFT_FIELDS
        if unknown:
            raise SelfSpecError(f"unknown option(s): {', '.join(sorted(unknown))}")
        if strategy is not None and strategy not in STRATEGIES:
            raise SelfSpecError(unknown_choice("strategy", strategy, STRATEGIES))
        given = {k: v for k, v in options.items() if v is not None}
        if profile is None:
            return DraftConfig.from_dict({**({"strategy": strategy} if strategy else {}), **given})
        prof = profile if isinstance(profile, Profile) else load_profile(profile, self.fingerprint)
        if prof.model_fingerprint != self.fingerprint:
            raise SelfSpecError("the profile was made for another model")
        return merge_profile_draft(prof.draft, strategy, given)

    def drafter(self, cfg: DraftConfig) -> Drafter:
        """The drafter for cfg, kept for reuse (at most MAX_DRAFTERS, least recently used dropped)."""
        with self._lock:
            return _lru_get(self._drafters, cfg, lambda: self._make_drafter(cfg), MAX_DRAFTERS)

    def _make_drafter(self, cfg: DraftConfig) -> Drafter:
        if cfg.strategy == "auto":
            return self._auto_drafter(cfg)
        draft_rt = self._draft_runtime(cfg.draft_model) if cfg.strategy == "draft-model" else None
        adapter = self._adapter(cfg) if cfg.strategy == "exit-adapter" else None
        if adapter is not None and cfg.exit_layer is None:
            cfg = cfg.replace(exit_layer=adapter.meta.exit_layer)
        d = make_drafter(self.runtime, cfg, self.eos_token_ids, draft_rt, adapter)
        if cfg.draft_vocab is not None:
            d.set_draft_vocab(*self.draft_head(cfg.draft_vocab))
        return d

    def draft_head(self, n: int) -> tuple[torch.Tensor, object]:
        """(ids of the n most frequent tokens, those LM-head columns prepared for the runtime):
        one copy per vocabulary size, shared by every drafter that drafts over it."""
        def make():
            vocab = self.draft_vocabulary(n)
            return vocab, self.runtime.prepare_weight(self.runtime.head_columns(vocab).contiguous())

        with self._lock:
            return _lru_get(self._draft_heads, n, make, MAX_DRAFT_HEADS)

    def _adapter(self, cfg: DraftConfig):
        from selfspec.adapter import load_adapter

        adapter = load_adapter(cfg.adapter, self.runtime.device)
        meta = adapter.meta
        if meta.model_fingerprint and meta.model_fingerprint != self.fingerprint:
            raise SelfSpecError(f"the exit adapter {cfg.adapter} was trained for another model (fingerprint {meta.model_fingerprint}, this model is {self.fingerprint})")
        if meta.hidden_size != self.spec.hidden_size:
            raise SelfSpecError(f"the exit adapter {cfg.adapter} has hidden size {meta.hidden_size}; this model's is {self.spec.hidden_size}")
        if cfg.exit_layer is not None and cfg.exit_layer != meta.exit_layer:
            raise SelfSpecError(f"the exit adapter {cfg.adapter} was trained for exit layer {meta.exit_layer}, not {cfg.exit_layer}")
        return adapter

    def cost_model(self, draft_vocabs: tuple[int, ...] = ()):
        """Measured primitive costs of this model's runtime (predictor.costs), cached per model."""
        key = tuple(sorted(set(draft_vocabs)))
        if key not in self._costs:
            ident = self._cost_identity(key)
            costs = load_costs(ident)
            if costs is None:
                heads = {n: self.draft_head(n)[1] for n in key}
                costs = CostModel.measure(self.runtime, heads)
                save_costs(ident, costs)
            self._costs[key] = costs
        return self._costs[key]

    def _cost_identity(self, vocabs: tuple[int, ...]) -> dict:
        """What measured costs depend on. They are kept on disk under this key, so auto's
        decisions (and with them how sampling consumes the RNG) are the same on every load
        on this machine: a seed reproduces its output."""
        import platform

        rt = self.runtime
        return {"model": self.fingerprint, "dtype": str(rt.dtype), "device": str(rt.device), "kernels": kernels.build_id() if rt.uses_kernels else False,
                "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
                "cpu": platform.processor(), "draft_vocabs": list(vocabs)}

    def _auto_drafter(self, cfg: DraftConfig) -> Drafter:
        """auto gates cfg.base, else the model's installed profile, else a draft chosen per
        prompt by calibration (predictor.calibrate)."""
        from selfspec.drafters import AutoDrafter
        from selfspec.profiles import installed_profile

        base_cfg = cfg.base
        if base_cfg is None:
            prof = installed_profile(self.fingerprint)
            if prof is not None:
                base_cfg = prof.draft.base if prof.draft.strategy == "auto" else prof.draft
        if base_cfg is not None:
            base = self.drafter(base_cfg)
            costs = self.cost_model((base.cfg.draft_vocab,) if base.cfg.draft_vocab else ())
            return AutoDrafter(self.runtime, cfg, self.eos_token_ids, base=base, costs=costs)

        n = cfg.draft_vocab
        if n is None and self.spec.vocab_size > 2 * AUTO_DRAFT_VOCAB and (self.tokenizer is not None or self._token_order is not None):
            n = AUTO_DRAFT_VOCAB  # FR-Spec: on a big vocabulary the full draft head would dominate
        costs = self.cost_model((n,) if n else ())
        vocab, head = self.draft_head(n) if n else (None, None)

        def choose_base(ids: list[int], captured: dict) -> tuple[Drafter, float | None]:
            chosen, pred = calibrate(self.runtime, ids, costs, cfg, captured, head, vocab, n)
            alpha = None if pred is None or not pred.drafted else pred.acceptance_rate
            return self.drafter(chosen), alpha

        return AutoDrafter(self.runtime, cfg, self.eos_token_ids, costs=costs, choose_base=choose_base,
                           capture_exits=calibration_exits(self.spec.num_layers))

    def draft_vocabulary(self, n: int) -> torch.Tensor:
        """The n most frequent token ids (see draft_vocab.py), sorted by id."""
        if self._token_order is None:
            if self.tokenizer is None:
                raise SelfSpecError("a restricted draft vocabulary needs token frequencies: load a tokenizer or call set_token_frequencies")
            from selfspec.draft_vocab import cached_frequency_order
            from selfspec.loading import cache_root

            self._token_order = cached_frequency_order(self.tokenizer, self.spec.vocab_size, cache_root() / "draft-vocab")
        return self._token_order[:n].sort().values.to(self.runtime.device)

    def set_token_frequencies(self, order: torch.Tensor) -> None:
        """Token ids, most frequent first: defines the restricted draft vocabularies."""
        with self._lock:
            self._token_order = order.to(torch.long)
            self._draft_heads.clear()
            for k in [k for k in self._drafters if k.draft_vocab is not None or k.strategy == "auto"]:
                del self._drafters[k]

    def _draft_runtime(self, source: str) -> Runtime:
        if source not in self._draft_models:
            from selfspec.loading import load_source

            from selfspec.loading import resolve_tokenizer

            sd, config, tok, _ = load_source(source)
            tok = resolve_tokenizer(tok)
            spec = ModelSpec.from_hf_config(config)
            if tok is not None and self.tokenizer is not None and tok.get_vocab() != self.tokenizer.get_vocab():
                raise SelfSpecError(f"the draft model {source} uses another tokenizer than the target model")
            if abs(spec.vocab_size - self.spec.vocab_size) > 1024:
                raise SelfSpecError(f"the draft model's vocabulary ({spec.vocab_size}) does not match the target's ({self.spec.vocab_size})")
            self._draft_models[source] = Runtime.from_state_dict(spec, sd, config, self.runtime.dtype, self.runtime.device)
        return self._draft_models[source]

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = GenerationConfig.max_new_tokens,
        temperature: float = SamplingConfig.temperature,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        chat: bool = False,
        strategy: str | None = None,
        profile: str | Profile | None = None,
        draft: DraftConfig | None = None,
        on_event=None,
        **draft_options,
    ) -> GenerationResult:
        gen = GenerationConfig(max_new_tokens=max_new_tokens, stop=tuple(stop) if isinstance(stop, (list, tuple)) else (stop or ()), chat=chat)
        sampling = SamplingConfig(temperature=float(temperature), top_k=top_k, top_p=top_p, seed=seed)
        if draft is not None and (strategy is not None or profile is not None or draft_options):
            raise SelfSpecError("pass either draft=DraftConfig(...) or strategy/profile/draft options, not both")
        cfg = draft if draft is not None else self.draft_config(strategy, profile, **draft_options)
        ids = self.encode(prompt, chat)
        budget = min(gen.max_new_tokens, self.context_length - len(ids))
        if budget != gen.max_new_tokens:
            gen = GenerationConfig(budget, gen.stop, gen.chat)
        with self._lock:  # one generation at a time (class doc)
            return generate(self.runtime, self.drafter(cfg), ids, gen, sampling, self.tokenizer, self.eos_token_ids, on_event)


def load(
    source="gemma-3-270m",
    *,
    tokenizer=None,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    chat_template: str | None = None,
) -> SelfSpecModel:
    """Load from a built-in alias, a HF model directory, a .gguf file, or a transformers
    model object (its weights are read, never modified). chat_template: a Jinja file, a
    built-in name or a Jinja string for chat prompts (default: the tokenizer's own, else the
    built-in template of the model's family; see SelfSpecModel.set_chat_template)."""
    from selfspec.loading import load_source, resolve_tokenizer

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if chat_template is not None:
        chat_templates.resolve(chat_template)  # a bad name or file fails before the weights load
    sd, config, tok, name = load_source(source, tokenizer)
    spec = ModelSpec.from_hf_config(config)
    runtime = Runtime.from_state_dict(spec, sd, config, torch_dtype, device)
    runtime.warm_up()
    return SelfSpecModel(runtime, resolve_tokenizer(tok), name, chat_template)
