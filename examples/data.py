"""Training data for the examples: a byte-level and a word-level tokenizer, a default corpus
that needs no download (this Python's own standard-library sources), and deterministic random
batches.

Batches depend only on (seed, step), so a resumed run and a run on another backend see exactly
the same tokens.
"""

from __future__ import annotations

import collections
import os
import re
import sysconfig
import zlib

import numpy as np

BOS, EOS, PAD = 256, 257, 258


class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255, plus BOS / EOS / PAD: vocab_size 259."""

  vocab_size = 259

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids)
    return bytes(ids[ids < 256].astype(np.uint8).tolist()).decode("utf-8", errors="replace")


class WordTokenizer:
  """Word-level ids fitted to one text: runs of word characters and single punctuation marks,
  each with the whitespace before it folded in (so no token is a lone space, which is 29% of
  the default corpus's bytes and sets a floor on how evenly a router can spread its tokens:
  benchmarks/ROUTING_COLLAPSE_NOTES.md). The vocab_size - vocab_size // 8 most frequent words
  get their own ids in order of frequency; every other word is hashed (crc32) into the last
  vocab_size // 8 ids. Deterministic: the same text gives the same ids on every process."""

  _WORD = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

  def __init__(self, text: str, vocab_size: int):
    if vocab_size < 2:
      raise ValueError(f"vocab_size must be >= 2 (ids for words and hash buckets), got "
                       f"{vocab_size}")
    self.vocab_size = vocab_size
    self.buckets = max(1, vocab_size // 8)
    counts = collections.Counter(self._WORD.findall(text))
    kept = counts.most_common(vocab_size - self.buckets)
    self.words = [word for word, _ in kept]
    self.ids = {word: i for i, word in enumerate(self.words)}

  def encode(self, text: str) -> np.ndarray:
    first_bucket = len(self.words)
    return np.array([self.ids[w] if w in self.ids else
                     first_bucket + zlib.crc32(w.encode("utf-8")) % self.buckets
                     for w in self._WORD.findall(text)], dtype=np.int32)

  def decode(self, ids) -> str:
    return "".join(self.words[i] if i < len(self.words) else " <unk>"
                   for i in np.asarray(ids).reshape(-1).tolist())


TOKENIZERS = ("bytes", "words")


def stdlib_corpus(max_bytes: int = 8 << 20) -> bytes:
  """The standard library's .py files (site-packages and tests excluded), sorted by path and
  joined by NUL-free separators, up to max_bytes. Same bytes on every process of a run."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs
                        if d not in ("site-packages", "dist-packages", "test", "tests",
                                     "idle_test", "__pycache__"))
    paths.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))
  chunks, total = [], 0
  for path in sorted(paths):
    with open(path, "rb") as f:
      chunk = f.read()
    chunks.append(chunk)
    total += len(chunk)
    if total >= max_bytes:
      break
  if not chunks:
    raise FileNotFoundError(f"no .py files under the standard library directory {root!r}")
  return b"\n\n".join(chunks)[:max_bytes]


def load_tokens(data: str | None, vocab_size: int, tokenizer: str = "bytes") -> np.ndarray:
  """Token ids [N] int32 for training.

  data: None for the embedded corpus; a .npy file of token ids (any integer dtype, e.g. from
  the model's own tokenizer, for --init-from runs); any other path is read as text.
  tokenizer: how text (the embedded corpus or a text file) becomes ids: "bytes"
  (ByteTokenizer) or "words" (a WordTokenizer fitted to that text, vocab_size ids). A .npy
  file is already ids and takes the default only.
  """
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
  if data is not None and data.endswith(".npy"):
    if tokenizer != "bytes":
      raise ValueError(f"--data {data!r} holds token ids already: --tokenizer {tokenizer!r} "
                       f"applies to text only")
    tokens = np.load(data).reshape(-1)
    if not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"--data {data!r}: a .npy token array must hold integers, got "
                       f"{tokens.dtype}")
    tokens = tokens.astype(np.int32)
  else:
    if data is None:
      raw = stdlib_corpus()
    else:
      with open(data, "rb") as f:
        raw = f.read()
    if tokenizer == "words":
      text = raw.decode("utf-8", errors="replace")
      tokens = WordTokenizer(text, vocab_size).encode(text)
    else:
      tokens = ByteTokenizer().encode(raw)
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ValueError(f"token ids must be in [0, vocab_size={vocab_size}), got range "
                     f"[{tokens.min()}, {tokens.max()}] from {data or 'the embedded corpus'}")
  return tokens


class BatchSampler:
  """Random windows of seq_len + 1 tokens: batch(step) -> (inputs, targets), each
  [batch, seq_len] int32, targets shifted by one."""

  def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int):
    if tokens.size < seq_len + 2:
      raise ValueError(f"the data has {tokens.size} tokens, fewer than seq_len + 2 = "
                       f"{seq_len + 2}")
    self.tokens, self.batch, self.seq_len, self.seed = tokens, batch, seq_len, seed

  def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng((self.seed, step))
    starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.batch)
    windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]
