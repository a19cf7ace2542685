"""What the drafters of one model draft *with*: made from the loaded model on first use,
shared by every drafter (a drafter holds one generation's state only), and kept within bounds
however many draft configurations a long-running process serves.

    draft_head(n, bits)   the LM head over the n most frequent tokens (n None: all of them),
                          prepared for the runtime or quantized to `bits`
    quantized(bits)       a copy of the model whose layers are `bits`-bit (runtime.quantized)
    adapter(path)         a trained exit adapter, checked against the model, with its matrices
                          prepared for the runtime
    draft_model(source)   the runtime of a separate draft model
    cost_model(...)       measured primitive costs (predictor/costs.py), kept on disk per machine
    once(name, make)      anything made once per model (the batch planner's pass costs: batch/planner.py)
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from collections import OrderedDict

import torch

from selfspec import kernels
from selfspec.adapter import load_adapter, prepared_weights
from selfspec.architectures import ModelSpec
from selfspec.draft_vocab import cached_frequency_order
from selfspec.errors import SelfSpecError
from selfspec.loading import cache_root, load_source, resolve_tokenizer
from selfspec.predictor.costs import CostModel, head_key, load_costs, measure_plausibly, save_costs
from selfspec.quant import quantize_columns
from selfspec.quant_store import load_weights, save_weights, store_path
from selfspec.runtime import _MATRICES, Runtime
from selfspec.sampling import SubVocab

_log = logging.getLogger("selfspec")

MAX_DRAFT_HEADS = 12  # restricted / quantized draft heads (search measures 11 at once)
MAX_QUANTIZED = 2  # quantized copies of the model (int8: half the model's bytes each)
MAX_ADAPTERS = 4
MAX_DRAFT_MODELS = 2


def _lru_get(cache: OrderedDict, key, make, limit: int):
    """cache[key], made on a miss; the least recently used entries beyond `limit` are dropped."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    while len(cache) > limit:
        cache.popitem(last=False)
    return value


