"""examples/train_qwen3_moe.py end to end, small: the loss falls, the plots and the loss curve
are written, and a run resumed from a checkpoint reproduces the uninterrupted losses."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_qwen3_moe.py")
# 4 virtual CPUs as data=2 x expert=2: FSDP, expert parallelism and sharded checkpoints.
COMMON = ["--num-layers", "1", "--steps", "12", "--batch", "8", "--seq-len", "32", "--lr",
          "1e-2", "--log-every", "4", "--mesh", "data=2,expert=2", "--no-progress",
          "--checkpoint-every", "6"]


def _train(out, *extra):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, SCRIPT, "--out", str(out), *COMMON, *extra],
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  with open(os.path.join(out, "losses.json")) as f:
    return json.load(f), result.stdout


def test_tiny_run_learns_plots_and_resumes(tmp_path):
  straight, stdout = _train(tmp_path / "straight")
  assert straight["step"] == list(range(1, 13))
  assert straight["ce"][-1] < straight["ce"][0] - 1.0, straight["ce"]
  assert "tok/s" in stdout and "imbalance" in stdout
  for name in ("loss_curve.png", "expert_load.png", "metrics.jsonl"):
    assert os.path.getsize(tmp_path / "straight" / name) > 0, name
  assert sorted(os.listdir(tmp_path / "straight" / "checkpoints")) == ["12", "6"]

  # As if preempted after step 6's checkpoint: steps 7..12 are redone from it.
  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "12")
  resumed, stdout = _train(tmp_path / "resumed", "--resume")
  assert "resumed from step 6" in stdout
  assert resumed["step"] == list(range(1, 13))
  assert resumed["ce"] == pytest.approx(straight["ce"], rel=1e-6)

  # The loss-parity tool: same curves -> no difference, and a PNG.
  compare = subprocess.run(
      [sys.executable, os.path.join(ROOT, "examples", "compare_losses.py"),
       str(tmp_path / "straight"), str(tmp_path / "resumed"), "--labels", "a,b",
       "--out", str(tmp_path / "parity.png")], capture_output=True, text=True, timeout=120)
  assert compare.returncode == 0, compare.stderr
  assert "b vs a: max |diff| of ce =" in compare.stdout
  assert os.path.getsize(tmp_path / "parity.png") > 0


def _data_lib():
  sys.path.insert(0, os.path.join(ROOT, "examples"))
  try:
    import data
  finally:
    sys.path.pop(0)
  return data


def test_byte_tokenizer_corpus_and_batches(tmp_path):
  data = _data_lib()
  tok = data.ByteTokenizer()
  assert tok.decode(tok.encode("déjà vu")) == "déjà vu"
  tokens = data.load_tokens(None, vocab_size=tok.vocab_size)
  assert tokens.size > 1_000_000 and tokens.max() < 256
  sampler = data.BatchSampler(tokens, batch=4, seq_len=16, seed=3)
  inputs, targets = sampler(7)
  assert inputs.shape == targets.shape == (4, 16)
  assert (inputs[:, 1:] == targets[:, :-1]).all()
  again, _ = data.BatchSampler(tokens, batch=4, seq_len=16, seed=3)(7)
  assert (again == inputs).all()  # batches depend on (seed, step) only

  import numpy as np
  np.save(tmp_path / "ids.npy", np.array([1, 2, 500]))
  with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=300\)"):
    data.load_tokens(str(tmp_path / "ids.npy"), vocab_size=300)


def test_word_tokenizer_of_the_corpus(tmp_path):
  import numpy as np
  data = _data_lib()
  tok = data.WordTokenizer("a b, a  c\n\n a d e f g h", vocab_size=8)  # 7 word ids + 1 bucket
  ids = tok.encode("a b, a  c zzz")
  assert ids.tolist()[:2] == [tok.ids["a"], tok.ids[" b"]] and ids.max() < 8
  assert tok.encode(" q")[0] == tok.encode(" r")[0] == 7  # rare words share the one bucket
  assert tok.decode(tok.encode("a b, a")) == "a b, a"
  with pytest.raises(ValueError, match="vocab_size must be >= 2"):
    data.WordTokenizer("a", vocab_size=1)

  bytes_ids = data.load_tokens(None, vocab_size=259)
  words = data.load_tokens(None, vocab_size=4096, tokenizer="words")
  assert (words == data.load_tokens(None, vocab_size=4096, tokenizer="words")).all()
  assert words.size > 1_000_000 and 0 <= words.min() and words.max() < 4096
  assert np.bincount(bytes_ids).max() / bytes_ids.size > 0.2   # the byte corpus: spaces
  assert np.bincount(words).max() / words.size < 0.07          # no dominant token
  with pytest.raises(ValueError, match="tokenizer must be one of"):
    data.load_tokens(None, vocab_size=4096, tokenizer="bpe")
  np.save(tmp_path / "ids.npy", np.array([1, 2, 3]))
  with pytest.raises(ValueError, match="holds token ids already"):
    data.load_tokens(str(tmp_path / "ids.npy"), vocab_size=300, tokenizer="words")
  (tmp_path / "t.txt").write_text(" x y x")  # " x" twice, " y" once
  assert data.load_tokens(str(tmp_path / "t.txt"), 16, "words").tolist() == [0, 1, 0]
