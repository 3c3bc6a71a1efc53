"""Byte tokenizer and the incremental detokenizer (UTF-8 boundaries, stop strings, hold-back)."""

from __future__ import annotations

from hpdl.serve.tokenizer import ByteTokenizer, IncrementalDetokenizer


def test_incremental_text_equals_full_decode_across_multibyte_chars():
    tok = ByteTokenizer()
    ids = tok.encode("héllo wörld ✓ ok")
    det = IncrementalDetokenizer(tok, [1, 2], stop=[])
    streamed = ""
    for t in ids:
        det.add(t)
        streamed += det.delta(final=False)
    streamed += det.delta(final=True)
    assert streamed == "héllo wörld ✓ ok" == tok.decode(ids)
    assert tok.decode([104, 257, 300]) == "h<|300|>"


def test_stop_string_is_cut_and_never_streamed():
    tok = ByteTokenizer()
    det = IncrementalDetokenizer(tok, [1], stop=["STOP", "xyz"])
    sent, hit = "", False
    for t in tok.encode("abc STOP def"):
        hit = det.add(t)
        sent += det.delta(final=hit)
        if hit:
            break
    assert hit and sent == "abc " and "S" not in sent
