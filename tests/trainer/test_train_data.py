"""fp8-train data: text and uint16 .bin corpora, vocabulary per corpus, seeded streams, clear errors."""

import numpy as np
import pytest
import torch

from fp8_trainer.app import cli
from fp8_trainer.app.data import ByteCorpus, DataError, load_corpus
from fp8_trainer.app.model import GPT, PRESETS, preset_config
from fp8_trainer.app.train import train

pytestmark = pytest.mark.usefixtures("one_thread")


def write_bin(path, ids):
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def test_text_file_is_bytes(tmp_path):
    text = "def f(x):\n    return x + 1\n" * 40
    (tmp_path / "a.txt").write_text(text)
    c = load_corpus(tmp_path / "a.txt")
    assert c.vocab_size == 256
    assert bytes(np.concatenate([c.train, c.val]).astype(np.uint8)) == text.encode()
    assert len(c.val) == int(len(text) * 0.1)  # the last tenth is validation


@pytest.mark.parametrize("max_id,vocab", [(5, 50304), (50303, 50304), (50304, 50368), (65535, 65536)])
def test_bin_vocabulary_follows_the_ids(tmp_path, max_id, vocab):
    ids = np.arange(2000) % 7
    ids[1234] = max_id
    c = load_corpus(write_bin(tmp_path / "t.bin", ids))
    assert c.vocab_size == vocab
    x, y = c.batch("train", 3, 10)
    assert x.dtype == torch.int64 and x.shape == (3, 10) and torch.equal(x[:, 1:], y[:, :-1])


def test_batches_are_shifted_windows_of_the_tokens(tmp_path):
    ids = np.arange(1000) * 37 % 50000
    c = load_corpus(write_bin(tmp_path / "t.bin", ids), seed=3)
    x, y = c.batch("train", 4, 16)
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        start = ids.tolist().index(row_x[0])
        assert row_x == ids[start : start + 16].tolist() and row_y == ids[start + 1 : start + 17].tolist()
        assert start + 17 <= len(c.train)  # training batches never read validation tokens


def test_streams_are_seeded_per_rank_and_validation_is_fixed():
    data = bytes(range(256)) * 40
    a0, b0, a1 = ByteCorpus(data, seed=1), ByteCorpus(data, seed=1), ByteCorpus(data, seed=1, rank=1)
    first = a0.batch("train", 4, 8)[0]
    assert torch.equal(first, b0.batch("train", 4, 8)[0])  # repeatable
    assert not torch.equal(first, a1.batch("train", 4, 8)[0])  # each rank its own stream
    v1 = a0.val_batches(2, 4, 8)
    v2 = a0.val_batches(2, 4, 8)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(v1, v2, strict=True))  # the same set every time
    assert torch.equal(a0.batch("train", 4, 8)[0], b0.batch("train", 4, 8)[0])  # evaluating shifts nothing


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("vocab", [256, 50304])
def test_every_preset_takes_every_vocabulary(name, vocab):
    with torch.device("meta"):  # shapes only: the big presets would not fit a test machine's time
        model = GPT(preset_config(name, vocab))
    assert model.wte.weight.shape == (vocab, PRESETS[name].n_embd)
    assert model.lm_head.weight is model.wte.weight


def test_training_on_a_bin_file_uses_its_vocabulary(tmp_path):
    ids = (np.arange(4000) * 7919) % 60000  # ids beyond GPT-2's vocabulary
    path = write_bin(tmp_path / "tokens.bin", ids)
    a, prepared = cli.prepare(
        ["--data", str(path), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-interval", "0"]
    )
    lines = []
    result = train(a, prepared, out=lines.append)
    assert result.model.wte.weight.shape[0] == 60032
    assert "vocabulary 60032" in lines[0] and all(np.isfinite(result.losses))


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such file"),
        (b"", "the file is empty"),
        (b"x" * 50, "the training split has 45 tokens; --seq-len 64 needs at least 66"),
        (b"x" * 400, "the validation split has 40 tokens; --seq-len 64 needs at least 66"),
    ],
)
def test_bad_text_files_are_clear_errors(tmp_path, content, message, capsys):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        cli.prepare(["--data", str(path)])
    assert e.value.code == 2
    assert f"--data {path}: {message}" in capsys.readouterr().err


def test_odd_sized_bin_is_an_error(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="3 bytes is not a whole number of uint16 token ids"):
        load_corpus(tmp_path / "t.bin")
