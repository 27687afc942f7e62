"""A causal-LM policy over the action grammar: byte tokenizer, tiny GPT-2, sampling, per-token log-probs.

Any ``transformers`` causal LM and any tokenizer with ``encode(text, add_special_tokens=False)``,
``decode(ids)`` and ``eos_token_id`` plug in (e.g. the K3 model and its tokenizer); `ByteTokenizer` and
`tiny_model` make a few-hundred-K-parameter policy that trains on CPU.

An episode is one text: ``"T: <instruction>\\n"`` then per turn ``"A: <action>\\n"`` and ``"O: <obs>\\n"``.
Only the action characters (and their newline) are trained on.
"""

from __future__ import annotations

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


def tiny_model(vocab_size: int = ByteTokenizer.vocab_size, *, seed: int = 0, n_embd: int = 96, n_layer: int = 2,
               n_head: int = 4, n_positions: int = 512):
    """A small GPT-2 causal LM built from a config (random init, no hub weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, bos_token_id=ByteTokenizer.eos_token_id,
                        eos_token_id=ByteTokenizer.eos_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


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
def generate_action(model, tokenizer, context: str, *, temperature: float = 1.0, max_new_tokens: int = 24,
                    generator: torch.Generator | None = None) -> str:
    """Sample one action line after `context` (greedy when ``temperature == 0``); stops at newline or eos."""
    ids = tokenizer.encode(context + "A: ", add_special_tokens=False)
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", 4096)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    out = []
    ids = ids[-(limit - max_new_tokens):]
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids + out], dtype=torch.long)).logits[0, -1].float()
        if temperature == 0:
            tok = int(logits.argmax())
        else:
            tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        if tok in (newline, tokenizer.eos_token_id):
            break
        out.append(tok)
    return tokenizer.decode(out)
