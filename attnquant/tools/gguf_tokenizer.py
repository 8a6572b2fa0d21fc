"""Rebuild Gemma's SentencePiece tokenizer from the vocabulary inside a GGUF file.

A GGUF checkpoint carries the tokenizer as parallel arrays (pieces, scores,
token types) plus the special-token ids, not as the original
``tokenizer.model``. transformers' own GGUF conversion turns Gemma's arrays
into a *Unigram* model, but Gemma's SentencePiece model is *BPE* (scores are
negated merge ranks), so that conversion splits words into one- and
two-character pieces. Here the arrays become:

* a SentencePiece ``ModelProto`` (``tokenizer.model``) configured like
  Gemma's: BPE, byte fallback, no dummy prefix, identity normalization,
  spaces escaped as ``▁``. SentencePiece itself, loaded from it, is the ground
  truth for tokenization;
* a Hugging Face fast tokenizer (``tokenizer.json``) that reproduces it: BPE
  whose merges are ranked by SentencePiece score, user-defined pieces as
  added tokens matched after normalization, control pieces as special tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, TokenType
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

# transformers ships this generated module for protobuf >= 4. The copy inside
# the sentencepiece wheel is generated for a newer protobuf than MAX 26.7
# allows (< 6.34), so importing that one fails.
from transformers.utils import sentencepiece_model_pb2_new as sentencepiece_pb2

__all__ = [
    "SPACE_SYMBOL",
    "GGUFVocabulary",
    "build_fast_tokenizer",
    "build_sentencepiece_model",
    "save_tokenizer_files",
]

SPACE_SYMBOL = "▁"
"""What SentencePiece writes for a space inside pieces (U+2581)."""

_SENTENCEPIECE_TYPE = {
    TokenType.NORMAL: sentencepiece_pb2.ModelProto.SentencePiece.NORMAL,
    TokenType.UNKNOWN: sentencepiece_pb2.ModelProto.SentencePiece.UNKNOWN,
    TokenType.CONTROL: sentencepiece_pb2.ModelProto.SentencePiece.CONTROL,
    TokenType.USER_DEFINED: sentencepiece_pb2.ModelProto.SentencePiece.USER_DEFINED,
    TokenType.UNUSED: sentencepiece_pb2.ModelProto.SentencePiece.UNUSED,
    TokenType.BYTE: sentencepiece_pb2.ModelProto.SentencePiece.BYTE,
}


@dataclass(frozen=True)
class GGUFVocabulary:
    """A SentencePiece vocabulary as stored in a GGUF file's metadata."""

    pieces: list[str]
    scores: list[float]
    token_types: list[TokenType]
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    add_bos: bool

    @classmethod
    def from_gguf(cls, gguf_path: Path) -> GGUFVocabulary:
        """Reads the ``tokenizer.ggml.*`` metadata of a SentencePiece GGUF file."""
        return cls.from_reader(GGUFReader(gguf_path))

    @classmethod
    def from_reader(cls, reader: GGUFReader) -> GGUFVocabulary:
        """Like ``from_gguf``, for a file already open (opening one parses all
        its metadata, which takes seconds for a 262k-piece vocabulary)."""

        def field(name: str) -> Any:
            key = f"tokenizer.ggml.{name}"
            if key not in reader.fields:
                raise ValueError(f"the GGUF has no {key!r} metadata, so its tokenizer cannot be rebuilt")
            return reader.fields[key].contents()

        if field("model") != "llama":
            raise ValueError(
                f"the GGUF has tokenizer.ggml.model={field('model')!r}; only SentencePiece "
                "vocabularies ('llama', as Gemma's are) can be rebuilt"
            )
        types = [TokenType(t) for t in field("token_type")]
        return cls(
            pieces=[_undo_space_prenormalization(p, t) for p, t in zip(field("tokens"), types)],
            scores=list(field("scores")),
            token_types=types,
            bos_id=field("bos_token_id"),
            eos_id=field("eos_token_id"),
            pad_id=field("padding_token_id"),
            unk_id=field("unknown_token_id"),
            add_bos=bool(field("add_bos_token")),
        )

    def piece(self, token_id: int) -> str:
        return self.pieces[token_id]

    def ids_of_type(self, token_type: TokenType) -> list[int]:
        return [i for i, t in enumerate(self.token_types) if t == token_type]


def _undo_space_prenormalization(piece: str, token_type: TokenType) -> str:
    # llama.cpp's converter writes user-defined pieces with "▁" replaced by a
    # space (Gemma's whitespace runs "▁▁", "▁▁▁", ...). SentencePiece matches
    # user-defined pieces against the escaped text, so put "▁" back.
    if token_type == TokenType.USER_DEFINED:
        return piece.replace(" ", SPACE_SYMBOL)
    return piece


