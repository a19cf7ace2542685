"""Shared builders for the test suite: tiny random-weight HF models of every supported
architecture, an offline word-level tokenizer, and small utilities.

Nothing here touches the network: models come from transformers configs with random
weights, tokenizers are built in memory with the `tokenizers` library.
"""

from __future__ import annotations

import copy

import torch

import selfspec

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3")

# A vocabulary big enough for interesting text, small enough to keep models tiny.
VOCAB = 96


def tiny_config(arch: str, vocab_size: int = VOCAB, num_layers: int = 4, max_pos: int = 512, **overrides):
    """A tiny transformers config of `arch` (fp32, eager attention, no eos so HF generate
    never stops early)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        initializer_range=0.3,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = LlamaConfig(**{**common, **overrides})
    elif arch == "llama3":
        # llama3 rope scaling, GQA 4:1, explicit head_dim and tied embeddings.
        kw = {
            **common,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        }
        cfg = LlamaConfig(**{**kw, **overrides})
    elif arch == "mistral":
        cfg = MistralConfig(**{**common, "sliding_window": 8, **overrides})
    elif arch == "qwen2":
        cfg = Qwen2Config(**{**common, "use_sliding_window": False, **overrides})
    elif arch == "qwen3":
        cfg = Qwen3Config(**{**common, "head_dim": 16, **overrides})
    elif arch == "gemma3":
        kw = {
            **common,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            # untied: tied tiny Gemmas degenerate into repeating one token (the llama3
            # config and the real Gemma 3 270M cover tied embeddings)
            "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2)
            + ["sliding_attention"] * (num_layers % 2),
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        }
        cfg = Gemma3TextConfig(**{**kw, **overrides})
    else:  # pragma: no cover
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    return cfg


def randomize_extras(model: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """HF initialises norm weights to 1 (or 0 for Gemma's 1+w) and biases to 0: give them
    random values so that every norm and bias actually takes part in the comparison."""
    g = torch.Generator().manual_seed(seed + 12345)
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                noise = torch.randn(p.shape, generator=g) * scale
                p.copy_(noise if gemma else 1.0 + noise)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def build_hf(arch: str, seed: int = 0, **config_kw):
    """A tiny HF causal LM of `arch`, random weights, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_extras(model, seed)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


def looping_model(seed: int = 3):
    """A tiny fp32 Gemma 3 with no attention output (zeroed o_proj): its next token depends on
    the last one only, so greedy text loops and prompt-lookup copies hold."""
    hf = build_hf("gemma3", seed=seed, num_layers=4, hidden_size=128, intermediate_size=256, vocab_size=256, head_dim=32)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return selfspec.load(hf, dtype="float32")


def prompts(vocab: int = VOCAB, n: int = 3, seed: int = 7, lengths=(5, 11, 3)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`, exactly n new tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' full forward (no cache): fp32 logits [T, V]."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def assert_plain(result):
    """`result` came from plain decoding: one token per step and no draft slots at all (only
    the autoregressive drafter has K = 0; auto has K >= 1 even on steps it does not draft)."""
    s = result.stats
    assert s.per_position_drafted == [] and s.drafted == 0 and not any(result.drafted_mask), \
        f"the reference drafted: K={len(s.per_position_drafted)}, drafted={s.drafted}"
    assert s.verify_steps == len(result.token_ids) - 1
    return result


def ar_generate(model, prompt, **kw):
    """The reference of every lossless test: plain autoregressive decoding, pinned (the
    default strategy, auto, drafts) and checked to be plain. kw: generation options only."""
    named = {"strategy", "draft", "profile"} & kw.keys()
    if named:
        raise TypeError(f"ar_generate pins the strategy; do not pass {sorted(named)}")
    return assert_plain(model.generate(prompt, strategy="autoregressive", **kw))


def state_snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def config_snapshot(model) -> dict:
    return copy.deepcopy(model.config.to_dict())


# ---- an offline tokenizer --------------------------------------------------------------

WORDS = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "house", "red", "blue",
    "big", "small", "tree", "sun", "moon", "star", "sky", "is", "was", "very", "not", "it",
    "he", "she", "we", "they", "go", "went", "see", "saw", "up", "down", "in", "out", "over",
    "under", "fast", "slow", "bird", "fish", "river", "hill", "road", "car", "boat", "rain",
    "snow", "wind", "fire", "stone", "gold", "iron", "wood", "glass", "paper", "book", "pen",
    "cup", "tea", "milk", "bread", "salt", "sugar", "apple", "pear", "plum", "grape", "one",
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hello", "world",
    "yes", "no", "maybe", "why", "how", "what", "who", "when", "where", "then", "now",
]


def word_tokenizer(vocab_size: int = VOCAB, eos: bool = False):
    """A WordLevel tokenizer (whitespace split, words joined by spaces when decoding) of
    exactly `vocab_size` tokens, wrapped as a transformers fast tokenizer. Id 0 is <unk>;
    with eos=True id 1 is the eos token '<eos>'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>"] if eos else ["<unk>"]
    words = specials + WORDS
    i = 0
    while len(words) < vocab_size:
        words.append(f"w{i}")
        i += 1
    words = words[:vocab_size]
    vocab = {w: idx for idx, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    kw = {"unk_token": "<unk>"}
    if eos:
        kw["eos_token"] = "<eos>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def load_tiny(arch: str, seed: int = 0, dtype: str = "float32", tokenizer=None, **config_kw):
    """(hf_model, selfspec_model) for a tiny model of `arch`."""
    hf = build_hf(arch, seed, **config_kw)
    return hf, selfspec.load(hf, dtype=dtype, tokenizer=tokenizer)


# ---- checkpoints on disk -------------------------------------------------------------------


def random_adapter(path, seed: int = 0) -> str:
    """A random exit adapter with attention at exit layer 2 (hidden 64: every tiny arch), saved to path."""
    from selfspec.adapter import AdapterMeta, ExitAdapter, save_adapter

    a = ExitAdapter(AdapterMeta(exit_layer=2, hidden_size=64, inner_size=16, heads=2, head_dim=8))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        a.down.copy_(torch.randn(a.down.shape, generator=g) * 0.5)
        a.out.copy_(torch.randn(a.out.shape, generator=g) * 0.5)
    save_adapter(a, path)
    return str(path)


def write_llama_checkpoint(path, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                           tied: bool, dtype=torch.bfloat16, shard_bytes: int = 2 << 30, seed: int = 0, max_pos: int = 4096):
    """A random-weight Llama checkpoint written as transformers writes one (config.json,
    safetensors shards of at most shard_bytes with model.safetensors.index.json), one tensor
    shard in memory at a time: checkpoints near the machine's memory can be made. Returns
    the bytes of its weights."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      tie_word_embeddings=tied, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.save_pretrained(path)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                       p + "mlp.down_proj.weight": (hidden, intermediate), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        n = size * int(torch.tensor(shape).prod())
        if shards[-1] and used + n > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    weight_map, total = {}, 0
    for s, names in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if len(shape) == 1:  # norms near 1, as trained models have them
                t = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:  # scaled so activations neither vanish nor blow up through the layers
                t = torch.randn(shape, generator=g) * shape[1] ** -0.5
            tensors[name] = t.to(dtype)
            weight_map[name] = fname
            total += tensors[name].numel() * size
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total
