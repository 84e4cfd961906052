"""A tiny Llama with fixed-seed random weights and a word-level tokenizer, built locally.

For demos and tests of :mod:`lmcache_async.hf` (the KV-edit experiment,
``examples/kv_edit_experiment.py``): nothing is downloaded from a model hub. The model is
a real ``LlamaForCausalLM`` — rotary position embeddings, grouped-query attention (fewer
KV heads than attention heads), RMSNorm, SwiGLU — small enough to run a few hundred
tokens in milliseconds on a CPU. Its weights are random, so its output is not language,
but it is deterministic and depends on every token of the prompt at its position, which
is what an experiment on KV reuse needs. Needs ``transformers`` (``lmcache-async[hf]``).
"""

from __future__ import annotations

import itertools
from typing import Any, Final

import torch

__all__ = ["TINY_LLAMA", "WordTokenizer", "tiny_llama", "tiny_llama_config"]

#: The default shape: 4 layers, 8 attention heads sharing 2 KV heads of 16, vocab 512.
TINY_LLAMA: Final[dict[str, Any]] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    # Weights ~ N(0, 0.1) rather than transformers' 0.02: with 0.02 a random model's greedy
    # output collapses to one repeated token whatever the prompt; with 0.1 it depends on it.
    "initializer_range": 0.1,
}


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` with :data:`TINY_LLAMA`'s sizes (``overrides`` replace them)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_llama(
    dtype: torch.dtype = torch.float32, *, seed: int = 0, attn_implementation: str = "sdpa", **overrides: Any
) -> Any:
    """A ``LlamaForCausalLM`` in eval mode with weights drawn from ``seed`` (float32, then
    cast to ``dtype``), so the same arguments always give the same model."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**overrides)
    config._attn_implementation = attn_implementation
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model: Any = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()


_SYLLABLES: Final = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "da", "fu", "go", "hi", "ja", "ze"]
_WORD_LIST: Final = (
    "the a of to and in is it that was for on are with as his they be at one have this from or had by "
    "hot word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made "
    "live where after back little only round man year came show every good me give our under name"
)
_WORDS: Final = _WORD_LIST.split()


class WordTokenizer:
    """A word-level tokenizer over a fixed vocabulary of ``vocab_size`` words (common
    English words, then made-up two- and three-syllable words), built in memory.

    ``encode`` splits on whitespace (unknown words map to id 0, ``"<unk>"``); ``decode``
    joins words with spaces. Enough to show prompts and outputs as text.
    """

    def __init__(self, vocab_size: int = TINY_LLAMA["vocab_size"]) -> None:
        words = ["<unk>", *_WORDS]
        for n in (2, 3):
            for parts in itertools.product(_SYLLABLES, repeat=n):
                if len(words) >= vocab_size:
                    break
                words.append("".join(parts))
        if len(words) < vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is larger than the {len(words)} words available")
        self.words: list[str] = words[:vocab_size]
        self._ids = {w: i for i, w in enumerate(self.words)}

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(w, 0) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)
