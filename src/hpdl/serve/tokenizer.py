"""Tokenizers: a byte-level tokenizer for random-weight models (no downloads), or a model directory's own."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, ``<bos>`` = 256, ``<eos>`` = 257.

    Ids above 257 (a larger random model's vocabulary) decode to ``<|id|>`` so that they stay visible.
    """

    bos_token_id, eos_token_id = 256, 257
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if i > 257:
                out.append(f"<|{i}|>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Plain ``role: content`` lines then ``assistant:`` (for models without a chat template)."""
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class HFTokenizer:
    """A ``transformers`` tokenizer loaded from a local model directory (never the hub)."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.bos_token_id, self.eos_token_id = self.tok.bos_token_id, self.tok.eos_token_id
        self.chat_template = getattr(self.tok, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.chat_template:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return ByteTokenizer.apply_chat_template(self, messages)


def load_tokenizer(model_dir: str | None):
    """The directory's tokenizer if it has one (``tokenizer.json`` or ``tokenizer_config.json``), else bytes."""
    if model_dir is not None and any((Path(model_dir) / f).exists()
                                     for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return HFTokenizer(model_dir)
    return ByteTokenizer()


class IncrementalDetokenizer:
    """Text of a growing token list, emitted in deltas that never split a UTF-8 character or a stop string.

    Decodes a short window (vLLM's prefix/read offsets) so each step costs O(1) tokens, not O(length).
    ``stop`` strings: the text ends just before the first occurrence; text that could still become a stop
    string is held back until it cannot (vLLM issues #3574 and #2577: streamed text must equal the final).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tok, self.ids = tokenizer, list(prompt_ids[-6:])
        self.prefix, self.read = 0, len(self.ids)
        self.text, self.sent, self.stop = "", 0, stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int, check_stop: bool = True) -> bool:
        """Append one token; returns True when a stop string was found (the text is then final). With
        ``check_stop=False`` (before ``min_tokens``) the new text is not searched for stop strings."""
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # incomplete character: wait for more bytes
        old = len(self.text)
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        if not check_stop:
            return False
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, old - len(s) + 1))) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def flush(self) -> None:
        """At the end: keep whatever an incomplete trailing character decodes to (U+FFFD)."""
        if self.read < len(self.ids):
            before = self.tok.decode(self.ids[self.prefix:self.read])
            self.text += self.tok.decode(self.ids[self.prefix:])[len(before):]
            self.read = len(self.ids)

    def delta(self, final: bool) -> str:
        """Text not sent yet; keeps back the last ``max(len(stop)) - 1`` characters unless ``final``."""
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out
