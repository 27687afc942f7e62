"""A causal-LM policy over the action grammar: word and byte tokenizers, tiny GPT-2, sampling, log-probs.

Any ``transformers`` causal LM and any tokenizer with ``encode(text, add_special_tokens=False)``,
``decode(ids)``, ``eos_token_id`` and ``pad_token_id`` plug in (e.g. the K3 model and its tokenizer);
`WordTokenizer` (or `ByteTokenizer`) and `tiny_model` make a small policy that trains on CPU.

An episode is one text: ``"T: <instruction>\\n"`` then per turn ``"A: <action>\\n"`` and ``"O: <obs>\\n"``.
Only the action characters (and their newline) are trained on.
"""

from __future__ import annotations

import re

import torch

from agentenv.posttrain.tasks import format_observation


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus ``<eos>`` (256) and ``<pad>`` (257)."""

    eos_token_id = 256
    pad_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> byte ids (no special tokens are added)."""
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Ids -> text (special ids dropped)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class WordTokenizer:
    """Word-level ids over a fixed vocabulary: ``<eos>`` 0, ``<pad>`` 1, ``<unk>`` 2, the newline and the
    episode text's role tags (``T``, ``A``, ``O``, ``:``), then `words`.

    Text splits into newlines, runs of ``[A-Za-z0-9_./-]`` and single other characters; whitespace is dropped
    and `decode` joins words with one space, so an action line of known words round-trips. A word the policy
    must copy (a file name, a code word) is one token, so copying it is one attention lookup rather than a
    sequence of bytes.

    Raises:
        ValueError: `words` is empty, has duplicates, or contains whitespace.
    """

    eos_token_id, pad_token_id, unk_token_id = 0, 1, 2
    _split = re.compile(r"\n|[A-Za-z0-9_./-]+|[^\sA-Za-z0-9_./-]")

    def __init__(self, words: list[str]) -> None:
        words = list(words)
        if not words or len(set(words)) != len(words) or any(not w or re.search(r"[ \t\r]", w) for w in words):
            raise ValueError("words must be a non-empty list of distinct tokens without spaces")
        fixed = ["<eos>", "<pad>", "<unk>", "\n", "T", "A", "O", ":"]
        self.words = fixed + [w for w in words if w not in fixed]
        self.ids = {w: i for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> word ids (unknown words -> ``unk_token_id``; no special tokens are added)."""
        return [self.ids.get(w, self.unk_token_id) for w in self._split.findall(text)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Ids -> words joined by single spaces (special ids dropped)."""
        return " ".join(self.words[i] for i in ids if i > self.unk_token_id)


def tiny_model(vocab_size: int = ByteTokenizer.vocab_size, *, seed: int = 0, n_embd: int = 96, n_layer: int = 2,
               n_head: int = 4, n_positions: int = 512, eos_token_id: int = ByteTokenizer.eos_token_id,
               copy_head: bool = False):
    """A small GPT-2 causal LM built from a config (random init, no hub weights); input and output embeddings
    are tied, so a token attended to in the context is directly a likely next token. With `copy_head`, wrapped
    in a `PointerLM`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    lm = GPT2LMHeadModel(config)
    return PointerLM(lm) if copy_head else lm


class PointerLM(torch.nn.Module):
    """A causal LM with a copy (pointer) head: the next token is drawn from a mix of the LM's distribution
    and an attention over the context's tokens, ``p(w) = g * p_lm(w) + (1 - g) * sum_{j <= t, x_j = w} a_tj``
    (pointer-generator), so copying a word that appeared in an observation (a code word, a file name) is one
    learned attention, whatever the word. `forward` takes what a ``transformers`` causal LM takes and returns
    ``.logits`` as log-probabilities ``[B, T, V]`` (a softmax of them is the mixed distribution), so sampling,
    `token_logprobs` and the losses use it unchanged.

    Args:
        lm: a ``transformers`` causal LM (its last hidden state feeds the head).
        key_dim: width of the pointer's queries and keys.
    """

    def __init__(self, lm, key_dim: int = 64):
        super().__init__()
        width = getattr(lm.config, "n_embd", None) or lm.config.hidden_size
        self.lm = lm
        self.config = lm.config
        self.query = torch.nn.Linear(width, key_dim)
        self.key = torch.nn.Linear(width, key_dim)
        self.gate = torch.nn.Linear(width, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        from types import SimpleNamespace

        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      output_hidden_states=True)
        hidden = out.hidden_states[-1]
        length = input_ids.shape[1]
        scores = self.query(hidden) @ self.key(hidden).transpose(1, 2) / self.query.out_features ** 0.5
        allowed = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        ids = input_ids.clamp(max=out.logits.shape[-1] - 1)
        copy = torch.zeros_like(out.logits, dtype=attn.dtype).scatter_add_(2, ids[:, None, :].expand(-1, length, -1),
                                                                           attn)
        gate = torch.sigmoid(self.gate(hidden))
        mixed = gate * torch.softmax(out.logits.float(), dim=-1) + (1 - gate) * copy
        return SimpleNamespace(logits=torch.log(mixed.clamp(min=1e-9)))


def prompt_text(instruction: str) -> str:
    return f"T: {instruction}\n"


def turn_texts(action: str, obs: dict) -> tuple[str, str]:
    """(trained action segment, untrained observation segment) of one turn."""
    return f"A: {action}\n", f"O: {format_observation(obs)}\n"


def encode_segments(tokenizer, segments: list[tuple[str, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments ``(text, trained)`` -> ``(ids [T] long, mask [T] bool)``; the mask marks trained tokens, except
    each action's ``"A: "`` header, which is part of the context."""
    ids, mask = [], []
    for text, trained in segments:
        if trained:
            head = tokenizer.encode("A: ", add_special_tokens=False)
            body = tokenizer.encode(text[3:], add_special_tokens=False)
            ids += head + body
            mask += [False] * len(head) + [True] * len(body)
        else:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [False] * len(piece)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def token_logprobs(model, ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Log-prob of each next token: ``ids [B, T] -> [B, T]`` (position 0 is 0: it has no context)."""
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] > limit:
        raise ValueError(f"ids: {ids.shape[1]} tokens exceed the model's {limit} positions")
    attention = (ids != pad_id).long()
    logits = model(input_ids=ids.clamp(max=model.config.vocab_size - 1), attention_mask=attention).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, ids[:, 1:].clamp(max=model.config.vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def pad_batch(seqs: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``(ids, mask)`` pairs -> ``(ids [B, T], mask [B, T])``."""
    width = max(len(i) for i, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (i, m) in enumerate(seqs):
        ids[row, :len(i)], mask[row, :len(m)] = i, m
    return ids, mask


@torch.no_grad()
def generate_actions(model, tokenizer, contexts: list[str], *, temperature: float = 1.0, max_new_tokens: int = 24,
                     generator: torch.Generator | None = None) -> list[str]:
    """Sample one action line after each of `contexts`, all in one batch (greedy when ``temperature == 0``);
    each stops at a newline or eos. Contexts are left-padded, with position ids counted from each row's first
    real token, so a row is scored as it is alone (and as `token_logprobs` scores it)."""
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", 4096)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    prompts = [tokenizer.encode(c + "A: ", add_special_tokens=False)[-(limit - max_new_tokens):] for c in contexts]
    outs: list[list[int]] = [[] for _ in contexts]
    live = list(range(len(contexts)))
    for _ in range(max_new_tokens):
        if not live:
            break
        rows = [prompts[i] + outs[i] for i in live]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, width - len(row):], attention[r, width - len(row):] = torch.tensor(row), 1
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids.clamp(max=model.config.vocab_size - 1), attention_mask=attention,
                       position_ids=positions).logits[:, -1].float()
        if temperature == 0:
            picked = logits.argmax(-1)
        else:
            picked = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator).squeeze(1)
        still = []
        for i, tok in zip(live, picked.tolist()):
            if tok in (newline, tokenizer.eos_token_id):
                continue
            outs[i].append(tok)
            still.append(i)
        live = still
    return [tokenizer.decode(o) for o in outs]


def generate_action(model, tokenizer, context: str, *, temperature: float = 1.0, max_new_tokens: int = 24,
                    generator: torch.Generator | None = None) -> str:
    """Sample one action line after `context` (greedy when ``temperature == 0``); stops at newline or eos."""
    return generate_actions(model, tokenizer, [context], temperature=temperature, max_new_tokens=max_new_tokens,
                            generator=generator)[0]