class DraftResources:
    def __init__(self, runtime: Runtime, fingerprint: str, tokenizer=None, repo_id: str | None = None):
        self.runtime = runtime
        self.spec = runtime.spec
        self.fingerprint = fingerprint
        self.repo_id = repo_id  # the Hub repo the model came from: its built-in profile (profiles.installed_profile)
        self.tokenizer = tokenizer
        self._token_order: torch.Tensor | None = None
        self._heads: OrderedDict = OrderedDict()
        self._sub_vocabs: OrderedDict = OrderedDict()  # n -> SubVocab of draft_vocabulary(n)
        self._quantized: OrderedDict = OrderedDict()
        self._adapters: OrderedDict = OrderedDict()
        self._draft_models: OrderedDict = OrderedDict()
        self._costs: dict = {}
        self._made: dict = {}  # once()
        self._lock = threading.RLock()  # everything here is made once, whichever thread asks first

    # ---- vocabularies and heads ---------------------------------------------------------

    def draft_vocabulary(self, n: int) -> torch.Tensor:
        """The n most frequent token ids (see draft_vocab.py), sorted by id."""
        with self._lock:
            if self._token_order is None:
                if self.tokenizer is None:
                    raise SelfSpecError("a restricted draft vocabulary needs token frequencies: load a tokenizer or call set_token_frequencies")
                self._token_order = cached_frequency_order(self.tokenizer, self.spec.vocab_size, cache_root() / "draft-vocab")
            return self._token_order[:n].sort().values.to(self.runtime.device)

    def has_token_order(self) -> bool:
        return self._token_order is not None or self.tokenizer is not None

    def set_token_frequencies(self, order: torch.Tensor) -> None:
        """Token ids, most frequent first: defines the restricted draft vocabularies."""
        with self._lock:
            self._token_order = order.to(torch.long)
            self._heads.clear()
            self._sub_vocabs.clear()

    def draft_head(self, n: int | None, bits: int | None = None) -> tuple[torch.Tensor | None, object]:
        """(vocab, head): the ids of the n most frequent tokens (None: the whole vocabulary) and
        those LM-head columns, prepared for the runtime (bits None) or quantized to `bits`. The
        full head unquantized is (None, None): the runtime's own."""
        if n is None and bits is None:
            return None, None
        rt = self.runtime

        def make():
            vocab = None if n is None else self.draft_vocabulary(n)
            if bits is None:
                blocks = getattr(rt, "head_blocks", None)  # a GGUF run natively: those rows' own blocks (ggml_weights.py)
                return vocab, blocks(vocab) if blocks else rt.prepare_weight(rt.head_columns(vocab).contiguous())
            tag = "full" if vocab is None else f"{n}-{hashlib.sha256(vocab.cpu().numpy().tobytes()).hexdigest()[:8]}"
            return vocab, self._stored(f"head-{tag}-int{bits}", lambda: {"head": quantize_columns(
                rt.head_weight() if vocab is None else rt.head_columns(vocab), bits)})["head"]

        with self._lock:
            return _lru_get(self._heads, (n, bits), make, MAX_DRAFT_HEADS)

    def sub_vocab(self, vocab: torch.Tensor) -> SubVocab:
        """SubVocab(vocab), made once per vocabulary size and shared by the drafters that draft
        over it (a drafter is built per request: the vocabulary-sized token -> entry map and
        the entry -> token list were a visible part of each request's admission)."""
        with self._lock:
            sub = self._sub_vocabs.get(len(vocab))
            if sub is not None and not sub.ids.equal(vocab.long()):  # another vocabulary of that size
                del self._sub_vocabs[len(vocab)]
            return _lru_get(self._sub_vocabs, len(vocab), lambda: SubVocab(vocab, self.spec.vocab_size), MAX_DRAFT_HEADS)

    # ---- other drafting weights ---------------------------------------------------------

    def quantized(self, bits: int) -> Runtime:
        """The model with `bits`-bit layers (its own head stays; drafts pass theirs), made once
        per machine and kept on disk (quant_store)."""
        def make():
            path = self._store_path(f"layers-int{bits}")
            made = load_weights(path) if path else None
            q = self.runtime.quantized(bits, made=made)
            if path and made is None:
                save_weights(path, {f"{i}.{k}": L[k] for i, L in enumerate(q.layers) for k in _MATRICES})
            return q

        with self._lock:
            return _lru_get(self._quantized, bits, make, MAX_QUANTIZED)

    def _store_path(self, what: str):
        """Where quantized weights `what` of this model are kept; None for a model without a
        fingerprint (a bare runtime: make_drafter)."""
        return store_path(self.fingerprint, self.runtime.dtype, what) if self.fingerprint else None

    def _stored(self, what: str, make) -> dict:
        """Quantized weights `what` from the store, else make() (and stored)."""
        path = self._store_path(what)
        found = load_weights(path) if path else None
        if found is None:
            found = make()
            if path:
                save_weights(path, found)
        return found

    def adapter(self, path: str, exit_layer: int | None = None):
        """(ExitAdapter, its matrices as the runtime multiplies them), checked against this model."""
        def make():
            rt = self.runtime
            adapter = load_adapter(path, rt.device)
            meta = adapter.meta
            if meta.model_fingerprint and meta.model_fingerprint != self.fingerprint:
                raise SelfSpecError(f"the exit adapter {path} was trained for another model (fingerprint {meta.model_fingerprint}, this model is {self.fingerprint})")
            if meta.hidden_size != self.spec.hidden_size:
                raise SelfSpecError(f"the exit adapter {path} has hidden size {meta.hidden_size}; this model's is {self.spec.hidden_size}")
            return adapter, prepared_weights(adapter, rt)

        with self._lock:
            adapter, w = _lru_get(self._adapters, str(path), make, MAX_ADAPTERS)
        if exit_layer is not None and exit_layer != adapter.meta.exit_layer:
            raise SelfSpecError(f"the exit adapter {path} was trained for exit layer {adapter.meta.exit_layer}, not {exit_layer}")
        return adapter, w

    def provide_adapter(self, path: str, adapter) -> None:
        """Use an already loaded adapter for `path` (factory.make_drafter)."""
        with self._lock:
            self._adapters[str(path)] = (adapter, prepared_weights(adapter, self.runtime))

    def provide_draft_model(self, source: str, runtime: Runtime) -> None:
        """Use an already loaded draft model's runtime for `source` (factory.make_drafter)."""
        with self._lock:
            self._draft_models[source] = runtime

    def draft_model(self, source: str) -> Runtime:
        def make():
            sd, config, tok, _ = load_source(source)
            tok = resolve_tokenizer(tok)
            spec = ModelSpec.from_hf_config(config)
            if tok is not None and self.tokenizer is not None and tok.get_vocab() != self.tokenizer.get_vocab():
                raise SelfSpecError(f"the draft model {source} uses another tokenizer than the target model")
            if abs(spec.vocab_size - self.spec.vocab_size) > 1024:
                raise SelfSpecError(f"the draft model's vocabulary ({spec.vocab_size}) does not match the target's ({self.spec.vocab_size})")
            return Runtime.from_state_dict(spec, sd, config, self.runtime.dtype, self.runtime.device)

        with self._lock:
            return _lru_get(self._draft_models, source, make, MAX_DRAFT_MODELS)

    # ---- costs --------------------------------------------------------------------------

    def cost_model(self, heads: tuple[tuple[int | None, int | None], ...] = (), bits: tuple[int, ...] = ()) -> CostModel:
        """Measured primitive costs (predictor.costs), for the draft heads (n, bits) and the
        quantized copies `bits` given: measured once per machine and kept on disk, so auto's
        decisions (and with them how sampling consumes the RNG) are the same on every load
        and a seed reproduces its output."""
        heads = tuple(sorted({h for h in heads if h != (None, None)}, key=str))
        bits = tuple(sorted(set(bits)))
        key = (heads, bits)
        with self._lock:
            if key not in self._costs:
                ident = self._cost_identity(heads, bits)
                costs = load_costs(ident)
                if costs is None:
                    with self.runtime.compute_scope():  # timed as generations run them
                        costs, why = measure_plausibly(lambda: CostModel.measure(
                            self.runtime, {head_key(*h): self.draft_head(*h)[1] for h in heads}, {b: self.quantized(b) for b in bits}))
                    if why is None:
                        save_costs(ident, costs)
                    else:  # kept for this process only: the next load measures again
                        _log.warning(f"selfspec: note: the machine was busy while timing its primitives ({why}); "
                                     "auto's choices may be off until a later load measures them again")
                self._costs[key] = costs
            return self._costs[key]

    def _machine_identity(self) -> dict:
        """What measured costs are valid for: the model, its numerics, the build, the threads
        and the machine (a change of any measures again)."""
        rt = self.runtime
        return {"model": self.fingerprint, "dtype": str(rt.dtype), "device": str(rt.device),
                "kernels": kernels.build_id() if rt.uses_kernels else False, "threads": kernels.threads(),
                "torch": torch.__version__, "machine": platform.machine(), "cpu": platform.processor()}

    def _cost_identity(self, heads, bits) -> dict:
        return {**self._machine_identity(), "draft_heads": [head_key(*h) for h in heads], "quantized": list(bits)}

    def once(self, name: str, make):
        """make(), made once whichever thread asks first, and kept with these resources (e.g.
        the batch planner's pass costs: batch.planner.kept_costs)."""
        with self._lock:
            if name not in self._made:
                self._made[name] = make()
            return self._made[name]

    def stored_identity(self, kind: str) -> dict | None:
        """The identity under which measurements of `kind` are kept on disk (predictor.costs.
        save_stored): the model, numerics, build, threads and machine. None without a fingerprint
        (a bare runtime): measured once per process then."""
        return {**self._machine_identity(), "kind": kind} if self.fingerprint else None

    def draft_name(self, signature: tuple) -> str | None:
        """A name of a batched draft's signature (passes.signature: draft runtime, exit layer,
        draft head, skip sets) that is the same in every process: which of these resources
        it drafts with. None for weights made elsewhere (not kept on disk then)."""
        rt, exit_layer, head, skip_attn, skip_mlp = signature
        with self._lock:
            if rt is self.runtime:
                who = "model"
            else:
                who = next((f"int{b}" for b, q in self._quantized.items() if q is rt), None)
            if head is None:
                what = "own"
            else:
                what = next((str(head_key(*k)) for k, v in self._heads.items() if v[1] is head), None)
        if who is None or what is None:
            return None
        return f"{who} E={exit_layer} head={what} attn={','.join(map(str, sorted(skip_attn)))} mlp={','.join(map(str, sorted(skip_mlp)))}"

    def nbytes(self) -> dict[str, int]:
        """Bytes of what drafters have made and these caches hold: quantized copies of the layers,
        draft heads (restricted or quantized columns of the LM head)."""
        with self._lock:
            heads = sum(kernels.nbytes(h) for _, h in self._heads.values() if h is not None)
            copies = sum(kernels.nbytes(w) for q in self._quantized.values() for L in q.layers for k, w in L.items() if k in _MATRICES)
        return {"quantized_copies": copies, "draft_heads": heads}

    def bounded(self) -> dict[str, int]:
        """How many of each resource are held (tests, /health)."""
        return {"draft_heads": len(self._heads), "quantized": len(self._quantized), "adapters": len(self._adapters),
                "draft_models": len(self._draft_models)}
