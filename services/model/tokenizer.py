"""Tokenizer from the checkpoint's tokenizer.json (HF `tokenizers`, no transformers dependency)."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
ENDOFTEXT = "<|endoftext|>"


class TokenizerError(ValueError):
    pass


def byte_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode map (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_BYTE = {ch: b for b, ch in byte_unicode().items()}


class NeoTokenizer:
    def __init__(self, tokenizer: Tokenizer, tokenizer_config: dict | None = None):
        self._tok = tokenizer
        self.config = tokenizer_config or {}

        def lookup(token: str) -> int:
            tid = self._tok.token_to_id(token)
            if tid is None:
                raise TokenizerError(f"tokenizer lacks the special token {token!r}")
            return tid

        # Every id is looked up by its string (upstream hard-codes <img> = 151670; we do not).
        self.im_start_id = lookup(IM_START)
        self.im_end_id = lookup(IM_END)
        self.think_id = lookup(THINK)
        self.end_think_id = lookup(END_THINK)
        self.img_start_id = lookup(IMG_START)
        self.img_end_id = lookup(IMG_END)
        self.img_context_id = lookup(IMG_CONTEXT)
        eos = self.config.get("eos_token") or IM_END
        if isinstance(eos, dict):
            eos = eos.get("content", IM_END)
        self.eos_id = lookup(eos)
        pad = self.config.get("pad_token") or ENDOFTEXT
        if isinstance(pad, dict):
            pad = pad.get("content", ENDOFTEXT)
        self.pad_id = self._tok.token_to_id(pad)
        added = self._tok.get_added_tokens_decoder() if hasattr(self._tok, "get_added_tokens_decoder") else {}
        self.special_ids = {i for i, t in added.items() if t.special}
        self._added = set(added)
        # the same tokenizer without its added tokens: client text through it is text, never a control token
        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = []
        self._plain = Tokenizer.from_str(json.dumps(spec))

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "NeoTokenizer":
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise TokenizerError(f"no tokenizer.json in {model_dir}")
        tok = Tokenizer.from_file(path)
        cfg = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        return cls(tok, cfg)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Qwen adds no BOS; special-token strings inside the text map to their ids.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Client text: a `<|im_start|>` or `<think>` typed by a client is tokenised as the characters it is, so a
        client cannot forge a turn or a think block. For text without such strings the ids equal `encode`'s."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) in self._added or not all(ch in _UNICODE_BYTE for ch in piece):
            return piece.encode("utf-8")
        return bytes(_UNICODE_BYTE[ch] for ch in piece)