def build_sentencepiece_model(vocab: GGUFVocabulary) -> bytes:
    """Serializes a ``tokenizer.model`` that tokenizes as Gemma's SentencePiece model."""
    model = sentencepiece_pb2.ModelProto()
    for token_id, (piece, score) in enumerate(zip(vocab.pieces, vocab.scores)):
        entry = model.pieces.add()
        entry.piece = piece
        entry.score = score
        # llama.cpp marks <unk> CONTROL; SentencePiece insists on one UNKNOWN piece.
        entry.type = (
            sentencepiece_pb2.ModelProto.SentencePiece.UNKNOWN
            if token_id == vocab.unk_id
            else _SENTENCEPIECE_TYPE[vocab.token_types[token_id]]
        )
    _configure_like_gemma(model.trainer_spec, vocab)
    normalizer = model.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = False
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return model.SerializeToString()


def _configure_like_gemma(trainer: sentencepiece_pb2.TrainerSpec, vocab: GGUFVocabulary) -> None:
    # Only model_type, byte_fallback and the special ids change how text is
    # encoded; the splitting rules are Gemma's training settings, kept so the
    # file describes the model truthfully.
    trainer.model_type = sentencepiece_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(vocab.pieces)
    trainer.byte_fallback = True
    trainer.split_digits = True
    trainer.split_by_unicode_script = True
    trainer.split_by_number = True
    trainer.split_by_whitespace = True
    trainer.treat_whitespace_as_suffix = False
    trainer.allow_whitespace_only_pieces = True
    trainer.unk_id, trainer.unk_piece = vocab.unk_id, vocab.piece(vocab.unk_id)
    trainer.bos_id, trainer.bos_piece = vocab.bos_id, vocab.piece(vocab.bos_id)
    trainer.eos_id, trainer.eos_piece = vocab.eos_id, vocab.piece(vocab.eos_id)
    trainer.pad_id, trainer.pad_piece = vocab.pad_id, vocab.piece(vocab.pad_id)


def build_fast_tokenizer(vocab: GGUFVocabulary) -> Tokenizer:
    """Builds a ``tokenizers`` BPE that gives SentencePiece's ids for the same text."""
    bpe = BPE(
        vocab={piece: token_id for token_id, piece in enumerate(vocab.pieces)},
        merges=_merges_by_score(vocab),
        unk_token=vocab.piece(vocab.unk_id),
        byte_fallback=True,
        fuse_unk=True,
    )
    tokenizer = Tokenizer(bpe)
    # SentencePiece does no pre-tokenization: the whole escaped text is one
    # sequence of symbols, so there is deliberately no pre_tokenizer.
    tokenizer.normalizer = normalizers.Replace(" ", SPACE_SYMBOL)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_SYMBOL, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_tokens(
        # normalized=True: matched in the escaped text, as SentencePiece
        # matches user-defined pieces, so "  " finds "▁▁".
        [AddedToken(vocab.piece(i), normalized=True, special=False)
         for i in vocab.ids_of_type(TokenType.USER_DEFINED)]
    )
    tokenizer.add_special_tokens(
        [AddedToken(vocab.piece(i), normalized=False, special=True) for i in _special_ids(vocab)]
    )
    if vocab.add_bos:
        bos = vocab.piece(vocab.bos_id)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos}:1 $B:1",
            special_tokens=[(bos, vocab.bos_id)],
        )
    return tokenizer


def _special_ids(vocab: GGUFVocabulary) -> list[int]:
    return sorted({vocab.unk_id, *vocab.ids_of_type(TokenType.CONTROL)})


def _merges_by_score(vocab: GGUFVocabulary) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best score first.

    SentencePiece's BPE repeatedly joins the adjacent pair whose concatenation
    is the highest-scoring normal piece; a BPE merge list ranked by that score
    makes ``tokenizers`` pick the same pair.
    """
    mergeable = {
        piece for piece, token_type in zip(vocab.pieces, vocab.token_types)
        if token_type == TokenType.NORMAL
    }
    by_score = sorted(
        (i for i, t in enumerate(vocab.token_types) if t == TokenType.NORMAL),
        key=lambda i: (-vocab.scores[i], i),
    )
    merges = []
    for token_id in by_score:
        piece = vocab.pieces[token_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((left, right))
    return merges


def save_tokenizer_files(vocab: GGUFVocabulary, out_dir: Path, *, chat_template: str | None) -> None:
    """Writes ``tokenizer.model``, ``tokenizer.json``, ``tokenizer_config.json``
    and ``special_tokens_map.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.model").write_bytes(build_sentencepiece_model(vocab))
    build_fast_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    special_tokens = _special_tokens_map(vocab)
    _write_json(out_dir / "special_tokens_map.json", special_tokens)
    config = {
        "tokenizer_class": "GemmaTokenizer",
        **special_tokens,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "padding_side": "left",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(out_dir / "tokenizer_config.json", config)


def _special_tokens_map(vocab: GGUFVocabulary) -> dict[str, str]:
    return {
        "bos_token": vocab.piece(vocab.bos_id),
        "eos_token": vocab.piece(vocab.eos_id),
        "pad_token": vocab.piece(vocab.pad_id),
        "unk_token": vocab.piece(vocab.unk_id),
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
